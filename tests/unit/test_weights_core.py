"""Weight updates and bounded staleness in the coordinator's pure core (docs/weights.md)."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

from common import protocol as p
from common.config import Liveness, RolloutConfig
from coordinator.core import CoordinatorCore, CoreSettings, Persist
from coordinator.records import LedgerSnapshot, SetWeights, WeightLog

N = 2  # samples per prompt


def make_core(batch=2, eta=None, restored=None, prefetch=-1, size=40):
    cfg = RolloutConfig(rollout_batch_size=batch, n_samples_per_prompt=N, prefetch=prefetch, max_staleness=eta)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (size,), "fp"), restored)


def sends(effects, kind=None, to=None):
    out = []
    for e in effects:
        items = e.then if isinstance(e, Persist) else [e]
        out += [s for s in items if (kind is None or isinstance(s.msg, kind)) and (to is None or s.to == to)]
    return out


def ops(effects):
    return [op for e in effects if isinstance(e, Persist) for op in e.ops]


def engines(*names, tp=1, version=0, state="healthy"):
    return [p.EngineInfo(n, p.EngineState(state), f"http://{n}", tp=tp, version=version) for n in names]


def register(core, agent, engs=None, slots=8 * N, now=0.0):
    engs = engs if engs is not None else engines("e0")
    eff = core.handle(agent.encode(), p.Register(agent, 1, slots, f"tcp://{agent}:1", engs, [], []), now)
    return sends(eff, p.Welcome)[0].msg, eff


def attach(core, client="t", req=1, expect=None, now=0.0):
    eff = core.handle(b"trainer", p.Attach(req, client, expect or {}), now)
    return sends(eff, p.Ok)[0].msg.result["session"], eff


def report(core, agent, update_id, step, ok=True, seq=0, engs=None, error="", now=0.0):
    session = core.membership.agents[agent].session
    msg = p.WeightsReport(session, update_id, step, ok, seq, engs or {}, error)
    return core.handle(agent.encode(), msg, now)


def reply(effects):
    return [s.msg for s in sends(effects, to=b"trainer") if isinstance(s.msg, (p.Ok, p.Error))][-1]


def disk_update(core, session, version, path="/ckpt", req=10, now=0.0, timeout=300.0):
    return core.handle(b"trainer", p.UpdateWeights(session, req, version, "disk", path, timeout=timeout), now)


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


# ---------------------------------------------------------------------- disk updates and the lock


def test_disk_update_fans_out_holds_admission_and_records_once_every_agent_reported():
    core = make_core(prefetch=0)
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    eff = disk_update(core, session, 3)
    steps = sends(eff, p.WeightsFromDisk)
    assert sorted(s.to for s in steps) == ["a", "b"] and steps[0].msg.path == "/ckpt"
    uid = steps[0].msg.update_id
    assert core.statistics().weights["lock"]["step"] == "disk"
    # Admission is stopped while the lock is held, whatever the demand.
    eff = core.handle(b"trainer", p.Generate(session, 11, 0), 0.0)
    assert not grants(eff)
    assert not sends(report(core, "a", uid, "disk", engs={"e0": 3}), to=b"trainer")
    eff = report(core, "b", uid, "disk", engs={"e0": 3})
    assert ops(eff)[0] == SetWeights(WeightLog(3, 1, "disk", "/ckpt", (core.weights.log.boundaries[-1],)))
    ok = reply(eff)
    assert ok.req == 10 and ok.result["version"] == 3 and ok.result["engines"] == {"a/e0": 3, "b/e0": 3}
    assert grants(eff), "admission resumes once the update is recorded"
    stats = core.statistics().weights
    assert (stats["version"], stats["updates"], stats["kind"], stats["lock"]) == (3, 1, "disk", None)
    # Every engine shows the version as soon as the update is answered (not at the agents' next heartbeat).
    assert stats["engines"] == {"a/e0": 3, "b/e0": 3}
    # A resend of the finished request gets the same answer and starts nothing.
    again = disk_update(core, session, 3)
    assert reply(again) == ok and not sends(again, p.WeightsFromDisk)


def test_versions_never_move_backwards_and_one_update_at_a_time():
    core = make_core()
    register(core, "a")
    session, _ = attach(core)
    eff = disk_update(core, session, 0)
    assert reply(eff).code == "weights_version" and "not greater than" in reply(eff).message
    uid = sends(disk_update(core, session, 2, req=11), p.WeightsFromDisk)[0].msg.update_id
    other, _ = attach(core, "t2", req=2)  # a disk update does not need its trainer: it goes on
    busy = disk_update(core, other, 5, req=12)
    assert reply(busy).code == "weights_busy" and "in flight" in reply(busy).message
    report(core, "a", uid, "disk")
    assert core.weights.log.version == 2
    assert reply(disk_update(core, other, 2, req=13)).code == "weights_version"


def test_an_error_report_aborts_names_agent_and_engine_and_releases_the_lock():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    uid = sends(disk_update(core, session, 1), p.WeightsFromDisk)[0].msg.update_id
    eff = report(core, "b", uid, "disk", ok=False, error="engine e0 of agent b: 400 bad checkpoint")
    err = reply(eff)
    assert err.code == "weights" and "engine e0 of agent b" in err.message and "bad checkpoint" in err.message
    aborts = sends(eff, p.WeightsAbort)
    assert sorted(s.to for s in aborts) == ["a", "b"] and aborts[0].msg.version == 0
    assert core.weights.lock is None and core.weights.log.version == 0


def test_the_deadline_aborts_and_names_who_did_not_answer():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    uid = sends(disk_update(core, session, 1, timeout=2.0), p.WeightsFromDisk)[0].msg.update_id
    report(core, "a", uid, "disk", now=1.0)
    core.handle(b"b", p.Heartbeat(core.membership.agents["b"].session), 1.5)
    assert not sends(tick(core, 1.9), p.WeightsAbort)
    eff = tick(core, 2.1)
    assert sends(eff, p.WeightsAbort) and "deadline" in reply(eff).message and "agents b" in reply(eff).message
    assert core.weights.lock is None


def test_an_agent_registering_during_a_disk_update_joins_it_and_a_lost_one_is_left_to_its_welcome():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    uid = sends(disk_update(core, session, 4), p.WeightsFromDisk)[0].msg.update_id
    _, eff = register(core, "c")
    assert [s.msg.update_id for s in sends(eff, p.WeightsFromDisk, to="c")] == [uid]
    report(core, "a", uid, "disk")
    report(core, "c", uid, "disk")
    for t in (1.0, 2.0, 3.0):
        for agent in ("a", "c"):
            core.handle(agent.encode(), p.Heartbeat(core.membership.agents[agent].session), t)
    eff = tick(core, 3.5)  # b is silent past its TTL: the update is recorded without it
    assert reply(eff).result["version"] == 4
    welcome, _ = register(core, "b", now=4.0)
    assert welcome.weights == p.FleetWeights(4, "disk", "/ckpt")


# ---------------------------------------------------------------------- broadcasts


def broadcast(core, session, version, req=20, address="127.0.0.1", port=29500, confirmed=None, now=0.0):
    """Begin a broadcast; each agent sent ``WeightsBegin`` confirms its engines up (or ``confirmed[agent]``)."""
    eff = core.handle(b"trainer", p.UpdateWeights(session, req, version, "distributed", "", address, port, "gloo"), now)
    for begin in sends(eff, p.WeightsBegin):
        rec = core.membership.agents[begin.to]
        up = [e.name for e in rec.engines if e.state.up]
        members = (confirmed or {}).get(begin.to, up)
        msg = p.WeightsReport(rec.session, begin.msg.update_id, "begin", True, 0, {}, "", members)
        eff += core.handle(begin.to.encode(), msg, now)
    return eff


def finish_broadcast(core, session, uid, agents, buckets=1, req=30, init=True):
    for agent in agents:
        if init:
            report(core, agent, uid, "init")
    for seq in range(buckets):
        core.handle(b"trainer", p.WeightBucket(session, req + 1 + seq, uid, seq, ["w"], ["float32"], [[2]]), 0.0)
        for agent in agents:
            report(core, agent, uid, "bucket", seq=seq)
    eff = core.handle(b"trainer", p.FinishWeights(session, req, uid), 0.0)
    for agent in agents:
        eff += report(core, agent, uid, "finish")
    return eff


def test_broadcast_group_ranks_follow_agent_and_engine_order_with_tp():
    core = make_core()
    register(core, "b", engines("e1", "e0"))
    register(core, "a", engines("x", tp=2) + engines("down", state="down") + engines("s", state="stale"))
    session, _ = attach(core)
    eff = broadcast(core, session, 1)
    assert sorted(s.to for s in sends(eff, p.WeightsBegin)) == ["a", "b"]
    inits = {s.to: s.msg for s in sends(eff, p.WeightsInitGroup)}
    assert inits["a"].rank_offsets == {"a/s": 1, "a/x": 2}
    assert inits["b"].rank_offsets == {"b/e0": 4, "b/e1": 5}
    assert inits["a"].world_size == 6 and inits["a"].master_port == 29500 and inits["a"].backend == "gloo"
    result = reply(eff).result
    assert result["init"] and result["world_size"] == 6 and result["group_name"] == inits["b"].group_name


def test_broadcast_buckets_are_forwarded_once_and_finish_waits_for_every_report():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 7)).result["update_id"]
    bucket = p.WeightBucket(session, 31, uid, 0, ["w"], ["float32"], [[2]])
    first = core.handle(b"trainer", bucket, 0.0)
    assert sorted(s.to for s in sends(first, p.WeightsBucket)) == ["a", "b"] and isinstance(reply(first), p.Ok)
    resent = core.handle(b"trainer", bucket, 0.0)
    assert not sends(resent, p.WeightsBucket) and isinstance(reply(resent), p.Ok)
    eff = core.handle(b"trainer", p.FinishWeights(session, 32, uid), 0.0)
    assert not sends(eff, p.WeightsFinish)
    for agent in ("a", "b"):
        report(core, agent, uid, "init")
    report(core, "a", uid, "bucket", seq=0)
    assert not sends(report(core, "a", uid, "bucket", seq=0), p.WeightsFinish)
    eff = report(core, "b", uid, "bucket", seq=0)
    assert sorted(s.to for s in sends(eff, p.WeightsFinish)) == ["a", "b"]
    report(core, "a", uid, "finish", engs={"e0": 7})
    eff = report(core, "b", uid, "finish", engs={"e0": 7})
    assert reply(eff).req == 32 and reply(eff).result["engines"] == {"a/e0": 7, "b/e0": 7}
    assert core.weights.log == WeightLog(7, 1, "distributed", "", core.weights.log.boundaries)


def test_the_answer_lists_each_agents_engines_as_its_finish_report_says_not_an_earlier_step():
    """An engine paused on the old version (named in a bucket report) that dies while the finish labels it,
    its agent's other engine restarting: the finish report names no engine, and the answer must not show the
    dead one on the old version."""
    core = make_core()
    register(core, "a")
    register(core, "b", engines("e0", "e1"))
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 7)).result["update_id"]
    core.handle(b"trainer", p.WeightBucket(session, 31, uid, 0, ["w"], ["float32"], [[2]]), 0.0)
    core.handle(b"trainer", p.FinishWeights(session, 32, uid), 0.0)
    for agent in ("a", "b"):
        report(core, agent, uid, "init")
    report(core, "a", uid, "bucket", seq=0, engs={"e0": 6})
    report(core, "b", uid, "bucket", seq=0, engs={"e0": 6, "e1": 6})
    report(core, "a", uid, "finish", engs={"e0": 7})
    session_b = core.membership.agents["b"].session
    msg = p.WeightsReport(session_b, uid, "finish", True, 0, {}, "")  # e0 restarting, e1 died in the finish
    eff = core.handle(b"b", msg, 0.0)
    assert reply(eff).result["engines"] == {"a/e0": 7}


def test_the_group_is_formed_again_only_when_the_fleet_or_trainer_changed():
    core = make_core()
    register(core, "a")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 1)).result["update_id"]
    finish_broadcast(core, session, uid, ["a"])
    eff = broadcast(core, session, 2, req=40, port=29501)
    assert not reply(eff).result["init"] and not sends(eff, p.WeightsInitGroup)
    finish_broadcast(core, session, reply(eff).result["update_id"], ["a"], req=50, init=False)
    register(core, "b")  # an engine joined
    eff = broadcast(core, session, 3, req=60)
    assert reply(eff).result["init"] and sorted(s.to for s in sends(eff, p.WeightsInitGroup)) == ["a", "b"]
    finish_broadcast(core, session, reply(eff).result["update_id"], ["a", "b"], req=70)
    other, _ = attach(core, "t2", req=2)  # a new trainer process: its own group
    assert reply(broadcast(core, other, 4, req=80)).result["init"]


def test_a_fenced_trainer_aborts_its_broadcast_and_the_next_forms_a_new_group():
    core = make_core()
    register(core, "a")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 1)).result["update_id"]
    core.handle(b"trainer", p.WeightBucket(session, 21, uid, 0, ["w"], ["float32"], [[2]]), 0.0)
    _, eff = attach(core, "t2", req=2)
    assert [s.msg.update_id for s in sends(eff, p.WeightsAbort)] == [uid]
    assert core.weights.lock is None and core.weights.log.version == 0
    late = core.handle(b"trainer", p.FinishWeights(session, 22, uid), 0.0)
    assert reply(late).code == "fenced"


def test_a_trainer_beginning_again_gives_up_its_own_update_in_flight():
    core = make_core()
    register(core, "a")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 1)).result["update_id"]
    eff = broadcast(core, session, 1, req=21)
    assert [s.msg.update_id for s in sends(eff, p.WeightsAbort)] == [uid]
    assert reply(eff).result["init"] and reply(eff).result["update_id"] != uid
    stale = core.handle(b"trainer", p.FinishWeights(session, 22, uid), 0.0)
    assert reply(stale).code == "weights" and "replaced" in reply(stale).message


def test_a_lost_group_member_aborts_the_broadcast():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session, _ = attach(core)
    broadcast(core, session, 1)
    core.handle(b"a", p.Heartbeat(core.membership.agents["a"].session), 3.0)
    eff = tick(core, 3.5)
    assert sends(eff, p.WeightsAbort, to="a") and core.weights.lock is None


def test_attach_with_a_different_config_is_refused_naming_every_field():
    core = make_core(eta=1)
    eff = core.handle(
        b"trainer",
        p.Attach(1, "t", {"max_staleness": 2, "partial_rollout": True, "rollout_batch_size": 3, "bogus": 1}),
        0.0,
    )
    err = reply(eff)
    assert err.code == "config_mismatch"
    for name in ("max_staleness", "rollout_batch_size", "bogus"):
        assert name in err.message
    assert "partial_rollout" not in err.message
    assert core.trainer.session == 0
    attach(core, expect={"max_staleness": 1, "partial_rollout": True})


# ---------------------------------------------------------------------- restore


def test_weight_log_and_staleness_state_survive_a_restart():
    core = make_core(prefetch=2, batch=1)
    _, eff = register(core, "a")
    before = granted(eff)
    session, _ = attach(core)
    uid = sends(disk_update(core, session, 5), p.WeightsFromDisk)[0].msg.update_id
    eff += report(core, "a", uid, "disk")
    more = core.handle(b"trainer", p.Generate(session, 11, 0), 0.0)
    after = granted(more)
    assert len(after) == 1 and core.leases.leases[after[0].lease].start == 1
    more += run_receipts(core, before[:1]) + run_receipts(core, after)  # batch 0, then a group on the new weights
    eff += more
    snap = LedgerSnapshot(generation=2)
    snap.apply(ops(eff))
    assert snap.weights.version == 5 and snap.weights.updates == 1
    assert [st.start for st in snap.prompts.values() if st.ready] == [1]
    restarted = make_core(prefetch=2, batch=1, restored=snap)
    msg = p.Register(
        "a",
        2,
        8 * N,
        "tcp://a:1",
        engines("e0", version=5),
        [],
        [[g.lease, g.data_epoch, g.index] for g in before[1:]],
    )
    welcome = sends(restarted.handle(b"a", msg, 0.0), p.Welcome)[0].msg
    assert welcome.weights == p.FleetWeights(5, "disk", "/ckpt")
    # A lease granted before the update keeps its start across the restart, and so does a ready group.
    assert {i: lease.start for i, lease in restarted.leases.leases.items()} == {before[1].lease: 0}
    assert [st.start for st in restarted.ready.info.values()] == [1]
    assert restarted.statistics().weights["updates"] == 1


def test_engines_ahead_of_the_log_raise_it_at_registration():
    core = make_core(restored=LedgerSnapshot(weights=WeightLog(3, 2, "disk", "/c3")))
    welcome, eff = register(core, "a", engines("e0", version=4))
    assert core.weights.log.version == 4 and welcome.weights.version == 4
    assert any(isinstance(op, SetWeights) for op in ops(eff))
    _, eff = register(core, "b", engines("e0", version=3))
    assert core.weights.log.version == 4


# ---------------------------------------------------------------------- staleness


def run_receipts(core, leases, now=0.0):
    """Every lease's group is committed."""
    out = []
    for g in leases:
        agent = g.agent
        session = core.membership.agents[agent].session
        key = f"{g.data_epoch}:{g.index}:{g.lease:x}"
        out += core.handle(
            agent.encode(), p.Receipt(session, g.lease, g.data_epoch, g.index, key, N, {"n_samples": N}), now
        )
    return out


