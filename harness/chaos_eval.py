"""The chaos run's evaluation passes: the dataset they run on and what must hold of them.

The trainer calls ``evaluate`` every few batches (``harness/chaos_trainer.py --evaluate-every``) while
agents, engines, the coordinator and the trainer itself are killed. Each pass that returns must count
every evaluation prompt exactly once: ``prompts`` is the dataset's size and ``samples`` is
``n_samples`` per prompt that was scored. The ledger's last pass holds one result per prompt, and
the metrics returned for it are those of its recorded results.
"""

from __future__ import annotations

from pathlib import Path

from common.demo_data import write_arithmetic_dataset
from coordinator.evaluation import EvalSpec, eval_metrics
from coordinator.records import LedgerSnapshot

NAME, ROWS, N_SAMPLES = "chaos-eval", 24, 2


def eval_flag(workdir: Path) -> list[str]:
    """``coordinator serve`` flags declaring the chaos evaluation dataset (written on first use)."""
    path = workdir / "eval.jsonl"
    if not path.exists():
        write_arithmetic_dataset(path, ROWS, seed=99)
    return ["--eval-dataset", f"{NAME}={path},n_samples={N_SAMPLES},max_new_tokens=48"]


def check_evaluations(calls: list[dict], ledger: LedgerSnapshot, problems: list[str]) -> int:
    """Append what is wrong to ``problems``; returns the passes that completed."""
    done = [c for c in calls if c.get("ok")]
    if calls and not done:
        problems.append(f"evaluation: none of {len(calls)} evaluate() calls returned: {calls[-1].get('error')}")
    for c in done:
        m = c["metrics"]
        if m["prompts"] != ROWS:
            problems.append(f"evaluation pass {m['pass']} counted {m['prompts']} prompts, the dataset has {ROWS}")
        if m["samples"] != N_SAMPLES * (m["prompts"] - m["failed_prompts"]):
            problems.append(f"evaluation pass {m['pass']}: {m['samples']} samples for {m['prompts']} prompts")
    passes = sorted({c["metrics"]["pass"] for c in done})
    record = ledger.evals.get(NAME)
    if record is None:
        if done:
            problems.append("evaluation: passes returned but the ledger records none")
        return len(passes)
    results = ledger.eval_results_of(NAME)
    if record.done:
        if sorted(results) != list(range(ROWS)):
            missing = sorted(set(range(ROWS)) - set(results))
            problems.append(f"evaluation pass {record.pass_id}: the ledger misses results for prompts {missing}")
        spec = EvalSpec(NAME, ROWS, record.fingerprint, N_SAMPLES)
        recomputed = eval_metrics(spec, record.pass_id, results)
        returned = [c["metrics"] for c in done if c["metrics"]["pass"] == record.pass_id]
        for m in returned + [dict(record.metrics)]:
            if m != recomputed:
                problems.append(f"evaluation pass {record.pass_id}: metrics {m} are not those of its results")
    return len(passes)
