"""Over-sampling and partial batches in the pure cores (coordinator/oversampling.py, agent/lease_flow.py):
which leases are stopped, what happens to them, and the ``generate`` deadline. No sockets, no clock."""

from __future__ import annotations

import msgpack
import pytest

from agent.events import AbortRequests, AssignEngine, CancelLease, GenerationEnded
from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.errors import ConfigError, ProtocolError
from coordinator.core import CoordinatorCore, CoreSettings
from coordinator.frontier import DELIVERED, LEASED, PENDING, READY
from coordinator.oversampling import batch_demand, select_stops
from tests.unit.test_agent_session import commit, join, make_session, of, recv, sent, start
from tests.unit.test_core import MemLedger, N, attach, grants, receipt, register, sends, tick


def make_core(batch=2, prefetch=0, over=1.0, size=40, restored=None, ttl=30.0, retire=100.0):
    cfg = RolloutConfig(rollout_batch_size=batch, n_samples_per_prompt=N, prefetch=prefetch)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, ttl, retire), (size,), "fp", over_sampling=over), restored)


def release(core, session, leases, reason=p.ReleaseReason.STOPPED, now=0.0, agent=b"a"):
    return core.handle(agent, p.Release(session, list(leases), reason), now)


# ---------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    "size, factor, want", [(4, 1.0, 4), (4, 2.0, 8), (3, 1.5, 5), (10, 1.1, 11), (32, 1.25, 40), (1, 1.01, 2)]
)
def test_an_oversampled_batch_wants_the_ceiling_of_size_times_factor(size, factor, want):
    assert batch_demand(size, factor) == want


def test_the_newest_leases_are_stopped_first_and_none_twice():
    assert select_stops([5, 9, 2, 7], skip=(), n=2) == [9, 7]
    assert select_stops([5, 9, 2, 7], skip={9}, n=2) == [7, 5]
    assert select_stops([5, 9], skip=(), n=0) == [] and select_stops([5], skip=(), n=3) == [5]


@pytest.mark.parametrize("factor", [0.5, 0.0, float("nan"), float("inf")])
def test_a_factor_below_one_is_refused(factor):
    with pytest.raises(ConfigError, match="--over-sampling"):
        make_core(over=factor)


# ---------------------------------------------------------------------------- stopping


def test_a_waiting_batch_oversamples_and_its_surplus_is_stopped_newest_first_once_it_is_full():
    core = make_core(batch=2, over=2.0)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    assert len(gs) == 4, "ceil(2 x 2.0) groups start for the waiting batch"
    receipt(core, w.session, gs[1])
    eff, _ = receipt(core, w.session, gs[3])  # the second group completes the batch
    assert len(sends(eff, p.BatchRefs)[0].msg.groups) == 2
    [stop] = sends(eff, p.Stop)
    assert stop.to == "a" and stop.msg == p.Stop(w.session, [gs[2].lease, gs[0].lease])
    # Kept until the agent answers: they still count as leased, and nothing new is admitted.
    assert core.statistics().leased == 2 and core.frontier.state_of(0, gs[0].index) == LEASED
    assert sends(core.tick(0.1), p.Stop) == [], "a lease is stopped once"
    eff = release(core, w.session, [gs[2].lease, gs[0].lease])
    assert grants(eff) == [] and core.statistics().leased == 0
    assert core.frontier.state_of(0, gs[0].index) == PENDING
    assert core.counters.lease_ends["stopped"] == 2 and core.counters.stops_sent == 2
    # First in line again, and counted in the next batch's metrics.
    again = grants(core.handle(b"trainer", p.Generate(session, 2, 1), 0.2))
    assert [g.index for g in again[:2]] == [gs[2].index, gs[0].index]
    for g in again[:2]:
        eff, _ = receipt(core, w.session, g)
    batch = sends(eff, p.BatchRefs)[0].msg
    assert batch.metrics["rollout/stopped_groups"] == 2 and batch.metrics["rollout/deficit"] == 0


