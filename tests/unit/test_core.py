"""The coordinator's pure core: events in, effects out; no sockets, no clock."""

from __future__ import annotations

import dataclasses

import pytest

from common import protocol as p
from common.config import Liveness, RolloutConfig
from coordinator.core import CoordinatorCore, CoreSettings, Persist
from coordinator.frontier import DELIVERED, FILTERED, LEASED, PENDING, READY
from coordinator.records import LedgerSnapshot, PromptState, PutPrompt, SetCursors, SetPaused, WeightLog

N = 4  # samples per prompt


def make_core(size=20, batch=2, prefetch=-1, restored=None, now=0.0, ttl=3.0, retire=10.0):
    cfg = RolloutConfig(rollout_batch_size=batch, n_samples_per_prompt=N, prefetch=prefetch)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, ttl, retire), (size,), "fp"), restored, now)


def sends(effects, kind=None):
    out = []
    for e in effects:
        items = e.then if isinstance(e, Persist) else [e]
        out += [s for s in items if kind is None or isinstance(s.msg, kind)]
    return out


def register(core, agent="a", slots=4 * N, now=0.0, unacked=(), in_flight=()):
    eff = core.handle(
        agent.encode(), p.Register(agent, 1, slots, f"tcp://{agent}:1", [], list(unacked), list(in_flight)), now
    )
    welcome = sends(eff, p.Welcome)[0].msg
    return welcome, eff


def tick(core, now):
    """Advance the clock to ``now`` the way the server does: many small ticks."""
    out = []
    t = core.admission._last_tick
    while t < now:
        t = min(now, t + 0.25)
        out += core.tick(t)
    return out


def grants(effects):
    return [g for s in sends(effects, p.Grant) for g in s.msg.leases]


def attach(core):
    eff = core.handle(b"trainer", p.Attach(1, "t"), 0.0)
    return sends(eff, p.Ok)[0].msg.result["session"]


def receipt(core, session, g, key=None, now=0.0, agent=b"a"):
    key = key or f"{g.data_epoch}:{g.index}:{g.lease:x}"
    eff = core.handle(
        agent,
        p.Receipt(session, g.lease, g.data_epoch, g.index, key, N, {"n_samples": N, "reward_sum": 2.0}),
        now,
    )
    return eff, sends(eff, p.ReceiptAck)[0].msg


def test_welcome_precedes_grants_and_admission_is_bounded_by_prefetch():
    core = make_core(prefetch=3)
    welcome, eff = register(core)
    out = sends(eff)
    assert isinstance(out[0].msg, p.Welcome)
    assert len(grants(eff)) == 3  # no trainer demand yet: prefetch only, though capacity is 4
    assert core.statistics().leased == 3


def test_capacity_is_slots_divided_by_group_size():
    core = make_core(prefetch=100)
    _, eff = register(core, slots=2 * N + 3)
    assert len(grants(eff)) == 2


def test_receipt_is_acknowledged_after_persist_and_counted_once():
    core = make_core(prefetch=2)
    welcome, eff = register(core)
    g = grants(eff)[0]
    eff, ack = receipt(core, welcome.session, g)
    assert ack.accepted
    persist = [e for e in eff if isinstance(e, Persist)][0]
    assert any(isinstance(op, PutPrompt) and op.state.ready for op in persist.ops)
    assert any(isinstance(s.msg, p.ReceiptAck) for s in persist.then), "ack must wait for the ledger commit"
    # The same receipt again (retransmit): acknowledged, not counted twice.
    _, ack2 = receipt(core, welcome.session, g)
    assert ack2.accepted
    assert core.statistics().ready == 1
    # Another group for the same prompt (e.g. from a reissued lease): refused.
    _, ack3 = receipt(core, welcome.session, g, key="0:0:other")
    assert not ack3.accepted and "duplicate" in ack3.reason


def test_batches_assemble_exactly_and_replay_identically():
    core = make_core(batch=2, prefetch=0)
    welcome, _ = register(core)
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 10, 0), 0.0)
    gs = grants(eff)
    assert len(gs) == 2
    for g in gs:
        eff, _ = receipt(core, welcome.session, g)
    batch = sends(eff, p.BatchRefs)[0].msg
    assert sorted(r[1] for r in batch.groups) == sorted(g.index for g in gs)
    assert core.frontier.state_of(0, gs[0].index) == DELIVERED
    replay = sends(core.handle(b"trainer", p.Generate(session, 11, 0), 0.0), p.BatchRefs)[0].msg
    assert replay.groups == batch.groups and replay.metrics == batch.metrics
    err = sends(core.handle(b"trainer", p.Generate(session, 12, -5), 0.0), p.Error)
    assert err, "an id older than the last batch that was never generated is an error"


