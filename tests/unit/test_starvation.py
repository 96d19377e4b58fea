"""Starvation, as a spec: a reward or filter that fails on every group stops admission and fails
``generate`` with the failure named, instead of burning the dataset while the trainer waits.

Pure core: messages in, effects out; no sockets, no clock.
"""

from __future__ import annotations

import pytest

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.errors import ProtocolError
from coordinator.core import CoordinatorCore, CoreSettings, Persist
from coordinator.frontier import FILTERED, PENDING
from coordinator.records import DropPrompt, LedgerSnapshot
from coordinator.starvation import Starvation, default_starve_after

N = 4  # samples per prompt
AFTER = 12  # --starve-after in these tests
BOOM = "reward 'support:boom' raised RuntimeError: boom"


def make_core(size=100, batch=2, prefetch=0, starve_after=AFTER):
    cfg = RolloutConfig(rollout_batch_size=batch, n_samples_per_prompt=N, prefetch=prefetch)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (size,), "fp", starve_after=starve_after))


def sends(effects, kind=None):
    out = []
    for e in effects:
        items = e.then if isinstance(e, Persist) else [e]
        out += [s for s in items if kind is None or isinstance(s.msg, kind)]
    return out


def grants(effects):
    return [g for s in sends(effects, p.Grant) for g in s.msg.leases]


def ledger_ops(effects):
    return [op for e in effects if isinstance(e, Persist) for op in e.ops]


def register(core, agent="a", groups=4):
    msg = p.Register(agent, 1, groups * N, f"tcp://{agent}:1", [], [], [])
    eff = core.handle(agent.encode(), msg, 0.0)
    return sends(eff, p.Welcome)[0].msg.session, eff


def attach(core):
    return sends(core.handle(b"trainer", p.Attach(1, "t"), 0.0), p.Ok)[0].msg.result["session"]


def fail(core, session, g, kind="reward_error", detail=BOOM, agent=b"a"):
    """The agent reports that ``g``'s group failed in ``kind``."""
    failure = p.Failure.of(kind, detail)
    return core.handle(agent, p.Release(session, [g.lease], p.ReleaseReason.FAILED, failure), 0.0)


def accept(core, session, g, agent=b"a"):
    key = f"{g.data_epoch}:{g.index}:{g.lease:x}"
    msg = p.Receipt(session, g.lease, g.data_epoch, g.index, key, N, {"n_samples": N})
    return core.handle(agent, msg, 0.0)


def fail_everything(core, session, leased, limit=1000, **kw):
    """Play an agent whose every group fails, until no lease is left; returns every effect."""
    out: list = []
    queue = list(leased)
    while queue:
        assert len(out) < limit, "admission never stopped"
        eff = fail(core, session, queue.pop(0), **kw)
        out += eff
        queue += grants(eff)
    return out


# ---------------------------------------------------------------------- the watch alone


def test_streak_of_errors_starves_with_the_dominant_failure_and_an_ok_resets_it():
    s = Starvation(4)
    for i in range(3):
        assert s.error((0, i), "reward_error", "raised A") is None
    s.ok()
    for i in range(3):
        assert s.error((0, i), "reward_error", "raised A") is None
    fresh = s.error((0, 9), "filter_error", "raised B")
    assert fresh is not None and fresh.failed == ((0, 0), (0, 1), (0, 2), (0, 9))
    assert s.reason == "every group of the last 4 failed: reward_error: raised A (3 of them; 1 other failure(s))"
    assert s.error((0, 10), "reward_error", "raised A") is None, "while starved, errors start no new streak"
    s.clear()
    assert s.reason is None


def test_default_window_is_two_batches_and_at_least_64():
    assert default_starve_after(8) == 64
    assert default_starve_after(100) == 200
    assert make_core(batch=100, starve_after=None).training.starvation.after == 200
    with pytest.raises(ValueError):
        Starvation(0)


def test_failures_are_typed_bounded_and_come_with_reason_failed_only():
    failure = p.Failure.of("filter_error", "filter 'm:f' raised KeyError:\n 'x'" + "y" * 1000)
    assert failure.kind is p.FailureKind.FILTER_ERROR and failure.detail.startswith("filter 'm:f' raised KeyError: 'x'")
    assert len(failure.detail) <= p.MAX_FAILURE_DETAIL
    released = p.Release(1, [2], p.ReleaseReason.FAILED, failure)
    assert p.decode(p.encode(released)) == released
    for reason, with_failure in ((p.ReleaseReason.FAILED, None), (p.ReleaseReason.PAUSED, failure)):
        with pytest.raises(ProtocolError, match="a failure comes with 'failed' only"):
            p.decode(p.encode(p.Release(1, [2], reason, with_failure)))
    with pytest.raises(ValueError):
        p.Failure.of("reward_error_42", "x")


