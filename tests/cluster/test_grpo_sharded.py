"""The GRPO example under ``torchrun --nproc-per-node 2``: FSDP2 on CPU (gloo), each rank its own share.

The same fleet as tests/cluster/test_grpo_example.py (one hf engine serving the warmed-up tiny model); the
example's trainer runs as two rank processes (examples/grpo/sharded.py), each a ``RolloutClient(rank=R,
world_size=2)`` training its share of every batch, both taking part in every gloo push. Asserted as for one
process, with the same margins: on every rank the logprobs it recomputes for its share's tokens equal the
engine's after every push, and the reward rises; the two ranks' shares together are each batch.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from harness.cluster import run_group  # noqa: E402
from tests.cluster.test_grpo_example import (  # noqa: E402,F401
    BATCH,
    GROUP,
    LR,
    MARGIN,
    STEPS,
    assert_logprobs_match,
    start_fleet,
    warm_models,  # noqa: F811 (a fixture)
)


@pytest.mark.timeout(900)
def test_grpo_under_torchrun_with_fsdp2_learns_on_every_rank(make_cluster, tmp_path, warm_models):  # noqa: F811
    cluster, _ = start_fleet(make_cluster, tmp_path, warm_models)
    out = tmp_path / "run"
    config = {"steps": STEPS, "lr": LR, "weights": "gloo"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",  # a free port of its own (``--master-port 0`` hangs torchrun's rendezvous)
        "-m",
        "examples.grpo.sharded",
        "--coordinator",
        cluster.address,
        "--model",
        warm_models("add"),
        "--out",
        str(out),
        "--config",
        json.dumps(config),
    ]
    done = run_group(argv, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [
        [json.loads(line) for line in (out / name).read_text().splitlines()]
        for name in ("metrics.jsonl", "metrics-rank1.jsonl")
    ]
    for history in ranks:
        assert len(history) == STEPS
        assert_logprobs_match(history)
    for a, b in zip(*ranks, strict=True):
        assert a["reward"] == b["reward"]  # the whole batch's metrics on both ranks
        assert a["samples"] + b["samples"] == BATCH * GROUP  # the two shares are the batch
        assert a["samples"] % GROUP == 0 and b["samples"] % GROUP == 0  # whole groups
    history = ranks[0]
    start = sum(r["reward"] for r in history[:3]) / 3
    end = sum(r["reward"] for r in history[-3:]) / 3
    assert end >= start + MARGIN, f"reward did not rise: {start:.2f} -> {end:.2f} ({[r['reward'] for r in history]})"
    assert not math.isnan(history[-1]["train/rollout_logprob_abs_diff"])
