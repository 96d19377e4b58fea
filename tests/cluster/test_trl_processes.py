"""TRL's GRPOTrainer on two processes (torchrun; accelerate runs MULTI_CPU on gloo), each with its own
``FleetRollouts`` pulling its own equal share of every fleet batch (harness/trl_rank.py).

Asserted on both processes, with the margins of the one-process test (tests/cluster/test_trl.py): every step's
slice is the process's share (``rollout_batch_size / 2`` whole groups), TRL's current model scores each
process's completions as the engine did after every push (both processes take part in each one), the fleet
ends at version ``steps - 1``, and the reward rises.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("trl")

from harness.cluster import run_group  # noqa: E402
from tests.cluster.test_grpo_example import BATCH, GROUP, start_fleet, warm_models  # noqa: E402,F401
from tests.cluster.test_trl import STEPS, assert_rises  # noqa: E402


@pytest.mark.timeout(900)
def test_trl_on_two_processes_pulls_a_share_each_and_learns(make_cluster, tmp_path, warm_models):  # noqa: F811
    cluster, _ = start_fleet(make_cluster, tmp_path, warm_models, max_staleness=0)
    out = tmp_path / "trl"
    out.mkdir()
    # torchrun, not ``accelerate launch``: accelerate's launcher starts one process for ``--cpu --num_processes 2``
    # (its multi-CPU mode goes through mpirun, which this machine lacks); under torchrun accelerate finds the
    # ranks in the environment and runs MULTI_CPU on gloo, as TRL's trainer then does.
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    argv += ["-m", "harness.trl_rank", cluster.address, warm_models("add"), str(out), str(STEPS)]
    done = run_group(argv, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["sizes"] == [BATCH * GROUP // 2] * STEPS  # its equal share, every step
        assert max(result["diffs"]) < 1e-3, result["diffs"]  # every push reached the engine
        assert result["version"] == STEPS - 1
        assert len(result["rewards"]) == STEPS
    assert_rises(ranks[0]["rewards"])
