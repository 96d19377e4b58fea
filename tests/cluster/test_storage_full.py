"""A full LMDB map (``--map-size``), on real processes, on both sides (common/lmdb_env.py).

What must hold: the process that hit it says so in one line naming the data dir and the flag,
exits 1, and loses nothing it acknowledged: restarted on the same data dir with a larger
``--map-size``, it carries on and every group acknowledged before is delivered, exactly once.
"""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb

from common.types import Group
from harness.polling import wait_for

FIXED = "--output-len-dist fixed --output-len-median 16"


def committed_groups(data_dir: Path) -> dict[int, Group]:
    """The groups an agent's store holds, read from outside: dataset index -> group."""
    env = lmdb.open(str(data_dir / "store"), readonly=True, max_dbs=4, lock=True)
    try:
        db = env.open_db(b"groups", create=False)
        with env.begin() as txn:
            groups = [Group.from_wire(bytes(v)) for _, v in txn.cursor(db=db)]
    finally:
        env.close()
    return {g.index: g for g in groups}


def assert_full_line(text: str, what: str, data_dir: Path, size: str) -> None:
    lines = [line for line in text.splitlines() if line.startswith(("agent: error:", "coordinator: error:"))]
    assert len(lines) == 1, text[-3000:]
    assert what in lines[0] and str(data_dir) in lines[0] and f"--map-size {size}" in lines[0], lines[0]
    assert "Traceback" not in text, text[-3000:]


def test_full_agent_store_stops_the_agent_and_a_restart_with_a_larger_map_delivers_every_committed_group(
    make_cluster,
):
    """Red if: the agent keeps running and failing every group, dies with a traceback, the message
    does not name the store and the flag, or a group committed before the stop is lost or delivered
    twice after the restart."""
    cluster = make_cluster(rows=64, dynamic_filter="none", prefetch=64)  # every row leased: the store fills
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", "--map-size", "256KiB", sim_args=FIXED, wait=False)
    assert agent.wait(60) == 1
    data_dir = cluster.tmp / "a1"
    assert_full_line(agent.text(), "agent store", data_dir / "store", "256KiB")
    before = committed_groups(data_dir)
    assert before, "nothing was committed before the store was full"

    cluster.start_agent("a1", "--map-size", "64MiB", sim_args=FIXED)
    delivered: dict[int, Group] = {}
    with cluster.client() as client:
        for step in range(8):  # the whole epoch: 64 rows, 8 per batch
            batch = client.generate(step)
            assert len(batch.groups) == 8
            for g in batch.groups:
                assert g.index not in delivered, f"index {g.index} delivered twice"
                delivered[g.index] = g
    assert set(delivered) == set(range(64))
    for index, group in before.items():  # the very groups committed before the stop, not regenerated ones
        got = delivered[index]
        assert [list(s.response_tokens) for s in got.samples] == [list(s.response_tokens) for s in group.samples]


def test_full_coordinator_ledger_stops_it_and_a_restart_with_a_larger_map_carries_on(make_cluster):
    """Red if: the coordinator dies with a traceback or keeps serving on a ledger it cannot write,
    the message does not name the ledger and the flag, or after the restart a batch the trainer
    was given is lost or given again with other groups (an index twice)."""
    cluster = make_cluster(rows=400, dynamic_filter="none")
    coordinator = cluster.start_coordinator("--map-size", "64KiB")
    cluster.start_agent("a1", sim_args=FIXED)
    batches: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def train():
        try:
            with cluster.client(timeout=120) as client:
                for step in range(6):
                    batches[step] = [g.index for g in client.generate(step).groups]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    assert coordinator.wait(120) == 1
    assert_full_line(coordinator.text(), "coordinator ledger", cluster.tmp / "coordinator" / "ledger", "64KiB")
    given_before = dict(batches)
    cluster.start_coordinator("--map-size", "64MiB")
    trainer.join(180)
    assert not trainer.is_alive() and not errors, errors
    assert sorted(batches) == list(range(6))
    for step, indices in given_before.items():
        assert batches[step] == indices
    seen = [i for indices in batches.values() for i in indices]
    assert len(seen) == len(set(seen)) == 48, batches
    wait_for(lambda: cluster.status()["agents"]["a1"]["status"] == "alive", 30, "the agent to be back")