def granted(effects):
    return [SimpleNamespace(**asdict(g), agent=s.to) for s in sends(effects, p.Grant) for g in s.msg.leases]


def one_update(core, session, version, req):
    uid = sends(disk_update(core, session, version, req=req), p.WeightsFromDisk)[0].msg.update_id
    return report(core, "a", uid, "disk")


def test_staleness_eta_0_admits_one_batch_per_update():
    core = make_core(batch=2, eta=0, prefetch=8)
    _, eff = register(core, "a")
    assert len(granted(eff)) == 2, "rule 1: (updates + ETA + 1) * B - delivered = 2"
    session, _ = attach(core)
    leases = granted(eff)
    eff = core.handle(b"trainer", p.Generate(session, 5, 0), 0.0) + run_receipts(core, leases)
    batch = [s.msg for s in sends(eff, p.BatchRefs)][0]
    assert batch.metrics["rollout/staleness_max"] == 0.0
    assert not granted(eff), "no admission for rollout 1 before the update"
    eff = one_update(core, session, 1, 6)
    assert len(granted(eff)) == 2
    assert all(lease.start == 1 for lease in core.leases.leases.values())


def test_staleness_eta_1_keeps_oldest_first_and_holds_a_batch_for_a_lease_that_must_join_it():
    core = make_core(batch=2, eta=1, prefetch=8)
    _, eff = register(core, "a")
    old = granted(eff)
    assert len(old) == 4  # two batches ahead: (0 + 1 + 1) * 2
    session, _ = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 5, 0), 0.0) + run_receipts(core, old[:2])
    assert [s.msg for s in sends(eff, p.BatchRefs)][0].metrics["rollout/staleness_max"] == 0.0
    eff = one_update(core, session, 1, 6)  # updates = 1: rule 1 allows (1 + 2) * 2 - 2 delivered - 2 leased
    new = granted(eff)
    assert len(new) == 2 and all(core.leases.leases[g.lease].start == 1 for g in new)
    # The new leases finish first, but batch 1 must take the old ones (start 0 <= 1 - 1): it waits for them.
    eff = core.handle(b"trainer", p.Generate(session, 7, 1), 0.0) + run_receipts(core, new)
    assert not sends(eff, p.BatchRefs)
    eff = run_receipts(core, old[2:3])
    assert not sends(eff, p.BatchRefs), "one lease with start 0 is still in flight"
    eff = run_receipts(core, old[3:])
    batch = [s.msg for s in sends(eff, p.BatchRefs)][0]
    assert sorted(g[1] for g in batch.groups) == sorted(g.index for g in old[2:])
    assert batch.metrics["rollout/staleness_max"] == 1.0 and batch.metrics["rollout/staleness_mean"] == 1.0