def test_filtered_groups_are_replaced_and_reported_in_the_next_batch():
    core = make_core(batch=1, prefetch=0)
    welcome, _ = register(core)
    session = attach(core)
    g = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))[0]
    eff = core.handle(b"a", p.Filtered(welcome.session, g.lease, 0, g.index, "zero_std_1"), 0.0)
    assert core.frontier.state_of(0, g.index) == FILTERED
    replacement = grants(eff)
    assert len(replacement) == 1 and replacement[0].index != g.index
    eff, _ = receipt(core, welcome.session, replacement[0])
    m = sends(eff, p.BatchRefs)[0].msg.metrics
    assert m["rollout/dynamic_filter/drop_zero_std_1"] == 1
    assert m["rollout/dynamic_filter/dropped_groups"] == 1
    assert m["rollout/dynamic_filter/dropped_ratio"] == 0.5


def test_silent_agent_is_fenced_and_its_leases_are_held_for_it_not_leased_again():
    core = make_core(prefetch=2, ttl=3.0)
    w1, eff = register(core, "a", now=0.0)
    leased = grants(eff)
    w2, _ = register(core, "b", now=0.0)
    core.handle(b"b", p.Heartbeat(w2.session), 2.9)
    eff = tick(core, 3.5)  # a is silent past the TTL; b is not
    # b gets the work the bound allows, but none of a's prompts: they stay leased, held for a.
    fresh = grants(eff)
    assert len(fresh) == 2 and all(s.to == "b" for s in sends(eff, p.Grant))
    assert not {g.index for g in fresh} & {g.index for g in leased}
    assert all(core.frontier.state_of(0, g.index) == LEASED for g in leased)
    stats = core.statistics()
    assert (stats.held, stats.leased) == (2, 2)
    # a's late receipt is fenced: it must register again.
    late = core.handle(b"a", p.Receipt(w1.session, leased[0].lease, 0, leased[0].index, "k", N, {}), 4.0)
    assert isinstance(sends(late)[0].msg, p.Fence)
    # Back: the group it committed meanwhile is accepted, the one it still generates stays its lease.
    unacked = [{"lease": leased[0].lease, "data_epoch": 0, "index": leased[0].index, "key": "k", "stats": {}}]
    in_flight = [[leased[1].lease, 0, leased[1].index]]
    w1b, eff = register(core, "a", now=4.0, unacked=unacked, in_flight=in_flight)
    assert w1b.acks == [["k", True]] and w1b.cancel == []
    assert core.frontier.state_of(0, leased[0].index) == READY
    assert core.leases.leases[leased[1].lease].agent_id == "a"
    assert leased[1].index not in {g.index for g in grants(eff)}
    _, ack = receipt(core, w1b.session, leased[1], now=4.5)
    assert ack.accepted
    stats = core.statistics()
    assert stats.held == 0 and stats.receipts == {"accepted": 2, "refused": 0}


def test_held_prompts_are_pending_again_when_their_agent_is_retired_or_returns_without_them():
    core = make_core(prefetch=2, ttl=1.0, retire=5.0)
    _, eff = register(core, "a", now=0.0)
    first, second = grants(eff)
    w2, _ = register(core, "b", now=0.0)
    for t in (0.5, 1.0, 1.5):
        core.handle(b"b", p.Heartbeat(w2.session), t)
    tick(core, 1.5)
    assert core.statistics().held == 2
    # a comes back with only the first (say, restarted without the other): the second is pending again.
    register(core, "a", now=2.0, in_flight=[[first.lease, 0, first.index]])
    assert core.statistics().held == 0
    assert core.frontier.state_of(0, second.index) == PENDING
    assert core.leases.leases[first.lease].agent_id == "a"
    # Silent again, then retired: what is held for it is pending again, first in line.
    for t in [2.5 + 0.5 * i for i in range(11)]:
        core.handle(b"b", p.Heartbeat(w2.session), t)
        tick(core, t)
    assert core.membership.agents["a"].status == "retired"
    assert core.statistics().held == 0
    assert core.frontier.state_of(0, first.index) == PENDING
    assert core.frontier.take(8.0) == (0, second.index)


def test_held_prompts_go_to_a_live_agent_before_a_new_epoch_opens():
    core = make_core(size=4, batch=2, prefetch=4, ttl=1.0, retire=100.0)
    _, eff = register(core, "a", slots=2 * N, now=0.0)
    leased = grants(eff)
    assert len(leased) == 2
    tick(core, 1.5)  # a is dead, its two prompts held
    w2, eff = register(core, "b", slots=8 * N, now=1.5)
    got = grants(eff)
    # The two fresh prompts of epoch 0 first, then a's two held ones; no epoch 1 while they are held.
    assert sorted(g.index for g in got if g.data_epoch == 0) == [0, 1, 2, 3]
    assert {g.index for g in got if g.data_epoch == 1} <= set(range(4))
    assert core.statistics().held == 0
    # a returns with a group for one of them: first committer wins, b's copy is then refused.
    unacked = [{"lease": leased[0].lease, "data_epoch": 0, "index": leased[0].index, "key": "k", "stats": {}}]
    w1b, _ = register(core, "a", slots=2 * N, now=2.0, unacked=unacked)
    assert w1b.acks == [["k", True]]
    mine = [g for g in got if (g.data_epoch, g.index) == (0, leased[0].index)][0]
    _, ack = receipt(core, w2.session, mine, key="other", agent=b"b")
    assert not ack.accepted