# ---------------------------------------------------------------------- in the core


def test_every_group_failing_starves_the_rollout_and_generate_fails_naming_the_failure():
    core = make_core()
    agent, eff = register(core)
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 7, 0), 0.0)
    eff = fail_everything(core, agent, grants(eff))
    errors = sends(eff, p.Error)
    assert [(e.to, e.msg.code, e.msg.req) for e in errors] == [(b"trainer", "starved", 7)]
    why = errors[0].msg.message
    assert why == f"every group of the last {AFTER} failed: reward_error: {BOOM}"
    st = core.statistics()
    assert st.starved == why and st.leased == 0 and st.pending_generates == 0
    # Admission stopped: nothing leased after the last lease came back.
    assert not grants(core.handle(b"a", p.Capacity(agent, 8 * N, []), 0.0))


def test_a_starved_rollout_loses_no_prompt_prompts_filtered_during_the_streak_are_pending_again():
    core = make_core()
    agent, eff = register(core, groups=1)  # one lease at a time: each prompt fails three times, then is filtered
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 7, 0), 0.0)
    eff = fail_everything(core, agent, grants(eff))
    filtered_then_restored = {(op.data_epoch, op.index) for op in ledger_ops(eff) if isinstance(op, DropPrompt)}
    assert len(filtered_then_restored) == AFTER // 3
    st = core.statistics()
    assert st.prompts["filtered"] == 0 and st.filtered_total == 0
    assert st.prompts["pending"] == 100
    assert all(core.frontier.state_of(*prompt) == PENDING for prompt in filtered_then_restored)
    assert core.training.failures == {}, "every prompt gets a fresh start"
    assert core.training.drops.dropped == {}, "no drop reported for prompts that are pending again"
    # The ledger agrees: replaying the effects leaves no prompt record behind.
    snap = LedgerSnapshot()
    snap.apply(ledger_ops(eff))
    assert snap.prompts == {}


def play(core, agent, queue, outcomes):
    """Report one outcome per lease in order (``"error"``, ``"ok"`` or ``"drop"``), leasing on as granted."""
    for outcome in outcomes:
        g = queue.pop(0)
        if outcome == "error":
            eff = fail(core, agent, g)
        elif outcome == "ok":
            eff = accept(core, agent, g)
        else:
            eff = core.handle(b"a", p.Filtered(agent, g.lease, 0, g.index, "zero_std_0"), 0.0)
        queue += grants(eff)


def test_an_accepted_group_resets_the_window():
    core = make_core(prefetch=8)
    agent, eff = register(core)
    queue = grants(eff)
    play(core, agent, queue, (["error"] * (AFTER - 1) + ["ok"]) * 3 + ["error"] * (AFTER - 1))
    assert core.statistics().starved is None
    assert queue, "admission goes on"
    play(core, agent, queue, ["error"])
    assert core.statistics().starved is not None


def test_a_filter_drop_is_a_working_pipeline_and_resets_the_window_too():
    core = make_core(prefetch=8)
    agent, eff = register(core)
    queue = grants(eff)
    play(core, agent, queue, (["error"] * (AFTER - 1) + ["drop"]) * 3)
    assert core.statistics().starved is None


def test_a_prompt_failing_on_its_own_is_filtered_with_its_failure_kind_and_stays_filtered():
    core = make_core(prefetch=50)
    agent, eff = register(core, groups=2)
    queue = grants(eff)
    for _ in range(20):  # prompt 0's filter raises, every other prompt is fine
        g = queue.pop(0)
        if g.index == 0:
            queue += grants(fail(core, agent, g, kind="filter_error", detail="filter 'm:f' raised KeyError: 'x'"))
        else:
            queue += grants(accept(core, agent, g))
    assert core.frontier.state_of(0, 0) == FILTERED
    assert core.training.drops.dropped == {"filter_error": 1}
    assert core.statistics().filtered_total == 1
    # A later streak that starves the rollout does not take back what an earlier success confirmed.
    fail_everything(core, agent, queue)
    assert core.statistics().starved is not None
    assert core.frontier.state_of(0, 0) == FILTERED