def test_a_stopped_group_that_finished_anyway_is_accepted_and_goes_into_the_next_batch():
    core = make_core(batch=2, over=2.0)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    receipt(core, w.session, gs[0])
    eff, _ = receipt(core, w.session, gs[1])
    assert {lease for s in sends(eff, p.Stop) for lease in s.msg.leases} == {gs[2].lease, gs[3].lease}
    _, ack = receipt(core, w.session, gs[3])  # the Stop came too late (or was lost): the group is kept
    assert ack.accepted and core.frontier.state_of(0, gs[3].index) == READY
    release(core, w.session, [gs[2].lease])
    eff = core.handle(b"trainer", p.Generate(session, 2, 1), 0.1)
    fresh = grants(eff)
    assert fresh[0].index == gs[2].index, "the stopped prompt is first in line"
    eff, _ = receipt(core, w.session, fresh[0])
    batch = sends(eff, p.BatchRefs)[0].msg
    assert {g[1] for g in batch.groups} == {gs[3].index, gs[2].index}
    assert batch.metrics["rollout/stopped_groups"] == 1


def test_the_prefetch_keeps_its_share_of_the_surplus():
    core = make_core(batch=2, over=2.0, prefetch=1)
    w, eff = register(core, slots=8 * N)
    gs = grants(eff)  # the prefetch, before any trainer asks
    session = attach(core)
    gs += grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    assert len(gs) == 4 + 1
    receipt(core, w.session, gs[0])
    eff, _ = receipt(core, w.session, gs[1])
    [stop] = sends(eff, p.Stop)
    assert stop.msg.leases == [gs[4].lease, gs[3].lease], "3 in flight, 1 kept for the prefetch"


def test_without_oversampling_a_partial_batch_stops_nothing():
    core = make_core(batch=4, over=1.0)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0, -1, 1.0), 0.0))
    receipt(core, w.session, gs[0])
    eff = tick(core, 1.0)
    assert len(sends(eff, p.BatchRefs)[0].msg.groups) == 1
    assert sends(eff, p.Stop) == [] and core.statistics().leased == 3, "the rest go into the next batch"
    assert sends(eff, p.BatchRefs)[0].msg.metrics["rollout/stopped_groups"] == 0


def test_a_lost_stop_leaks_nothing_the_heartbeat_reconciles_the_leases():
    core = make_core(batch=1, over=3.0)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0), 0.0))
    eff, _ = receipt(core, w.session, gs[0])
    assert len(sends(eff, p.Stop)[0].msg.leases) == 2
    # The agent never got the Stop and dropped the leases some other way (its Release lost too).
    core.handle(b"a", p.Heartbeat(w.session, {}, [], max_lease=gs[-1].lease), 0.1)
    assert core.statistics().leased == 0 and not core.oversampling.stopping & core.leases.leases.keys()
    assert all(core.frontier.state_of(0, g.index) == PENDING for g in gs[1:])


# ---------------------------------------------------------------------------- deadline


def test_a_batch_not_full_at_its_deadline_is_partial_recorded_and_replayed():
    core = make_core(batch=4)
    ledger = MemLedger()
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0, -1, 5.0), 0.0))
    assert len(gs) == 4
    eff, _ = receipt(core, w.session, gs[2], now=1.0)
    ledger.apply(eff)
    assert sends(tick(core, 4.9), p.BatchRefs) == []
    # The client resends (same rollout id): the deadline still counts from the first arrival.
    core.handle(b"trainer", p.Generate(session, 2, 0, -1, 5.0), 4.95)
    eff = tick(core, 5.25)
    ledger.apply(eff)
    [batch] = [s.msg for s in sends(eff, p.BatchRefs)]
    assert [g[1] for g in batch.groups] == [gs[2].index]
    assert batch.metrics["rollout/deficit"] == 3 and batch.metrics["rollout/groups"] == 1
    assert core.batches.recorded[0].size == 1 and core.counters.partial_batches == 1
    replay = sends(core.handle(b"trainer", p.Generate(session, 3, 0, -1, 5.0), 6.0), p.BatchRefs)[0].msg
    assert (replay.groups, replay.metrics) == (batch.groups, batch.metrics)
    # The prompts not in it are still in flight, and go into the next batch.
    assert [core.frontier.state_of(0, g.index) for g in gs] == [LEASED, LEASED, DELIVERED, LEASED]
    for g in (gs[0], gs[1], gs[3]):
        receipt(core, w.session, g, now=6.1)
    eff = core.handle(b"trainer", p.Generate(session, 4, 1), 6.2)
    more = grants(eff)
    eff, _ = receipt(core, w.session, more[0], now=6.3)
    nxt = sends(eff, p.BatchRefs)[0].msg
    assert {g[1] for g in nxt.groups} >= {gs[0].index, gs[1].index, gs[3].index}
    assert nxt.metrics["rollout/deficit"] == 0
    # After a restart, the same id replays the same partial batch.
    ledger.apply(eff)
    restarted = make_core(batch=4, restored=ledger.restored(2))
    s2 = attach(restarted)
    again = sends(restarted.handle(b"trainer", p.Generate(s2, 5, 0), 7.0), p.BatchRefs)[0].msg
    refs = lambda b: [g[:4] for g in b.groups]  # noqa: E731  (the payload address is filled in per reply)
    assert (refs(again), again.metrics) == (refs(batch), batch.metrics)