def test_a_prompt_pending_again_is_not_parked_on_a_node_whose_engines_are_behind_the_fleets_weights():
    """A prompt pending again goes first in line, to an agent that can start it.

    A Register is written before the agent knows the fleet's weights (the Welcome names them), so its capacity
    counts engines still on older ones, which the agent then takes out of its pool until they re-load. A grant
    made on that capacity (behind the Welcome, or by the next pump) waits there for an engine. In a chaos run
    (seed 5, prompt (1, 203)) that is how a requeued prompt stayed behind the cursor for ten batches: leased to
    a node whose new process had registered on launch weights while the fleet was on disk version 40, waiting,
    while the others took fresh prompts; given back at the pause, it was pending at quiesce."""
    restored = LedgerSnapshot(generation=2, weights=WeightLog(3, 3, "disk", "/ckpt/v3"))
    core = make_core(size=40, batch=2, prefetch=4, restored=restored, ttl=1.0, retire=100.0)

    def engine(version):
        return [p.EngineInfo("e0", p.EngineState.HEALTHY, "http://e0", version=version)]

    def join(agent, incarnation, version, now):
        msg = p.Register(agent, incarnation, 2 * N, f"tcp://{agent}:1", engine(version), [], [])
        eff = core.handle(agent.encode(), msg, now)
        return sends(eff, p.Welcome)[0].msg, eff

    wa, eff = join("a", 1, 3, 0.0)
    ours = grants(eff)
    wc, eff = join("c", 1, 3, 0.0)
    held = grants(eff)
    assert len(ours) == len(held) == 2  # both full
    for t in (0.5, 1.0, 1.5):
        core.handle(b"a", p.Heartbeat(wa.session, {}, [g.lease for g in ours], ours[-1].lease), t)
        tick(core, t)
    assert core.statistics().held == 2  # c is silent past the TTL: its two prompts are held for it
    # c's new process: nothing in flight, engines on the launch weights (version 0), the fleet on version 3.
    wc2, eff = join("c", 2, 0, 1.6)
    assert core.statistics().held == 0
    again = {g.index for g in held}
    assert grants(eff) == [], "c's engines cannot generate until they hold the fleet's weights"
    assert all(core.frontier.state_of(0, i) == PENDING for i in again)  # first in line
    # c takes its engines out of its pool one at a time to re-load them (from disk: seconds, the first time):
    # a report made before the last one left still counts none that holds the fleet's weights.
    core.handle(b"c", p.Capacity(wc2.session, 2 * N, engine(0)), 1.65)
    assert core.membership.agents["c"].free == 0
    core.handle(b"c", p.Capacity(wc2.session, 0, engine(0)), 1.66)
    # a finishes its two groups: the prompts pending again are leased before any fresh prompt, to a.
    eff = []
    for g in ours:
        eff += receipt(core, wa.session, g, now=1.7)[0]
    assert {g.index for g in grants(eff)} == again
    # Once c's engines hold the fleet's weights, its capacity counts again.
    core.handle(b"c", p.Capacity(wc2.session, 2 * N, engine(3)), 2.0)
    assert core.membership.agents["c"].free == 2


def test_under_max_staleness_a_silent_agents_leases_are_released_at_once():
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=N, prefetch=2, max_staleness=1)
    core = CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 1.0, 10.0), (20,), "fp"))
    _, eff = register(core, "a", now=0.0)
    leased = grants(eff)
    w2, _ = register(core, "b", now=0.0)
    for t in (0.5, 1.0, 1.5):
        core.handle(b"b", p.Heartbeat(w2.session), t)
    eff = tick(core, 1.5)
    assert core.statistics().held == 0
    assert sorted(g.index for g in grants(eff)) == sorted(g.index for g in leased)


def test_reregistering_agent_keeps_its_in_flight_leases():
    core = make_core(prefetch=2)
    w, eff = register(core)
    leased = grants(eff)
    in_flight = [[g.lease, 0, g.index] for g in leased]
    w2, eff = register(core, in_flight=in_flight)
    assert w2.cancel == []
    assert core.statistics().leased == 2
    assert grants(eff) == []  # nothing reissued


def test_heartbeat_reconciles_leases_the_agent_no_longer_has():
    core = make_core(prefetch=2)
    w, eff = register(core)
    leased = grants(eff)
    # The agent's Filtered for the first lease was lost: its heartbeat no longer lists it.
    eff = core.handle(b"a", p.Heartbeat(w.session, {}, [leased[1].lease], max(g.lease for g in leased)), 0.5)
    assert core.frontier.state_of(0, leased[0].index) in (PENDING, LEASED)
    assert len(core.leases.leases) == 2  # released, then granted again (to the same agent)
    assert [g.index for g in grants(eff)] == [leased[0].index]


