"""The chaos suite (bounded): agents, engines, the coordinator and the trainer killed mid-run.

``scripts/chaos.py`` runs the same thing longer and with other seeds.
"""

import os

import pytest

from harness.chaos import run_chaos


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_exactly_once_under_random_kills(tmp_path):
    batches = int(os.environ.get("ROLLFLEET_CHAOS_BATCHES", "60"))
    seed = int(os.environ.get("ROLLFLEET_CHAOS_SEED", "1"))
    report = run_chaos(tmp_path, batches=batches, seed=seed)
    kinds = {a[1] for a in report.actions}
    assert "trainer" in kinds and "coordinator" in kinds and "agent" in kinds, report.actions
    assert report.batches == batches
    assert report.problems == []
    assert report.duplicated == 0 and report.lost == 0 and report.replay_mismatches == 0 and report.unaccounted_prompts == 0
