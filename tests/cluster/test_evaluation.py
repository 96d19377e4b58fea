"""Evaluation passes (``--eval-dataset``, ``client.evaluate``) on real clusters.

A pass runs on the training fleet without touching training, reports the metrics a user logs,
and is durable: a coordinator SIGKILLed in the middle resumes it and counts each prompt once.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import astuple

import pytest

from common.demo_data import write_arithmetic_dataset
from common.errors import RemoteError
from coordinator.evaluation import pass_at_k
from coordinator.ledger import read_ledger
from harness.cluster import ROOT
from harness.polling import wait_for


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected(results: dict[int, dict], n: int) -> dict:
    """The metrics recomputed from the ledger's per-prompt results, independently of the coordinator's code."""
    rewards = [x for r in results.values() for x in r["rewards"]]
    lengths = [x for r in results.values() for x in r["lengths"]]
    out = {
        "reward_mean": sum(rewards) / len(rewards),
        "response_length_mean": sum(lengths) / len(lengths),
        "truncated_ratio": sum(r["truncated"] for r in results.values()) / len(rewards),
    }
    out["pass_at"] = {}
    for k in range(1, n + 1):
        per = [pass_at_k(n, sum(x >= 1.0 for x in r["rewards"]), k) for r in results.values()]
        out["pass_at"][k] = sum(per) / len(per)
    return out


def _check_training_batch(batch, rows, size, seen):
    assert len(batch.groups) == size
    for g in batch.groups:
        assert g.data_epoch >= 0
        assert (g.data_epoch, g.index) not in seen, f"training prompt {g.index} delivered twice"
        seen.add((g.data_epoch, g.index))
        assert g.label == rows[g.index]["label"]
        assert all(s.prompt_tokens.tolist() == list(rows[g.index]["prompt"].encode()) for s in g.samples)


def test_evaluate_reports_metrics_and_leaves_training_untouched(make_cluster, tmp_path):
    evals = write_arithmetic_dataset(tmp_path / "eval.jsonl", 24, seed=11)
    short = write_arithmetic_dataset(tmp_path / "short.jsonl", 10, seed=12)
    cluster = make_cluster(rows=120, dynamic_filter="none")
    cluster.start_coordinator(
        "--eval-dataset",
        f"math={evals},n_samples=3,max_new_tokens=400",
        "--eval-dataset",
        f"short={short},n_samples=2,max_new_tokens=1,temperature=0",
        "--prefetch",
        "4",
    )
    cluster.start_agent("a1")
    cluster.start_agent("a2")
    rows = _rows(cluster.dataset)
    size = cluster.config["rollout_batch_size"]
    seen: set[int] = set()
    with cluster.client() as client:
        for rid in range(2):
            _check_training_batch(client.generate(rid), rows, size, seen)
        before = client.stats().prompts

        m = client.evaluate("math")
        assert m.name == "math" and m.pass_id == 1
        assert (m.prompts, m.samples, m.failed_prompts, m.n_samples) == (24, 72, 0, 3)
        assert set(m.pass_at) == {1, 2, 3} and {"pass@1", "pass@2", "pass@3"} <= set(m.to_dict())
        assert 0.0 <= m.pass_at[1] <= m.pass_at[2] <= m.pass_at[3] <= 1.0
        assert 0 < m.response_length_mean <= 400
        assert m.weight_versions == ("default",)
        ledger = read_ledger(cluster.tmp / "coordinator")
        results = ledger.eval_results_of("math")
        assert sorted(results) == list(range(24)), "every evaluation prompt has exactly one result"
        assert all(len(r["rewards"]) == len(r["lengths"]) == 3 for r in results.values())
        for key, value in _expected(results, 3).items():
            assert getattr(m, key) == pytest.approx(value), key
        assert 0.0 < m.reward_mean < 1.0  # the sim engine answers right about half the time

        # One token per sample: every sample stops at the length limit.
        s = client.evaluate("short")
        assert (s.prompts, s.samples, s.n_samples) == (10, 20, 2)
        assert s.response_length_mean == 1.0
        assert s.truncated_ratio == 1.0

        # Training did not move for it: no prompt was taken, finished or delivered by the passes.
        after = client.stats().prompts
        assert after.delivered == before.delivered == 2 * size
        assert sum(astuple(after)) == sum(astuple(before))
        for rid in range(2, 5):
            _check_training_batch(client.generate(rid), rows, size, seen)

        evaluations = client.stats().evaluations
        assert evaluations["math"].running is False and evaluations["math"].last == m
        table = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", cluster.address],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        ).stdout
        assert f"eval:     math: last pass 1: reward_mean {m.reward_mean:.4f}" in table, table
        assert "eval:     short: last pass 1" in table, table
        # A new call is a new pass over the same prompts.
        again = client.evaluate("math")
        assert again.pass_id == 2 and again.prompts == 24
        with pytest.raises(RemoteError, match="no evaluation dataset 'nope'.*math, short") as err:
            client.evaluate("nope")
        assert err.value.code == "unknown_eval"


SLOW_SHORT = "--token-latency-ms 5 --output-len-median 40 --output-len-max 100"


def test_evaluation_resumes_after_coordinator_sigkill_counting_each_prompt_once(make_cluster, tmp_path):
    evals = write_arithmetic_dataset(tmp_path / "eval.jsonl", 40, seed=5)
    cluster = make_cluster(rows=80)
    # Long, varied answers (a regenerated result differs from the recorded one), and two groups at a time per
    # agent, so the pass takes seconds and the kill lands in the middle of it.
    spec = f"math={evals},n_samples=2,max_new_tokens=100"
    cluster.start_coordinator("--eval-dataset", spec)
    for name in ("a1", "a2"):
        cluster.start_agent(name, concurrency=4, sim_args=SLOW_SHORT)
    data_dir = cluster.tmp / "coordinator"
    result: dict = {}
    with cluster.client(timeout=120) as client:
        client.generate(0)

        def evaluate():
            try:
                result["metrics"] = client.evaluate("math")
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                result["error"] = exc

        caller = threading.Thread(target=evaluate)
        caller.start()

        def some_done():
            done = read_ledger(data_dir).eval_results_of("math")
            return done if 5 <= len(done) < 40 else None

        wait_for(some_done, timeout=60, what="some evaluation results in the ledger")
        cluster.coordinator.signal(signal.SIGKILL)
        cluster.coordinator.wait(10)
        early = read_ledger(data_dir).eval_results_of("math")
        assert len(early) < 40, "the pass finished before the kill: nothing left to resume"
        assert len({tuple(r["lengths"]) for r in early.values()}) > 1  # results tell regenerated ones apart
        cluster.start_coordinator("--eval-dataset", spec)
        caller.join(timeout=120)
        assert not caller.is_alive(), "evaluate() never returned after the restart"
        assert "error" not in result, result.get("error")
        m = result["metrics"]
        assert (m.pass_id, m.prompts, m.samples, m.failed_prompts) == (1, 40, 80, 0)
        final = read_ledger(data_dir).eval_results_of("math")
        assert sorted(final) == list(range(40))
        # What was recorded before the kill counts as it was: not generated again, not counted twice.
        for index, r in early.items():
            assert final[index] == r
        for key, value in _expected(final, 2).items():
            assert getattr(m, key) == pytest.approx(value), key
        # Training goes on from where it was.
        assert len(client.generate(1).groups) == cluster.config["rollout_batch_size"]