def test_retired_agent_ready_groups_are_generated_again():
    core = make_core(prefetch=2, ttl=1.0, retire=5.0)
    w, eff = register(core, "a")
    for g in grants(eff):
        receipt(core, w.session, g)
    assert core.statistics().ready == 2
    tick(core, 2.0)  # dead: no leases to release
    eff = tick(core, 6.0)  # retired: its payloads are gone for good
    assert core.statistics().ready == 0
    assert core.statistics().prompts["pending"] == 20


def test_all_agents_retired_fails_generate_clearly():
    core = make_core(ttl=1.0, retire=2.0)
    register(core, "a")
    session = attach(core)
    core.handle(b"trainer", p.Generate(session, 1, 0), 0.0)
    tick(core, 1.5)
    eff = tick(core, 3.0)
    err = sends(eff, p.Error)[0].msg
    assert err.code == "no_capacity" and "retired" in err.message


def test_trainer_fencing_and_unknown_session():
    core = make_core()
    s1 = attach(core)
    eff = core.handle(b"trainer2", p.Attach(2, "t2"), 0.0)
    s2 = sends(eff, p.Ok)[0].msg.result["session"]
    assert s2 != s1
    err = sends(core.handle(b"trainer", p.Generate(s1, 3, 0), 0.0), p.Error)[0].msg
    assert err.code == "fenced"
    fresh = make_core()
    err = sends(fresh.handle(b"trainer", p.Generate(s1, 3, 0), 0.0), p.Error)[0].msg
    assert err.code == "unknown_session"


def test_state_dict_trims_consumed_batches_and_refuses_older_checkpoints():
    core = make_core(batch=1, prefetch=0)
    w, _ = register(core)
    session = attach(core)
    for rid in range(3):
        g = grants(core.handle(b"trainer", p.Generate(session, rid, rid), 0.0))[0]
        receipt(core, w.session, g)
    ctl = lambda msg: core.handle(b"trainer", msg, 0.0)
    assert sends(ctl(p.StateDict(session, 99, 2)), p.Error)[0].msg.code == "not_drained"
    ctl(p.Pause(session, 99, drain=True))
    eff = ctl(p.StateDict(session, 99, 0))
    first = sends(eff, p.Ok)[0].msg.result
    assert first["rollout_id"] == 0 and sends(eff, p.Trim) == []  # nothing trimmed before a second checkpoint
    eff = ctl(p.StateDict(session, 99, 1))
    state = sends(eff, p.Ok)[0].msg.result
    trims = sends(eff, p.Trim)
    # Only what is behind the previous checkpoint goes: a trainer that dies while
    # saving checkpoint 1 can still resume from checkpoint 0.
    assert state["rollout_id"] == 1 and len(trims[0].msg.keys) == 1
    assert sorted(core.batches.recorded) == [1, 2]
    assert sends(ctl(p.LoadStateDict(session, 99, first)), p.Ok)
    assert sends(ctl(p.LoadStateDict(session, 99, {**state, "rollout_id": -1})), p.Error)[0].msg.code == "bad_state"
    assert sends(ctl(p.LoadStateDict(session, 99, {**state, "rollout_id": 7})), p.Error)[0].msg.code == "bad_state"
    assert sends(ctl(p.LoadStateDict(session, 99, state)), p.Ok)
    assert sends(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0), p.Error)[0].msg.code == "trimmed"


def test_restore_keeps_accounted_prompts_and_delays_orphans():
    restored = LedgerSnapshot(
        generation=2,
        cursors={0: 5},
        prompts={
            (0, 0): PromptState(DELIVERED, "a", "k0"),
            (0, 1): PromptState(FILTERED, "a", reason="x"),
            (0, 2): PromptState(READY, "a", "k2", seq=1),
        },
    )
    core = make_core(prefetch=10, restored=restored, now=100.0, ttl=3.0)
    assert core.frontier.state_of(0, 0) == DELIVERED
    assert core.frontier.state_of(0, 1) == FILTERED
    assert core.frontier.state_of(0, 2) == READY
    w, eff = register(core, now=100.0, slots=40 * N)
    first = [g for g in grants(eff)]
    indices = [g.index for g in first]
    assert 3 not in indices and 4 not in indices, "orphans wait a TTL for their agents to come back"
    assert 5 in indices
    # After the grace period, released work is reissued with the orphans first.
    eff = core.handle(b"a", p.Release(w.session, [g.lease for g in first[:2]], p.ReleaseReason.PAUSED), 104.0)
    assert sorted(g.index for g in grants(eff)) == [3, 4]


def test_agent_reporting_an_orphan_adopts_it_after_restart():
    restored = LedgerSnapshot(generation=2, cursors={0: 3})
    core = make_core(prefetch=0, restored=restored)
    w, _ = register(core, in_flight=[[77, 0, 1]])
    assert w.cancel == []
    assert core.frontier.state_of(0, 1) == LEASED


def test_dataset_mismatch_is_refused():
    core = make_core()
    eff = core.handle(b"a", p.Register("a", 1, 8, "tcp://a:1", [], [], [], "other", 20), 0.0)
    assert sends(eff, p.Error)[0].msg.code == "dataset_mismatch"


