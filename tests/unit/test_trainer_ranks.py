"""A trainer of several processes against the coordinator's pure core: the leader attaches, members join its
session, each rank's generate gets its own share, the batch is consumed once every rank took its share, and a
lost node costs only the ranks still missing theirs."""

from __future__ import annotations

from common import protocol as p
from coordinator.frontier import DELIVERED, PENDING
from coordinator.shares import decode_lengths
from tests.unit.test_core import MemLedger, N, grants, make_core, register, sends, tick

RANKS = [b"r0", b"r1", b"r2"]


def join(core, rank, world=3, run="run-a", peer=None):
    eff = core.handle(peer or RANKS[rank], p.Attach(10 + rank, f"t{rank}", {}, rank, world, run), 0.0)
    (answer,) = sends(eff)
    return answer.msg


def attach_all(core, world=3, run="run-a"):
    session = join(core, 0, world, run).result["session"]
    for rank in range(1, world):
        assert join(core, rank, world, run).result["session"] == session
    return session


def commit(core, agent_session, g, agent=b"a", now=0.0):
    lengths = [g.index * 7 + 11 + k for k in range(N)]  # every group its own size
    stats = {"n_samples": N, "reward_sum": float(g.index), "prompt_tokens": 4 * N, "lengths": lengths}
    key = f"{g.data_epoch}:{g.index}:{g.lease:x}"
    return core.handle(agent, p.Receipt(agent_session, g.lease, g.data_epoch, g.index, key, N, stats), now)


def ask_all(core, session, rollout_id, req=100, ranks=range(3), now=0.0):
    out = []
    for rank in ranks:
        out += core.handle(RANKS[rank], p.Generate(session, req + rank, rollout_id, -1, 0.0, rank), now)
    return out


def shares_of(effects) -> dict[int, p.BatchRefs]:
    return {RANKS.index(s.to): s.msg for s in sends(effects, p.BatchRefs)}


def produce(core, batch=6):
    wa, eff = register(core, "a", slots=batch * N)
    return wa, eff


def full_batch(core, session, agent_session, eff, rollout_id=0):
    out = ask_all(core, session, rollout_id)
    pending = grants(eff) + grants(out)
    for g in pending:
        out += commit(core, agent_session, g)
    return shares_of(out)


def test_every_rank_gets_a_disjoint_share_and_together_the_whole_batch():
    core = make_core(size=30, batch=6, prefetch=0)
    session = attach_all(core)
    wa, eff = produce(core)
    got = full_batch(core, session, wa.session, eff)
    assert sorted(got) == [0, 1, 2]
    keys = [set(g[3] for g in got[r].groups) for r in range(3)]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert sum(len(k) for k in keys) == 6
    # The whole batch's metrics on every rank, computed over the union.
    assert got[0].metrics == got[1].metrics == got[2].metrics
    assert got[0].metrics["rollout/groups"] == 6
    # Tokens balanced: ranks at most the largest group apart; every rank knows every rank's lengths.
    lengths = decode_lengths(got[0].share["lengths"])
    assert decode_lengths(got[1].share["lengths"]) == lengths and got[2].share["rank"] == 2
    loads = [sum(x) for x in lengths]
    group_tokens = [sum(g.index * 7 + 11 + k for k in range(N)) for g in core.batches.recorded[0].groups]
    assert max(loads) - min(loads) <= max(group_tokens)
    assert sum(loads) == sum(group_tokens)


def test_the_batch_is_consumed_only_once_every_rank_holds_its_share():
    core = make_core(size=30, batch=6, prefetch=0)
    session = attach_all(core)
    wa, eff = produce(core)
    full_batch(core, session, wa.session, eff)
    for rank in (0, 1):
        core.handle(RANKS[rank], p.Consumed(session, 200 + rank, 0, rank), 0.0)
        assert core.batches.consumed_upto == -1
    core.handle(RANKS[2], p.Consumed(session, 202, 0, 2), 0.0)
    assert core.batches.consumed_upto == 0


def test_a_node_lost_after_two_ranks_took_theirs_costs_only_the_third_rank_its_groups():
    core = make_core(size=30, batch=6, prefetch=0, ttl=1.0, retire=5.0)
    session = attach_all(core)
    wa, eff = register(core, "a", slots=3 * N)
    out = ask_all(core, session, 0)
    wb, effb = register(core, "b", slots=3 * N)
    for g in grants(eff) + grants(out):
        out += commit(core, wa.session, g)
    for g in grants(effb):
        out += commit(core, wb.session, g, agent=b"b")
    got = shares_of(out)
    assert {g[2] for r in range(3) for g in got[r].groups} == {"a", "b"}
    for rank in (0, 1):
        core.handle(RANKS[rank], p.Consumed(session, 200 + rank, 0, rank), 0.0)
    # Node a is lost for good before rank 2 took its share.
    core.handle(b"b", p.Heartbeat(wb.session), 1.9)
    tick(core, 2.0)
    core.handle(b"b", p.Heartbeat(wb.session), 5.9)
    tick(core, 6.0)
    held = {(g[0], g[1]) for r in (0, 1) for g in got[r].groups}
    lost = {(g[0], g[1]) for g in got[2].groups if g[2] == "a"}
    eff = core.handle(RANKS[2], p.Generate(session, 300, 0, -1, 0.0, 2), 6.0)
    again = grants(eff)
    # Only rank 2's lost prompts are generated again (never trained); ranks 0 and 1's stay delivered.
    assert {(g.data_epoch, g.index) for g in again} == lost
    assert all(core.frontier.state_of(*prompt) == DELIVERED for prompt in held)
    out = []
    for g in again:
        out += commit(core, wb.session, g, agent=b"b", now=6.1)
    repaired = shares_of(out)[2]
    assert len(repaired.groups) == len(got[2].groups)
    assert {(g[0], g[1]) for g in repaired.groups} == {(g[0], g[1]) for g in got[2].groups}
    assert all(g[2] == "b" for g in repaired.groups)
    core.handle(RANKS[2], p.Consumed(session, 301, 0, 2), 6.3)
    assert core.batches.consumed_upto == 0