def test_with_nothing_ready_at_the_deadline_the_first_group_makes_the_batch():
    core = make_core(batch=4)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0, -1, 1.0), 0.0))
    assert sends(tick(core, 3.0), p.BatchRefs) == []
    eff, _ = receipt(core, w.session, gs[0], now=3.1)
    [batch] = [s.msg for s in sends(eff, p.BatchRefs)]
    assert len(batch.groups) == 1 and batch.metrics["rollout/deficit"] == 3


def test_a_full_batch_before_the_deadline_is_an_ordinary_batch():
    core = make_core(batch=2)
    w, _ = register(core, slots=8 * N)
    session = attach(core)
    gs = grants(core.handle(b"trainer", p.Generate(session, 1, 0, -1, 60.0), 0.0))
    receipt(core, w.session, gs[0])
    eff, _ = receipt(core, w.session, gs[1])
    batch = sends(eff, p.BatchRefs)[0].msg
    assert len(batch.groups) == 2 and batch.metrics["rollout/deficit"] == 0 and core.batches.recorded[0].size == 0


def test_a_partial_batch_that_loses_its_node_is_repaired_to_its_own_size():
    core = make_core(batch=4, ttl=1.0, retire=5.0)
    wa, _ = register(core, "a", slots=N)
    session = attach(core)
    ga = grants(core.handle(b"trainer", p.Generate(session, 1, 0, -1, 1.0), 0.0))
    wb, eff = register(core, "b", slots=8 * N)
    gb = grants(eff)
    receipt(core, wa.session, ga[0], now=0.5)
    receipt(core, wb.session, gb[0], agent=b"b", now=0.5)
    [partial] = [s.msg for s in sends(tick(core, 1.0), p.BatchRefs)]
    assert len(partial.groups) == 2
    for t in (1.9, 3.9, 5.9):
        core.handle(b"b", p.Heartbeat(wb.session, {}, [g.lease for g in gb[1:]], gb[-1].lease), t)
        tick(core, t + 0.1)  # a is presumed dead, then retired with its payload
    eff = core.handle(b"trainer", p.Generate(session, 2, 0), 6.0)
    assert core.statistics().batches_in_repair == (0,)
    assert grants(eff) == [], "one group is missing, and b's two leases in flight cover it"
    eff, _ = receipt(core, wb.session, gb[1], agent=b"b", now=6.1)
    [repaired] = [s.msg for s in sends(eff, p.BatchRefs)]
    assert len(repaired.groups) == 2, "filled to the partial batch's own size, not rollout_batch_size"
    assert repaired.metrics["rollout/deficit"] == 2 and repaired.metrics["rollout/replaced_groups"] == 1
    receipt(core, wb.session, gb[2], agent=b"b", now=6.2)
    assert len(core.batches.recorded[0].groups) == 2 and core.statistics().ready == 1


# ---------------------------------------------------------------------------- wire


def test_stop_and_the_generate_deadline_round_trip_and_the_deadline_may_be_omitted():
    assert p.decode(p.encode(p.Stop(3, [1, 2]))) == p.Stop(3, [1, 2])
    assert p.decode(p.encode(p.Generate(3, 4, 5, -1, 2.5))).deadline == 2.5
    frame = msgpack.packb([p.PROTOCOL_VERSION, "generate", {"session": 3, "req": 4, "rollout_id": 5}])
    assert p.decode(frame).deadline == 0.0
    bad = msgpack.packb([p.PROTOCOL_VERSION, "generate", {"session": 3, "req": 4, "rollout_id": 5, "deadline": "x"}])
    with pytest.raises(ProtocolError, match="deadline"):
        p.decode(bad)


