"""Weight broadcast over NCCL between two GPUs (the trainer on one, an hf engine on the other).

Runs ``scripts/bench/w_nccl_broadcast.py --quick``: after every push the engine's logprobs equal the
trainer's recompute and its digest the trainer's; an engine SIGKILLed before an update is brought back
by a catch-up over NCCL. Skipped without two CUDA devices and NCCL, so CI (CPU only) skips it; the same
script runs on CPU over gloo in ``test_the_nccl_bench_runs_on_cpu_over_gloo``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench" / "w_nccl_broadcast.py"


def run_bench(*flags: str) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", *flags], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {line["metric"]: line for line in lines}


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()),
    reason="needs two CUDA devices and NCCL",
)
def test_nccl_pushes_reach_an_hf_engine_on_the_other_gpu():
    metrics = run_bench()
    assert metrics["logprob_gap_max"]["value"] < 1e-3
    assert metrics["logprob_gap_after_restart"]["value"] < 1e-3
    assert metrics["summary"]["backend"] == "nccl"


@pytest.mark.timeout(300)
def test_the_nccl_bench_runs_on_cpu_over_gloo():
    """The bench's own checks (logprobs, digests, the kill and catch-up) on CPU, so it is known to work
    wherever the GPUs are not."""
    metrics = run_bench("--cpu", "--sizes", "1,4", "--sweep", "1,4", "--bucket-mb", "2")
    assert metrics["logprob_gap_max"]["value"] < 1e-3
    assert metrics["logprob_gap_after_restart"]["value"] < 1e-3
    assert set(metrics["catch_up_s"]["engines"].values()) == {metrics["catch_up_s"]["engines"]["gpu-agent/hf-0"]}
