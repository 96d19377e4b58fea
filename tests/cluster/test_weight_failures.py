"""Weight updates under failure on a real loopback cluster (docs/weights.md, "Failure during an update").

What must hold: an engine that restarts between updates never serves on weights other than the
fleet's (it is re-loaded from disk, or kept out of the pool until a broadcast reaches it); a trainer
that dies in the middle of a broadcast leaves the fleet on one version, the lock released by its
deadline and the engines serving, for the next trainer to attach and update; a fleet at
``--max-staleness 0`` with an update every step delivers fully on-policy batches without stalling.
"""

from __future__ import annotations

import pytest

from harness.polling import wait_for

pytestmark = pytest.mark.timeout(60)


def version(label) -> int:
    """An engine's weight-version label as a number (a fresh engine's ``"default"`` is 0)."""
    return 0 if label == "default" else int(label)


def test_fully_on_policy_with_an_update_every_step(make_cluster):
    """``--max-staleness 0``: batch ``t`` holds only groups leased after update ``t``, and the loop never stalls.

    Turns red if admission lets a group leased before an update into the batch after it (staleness_max
    > 0: rule 1 or rule 2 of docs/weights.md broken), or if the bound deadlocks generation (admission
    never reopened by an update, or assembly waiting for a group that can never be leased): the
    trainer's ``generate`` then times out.
    """
    cluster = make_cluster(rollout_batch_size=4, max_staleness=0)
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2, sim_args="--token-latency-ms 1")
    with cluster.client(timeout=15, expect={"max_staleness": 0}) as client:
        for step in range(10):
            batch = client.generate(step)
            assert batch.metrics["rollout/staleness_max"] == 0.0, (step, batch.metrics)
            assert len(batch.groups) == 4
            # Every group was leased after update ``step``: generated entirely on its weights.
            assert {version(v) for s in batch.samples for v, _, _ in s.weight_versions} == {step}, step
            ckpt = cluster.tmp / f"ckpt{step + 1}"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), step + 1, timeout=15)