@pytest.mark.parametrize("size", [1, 7])
def test_epochs_roll_over_and_every_prompt_is_accounted(size):
    core = make_core(size=size, batch=1, prefetch=0)
    w, _ = register(core, slots=100 * N)
    session = attach(core)
    seen = []
    for rid in range(3 * size):
        eff = core.handle(b"trainer", p.Generate(session, rid, rid, 0), 0.0)
        g = grants(eff)[0]
        eff, _ = receipt(core, w.session, g)
        seen.append((g.data_epoch, g.index))
    assert len(set(seen)) == len(seen)
    for epoch in range(3):
        assert sorted(i for e, i in seen if e == epoch) == list(range(size))


def test_batch_on_a_retired_node_is_completed_with_replacements():
    core = make_core(batch=2, prefetch=0, ttl=1.0, retire=5.0)
    wa, _ = register(core, "a", slots=N)
    session = attach(core)
    ga = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    wb, eff = register(core, "b", slots=N)
    gb = grants(eff)
    receipt(core, wa.session, ga[0])
    eff, _ = receipt(core, wb.session, gb[0], agent=b"b")
    first = sends(eff, p.BatchRefs)[0].msg
    assert {g[2] for g in first.groups} == {"a", "b"}
    core.handle(b"b", p.Heartbeat(wb.session), 1.9)
    tick(core, 2.0)  # a is presumed dead; b is alive
    core.handle(b"b", p.Heartbeat(wb.session), 5.9)
    tick(core, 6.0)  # a is retired with its payloads
    # Nothing changes until a trainer asks for batch 0 again (it could not fetch a's group).
    assert core.frontier.state_of(0, ga[0].index) == DELIVERED
    eff = core.handle(b"trainer", p.Generate(session, 2, 0), 6.0)
    assert sends(eff, p.BatchRefs) == []
    # Batch 0 was never fetched, so a's prompt was never trained: it is generated again.
    replacement = grants(eff)
    assert core.statistics().batches_in_repair == (0,)
    assert [g.index for g in replacement] == [ga[0].index]
    assert all(s.to == "b" for s in sends(eff, p.Grant))
    eff, _ = receipt(core, wb.session, replacement[0], agent=b"b", now=6.1)
    repaired = sends(eff, p.BatchRefs)[0].msg
    assert len(repaired.groups) == 2 and {g[2] for g in repaired.groups} == {"b"}
    assert repaired.metrics["rollout/replaced_groups"] == 1


class MemLedger:
    """The ledger's operations folded in memory, with the meaning ``Ledger.apply`` gives them."""

    def __init__(self):
        self.snapshot = LedgerSnapshot()

    def apply(self, effects) -> None:
        for e in effects:
            if isinstance(e, Persist):
                self.snapshot.apply(e.ops)

    def restored(self, generation: int) -> LedgerSnapshot:
        snap = self.snapshot
        return dataclasses.replace(snap, generation=generation, prompts=dict(snap.prompts), batches=dict(snap.batches))


def test_grants_leave_only_behind_the_cursor_that_covers_them():
    """A crash right after a grant must not hand the prompt to a second agent as fresh."""
    core = make_core(batch=2, prefetch=0, ttl=3.0)
    ledger = MemLedger()
    _, eff = register(core, "a")
    ledger.apply(eff)
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 1, 0), 0.0)
    ledger.apply(eff)
    leased = grants(eff)
    assert len(leased) == 2
    # The grants ride in a Persist's ``then``, after the cursor that covers them.
    carrier = [e for e in eff if isinstance(e, Persist) and any(isinstance(s.msg, p.Grant) for s in e.then)]
    assert carrier and carrier[0].ops[-1] == SetCursors({0: 2})
    # The coordinator dies here. After the restart, b registers first and the trainer asks again:
    core2 = make_core(batch=2, prefetch=0, ttl=3.0, restored=ledger.restored(2), now=100.0)
    session = attach(core2)
    core2.handle(b"trainer", p.Generate(session, 1, 0), 100.0)
    _, eff = register(core2, "b", now=100.0)
    assert not {g.index for g in grants(eff)} & {g.index for g in leased}, "a's in-flight prompts were given to b"
    # a comes back within the TTL and adopts its own work.
    w, _ = register(core2, "a", now=101.0, in_flight=[[g.lease, 0, g.index] for g in leased])
    assert w.cancel == []
    assert all(core2.frontier.state_of(0, g.index) == LEASED for g in leased)


def test_pause_survives_a_coordinator_restart():
    core = make_core(prefetch=2)
    ledger = MemLedger()
    w, eff = register(core)
    ledger.apply(eff)
    session = attach(core)
    eff = core.handle(b"trainer", p.Pause(session, 7, drain=False), 0.0)
    ledger.apply(eff)
    persist = [e for e in eff if isinstance(e, Persist)][0]
    assert SetPaused(True) in persist.ops
    assert any(isinstance(s.msg, p.Ok) for s in persist.then), "pause is acknowledged only once durable"
    core2 = make_core(prefetch=2, restored=ledger.restored(2))
    w2, eff = register(core2, in_flight=[[g.lease, 0, g.index] for g in grants(eff)])
    assert w2.paused and grants(eff) == []
    assert core2.statistics().paused
    # Resuming is durable too.
    s2 = attach(core2)
    eff = core2.handle(b"trainer", p.Resume(s2, 7), 0.0)
    ledger.apply(eff)
    assert ledger.restored(3).paused is False