def test_unbounded_staleness_keeps_acceptance_order_and_admission():
    core = make_core(batch=2, eta=None, prefetch=8)
    _, eff = register(core, "a")
    assert len(granted(eff)) == 8
    assert core.staleness.budget(100, 100, 0) is None


# ---------------------------------------------------------------------- failures give the fleet back


def test_the_group_is_formed_of_confirmed_engines_once_every_agent_answered():
    """``UpdateWeights`` is answered only when every agent confirmed its engines; an engine its agent
    did not confirm (dead, or still in a failed broadcast) holds no rank, whatever the status said."""
    core = make_core()
    register(core, "a", engines("e0", "e1"))
    register(core, "b", engines("e0"))
    session, _ = attach(core)
    eff = core.handle(b"trainer", p.UpdateWeights(session, 20, 1, "distributed", "", "127.0.0.1", 29500, "gloo"), 0.0)
    assert sorted(s.to for s in sends(eff, p.WeightsBegin)) == ["a", "b"]
    assert not sends(eff, to=b"trainer") and not sends(eff, p.WeightsInitGroup)
    uid = sends(eff, p.WeightsBegin)[0].msg.update_id
    assert core.statistics().weights["lock"]["step"] == "begin"
    a = p.WeightsReport(core.membership.agents["a"].session, uid, "begin", True, 0, {}, "", ["e1"])
    assert not sends(core.handle(b"a", a, 0.0), to=b"trainer")
    b = p.WeightsReport(core.membership.agents["b"].session, uid, "begin", True, 0, {}, "", ["e0"])
    eff = core.handle(b"b", b, 0.0)
    result = reply(eff).result
    assert result["rank_offsets"] == {"a/e1": 1, "b/e0": 2} and result["world_size"] == 3 and result["init"]
    assert {s.to: s.msg.rank_offsets for s in sends(eff, p.WeightsInitGroup)} == {"a": {"a/e1": 1}, "b": {"b/e0": 2}}


