"""The agent's LMDB group store: commit-with-outbox, acks, identity, and SIGKILL at any moment."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.store import GroupStore


def test_commit_keeps_outbox_until_ack_and_refused_groups_are_deleted(tmp_path):
    async def run():
        store = GroupStore(tmp_path, agent_id="n1")
        await asyncio.gather(
            *(store.commit(f"0:{i}:1", f"payload{i}".encode(), {"key": f"0:{i}:1", "index": i}) for i in range(5))
        )
        assert sorted(r["index"] for r in store.unacked()) == [0, 1, 2, 3, 4]
        await store.ack("0:0:1", True)
        await store.ack("0:1:1", False)
        assert sorted(r["index"] for r in store.unacked()) == [2, 3, 4]
        assert await store.get_many(["0:0:1", "0:1:1", "0:9:9"]) == [b"payload0", None, None]
        await store.trim(["0:0:1"])
        assert await store.get_many(["0:0:1"]) == [None]
        store.close()

    asyncio.run(run())


def test_restart_recovers_unacked_receipts_and_keeps_identity(tmp_path):
    async def first():
        store = GroupStore(tmp_path)
        await store.commit("0:3:7", b"x", {"key": "0:3:7", "index": 3})
        ident = store.agent_id, store.incarnation
        store.close()
        return ident

    agent_id, incarnation = asyncio.run(first())
    store = GroupStore(tmp_path)
    assert store.agent_id == agent_id
    assert store.incarnation == incarnation + 1
    assert [r["key"] for r in store.unacked()] == ["0:3:7"]
    store.close()
    with pytest.raises(ValueError, match="belongs to agent"):
        GroupStore(tmp_path, agent_id="someone-else")


def test_a_data_dir_serves_one_process_at_a_time(tmp_path):
    import subprocess
    import sys

    first = GroupStore(tmp_path)
    try:
        script = f"from agent.store import GroupStore; GroupStore({str(tmp_path)!r})"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "is in use by pid" in out.stderr
    finally:
        first.close()
    GroupStore(tmp_path).close()  # free again once the first one closed


CRASH_CHILD = """
import asyncio, sys
from agent.store import GroupStore

def payload(k):
    return bytes([k % 251]) * (1000 + (k % 7) * 3000)

async def main(path, first):
    store = GroupStore(path, agent_id="crash")
    print("ready", flush=True)

    async def one(k):
        key = f"0:{k}:1"
        await store.commit(key, payload(k), {"key": key, "index": k})
        print(key, flush=True)  # committed: the receipt would leave now

    k = first
    while True:
        await asyncio.gather(*(one(k + j) for j in range(8)))
        k += 8

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _payload(k: int) -> bytes:
    return bytes([k % 251]) * (1000 + (k % 7) * 3000)


def test_store_sigkilled_at_random_moments_keeps_every_commit_whole(tmp_path):
    """A child commits groups 8 at a time (group commit) and is SIGKILLed after a random number of
    them; the reopened store holds every group whose commit had returned, each with its outbox
    entry, every outbox entry has its group, and no payload is cut short."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    rng = random.Random(5)
    acknowledged: set[str] = set()
    for run in range(20):
        child = subprocess.Popen(
            [sys.executable, "-c", CRASH_CHILD, str(tmp_path), str(run * 100_000)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env=env,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            for _ in range(rng.randint(0, 60)):
                acknowledged.add(child.stdout.readline().strip())
            # A random moment, not the one right after a commit returned (when the next writes have not
            # started): the kill must be able to land inside a commit too.
            time.sleep(rng.uniform(0, 0.01))
            child.send_signal(signal.SIGKILL)
            acknowledged.update(line.strip() for line in child.stdout)  # commits that returned before it died
        finally:
            child.kill()
            child.wait(10)
            child.stdout.close()
        store = GroupStore(tmp_path, agent_id="crash")
        try:
            assert store.incarnation == 2 * run + 2  # one start per child, one per reopening here
            keys, unacked = store.snapshot()
            outbox = {r["key"]: r for r in unacked}
            assert acknowledged <= set(keys), f"commits lost: {sorted(acknowledged - set(keys))[:5]}"
            assert set(outbox) == set(keys), "a group without its outbox entry, or an outbox entry without its group"
            payloads = dict(zip(keys, asyncio.run(store.get_many(keys)), strict=True))
            for key, data in payloads.items():
                index = int(key.split(":")[1])
                assert outbox[key]["index"] == index
                assert data == _payload(index), f"group {key} is not whole ({len(data)} bytes)"
        finally:
            store.close()
    assert len(acknowledged) > 50


class _FlushLog(GroupStore):
    """The real store, logging from its writer thread each transaction (and whether its commit
    flushed the file) and each explicit flush."""

    def __init__(self, *args, **kwargs):
        self.log: list[tuple] = []
        super().__init__(*args, **kwargs)

    def _apply(self, ops):
        flushed = super()._apply(ops)
        self.log.append(("txn", flushed, [key.decode() for kind, key, _ in ops if kind == "group"]))
        return flushed

    def _sync(self):
        super()._sync()
        self.log.append(("sync",))


def test_a_commit_returns_only_after_a_flush_that_followed_its_transaction(tmp_path):
    """A transaction's meta page is written without a flush of its own, so its commits may return
    only once a later commit's fsync or an explicit sync has run: whether writes stream in (many
    queued, a few per transaction) or come one at a time."""

    async def run(store):
        async def one(key):
            await store.commit(key, key.encode() * 1000, {"key": key})
            store.log.append(("returned", key))

        await asyncio.gather(*(one(f"0:{i}:1") for i in range(40)))  # queued: 4 per transaction
        for i in range(40, 43):  # alone: each needs its own flush
            await one(f"0:{i}:1")
        await store.ack("0:0:1", True)

    store = _FlushLog(tmp_path, agent_id="n1", max_batch=4)
    try:
        asyncio.run(run(store))
        committed_at = {}
        for at, entry in enumerate(store.log):
            if entry[0] == "txn":
                committed_at.update(dict.fromkeys(entry[2], at))
        flushes = [at for at, e in enumerate(store.log) if e[0] == "sync" or (e[0] == "txn" and e[1])]
        returned = [(at, e[1]) for at, e in enumerate(store.log) if e[0] == "returned"]
        assert len(returned) == 43 and max(len(e[2]) for e in store.log if e[0] == "txn") == 4
        for at, key in returned:
            assert any(committed_at[key] < f < at for f in flushes), f"{key} returned before a flush after its commit"
        assert any(e[0] == "txn" and len(e[2]) == 4 for e in store.log), "no transaction took several commits"
    finally:
        store.close()