def test_generate_resumes_a_rollout_its_killed_predecessor_left_paused():
    core = make_core(batch=1, prefetch=0)
    w, _ = register(core)
    s1 = attach(core)
    waiting = core.handle(b"trainer", p.Pause(s1, 5, drain=True), 0.0)
    assert core.trainer.paused
    # The trainer dies; its successor attaches and asks for the next batch.
    s2 = sends(core.handle(b"t2", p.Attach(1, "t2"), 0.0), p.Ok)[0].msg.result["session"]
    eff = core.handle(b"t2", p.Generate(s2, 2, 0), 0.0)
    assert not core.trainer.paused
    assert [s.to for s in sends(eff, p.Control)] == ["a"] and sends(eff, p.Control)[0].msg.action == "resume"
    assert len(grants(eff)) == 1, "admission resumed for the waiting generate"
    # Replaying a recorded batch does not resume; a pause still draining is told it was overtaken.
    del waiting
    core.handle(b"t2", p.Pause(s2, 6, drain=True), 0.0)
    eff = core.handle(b"t2", p.Resume(s2, 7), 0.0)
    errs = sends(eff, p.Error)
    assert errs and errs[0].msg.req == 6 and errs[0].msg.code == "resumed"


def test_a_fetched_batch_that_loses_its_node_never_regenerates_its_prompts():
    core = make_core(batch=1, prefetch=0, ttl=1.0, retire=5.0)
    wa, _ = register(core, "a", slots=N)
    session = attach(core)
    ga = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    receipt(core, wa.session, ga[0])
    ok = sends(core.handle(b"trainer", p.Consumed(session, 2, 0), 0.0), p.Ok)
    assert ok and core.batches.consumed_upto == 0
    wb, _ = register(core, "b", slots=N)
    core.handle(b"b", p.Heartbeat(wb.session), 1.9)
    tick(core, 2.0)
    core.handle(b"b", p.Heartbeat(wb.session), 5.9)
    tick(core, 6.0)  # a retired: batch 0 was trained on, so its prompt stays delivered
    assert core.frontier.state_of(0, ga[0].index) == DELIVERED
    assert core.statistics().batches_in_repair == ()
    # A resumed trainer asking for batch 0 again gets it completed with a fresh prompt.
    eff = core.handle(b"trainer", p.Generate(session, 3, 0), 6.0)
    fresh = grants(eff)
    assert len(fresh) == 1 and fresh[0].index != ga[0].index
    eff, _ = receipt(core, wb.session, fresh[0], agent=b"b", now=6.1)
    refs = sends(eff, p.BatchRefs)[0].msg
    assert [g[1] for g in refs.groups] == [fresh[0].index] and refs.metrics["rollout/replaced_groups"] == 1


def _run_epoch(core, w, session, size, start_rid):
    """Deliver every prompt of one epoch as batches of one, and have the trainer fetch them."""
    for rid in range(start_rid, start_rid + size):
        g = grants(core.handle(b"trainer", p.Generate(session, rid, rid, 0), 0.0))[0]
        receipt(core, w.session, g)
        core.handle(b"trainer", p.Consumed(session, rid, rid), 0.0)


def test_a_closed_epoch_is_never_opened_again_by_a_late_agent():
    core = make_core(size=3, batch=1, prefetch=0)
    w, _ = register(core, slots=10 * N)
    session = attach(core)
    _run_epoch(core, w, session, 3, 0)
    g = grants(core.handle(b"trainer", p.Generate(session, 3, 3, 0), 0.0))[0]
    assert g.data_epoch == 1
    receipt(core, w.session, g)
    core.handle(b"trainer", p.Consumed(session, 9, 3), 0.0)
    _run_epoch(core, w, session, 2, 4)  # epoch 1 complete: epoch 0 closes once a newer one is open
    assert core.frontier.is_closed(0)
    # A zombie agent comes back claiming a lease of epoch 0 and a committed group for it.
    w2, eff = register(
        core,
        "z",
        in_flight=[[12345, 0, 1]],
        unacked=[{"lease": 12345, "data_epoch": 0, "index": 1, "key": "late", "stats": {}}],
    )
    assert w2.cancel == [12345] and w2.acks == [["late", False]]
    assert not core.frontier.is_open(0)
    assert all(g.data_epoch >= 1 for g in grants(eff))


