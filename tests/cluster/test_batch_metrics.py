"""Every per-batch ``rollout/*`` metric a trainer logs, recomputed from the batch's own samples.

The coordinator computes a batch's metrics from the statistics the agents report with each
receipt, not from the samples the trainer receives; a wrong count there (a ratio divided by groups
instead of samples, tokens counted once per group instead of per sample, staleness measured from
the wrong version) goes straight into every dashboard and no other test reads the values. Here a
real cluster (two agents with a sim engine each, lognormal output lengths around the token budget
so some samples are truncated and some not, the nonzero-std filter dropping groups, a disk weight
update after every batch so groups arrive up to two versions stale) serves batches, and each
metric is recomputed from the batch's groups and samples and compared (staleness, which counts
updates since a group's lease, bounded by the versions its samples began on).
"""

from __future__ import annotations

import math

import pytest

BATCHES = 6
BATCH_SIZE = 8
SAMPLES = 4
MAX_NEW = 24
SIM = "--output-len-dist lognormal --output-len-median 20 --output-len-sigma 0.5"


def first_versions(group) -> list[int]:
    """The weight version each sample of ``group`` began on (its first span)."""
    label = [s.weight_versions[0][0] if s.weight_versions else s.weight_version for s in group.samples]
    return [int(v) if str(v).isdigit() else 0 for v in label]  # the launch weights are labelled, not numbered


def recompute(batch, rollout_id: int) -> dict[str, float]:
    """The ``rollout/*`` metrics of ``batch`` as its samples define them."""
    groups = batch.groups
    samples = [s for g in groups for s in g.samples]
    n = len(samples)
    gen = [g.gen_seconds for g in groups]
    return {
        "rollout/groups": float(len(groups)),
        "rollout/samples": float(n),
        "rollout/prompt_tokens": float(sum(len(s.prompt_tokens) for s in samples)),
        "rollout/response_tokens": float(sum(len(s.response_tokens) for s in samples)),
        "rollout/response_len_mean": sum(len(s.response_tokens) for s in samples) / n,
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/truncated_ratio": sum(s.status == "truncated" for s in samples) / n,
        "rollout/aborted_ratio": sum(s.status == "aborted" for s in samples) / n,
        "rollout/gen_seconds_mean": sum(gen) / len(gen),
        "rollout/gen_seconds_max": max(gen),
        "rollout/data_epoch": float(max(g.data_epoch for g in groups)),
        "rollout/deficit": float(BATCH_SIZE - len(groups)),
    }


@pytest.fixture
def fleet(make_cluster):
    cluster = make_cluster(
        rollout_batch_size=BATCH_SIZE,
        n_samples_per_prompt=SAMPLES,
        max_new_tokens=MAX_NEW,
        max_staleness=2,
        dynamic_filter="nonzero_std",
    )
    cluster.start_coordinator()
    for name in ("a1", "a2"):
        cluster.start_agent(name, sim_args=SIM)
    return cluster


def test_every_batch_metric_equals_what_its_samples_give(fleet, tmp_path):
    seen_truncated = seen_complete = seen_stale = 0
    with fleet.client() as client:
        for rollout_id in range(BATCHES):
            batch = client.generate(rollout_id)
            expected = recompute(batch, rollout_id)
            for key, value in expected.items():
                got = batch.metrics.get(key)
                assert got is not None, f"batch {rollout_id} has no {key}"
                assert math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-9), (
                    f"batch {rollout_id}: {key} is {got}, its samples give {value}"
                )
            # Staleness counts weight updates between a group's lease and the batch; the lease's
            # version is not in the batch, but a sample cannot begin on weights older than it, so
            # ``t - first version`` bounds each group's staleness from below, and ETA from above.
            lower = [max(0, rollout_id - min(first_versions(g))) for g in batch.groups]
            mean, top = batch.metrics["rollout/staleness_mean"], batch.metrics["rollout/staleness_max"]
            assert sum(lower) / len(lower) - 1e-9 <= mean <= top <= 2, (batch.metrics, lower)
            assert max(lower) <= top, (batch.metrics, lower)
            # The filter's own counts: kept groups are the batch's or were kept for a later one.
            kept = batch.metrics["rollout/dynamic_filter/kept_groups"]
            dropped = batch.metrics["rollout/dynamic_filter/dropped_groups"]
            assert kept >= 0 and dropped >= 0
            by_reason = sum(v for k, v in batch.metrics.items() if k.startswith("rollout/dynamic_filter/drop_"))
            assert by_reason == dropped, (batch.metrics, dropped)
            ratio = batch.metrics["rollout/dynamic_filter/dropped_ratio"]
            assert math.isclose(ratio, dropped / (kept + dropped) if kept + dropped else 0.0, abs_tol=1e-9)
            seen_truncated += expected["rollout/truncated_ratio"] > 0
            seen_complete += expected["rollout/truncated_ratio"] < 1
            seen_stale += max(lower) > 0
            ckpt = tmp_path / f"ckpt{rollout_id + 1}"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), rollout_id + 1)
    # The workload exercised what the comparison is about (else a wrong ratio could pass as 0 or 1).
    assert seen_truncated and seen_complete, (seen_truncated, seen_complete)
    assert seen_stale, "no batch held a group leased under older weights"