def test_no_engine_confirmed_fails_the_update_at_once_and_gives_the_fleet_back():
    core = make_core(prefetch=0)
    register(core, "a")
    session, _ = attach(core)
    eff = broadcast(core, session, 1, confirmed={"a": []})
    assert reply(eff).code == "weights" and "no engine" in reply(eff).message
    assert core.weights.lock is None and sends(eff, p.WeightsAbort, to="a")
    assert grants(core.handle(b"trainer", p.Generate(session, 11, 0), 0.0)), "admission goes on"


def test_the_trainers_own_failure_releases_the_lock_at_once_and_the_next_update_forms_a_new_group():
    """``AbortWeights`` (the trainer's broadcast raised): the lock is released in the same turn, admission
    resumes, every agent gives the update up, and the next update forms a new group under a new name."""
    core = make_core(prefetch=0)
    register(core, "a")
    session, _ = attach(core)
    first = reply(broadcast(core, session, 1)).result
    finish_broadcast(core, session, first["update_id"], ["a"])
    begun = reply(broadcast(core, session, 2, req=40)).result
    assert not begun["init"]  # the same fleet and trainer: the group is kept
    uid = begun["update_id"]
    core.handle(b"trainer", p.WeightBucket(session, 41, uid, 0, ["w"], ["float32"], [[2]]), 0.0)
    core.handle(b"trainer", p.Generate(session, 42, 0), 0.0)
    why = "RuntimeError: [gloo/transport/tcp/pair.cc:561] Connection closed by peer"
    eff = core.handle(b"trainer", p.AbortWeights(session, 43, uid, why), 0.0)
    assert isinstance(reply(eff), p.Ok) and core.weights.lock is None
    assert [s.msg.update_id for s in sends(eff, p.WeightsAbort)] == [uid]
    assert grants(eff), "admission resumes in the same turn"
    assert "Connection closed by peer" in core.weights.partial
    late = core.handle(b"trainer", p.FinishWeights(session, 44, uid), 0.0)
    assert reply(late).code == "weights" and "failed in its trainer" in reply(late).message
    again = reply(broadcast(core, session, 2, req=50, port=29511)).result
    assert again["init"] and again["group_name"] not in (first["group_name"], begun["group_name"])
    # An abort for an update already over changes nothing and is answered.
    assert isinstance(reply(core.handle(b"trainer", p.AbortWeights(session, 51, uid, "late"), 0.0)), p.Ok)
    assert core.weights.lock is not None