def test_epoch_stays_open_until_its_batches_are_fetched():
    core = make_core(size=2, batch=1, prefetch=0)
    w, _ = register(core, slots=10 * N)
    session = attach(core)
    for rid in range(3):
        g = grants(core.handle(b"trainer", p.Generate(session, rid, rid, 0), 0.0))[0]
        receipt(core, w.session, g)
    assert core.frontier.is_open(0), "batches 0 and 1 hold epoch 0 and were not fetched yet"
    core.handle(b"trainer", p.Consumed(session, 7, 1), 0.0)
    assert core.frontier.is_closed(0)


def test_a_prompt_that_keeps_failing_is_filtered_not_retried_forever():
    core = make_core(batch=1, prefetch=1)
    w, eff = register(core)
    g = grants(eff)[0]
    for attempt in range(3):
        failure = p.Failure.of(p.FailureKind.GENERATION_FAILED, "reward raised ValueError")
        eff = core.handle(b"a", p.Release(w.session, [g.lease], p.ReleaseReason.FAILED, failure), 0.0)
        again = [x for x in grants(eff) if x.index == g.index]
        if attempt < 2:
            assert again, "a failed prompt is retried"
            g = again[0]
    assert core.frontier.state_of(0, g.index) == FILTERED
    # The next batch reports it with the other filter drops.
    assert core.training.drops.metrics()["rollout/dynamic_filter/drop_generation_failed"] == 1


def test_filtered_report_counts_for_the_leased_prompt_only():
    core = make_core(prefetch=1)
    w, eff = register(core)
    g = grants(eff)[0]
    core.handle(b"a", p.Filtered(w.session, g.lease, 0, -1, "zero_std_0"), 0.0)
    assert core.frontier.state_of(0, g.index) == FILTERED


def test_malformed_register_fields_are_ignored_not_fatal():
    core = make_core(prefetch=2)
    eff = core.handle(
        b"a",
        p.Register(
            "a",
            1,
            4 * N,
            "tcp://a:1",
            [p.EngineInfo("e0", p.EngineState.HEALTHY)],
            [{"lease": "x"}, 5],
            [["l", "e", 1], [1, 0, 10_000]],
        ),
        0.0,
    )
    assert sends(eff, p.Welcome)
    assert core.statistics().agents["a"].engines == (
        {"name": "e0", "url": "", "state": "healthy", "in_flight": 0, "tp": 1, "version": None},
    )
    assert len(grants(eff)) == 2


def test_coordinator_stall_does_not_retire_the_fleet():
    core = make_core(prefetch=2, ttl=1.0, retire=5.0)
    w, _ = register(core)
    core.tick(100.0)  # the coordinator itself was stopped for 100 s
    assert core.statistics().agents["a"].status == "alive"


def test_agents_named_in_the_ledger_are_retired_if_they_never_come_back():
    restored = LedgerSnapshot(generation=2, cursors={0: 2}, prompts={(0, 0): PromptState(READY, "gone", "k0", seq=1)})
    core = make_core(prefetch=0, restored=restored, ttl=1.0, retire=5.0)
    assert core.statistics().agents["gone"].status == "dead"
    tick(core, 6.0)
    assert core.statistics().agents["gone"].status == "retired"
    assert core.frontier.state_of(0, 0) == PENDING, "its ready group is generated again"


def test_distribute_spreads_leases_over_many_agents_in_linear_time():
    core = make_core(size=100_000, prefetch=0)
    for i in range(512):
        register(core, f"n{i}", slots=32 * N)
    split = core.membership.distribute(1000)
    assert sum(split.values()) == 1000 and max(split.values()) - min(split.values()) <= 1
    assert sum(core.membership.distribute(10**6).values()) == 512 * 32


def test_registration_trims_stored_groups_nothing_refers_to():
    core = make_core(batch=1, prefetch=0)
    w, _ = register(core, "a")
    session = attach(core)
    g = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))[0]
    receipt(core, w.session, g, key="kept")
    g2 = grants(core.handle(b"trainer", p.Generate(session, 2, 1), 0.0))[0]
    unacked = [{"lease": g2.lease, "data_epoch": 0, "index": g2.index, "key": "pending-receipt", "stats": {}}]
    eff = core.handle(
        b"a",
        p.Register(
            "a",
            2,
            4 * N,
            "tcp://a:1",
            [],
            unacked,
            [],
            stored=["kept", "pending-receipt", "consumed-long-ago", "refused-dup"],
        ),
        1.0,
    )
    trims = [s.msg.keys for s in sends(eff, p.Trim)]
    assert trims == [["consumed-long-ago", "refused-dup"]]


def _register_msg(agent="a", incarnation=1, req=1, unacked=(), in_flight=()):
    return p.Register(agent, incarnation, 4 * N, f"tcp://{agent}:1", [], list(unacked), list(in_flight), req=req)