# ---------------------------------------------------------------------------- agent


def test_the_agent_aborts_a_stopped_generation_and_gives_the_lease_back_when_it_returns():
    s = make_session()
    join(s)
    [assign] = start(s, 1)
    out = recv(s, p.Stop(7, [1]))
    assert out == [AbortRequests("http://e0", assign.request_ids)]
    out = s.handle(GenerationEnded(1, aborted=True), 0.1)
    assert sent(out) == [p.Release(7, [1], p.ReleaseReason.STOPPED)] and CancelLease(1) in out
    assert not s.leases and not of(out, AssignEngine)


def test_the_agent_gives_back_a_stopped_lease_not_on_an_engine_at_once():
    s = make_session()
    join(s)
    recv(s, p.Grant(7, [p.LeaseGrant(4, 0, 4, 0)]))  # not on an engine yet
    out = recv(s, p.Stop(7, [4]))
    assert sent(out) == [p.Release(7, [4], p.ReleaseReason.STOPPED)] and CancelLease(4) in out


def test_a_stop_too_late_lets_the_finished_group_commit():
    s = make_session()
    join(s)
    start(s, 1)
    recv(s, p.Stop(7, [1]))
    assert sent(commit(s, 1), p.Receipt), "the engine finished before the abort: the group is reported"


@pytest.mark.parametrize("why", ["paused", "other session", "unknown lease"])
def test_a_stop_the_agent_should_not_act_on_is_ignored(why):
    s = make_session()
    join(s)
    start(s, 1)
    if why == "paused":
        recv(s, p.Control("pause"))
    msg = p.Stop(8 if why == "other session" else 7, [2 if why == "unknown lease" else 1])
    assert recv(s, msg) == []
    assert 1 in s.leases


def test_the_ledger_keeps_a_partial_batch_size_and_reads_old_records_as_full():
    from coordinator.ledger import _decode_batch, _encode_batch, _pack
    from coordinator.records import GroupRef, RecordedBatch

    partial = RecordedBatch((GroupRef(0, 1, "a", "k"),), {"rollout/deficit": 3.0}, size=1)
    assert _decode_batch(_encode_batch(partial)) == partial
    assert _decode_batch(_pack({"groups": [[0, 1, "a", "k"]], "metrics": {}, "lost": []})).size == 0


# ---------------------------------------------------------------------------- flag and API


def test_the_flag_and_its_config_file_key_take_a_factor_of_at_least_one(tmp_path):
    from common.config_file import parse_args_with_config
    from coordinator.cli import build_parser

    base = ["serve", "--dataset", "d.jsonl", "--data-dir", "d"]
    args, _ = parse_args_with_config(build_parser(), base)
    assert args.over_sampling == 1.0
    path = tmp_path / "c.toml"
    path.write_text("over-sampling = 1.5\n")
    args, effective = parse_args_with_config(build_parser(), [*base, "--config", str(path)])
    assert args.over_sampling == 1.5 and effective["over-sampling"] == 1.5
    path.write_text("over_sampling = 0.5\n")
    with pytest.raises(ConfigError, match=r"key 'over_sampling': must be a number >= 1, got '0.5'"):
        parse_args_with_config(build_parser(), [*base, "--config", str(path)])


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf"), float("nan"), "5"])
def test_generate_refuses_a_deadline_that_is_not_a_positive_number_of_seconds(deadline):
    import asyncio

    from coordinator.client import AsyncRolloutClient

    async def call():
        client = AsyncRolloutClient("tcp://127.0.0.1:9", attach=False, timeout=1)
        try:
            with pytest.raises(ValueError, match="deadline must be a number of seconds > 0"):
                await client.generate(0, deadline=deadline)
        finally:
            await client.close()

    asyncio.run(call())


def test_a_batch_knows_its_size_and_deficit():
    from coordinator.batch import RolloutBatch

    batch = RolloutBatch(3, [], {"rollout/deficit": 2.0})
    assert (len(batch), batch.deficit) == (0, 2) and RolloutBatch(4, []).deficit == 0