def test_errors_of_leases_granted_before_the_starvation_count_for_nothing():
    core = make_core(prefetch=8)
    agent, eff = register(core, groups=8)
    leased = grants(eff)
    for _ in range(AFTER):
        leased += grants(fail(core, agent, leased.pop(0)))
    assert core.statistics().starved is not None and leased
    late = leased[0]
    for _ in range(2):  # the same prompt failed before; it would be its third failure
        eff = fail(core, agent, leased.pop(0))
        assert not grants(eff)
    assert core.frontier.state_of(0, late.index) == PENDING
    assert core.statistics().prompts["filtered"] == 0
    assert core.training.failures == {}


def test_a_new_generate_clears_the_starvation_and_admission_resumes_a_resend_does_not():
    core = make_core()
    agent, eff = register(core)
    session = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 7, 0), 0.0)
    fail_everything(core, agent, grants(eff))
    # The trainer's resend of the same request (sent before the answer reached it) is told again.
    eff = core.handle(b"trainer", p.Generate(session, 7, 0), 0.0)
    assert [s.msg.code for s in sends(eff, p.Error)] == ["starved"] and not grants(eff)
    assert core.statistics().starved is not None
    # A new call (e.g. the agents now run a fixed reward): admission resumes.
    eff = core.handle(b"trainer", p.Generate(session, 8, 0), 0.0)
    leased = grants(eff)
    assert leased and core.statistics().starved is None
    effs = [accept(core, agent, g) for g in leased]
    assert sends(effs[-1], p.BatchRefs), "the batch comes"


def test_the_next_generate_after_a_fix_fails_again_only_after_another_full_window():
    core = make_core()
    agent, eff = register(core)
    session = attach(core)
    fail_everything(core, agent, grants(core.handle(b"trainer", p.Generate(session, 7, 0), 0.0)))
    queue = grants(core.handle(b"trainer", p.Generate(session, 8, 0), 0.0))
    play(core, agent, queue, ["error"] * (AFTER - 1))
    assert core.statistics().starved is None, "a fresh window"
    eff = fail_everything(core, agent, queue)
    assert [(s.msg.code, s.msg.req) for s in sends(eff, p.Error)] == [("starved", 8)]


# ---------------------------------------------------------------------- a filter that drops everything


def drop(core, session, g, reason="zero_std_0", agent=b"a"):
    return core.handle(agent, p.Filtered(session, g.lease, g.data_epoch, g.index, reason), 0.0)


def test_drops_in_a_row_warn_once_then_starve_with_the_counts_by_reason(caplog):
    s = Starvation(3, drop_after=5)
    with caplog.at_level("WARNING", logger="rollfleet.coordinator"):
        assert [s.dropped("zero_std_0") for _ in range(4)] == [False] * 4
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "last 3 (none kept): zero_std_0=3" in warnings[0]
    assert s.dropped("zero_std_1") and s.starved
    assert s.reason == "the filter dropped every group of the last 5 (none kept): zero_std_0=4, zero_std_1=1"
    s.clear()
    assert not s.starved and not s.dropped("zero_std_0")


def test_a_kept_group_ends_a_streak_of_drops_and_no_limit_means_never():
    s = Starvation(3, drop_after=3)
    s.dropped("r")
    s.dropped("r")
    s.kept()
    assert not s.dropped("r") and not s.dropped("r") and s.dropped("r")
    never = Starvation(3)
    assert not any(never.dropped("r") for _ in range(1000)) and not never.starved
    with pytest.raises(ValueError):
        Starvation(3, drop_after=0)


def test_a_filter_that_drops_every_group_starves_generate_with_the_counts_and_stops_admission():
    core = make_core(size=100)
    assert core.training.starvation.drop_after == 100, "the default: one data epoch"
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=N, prefetch=0)
    settings = CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (100,), "fp", starve_after=AFTER, starve_after_drops=20)
    core = CoordinatorCore(settings)
    agent, _ = register(core)
    session = attach(core)
    queue = grants(core.handle(b"trainer", p.Generate(session, 7, 0), 0.0))
    out: list = []
    while queue:
        assert len(out) < 1000, "admission never stopped"
        eff = drop(core, agent, queue.pop(0))
        out += eff
        queue += grants(eff)
    errors = sends(out, p.Error)
    assert [(e.to, e.msg.code, e.msg.req) for e in errors] == [(b"trainer", "starved", 7)]
    assert errors[0].msg.message.endswith("last 20 (none kept): zero_std_0=20")
    st = core.statistics()
    assert st.prompts["filtered"] == st.filtered_total >= 20 and st.leased == 0
    assert not grants(core.handle(b"a", p.Capacity(agent, 8 * N, []), 0.0)), "admission stopped"
