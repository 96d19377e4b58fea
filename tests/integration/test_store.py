"""The agent's LMDB group store: commit-with-outbox, acks, identity."""

import asyncio

import pytest

from agent.store import GroupStore


def test_commit_keeps_outbox_until_ack_and_refused_groups_are_deleted(tmp_path):
    async def run():
        store = GroupStore(tmp_path, agent_id="n1")
        await asyncio.gather(*(store.commit(f"0:{i}:1", f"payload{i}".encode(), {"key": f"0:{i}:1", "index": i})
                               for i in range(5)))
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