def test_a_resent_register_gets_the_same_session_and_the_same_acks_not_a_new_session():
    core = make_core(prefetch=2)
    session = attach(core)
    w, eff = register(core)
    g = grants(core.handle(b"trainer", p.Generate(session, 1, 1), 0.0))[0]
    unacked = [{"lease": g.lease, "data_epoch": 0, "index": g.index, "key": "k", "stats": {}}]
    # The agent lost its link and registers again; three copies of that Register arrive at the heal.
    copies = [core.handle(b"a2", _register_msg(req=7, unacked=unacked), 1.0 + i * 0.01) for i in range(3)]
    welcomes = [sends(eff, p.Welcome)[0].msg for eff in copies]
    assert welcomes[0].session != w.session
    assert {x.session for x in welcomes} == {welcomes[0].session}, "one session for one registration"
    assert [x.acks for x in welcomes] == [[["k", True]]] * 3, "the resends answer the same receipts the same way"
    assert core.counters.registrations == 2 and core.counters.registers_resent == 2
    assert not grants(copies[1]) and not grants(copies[2]), "a resend grants nothing new"
    # The session is current: its heartbeat is not fenced.
    assert not sends(core.handle(b"a2", p.Heartbeat(welcomes[0].session), 1.1), p.Fence)


def test_a_register_with_a_new_req_or_incarnation_or_after_the_session_died_makes_a_new_session():
    core = make_core(prefetch=0, ttl=1.0, retire=10.0)
    first = sends(core.handle(b"a", _register_msg(req=1), 0.0), p.Welcome)[0].msg.session
    new_req = sends(core.handle(b"a", _register_msg(req=2), 0.1), p.Welcome)[0].msg.session
    new_boot = sends(core.handle(b"a", _register_msg(incarnation=2, req=2), 0.2), p.Welcome)[0].msg.session
    assert len({first, new_req, new_boot}) == 3
    tick(core, 2.0)  # silent past the TTL: that session is void
    assert core.statistics().agents["a"].status == "dead"
    after = sends(core.handle(b"a", _register_msg(incarnation=2, req=2), 2.0), p.Welcome)[0].msg.session
    assert after != new_boot and core.statistics().agents["a"].status == "alive"
    # req 0 (an agent that does not number its attempts) is never taken for a resend.
    zero = [sends(core.handle(b"a", _register_msg(req=0), 2.1 + i), p.Welcome)[0].msg.session for i in range(2)]
    assert zero[0] != zero[1]


def test_a_resent_welcome_carries_todays_pause():
    core = make_core(prefetch=0)
    session = attach(core)
    before = sends(core.handle(b"a", _register_msg(req=3), 0.0), p.Welcome)[0].msg
    core.handle(b"trainer", p.Pause(session, 2), 0.5)
    again = sends(core.handle(b"a", _register_msg(req=3), 1.0), p.Welcome)[0].msg
    assert again.session == before.session and not before.paused and again.paused


def test_a_state_dict_while_paused_waits_for_a_lease_an_agent_declared_after_the_drain():
    core = make_core(batch=1, prefetch=0, ttl=2.0)
    register(core)
    session = attach(core)
    g = grants(core.handle(b"trainer", p.Generate(session, 0, 0), 0.0))[0]
    ctl = lambda msg, now: core.handle(b"trainer", msg, now)
    assert sends(ctl(p.Pause(session, 7, drain=True), 0.0), p.Ok) == []  # the lease is in flight
    # The agent goes silent past its TTL: its lease ends, and the drain is answered.
    assert sends(tick(core, 5.0), p.Ok)[0].msg.req == 7 and not core.leases.leases
    # It comes back declaring the group it still works on: the lease is in flight again.
    welcome, _ = register(core, now=5.0, in_flight=[[g.lease, g.data_epoch, g.index]])
    assert list(core.leases.leases) == [g.lease]
    eff = ctl(p.StateDict(session, 8, 0), 5.0)
    assert sends(eff, p.Error) == [] and sends(eff, p.Ok) == [], "neither refused nor answered while it runs"
    eff, _ = receipt(core, welcome.session, g, now=5.5)
    [ok] = [s.msg for s in sends(eff, p.Ok) if s.msg.req == 8]
    assert ok.result["rollout_id"] == 0


def test_heartbeats_in_slices_reach_every_live_agent_once_per_round():
    core = make_core()
    names = [f"agent-{i}" for i in range(50)]
    for name in names:
        register(core, name)
    parts = 10
    round_ = [s.to for part in range(parts) for s in core.heartbeats(part, parts)]
    assert sorted(round_) == sorted(names)  # each once, none left out
    assert max(len(core.heartbeats(part, parts)) for part in range(parts)) < len(names)  # spread, not one burst
    assert sorted(s.to for s in core.heartbeats()) == sorted(round_)  # one slice of one: everyone


def test_stats_on_the_wire_are_the_statistics_as_asdict_gives_them():
    from dataclasses import asdict

    core = make_core()
    for name in ("a", "b", "c"):
        register(core, name)
    eff = core.handle(b"probe", p.Stats(1), 0.5)
    wire = sends(eff, p.Ok)[0].msg.result
    assert wire == asdict(core.statistics(0.5))
    assert set(wire["agents"]) == {"a", "b", "c"} and wire["agents"]["a"]["status"] == "alive"
    p.decode(p.encode(sends(eff, p.Ok)[0].msg))  # every value encodes
