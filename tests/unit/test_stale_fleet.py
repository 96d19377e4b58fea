"""A fleet whose every engine is stale (restarted behind a broadcast) in the coordinator's pure core.

Only a weight update brings a stale engine back (docs/weights.md, failure during an update), so a
waiting ``generate`` is answered ``no_capacity`` instead of waiting forever; the trainer pushes an
update and asks again.
"""

from __future__ import annotations

from common import protocol as p
from common.config import Liveness, RolloutConfig
from coordinator.core import CoordinatorCore, CoreSettings, Persist

N = 2  # samples per prompt


def make_core():
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=N, prefetch=0)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (40,), "fp"))


def sends(effects, kind=None, to=None):
    out = []
    for e in effects:
        items = e.then if isinstance(e, Persist) else [e]
        out += [s for s in items if (kind is None or isinstance(s.msg, kind)) and (to is None or s.to == to)]
    return out


def engines(state, version=0):
    return [p.EngineInfo("e0", p.EngineState(state), "http://e0", version=version)]


def register(core, agent, state="healthy", now=0.0):
    core.handle(agent.encode(), p.Register(agent, 1, 8 * N, f"tcp://{agent}:1", engines(state), [], []), now)


def capacity(core, agent, state, version=0, now=0.0):
    session = core.membership.agents[agent].session
    return core.handle(agent.encode(), p.Capacity(session, 8 * N, engines(state, version)), now)


def attach(core):
    eff = core.handle(b"trainer", p.Attach(1, "t", {}), 0.0)
    return sends(eff, p.Ok)[0].msg.result["session"]


def errors(effects):
    return [s.msg for s in sends(effects, p.Error, to=b"trainer")]


def tick(core, now):
    out = []
    t = core.admission._last_tick
    while t < now:
        t = min(now, t + 0.25)
        out += core.tick(t)
    return out


def tick_alive(core, now, *agents):
    """Advance the clock to ``now`` while ``agents`` heartbeat every second."""
    out = []
    while core.admission._last_tick < now:
        t = min(now, core.admission._last_tick + 1.0)
        for agent in agents:
            core.handle(agent.encode(), p.Heartbeat(core.membership.agents[agent].session), t)
        out += tick(core, t)
    return out


def test_generate_fails_once_every_engine_is_stale_and_works_again_after_an_update():
    core = make_core()
    register(core, "a")
    register(core, "b")
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 2, 0), 0.0)
    leases = {s.to: s.msg.leases[0] for s in sends(eff, p.Grant)}
    assert sorted(leases) == ["a", "b"]
    # Both engines restart after a broadcast: out of the pool until the next update.
    assert not errors(capacity(core, "a", "stale")), "b's engine can still generate"
    [err] = errors(capacity(core, "b", "stale"))
    assert (err.code, err.req) == ("no_capacity", 2)
    assert "stale" in err.message and "update_weights" in err.message
    assert core.statistics().pending_generates == 0
    # Asking again before any update fails at once: nothing can bring the engines back meanwhile.
    [err] = errors(core.handle(b"trainer", p.Generate(session, 3, 0), 0.0))
    assert err.code == "no_capacity"
    # The trainer pushes an update: while it runs, a generate waits (the update may bring them back).
    eff = core.handle(b"trainer", p.UpdateWeights(session, 4, 1, "disk", "/ckpt"), 0.0)
    uid = sends(eff, p.WeightsFromDisk)[0].msg.update_id
    assert not errors(core.handle(b"trainer", p.Generate(session, 5, 0), 0.0))
    # Each agent reports its engine serving the new version before its step report.
    for agent in ("a", "b"):
        assert not errors(capacity(core, agent, "healthy", version=1))
        rec = core.membership.agents[agent]
        eff = core.handle(agent.encode(), p.WeightsReport(rec.session, uid, "disk", True, 0, {"e0": 1}, ""), 0.0)
        assert not errors(eff)
    assert core.statistics().weights["version"] == 1 and core.statistics().pending_generates == 1
    # The agents held their leases meanwhile; now their engines generate them and the batch comes.
    for agent, g in sorted(leases.items()):
        rec = core.membership.agents[agent]
        key = f"{g.data_epoch}:{g.index}"
        stats = {"n_samples": N, "reward_sum": 1.0}
        eff = core.handle(agent.encode(), p.Receipt(rec.session, g.lease, g.data_epoch, g.index, key, N, stats), 0.0)
    [batch] = [s.msg for s in sends(eff, p.BatchRefs, to=b"trainer")]
    assert (batch.req, batch.rollout_id, len(batch.groups)) == (5, 0, 2)


def test_a_healthy_or_starting_engine_or_an_update_in_flight_keeps_generate_waiting():
    core = make_core()
    register(core, "a", "stale")
    register(core, "b", "starting")
    session = attach(core)
    assert not errors(core.handle(b"trainer", p.Generate(session, 2, 0), 0.0)), "b's engine is starting"
    [err] = errors(capacity(core, "b", "down"))
    assert err.code == "no_capacity", "a down engine restarts behind the broadcast: stale, too"
    eff = core.handle(b"trainer", p.UpdateWeights(session, 3, 1, "disk", "/ckpt", timeout=5.0), 0.0)
    assert sends(eff, p.WeightsFromDisk)
    assert not errors(core.handle(b"trainer", p.Generate(session, 4, 0), 0.0)), "the update holds the lock"
    # The update misses its deadline: the engines are still stale, so the waiting generate fails.
    eff = tick_alive(core, 6.0, "a", "b")
    assert sorted((e.code, e.req) for e in errors(eff)) == [("no_capacity", 4), ("weights", 3)]


def test_a_dead_agent_with_a_healthy_engine_is_waited_for_until_it_is_retired():
    core = make_core()
    register(core, "a", "stale")
    register(core, "b")
    session = attach(core)
    assert not errors(core.handle(b"trainer", p.Generate(session, 2, 0), 0.0))
    eff = tick_alive(core, 9.0, "a")  # b falls silent: dead after 3 s, retired after 10 s
    assert core.membership.agents["b"].status == "dead" and not errors(eff), "b may come back"
    [err] = errors(tick_alive(core, 10.5, "a"))
    assert err.code == "no_capacity" and "stale" in err.message
