"""Held prompts of a mixture go to a live agent before any dataset opens a new epoch (issue 39; README guarantee 6).

The pure core with injected time. Three datasets (math 2 rows, code 2 rows, tool 4 rows, equal weights) and a
prefetch of 12 groups (4 per dataset). Agent b takes the first six prompts, agent a the next six: math and code in
their data epoch 1 (their epoch 0 is b's), tool still in its epoch 0. b commits; a goes silent past the TTL and its
six leases are held for it (``Admission.held``). b, alive with free capacity, must now be handed exactly a's six
prompts, each under its own dataset and data epoch, and no dataset may open a new epoch while any is held. A slip in
how a held prompt is matched to the dataset asking for it (only dataset 0, only data epoch 0, the key compared with
the dataset's number) leaves some held and opens an epoch past them instead. And a held prompt goes to its own
dataset's share: the oldest held prompt of any dataset, handed to whichever dataset asks, breaks the shares.
"""

from __future__ import annotations

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.mixture import SourceSpec, epoch_key, split_key
from coordinator.core import CoordinatorCore, CoreSettings
from coordinator.frontier import LEASED, READY

N = 4  # samples per prompt
NAMES = ("math", "code", "tool")
SIZES = [2, 2, 4]
TTL = 1.0


def make_core(sizes=SIZES, prefetch=12) -> CoordinatorCore:
    cfg = RolloutConfig(
        rollout_batch_size=len(sizes),
        n_samples_per_prompt=N,
        prefetch=prefetch,
        mixture=[SourceSpec(name, 1.0).to_dict() for name in NAMES[: len(sizes)]],
    )
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, TTL, 100.0), tuple(sizes), "fp"), now=0.0)


def sends(effects, kind):
    out = []
    for e in effects:
        out += [s for s in getattr(e, "then", [e]) if isinstance(s.msg, kind)]
    return out


def grants(effects, to: str) -> list[p.LeaseGrant]:
    return [g for s in sends(effects, p.Grant) if s.to == to for g in s.msg.leases]


def register(core, agent: str, groups: int, now: float, unacked=()):
    msg = p.Register(agent, 1, groups * N, f"tcp://{agent}:1", [], list(unacked), [])
    eff = core.handle(agent.encode(), msg, now)
    return sends(eff, p.Welcome)[0].msg, eff


def commit(core, agent: str, session: int, g: p.LeaseGrant, now: float, key: str | None = None):
    key = key or f"{agent}:{g.data_epoch}:{g.index}"
    msg = p.Receipt(session, g.lease, g.data_epoch, g.index, key, N, {"n_samples": N})
    eff = core.handle(agent.encode(), msg, now)
    return sends(eff, p.ReceiptAck)[0].msg


def named(g: p.LeaseGrant) -> tuple[str, int, int]:
    """A grant as (dataset, data epoch of that dataset, index), read from the grant's own fields."""
    source, epoch = split_key(g.data_epoch)
    assert g.dataset == NAMES[source], f"grant for key {g.data_epoch} names dataset {g.dataset!r}"
    return g.dataset, epoch, g.index


def outlive(core, session: int) -> tuple[list[p.LeaseGrant], float]:
    """b heartbeats while a stays silent past the TTL; what b was granted meanwhile, and the time."""
    handed: list[p.LeaseGrant] = []
    t = 0.0
    while t < 3 * TTL:
        t += 0.25
        handed += grants(core.handle(b"b", p.Heartbeat(session), t), "b")
        handed += grants(core.tick(t), "b")
    return handed, t


