"""A bounded fuzz run (scripts/fuzz.py's code, 3,000 frames per target): malformed frames at the coordinator and
an agent's payload endpoint, keys off and keys on (a known and an unknown key), then nothing crashed, no log
holds a Traceback, frames from the unknown key never reached the coordinator's decoder, and the next batches
are complete and unique."""

from __future__ import annotations

import pytest

from harness.fuzz import campaign

FRAMES = 3000


@pytest.mark.parametrize("keyed", [False, True], ids=["no-keys", "keys"])
def test_fuzzed_cluster_keeps_serving_correct_batches(make_cluster, keyed):
    cluster = make_cluster(curve_agents=("agent-0", "agent-1") if keyed else ())
    summary = campaign(cluster, FRAMES, keyed=keyed, batches=3)
    delivered = [r for r in summary["runs"] if r["key"] != "unknown"]
    assert [r["target"] for r in delivered] == ["coordinator", "payload"]
    for r in delivered:
        assert r["sent"] == FRAMES and r["probes_answered"] == FRAMES // 500
    assert summary["coordinator_rejections_logged"] >= FRAMES // 2
    if keyed:
        assert summary["unknown_key_frames_reaching_the_core"] == 0
        for r in summary["runs"][2:]:
            assert r["key"] == "unknown" and r["handshakes_refused"] == FRAMES // 500 and r["replies"] == 0
    assert summary["after"] == {"batches": 3, "groups": 3 * cluster.config["rollout_batch_size"]}
