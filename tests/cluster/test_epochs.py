"""Runs longer than one pass over the dataset, on the real ledger.

A small dataset (24 rows, batches of 8) is pulled for more than two data epochs through the
public trainer API, and ``coordinator status`` is read as a user reads it. What must hold:
- every prompt ``(data_epoch, index)`` reaches training at most once, and every prompt of a
  closed epoch was either delivered or filtered (the filter's verdicts are known in advance
  here: rows marked ``drop`` are filtered, all others delivered);
- an epoch closes once all its prompts are accounted for and fetched; the coordinator then
  forgets it (``data_epochs``, and one state per prompt of the open epochs only);
- ``--shuffle-seed`` fixes the order: each epoch is a different permutation, and a coordinator
  SIGKILLed and started again on its data dir after an epoch closed serves exactly the order of
  an uninterrupted run with the same seed.
"""

from __future__ import annotations

import json
import signal
import textwrap

from common.demo_data import arithmetic_rows
from harness.polling import wait_for

ROWS = 24
FAST = "--output-len-dist fixed --output-len-median 16"

FILTER = textwrap.dedent(
    """
    def keep_unmarked(samples):
        return not samples[0].metadata.get("drop", False), "marked"
    """
)


def marked(index: int) -> bool:
    return index % 4 == 3


def write_marked_dataset(tmp_path):
    """24 arithmetic rows; every fourth is marked for the filter to drop."""
    path = tmp_path / "marked.jsonl"
    with path.open("w") as f:
        for i, row in enumerate(arithmetic_rows(ROWS)):
            f.write(json.dumps({**row, "drop": marked(i)}) + "\n")
    return path


def take(batch, seen: dict, size: int = 8) -> list[tuple[int, int]]:
    """The batch's prompts in order, checked complete and new."""
    assert len(batch.groups) == size, f"batch {batch.rollout_id} has {len(batch.groups)} groups"
    out = []
    for g in batch.groups:
        key = (g.data_epoch, g.index)
        assert key not in seen, f"prompt {key} delivered in batch {seen[key]} and again in batch {batch.rollout_id}"
        seen[key] = batch.rollout_id
        out.append(key)
    return out


def test_epochs_close_with_every_prompt_delivered_or_filtered_once(make_cluster, tmp_path, monkeypatch):
    """Pulls until three epochs have closed. Each closed epoch delivered exactly its unmarked rows
    and filtered its marked ones; the status forgets closed epochs.

    Red if: a prompt is lost at an epoch boundary (the epoch never closes: the loop runs out of
    batches) or delivered twice (across epochs mixed in one batch); a filtered prompt is
    delivered or regenerated in the same epoch; closed epochs stay in memory; the filtered count
    disagrees with what was filtered.
    """
    (tmp_path / "rollfleet_epoch_filter.py").write_text(FILTER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the coordinator and agent import the filter
    cluster = make_cluster(
        dataset=write_marked_dataset(tmp_path), dynamic_filter="rollfleet_epoch_filter:keep_unmarked"
    )
    cluster.start_coordinator("--shuffle-seed", "3")
    cluster.start_agent("a1", sim_args=FAST)
    kept = {i for i in range(ROWS) if not marked(i)}
    seen: dict = {}
    drops = 0.0
    with cluster.client(timeout=30) as client:
        rid = 0
        while min(cluster.status()["data_epochs"]) < 3:
            assert rid < 12, f"three epochs not closed after {rid} batches: {cluster.status()}"
            batch = client.generate(rid)
            take(batch, seen)
            drops += batch.metrics.get("rollout/dynamic_filter/drop_marked", 0.0)
            rid += 1
    s = cluster.status()
    for epoch in range(3):
        delivered = {i for e, i in seen if e == epoch}
        assert delivered == kept, (
            f"epoch {epoch}: missing {sorted(kept - delivered)}, filtered yet delivered {sorted(delivered - kept)}"
        )
    assert {i for e, i in seen if e >= 3} <= kept
    assert all(e >= 3 for e in s["data_epochs"]), s["data_epochs"]
    assert sum(s["prompts"].values()) == ROWS * len(s["data_epochs"]), "closed epochs are still held"
    assert s["filtered_total"] == 3 * (ROWS - len(kept)) + s["prompts"]["filtered"], s
    assert 3 * (ROWS - len(kept)) <= drops <= s["filtered_total"]


def pull_order(cluster, batches: range, *, restart_after: int | None = None) -> list[tuple[int, int]]:
    """Prompts in delivery order. With ``restart_after``: once that batch is fetched and an epoch
    has closed, wait until admission has settled (nothing leased), then SIGKILL the coordinator
    and start it again on the same data dir; the same trainer goes on."""
    seen: dict = {}
    order = []
    with cluster.client(timeout=30) as client:
        for rid in batches:
            order += take(client.generate(rid), seen)
            if rid == restart_after:

                def settled():
                    s = cluster.status()
                    return s if 0 not in s["data_epochs"] and s["leased"] == 0 and s["ready"] == 8 else None

                wait_for(settled, 30, "epoch 0 closed and admission settled")
                cluster.coordinator.signal(signal.SIGKILL)
                cluster.coordinator.wait(30)
                cluster.start_coordinator("--shuffle-seed", "7")
                # The new process knows a1 only from its ledger (presumed dead) until it registers.
                cluster.wait_agent_registered("a1")
    assert cluster.status()["data_epochs"] == [3], "epochs 0..2 were fetched completely: only epoch 3 is open"
    return order


def test_shuffled_order_is_kept_across_a_coordinator_restart_after_an_epoch_closed(make_cluster):
    """Two clusters, same seed; one agent each that generates one group at a time, so delivery
    order is lease order. One runs uninterrupted, the other has its coordinator SIGKILLed mid
    epoch 1 (epoch 0 closed) and restarted. Both deliver the same prompts in the same order.

    Red if: the restored frontier forgets the seed or reshuffles (order differs after the
    restart); the closed epoch is reopened or its prompts served again (a duplicate); the
    shuffle is not per epoch (epochs 0 and 1 in the same order) or not applied at all.
    """
    runs = []
    for restart_after in (None, 3):
        cluster = make_cluster(rows=ROWS, dynamic_filter="none")
        cluster.start_coordinator("--shuffle-seed", "7")
        cluster.start_agent("a1", concurrency=4, sim_args=FAST)  # 4 slots: one group of 4 at a time
        runs.append(pull_order(cluster, range(9), restart_after=restart_after))
    uninterrupted, restarted = runs
    epochs = [[i for e, i in uninterrupted if e == epoch] for epoch in range(3)]
    assert [e for e, _ in uninterrupted] == sorted(e for e, _ in uninterrupted)
    for order in epochs:
        assert sorted(order) == list(range(ROWS))
    assert epochs[0] != list(range(ROWS)) and epochs[0] != epochs[1], "prompts are not shuffled per epoch"
    assert restarted == uninterrupted, "the restarted coordinator serves another order"