def test_a_broadcast_whose_trainer_falls_silent_is_aborted_at_the_ttl_not_the_deadline():
    """The session's liveness: ``WeightsAlive`` (or any message of the update) keeps the lock; silence past
    the TTL (3 s here) aborts the update though its deadline (300 s) is far."""
    core = make_core(prefetch=0)
    register(core, "a")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 1)).result["update_id"]
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        core.handle(b"a", p.Heartbeat(core.membership.agents["a"].session), t)
        core.handle(b"trainer", p.WeightsAlive(session, int(t * 10)), t)
        assert not sends(tick(core, t), p.WeightsAbort), t
    assert core.weights.lock is not None
    core.handle(b"trainer", p.Generate(session, 90, 0), 5.0)
    eff = []
    for t in (6.0, 7.0, 8.0, 8.5):
        core.handle(b"a", p.Heartbeat(core.membership.agents["a"].session), t)
        eff += tick(core, t)
    assert core.weights.lock is None and [s.msg.update_id for s in sends(eff, p.WeightsAbort)] == [uid]
    assert grants(eff)
    late = core.handle(b"trainer", p.FinishWeights(session, 91, uid), 9.0)
    assert "silent" in reply(late).message and "presumed dead" in reply(late).message


def test_no_capacity_names_a_partial_update_not_a_restart():
    core = make_core(prefetch=0)
    register(core, "a")
    session, _ = attach(core)
    uid = reply(broadcast(core, session, 1)).result["update_id"]
    core.handle(b"trainer", p.WeightBucket(session, 21, uid, 0, ["w"], ["float32"], [[2]]), 0.0)
    core.handle(b"trainer", p.AbortWeights(session, 22, uid, "RuntimeError: boom"), 0.0)
    rec = core.membership.agents["a"]
    hb = p.Heartbeat(rec.session)
    core.handle(b"a", hb, 0.1)
    rec.engines = engines("e0", state="stale")  # what the agent reports after the abort
    why = core.capacity.why_none()
    assert why is not None and "part of a failed weight update" in why and "boom" in why and "restart" not in why