def test_held_prompts_of_later_epochs_and_other_datasets_go_to_a_live_agent_before_a_new_epoch_opens():
    core = make_core()
    wb, eff = register(core, "b", groups=6, now=0.0)
    of_b = grants(eff, "b")
    assert sorted(named(g) for g in of_b) == sorted(
        [("math", 0, 0), ("math", 0, 1), ("code", 0, 0), ("code", 0, 1), ("tool", 0, 0), ("tool", 0, 1)]
    )
    _, eff = register(core, "a", groups=6, now=0.0)
    of_a = grants(eff, "a")
    # The true value, written out: math's and code's epoch 0 went to b, so a has their epoch 1; tool is in epoch 0.
    truth = {("math", 1, 0), ("math", 1, 1), ("code", 1, 0), ("code", 1, 1), ("tool", 0, 2), ("tool", 0, 3)}
    assert {named(g) for g in of_a} == truth and len(of_a) == 6
    for g in of_b:
        assert commit(core, "b", wb.session, g, now=0.1).accepted
    assert core.ready.count == [2, 2, 2] and core.training.in_flight == [2, 2, 2]

    # a is silent past the TTL; b is not. a's six leases are held for it, and b is handed exactly those.
    handed, t = outlive(core, wb.session)
    assert core.membership.agents["a"].status == "dead"
    assert {named(g) for g in handed} == truth, "b must get a's held prompts, not prompts of a new epoch"
    assert len(handed) == 6 and not {g.lease for g in handed} & {g.lease for g in of_a}
    assert core.statistics().held == 0 and len(core.leases.held) == 0
    # Each lease counts for its own dataset, and no dataset opened an epoch past the held prompts.
    assert core.training.in_flight == [2, 2, 2]
    assert sorted(core.frontier.epochs) == sorted(
        [epoch_key(0, 0), epoch_key(0, 1), epoch_key(1, 0), epoch_key(1, 1), epoch_key(2, 0)]
    )
    for dataset, epoch, index in truth:
        assert core.frontier.state_of(epoch_key(NAMES.index(dataset), epoch), index) == LEASED

    # a comes back with a group for code's epoch-1 prompt 0: first committer wins, b's copy is then refused.
    mine = next(g for g in of_a if named(g) == ("code", 1, 0))
    unacked = [{"lease": mine.lease, "data_epoch": mine.data_epoch, "index": mine.index, "key": "k", "stats": {}}]
    wa, _ = register(core, "a", groups=6, now=t, unacked=unacked)
    assert wa.acks == [["k", True]]
    assert core.frontier.state_of(epoch_key(1, 1), 0) == READY
    theirs = next(g for g in handed if named(g) == ("code", 1, 0))
    ack = commit(core, "b", wb.session, theirs, now=t, key="other")
    assert not ack.accepted and "duplicate" in ack.reason


def test_a_held_prompt_goes_to_the_dataset_that_lacks_it_not_to_whichever_asks_first():
    """Two datasets of 2 rows, prefetch 4 (2 each). a's oldest held prompt is math's, but code is the one that lacks:
    when b has room for one lease, it must be code's held prompt, not the oldest held of any dataset."""
    core = make_core(sizes=[2, 2], prefetch=4)
    wb, eff = register(core, "b", groups=2, now=0.0)
    assert [named(g) for g in grants(eff, "b")] == [("math", 0, 0), ("code", 0, 0)]
    _, eff = register(core, "a", groups=2, now=0.0)
    assert [named(g) for g in grants(eff, "a")] == [("math", 0, 1), ("code", 0, 1)]  # held oldest first: math's
    handed, t = outlive(core, wb.session)
    assert handed == [] and len(core.leases.held) == 2  # b is full: both held for a
    # b's filter drops its code group: code lacks 2 (math 1), and b has room for one lease.
    lease = next(x for x in core.leases.leases.values() if x.agent_id == "b" and split_key(x.data_epoch)[0] == 1)
    eff = core.handle(b"b", p.Filtered(wb.session, lease.lease_id, lease.data_epoch, lease.index, "zero_std_1"), t)
    assert [named(g) for g in grants(eff, "b")] == [("code", 0, 1)], "code's share must get code's held prompt"
    assert core.training.in_flight == [1, 1] and len(core.leases.held) == 1
    # b commits its math group: math lacks one, and gets math's held prompt; neither dataset opened its epoch 1.
    first = next(x for x in core.leases.leases.values() if x.agent_id == "b" and split_key(x.data_epoch)[0] == 0)
    receipt = p.Receipt(wb.session, first.lease_id, first.data_epoch, first.index, "b:math", N, {"n_samples": N})
    eff = core.handle(b"b", receipt, t)
    assert [named(g) for g in grants(eff, "b")] == [("math", 0, 1)]
    assert not core.leases.held and sorted(core.frontier.epochs) == [epoch_key(0, 0), epoch_key(1, 0)]