def test_a_member_needs_a_leader_of_its_run_and_a_new_leader_fences_the_old_members():
    core = make_core(size=30, batch=6, prefetch=0)
    refused = join(core, 1)
    assert isinstance(refused, p.Error) and refused.code == "no_leader" and "no leader" in refused.message
    session = attach_all(core, run="run-a")
    other = join(core, 1, run="run-b", peer=b"x1")
    assert other.code == "other_leader" and "run-a" in other.message
    wrong = join(core, 1, world=2, peer=b"x2")
    assert wrong.code == "other_leader"
    bad = join(core, 3, world=3, peer=b"x3")
    assert bad.code == "bad_request"
    # Members wait for batch 0; a new run's leader attaches: every waiting call is answered fenced.
    eff = ask_all(core, session, 0, ranks=(1, 2))
    assert sends(eff, p.BatchRefs) == []
    eff = core.handle(b"new0", p.Attach(1, "new", {}, 0, 3, "run-b"), 0.0)
    fenced = [s for s in sends(eff, p.Error)]
    assert sorted(s.to for s in fenced) == [b"r1", b"r2"] and all(s.msg.code == "fenced" for s in fenced)
    late = core.handle(b"r1", p.Generate(session, 500, 0, -1, 0.0, 1), 0.0)
    assert sends(late)[0].msg.code == "fenced"
    assert join(core, 1, run="run-b", peer=b"n1").result["session"] != session


def test_a_members_generate_does_not_resume_the_leaders_pause():
    core = make_core(size=30, batch=2, prefetch=0)
    session = attach_all(core, world=2)
    register(core, "a", slots=2 * N)
    core.handle(b"r0", p.Pause(session, 50, False, False), 0.0)
    core.handle(b"r1", p.Generate(session, 51, 0, -1, 0.0, 1), 0.0)
    assert core.trainer.paused
    core.handle(b"r0", p.Generate(session, 52, 0, -1, 0.0, 0), 0.0)
    assert not core.trainer.paused


def test_shares_survive_a_coordinator_restart():
    ledger = MemLedger()
    core = make_core(size=30, batch=6, prefetch=0)
    session = attach_all(core)
    wa, eff = produce(core)
    ledger.apply(eff)
    out = ask_all(core, session, 0)
    for g in grants(eff) + grants(out):
        out += commit(core, wa.session, g)
    ledger.apply(out)
    before = {r: m.groups for r, m in shares_of(out).items()}
    ledger.apply(core.handle(b"r0", p.Consumed(session, 60, 0, 0), 0.0))
    ledger.apply(core.handle(b"r1", p.Consumed(session, 61, 0, 1), 0.0))
    restarted = make_core(size=30, batch=6, prefetch=0, restored=ledger.restored(2))
    register(restarted, "a", slots=6 * N)
    session = attach_all(restarted)
    recorded = restarted.batches.recorded[0]
    assert {r: [[g.data_epoch, g.index, g.agent_id, g.key] for g in recorded.share(r)] for r in range(3)} == {
        r: [g[:4] for g in groups] for r, groups in before.items()
    }
    # Rank 2, which had not taken its share when the coordinator went down, gets the same one again.
    after = shares_of(ask_all(restarted, session, 0, req=700, ranks=(2,)))
    assert [g[:4] for g in after[2].groups] == [g[:4] for g in before[2]]
    assert restarted.batches.consumed_upto == -1
    restarted.handle(b"r2", p.Consumed(session, 62, 0, 2), 0.0)
    assert restarted.batches.consumed_upto == 0


def test_a_trainer_of_one_process_sees_no_shares():
    core = make_core(size=30, batch=2, prefetch=0)
    eff = core.handle(b"trainer", p.Attach(1, "t"), 0.0)
    session = sends(eff)[0].msg.result["session"]
    wa, eff = register(core, "a", slots=2 * N)
    out = core.handle(b"trainer", p.Generate(session, 2, 0), 0.0)
    for g in grants(eff) + grants(out):
        out += commit(core, wa.session, g)
    (refs,) = [s.msg for s in sends(out, p.BatchRefs)]
    assert refs.share == {} and len(refs.groups) == 2
    assert core.frontier.state_of(0, 0) in (DELIVERED, PENDING)
