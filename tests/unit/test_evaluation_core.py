"""Evaluation passes in the coordinator's pure core, and the metrics and flags around them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.errors import ConfigError
from coordinator.core import CoordinatorCore, CoreSettings, Persist
from coordinator.eval_datasets import parse_eval_dataset
from coordinator.evaluation import EVAL_EPOCH, EvalSpec, eval_metrics, pass_at_k
from coordinator.records import LedgerSnapshot, PutEvalResult, SetEvalPass
from tests.unit.test_core import grants, sends
from tests.unit.test_starvation import ledger_ops as ops

N = 4
SPEC = EvalSpec("math", size=6, fingerprint="efp", n_samples=2, sampling={"temperature": 0.0})


def make_core(restored=None, prefetch=2, specs=(SPEC,)):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=N, prefetch=prefetch)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), (20,), "fp", eval_specs=specs), restored)


leases = grants  # the Grants' leases, training or evaluation


def setup(restored=None, slots=8 * N, prefetch=2):
    core = make_core(restored, prefetch)
    eff = core.handle(b"a", p.Register("a", 1, slots, "tcp://a:1", [], [], []), 0.0)
    welcome = sends(eff, p.Welcome)[0].msg
    eff2 = core.handle(b"t", p.Attach(1, "t"), 0.0)
    trainer = sends(eff2, p.Ok)[0].msg.result["session"]
    return core, welcome.session, trainer, leases(eff)


def result(core, session, g, rewards=(1.0, 0.0)):
    res = p.EvalOutcome(list(rewards), [3] * len(rewards), 1, ["v0"])
    return core.handle(b"a", p.EvalResult(session, g.lease, g.eval, g.eval_pass, g.index, res), 1.0)


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(4, 1, 4) == 1.0


def test_metrics_leave_failed_prompts_out_of_the_means():
    spec = EvalSpec("m", 3, "f", n_samples=2)
    results = {
        0: {"rewards": [1.0, 0.0], "lengths": [4, 6], "truncated": 1, "versions": ["1"]},
        1: {"rewards": [0.0, 0.0], "lengths": [2, 2], "truncated": 0, "versions": ["1"]},
        2: {"failed": "reward_error: boom"},
    }
    m = eval_metrics(spec, 1, results)
    assert (m["prompts"], m["samples"], m["failed_prompts"]) == (3, 4, 1)
    assert m["reward_mean"] == 0.25
    assert m["response_length_mean"] == 3.5
    assert m["truncated_ratio"] == 0.25
    assert m["pass@1"] == pytest.approx(0.25) and m["pass@2"] == pytest.approx(0.5)
    assert m["weight_versions"] == ["1"]


def test_a_pass_leases_every_prompt_once_outside_the_training_bound_and_answers_after_the_commit():
    core, agent, trainer, training = setup()
    assert len(training) == 2  # prefetch
    cursors = core.frontier.cursors()
    eff = core.handle(b"t", p.Evaluate(trainer, 7, "math", "tok"), 0.5)
    evals = leases(eff)
    assert sorted(g.index for g in evals) == list(range(6))
    assert {g.data_epoch for g in evals} == {EVAL_EPOCH}
    assert all(g.n_samples == 2 and g.sampling == {"temperature": 0.0} for g in evals)
    assert all(s.with_rows for s in sends(eff, p.Grant))  # rows from the evaluation file, always
    assert core.frontier.cursors() == cursors  # the training frontier did not move
    assert core.statistics().prompts["leased"] == 2
    out = []
    for g in evals[:-1]:
        out += result(core, agent, g)
    assert not sends(out, p.Ok)
    # A second result for a prompt already counted changes nothing (a reissued lease, a restart).
    assert not ops(result(core, agent, evals[0], rewards=(0.0, 0.0)))
    assert core.evaluations.passes["math"].results[evals[0].index]["rewards"] == [1.0, 0.0]
    last = result(core, agent, evals[-1])
    (answer,) = sends(last, p.Ok)
    assert answer.msg.req == 7 and answer.msg.result["prompts"] == 6
    # The answer travels behind the write of the last result and the finished pass.
    (persist,) = [e for e in last if isinstance(e, Persist) and answer in e.then]
    kinds = {type(op) for op in persist.ops}
    assert {PutEvalResult, SetEvalPass} <= kinds
    assert answer.msg.result["reward_mean"] == 0.5


def test_a_resend_gets_the_recorded_metrics_and_a_new_call_starts_the_next_pass():
    core, agent, trainer, _ = setup()
    evals = leases(core.handle(b"t", p.Evaluate(trainer, 1, "math", "tok"), 0.0))
    for g in evals:
        result(core, agent, g)
    again = sends(core.handle(b"t", p.Evaluate(trainer, 2, "math", "tok"), 0.0), p.Ok)
    assert again and again[0].msg.result["pass"] == 1
    eff = core.handle(b"t", p.Evaluate(trainer, 3, "math", "other"), 0.0)
    assert {g.eval_pass for g in leases(eff)} == {2}


def test_released_and_failed_prompts_are_generated_again_then_recorded_failed():
    core, agent, trainer, _ = setup()
    evals = leases(core.handle(b"t", p.Evaluate(trainer, 1, "math", "tok"), 0.0))
    g = evals[0]
    again = leases(core.handle(b"a", p.Release(agent, [g.lease], p.ReleaseReason.PAUSED), 0.0))
    assert [x.index for x in again] == [g.index]
    for _ in range(3):
        g = again[0]
        failure = p.Failure.of("reward_error", "boom")
        eff = core.handle(b"a", p.Release(agent, [g.lease], p.ReleaseReason.FAILED, failure), 0.0)
        again = leases(eff)
    # The third failure records it as failed; the training rollout is not starved by it.
    assert not again
    assert any(isinstance(op, PutEvalResult) and "failed" in op.result for op in ops(eff))
    assert core.training.starvation.reason is None
    for x in evals[1:]:
        out = result(core, agent, x)
    assert sends(out, p.Ok)[0].msg.result["failed_prompts"] == 1


def test_a_restarted_core_resumes_the_pass_and_counts_recorded_prompts_once():
    core, agent, trainer, _ = setup()
    first = core.handle(b"t", p.Evaluate(trainer, 1, "math", "tok"), 0.0)
    evals = leases(first)
    # The ledger as the server wrote it: the pass, then three results.
    snap = LedgerSnapshot()
    snap.apply(ops(first))
    for g in evals[:3]:
        snap.apply(ops(result(core, agent, g)))
    restarted, agent2, trainer2, _ = setup(restored=snap)
    eff = restarted.handle(b"t", p.Evaluate(trainer2, 1, "math", "tok"), 0.0)
    assert sorted(g.index for g in leases(eff)) == sorted(g.index for g in evals[3:])
    # A result from before the restart for a prompt already recorded is not counted again...
    assert not ops(result(restarted, agent2, replace(evals[0], lease=12345)))
    # ...and one for a prompt not yet recorded counts, whichever lease carried it.
    assert ops(result(restarted, agent2, replace(evals[3], lease=12346)))


def test_an_agent_reregistering_with_an_evaluation_lease_has_it_cancelled():
    core, agent, trainer, _ = setup()
    g = leases(core.handle(b"t", p.Evaluate(trainer, 1, "math", "tok"), 0.0))[0]
    eff = core.handle(b"a", p.Register("a", 1, 8 * N, "tcp://a:1", [], [], [[g.lease, EVAL_EPOCH, g.index]]), 1.0)
    welcome = sends(eff, p.Welcome)[0].msg
    assert g.lease in welcome.cancel
    assert g.index in [x.index for x in leases(eff)]  # pending again, leased anew


def test_unknown_dataset_is_an_error_naming_the_declared_ones():
    core, _, trainer, _ = setup()
    (err,) = sends(core.handle(b"t", p.Evaluate(trainer, 1, "nope", "tok"), 0.0), p.Error)
    assert err.msg.code == "unknown_eval" and "math" in err.msg.message


@pytest.mark.parametrize(
    "text, match",
    [
        ("math", "expected NAME=PATH"),
        ("ma th=x.jsonl", "may hold only"),
        ("m=x.jsonl,n_samples=0", "at least 1"),
        ("m=x.jsonl,samples=3", "unknown option 'samples'"),
        ("m=x.jsonl,temperature=hot", "temperature must be a float"),
        ("m=x.jsonl,top_p=2", r"top_p must be in \(0, 1\]"),
    ],
)
def test_eval_dataset_flag_errors_say_what_is_wrong(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_eval_dataset(text)


def test_eval_dataset_flag_parses_its_options():
    assert parse_eval_dataset("m=/d/x.jsonl,n_samples=8,temperature=0.6,max_new_tokens=512") == (
        "m",
        "/d/x.jsonl",
        {"n_samples": 8, "temperature": 0.6, "max_new_tokens": 512},
    )
