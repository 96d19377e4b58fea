"""A mixture under ``--max-staleness 1`` on a real loopback cluster (issue 39).

The issue's setup as a new user ran it: datasets of 40, 24 and 8 rows at weights 0.5/0.3/0.2, batches of 10
(5/3/2 groups), groups of 4, no filter, one agent with a sim engine at ``--concurrency 32`` (8 groups at once),
and a trainer one step behind, as η = 1 allows: ``generate(0)``, ``generate(1)`` before any push, push 1,
``generate(2)``, ... Admission spent the staleness budget on whichever dataset lacked most, so the groups
admitted before a push came in the wrong mix (ready 7/2/1) and ``generate`` never returned. Every batch must now
come with exactly 5/3/2 groups and no group past the bound; a batch past the bound (asked for before the push it
needs: batch 4 before update 3) waits with its reason in ``coordinator status``, and comes once the push is made.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

import pytest

from common.demo_data import write_arithmetic_dataset
from harness.polling import wait_for

pytestmark = pytest.mark.timeout(120)

SIZES = {"math": 40, "code": 24, "tool": 8}
WEIGHTS = {"math": 0.5, "code": 0.3, "tool": 0.2}
SHARES = {"math": 5, "code": 3, "tool": 2}


def test_a_trainer_one_step_behind_gets_every_batch_of_the_mixture_and_a_batch_past_the_bound_says_it_waits(
    make_cluster, tmp_path
):
    datasets = [
        f"{name}={write_arithmetic_dataset(tmp_path / f'{name}.jsonl', n, seed=i)},weight={WEIGHTS[name]}"
        for i, (name, n) in enumerate(SIZES.items())
    ]
    cluster = make_cluster(
        datasets=datasets, rollout_batch_size=10, n_samples_per_prompt=4, dynamic_filter="none", max_staleness=1
    )
    cluster.start_coordinator()
    cluster.start_agent("a1", concurrency=32, sim_args="--output-len-median 8")
    seen: Counter = Counter()

    def check(rollout_id: int, batch) -> None:
        composition = dict(Counter(g.source for g in batch.groups))
        assert composition == SHARES, f"batch {rollout_id}: {composition}, the mixture asks for {SHARES}"
        assert batch.metrics["rollout/staleness_max"] <= 1.0, (rollout_id, batch.metrics["rollout/staleness_max"])
        seen.update((g.source, g.data_epoch, g.index) for g in batch.groups)

    def push(client, version: int) -> None:
        ckpt = tmp_path / f"ckpt{version}"
        ckpt.mkdir()
        assert client.update_weights_from_disk(str(ckpt), version).version == version

    # A short timeout: a batch that never comes fails the test in seconds, not at the suite's hard timeout.
    with cluster.client(timeout=20) as client:
        check(0, client.generate(0))
        check(1, client.generate(1))  # before any push: η = 1 admits batches 0 and 1
        for t in (2, 3):
            push(client, t - 1)  # one step behind: push t - 1, then ask for t
            check(t, client.generate(t))
        assert client.stats().waiting_for_update is None

        # Batch 4 before update 3 (batch t + 2 before push t + 1): past the bound, it waits for the push, and says so.
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(batch=client.generate(4)))
        waiter.start()
        why = wait_for(lambda: client.stats().waiting_for_update, 15, "the status to say why batch 4 waits")
        assert why.startswith("rollout 4 waits for 1 more weight update(s): with --max-staleness 1"), why
        assert "2 update(s) were pushed" in why and "math, code, tool lack their share" in why, why
        table = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", cluster.address],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert f"waiting:  {why}" in table, table
        assert waiter.is_alive() and client.stats().leased == 0
        push(client, 3)
        waiter.join(20)
        assert not waiter.is_alive(), "batch 4 did not come after the push it waited for"
        check(4, got["batch"])
        assert client.stats().waiting_for_update is None
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
