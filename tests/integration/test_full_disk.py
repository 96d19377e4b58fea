"""A full disk under the agent's store and the coordinator's ledger, on a real small filesystem.

Real LMDB environments on a 4 MiB tmpfs filled by a filler file (harness/small_disk.py), in
this process, so that the layout of the LMDB file, hence which error LMDB reports, is the same
at every run: a commit whose overflow pages go at the end of the file gets ENOSPC when no page
is left (the first write fails outright) and EIO when one page is left (a short write; LMDB has
no better code for it). Either is a full disk (common/lmdb_env.py ``storage_full``), and so is a
commit that the free-space check refuses before LMDB sees it (``check_space``). What must hold:
the write that hit it raises ``StorageFull`` naming the disk, the store's ``on_full`` is called
once, nothing committed before is lost, and once space is freed a reopened environment carries
on. The same scenarios through real processes, while batches flow: tests/cluster/test_storage_full.py.
"""

from __future__ import annotations

import asyncio
import errno
import os

import lmdb
import pytest

from agent.store import GroupStore
from common import faults
from common.errors import StorageFull
from common.lmdb_env import MIN_FREE, storage_full
from coordinator.frontier import READY
from coordinator.ledger import Ledger
from coordinator.records import GroupRef, PromptState, PutBatch, PutPrompt, RecordedBatch, SetCursors
from harness.small_disk import PAGE, fill, small_disk_or_skip, unfill

ENOSPC, EIO = "(ENOSPC)", "(EIO: a write ran out of space part-way"
LMDB_ERRORS = [pytest.param(0, ENOSPC, id="no-page-left"), pytest.param(PAGE, EIO, id="one-page-left")]


@pytest.fixture
def disk(tmp_path):
    with small_disk_or_skip(tmp_path / "disk") as path:
        yield path


@pytest.fixture
def unchecked(monkeypatch):
    """The free-space check off in this process (``ROLLFLEET_FAULTS=no_space_check=1``): writes reach LMDB."""
    monkeypatch.setattr(faults, "INJECTED", faults.Faults("no_space_check=1"))


def payload(i: int, size: int = 20_000) -> bytes:
    return (b"%06d" % i) * (size // 6)


async def commit_groups(store: GroupStore, indices) -> None:
    for i in indices:
        await store.commit(f"0:{i}:1", payload(i), {"key": f"0:{i}:1", "index": i})


def stored(data_dir) -> tuple[dict[str, bytes], list[int]]:
    """The groups and the unacknowledged receipts of the store at ``data_dir``, reopened."""
    store = GroupStore(data_dir, agent_id="a1")
    try:
        keys, unacked = store.snapshot()
        values = asyncio.run(store.get_many(keys))
        return dict(zip(keys, values, strict=True)), sorted(r["index"] for r in unacked)
    finally:
        store.close()


@pytest.mark.parametrize("leave,named", LMDB_ERRORS)
def test_a_store_commit_meeting_a_full_disk_in_lmdb_is_storage_full_and_loses_nothing(disk, unchecked, leave, named):
    """Red if: LMDB's EIO (a commit that ran out of space part-way) or ENOSPC is not a StorageFull
    naming the store's disk (the lease runner would charge it to the group's prompt), ``on_full`` is
    not called, or a group committed before is lost or the failed one half there after a restart."""
    data_dir = disk / "a1"

    async def run() -> list[StorageFull]:
        store = GroupStore(data_dir, agent_id="a1")
        reported: list[StorageFull] = []
        store.on_full = reported.append
        try:
            await commit_groups(store, range(10))
            assert fill(disk, leave) == leave
            with pytest.raises(StorageFull) as caught:
                await commit_groups(store, [10])
            assert store.full is caught.value
        finally:
            store.close()
        return reported

    reported = asyncio.run(run())
    assert len(reported) == 1, reported
    assert f"the disk under agent store {data_dir / 'store'} is full {named}" in str(reported[0]), reported[0]
    unfill(disk)
    groups, unacked = stored(data_dir)
    assert groups == {f"0:{i}:1": payload(i) for i in range(10)} and unacked == list(range(10))
    assert asyncio.run(_commit_after(data_dir)) == list(range(11))


async def _commit_after(data_dir) -> list[int]:
    store = GroupStore(data_dir, agent_id="a1")
    try:
        await commit_groups(store, [10])
        return sorted(r["index"] for r in store.unacked())
    finally:
        store.close()


def test_a_store_commit_the_disk_cannot_hold_is_refused_before_lmdb_sees_it(disk):
    """Red if: a commit goes to LMDB with less than the reserve left on the disk (LMDB would then
    fail part-way, or take the last pages a restart needs) instead of stopping as a full disk."""
    data_dir = disk / "a1"

    async def run():
        store = GroupStore(data_dir, agent_id="a1")
        reported: list[StorageFull] = []
        store.on_full = reported.append
        try:
            await commit_groups(store, range(3))
            txnid = store.env.info()["last_txnid"]
            fill(disk, MIN_FREE // 2)
            with pytest.raises(StorageFull, match="left, a write of"):
                await commit_groups(store, [3])
            assert store.env.info()["last_txnid"] == txnid, "LMDB was asked to commit"
            assert fill(disk, MIN_FREE // 2) == MIN_FREE // 2, "the refused commit took pages"
        finally:
            store.close()
        return reported

    reported = asyncio.run(run())
    assert len(reported) == 1 and str(data_dir / "store") in str(reported[0]), reported
    # Started on that disk, the store refuses at once: no SIGBUS from LMDB's lock file, nothing left open.
    with pytest.raises(StorageFull, match="left, less than the 1.0 MiB reserve"):
        GroupStore(data_dir, agent_id="a1")
    with pytest.raises(StorageFull, match="left, less than the 1.0 MiB reserve"):
        GroupStore(disk / "a2", agent_id="a2")
    unfill(disk)
    groups, unacked = stored(data_dir)
    assert sorted(groups) == [f"0:{i}:1" for i in range(3)] and unacked == [0, 1, 2]


def open_ledger(data_dir) -> Ledger:
    ledger = Ledger(data_dir)
    ledger.open_run(1000, "fp")
    return ledger


def batch_of(rollout_id: int, refs: int = 1000) -> PutBatch:
    """A recorded batch; of 1000 groups (about 13 KiB), overflow pages that go at the end of the ledger's file."""
    return PutBatch(rollout_id, RecordedBatch([GroupRef(0, i, "a1", f"0:{i}:1") for i in range(refs)], {"m": 1.0}))


def fill_ledger(ledger: Ledger) -> None:
    for i in range(20):
        ledger.apply([PutPrompt(0, i, PromptState(READY, "a1", f"0:{i}:1", {"n": 1}, seq=i)), SetCursors({0: i + 1})])
    ledger.apply([batch_of(0)])  # the end of the file is live overflow pages: nothing freed adjoins new pages


@pytest.mark.parametrize("leave,named", LMDB_ERRORS)
def test_a_ledger_commit_meeting_a_full_disk_in_lmdb_is_storage_full_and_loses_nothing(disk, unchecked, leave, named):
    """Red if: LMDB's EIO or ENOSPC under a ledger commit is not a StorageFull naming the ledger's
    disk (the coordinator would die with a raw lmdb.Error traceback), or after space is freed the
    ledger lacks a record committed before or holds part of the refused one."""
    data_dir = disk / "coordinator"
    ledger = open_ledger(data_dir)
    try:
        fill_ledger(ledger)
        before = ledger.snapshot()
        assert fill(disk, leave) == leave
        with pytest.raises(StorageFull) as caught:
            ledger.apply([batch_of(1)])
    finally:
        ledger.close()
    assert f"the disk under coordinator ledger {data_dir / 'ledger'} is full {named}" in str(caught.value)
    unfill(disk)
    ledger = open_ledger(data_dir)
    try:
        after = ledger.snapshot()
        assert (after.prompts, after.batches, after.cursors) == (before.prompts, before.batches, before.cursors)
        ledger.apply([batch_of(1)])
        assert sorted(ledger.snapshot().batches) == [0, 1]
    finally:
        ledger.close()


def test_a_ledger_commit_the_disk_cannot_hold_is_refused_before_lmdb_sees_it(disk):
    """Red if: a ledger commit goes to LMDB with less than the reserve left, or a coordinator
    started on such a disk gets past opening its ledger."""
    data_dir = disk / "coordinator"
    ledger = open_ledger(data_dir)
    try:
        fill_ledger(ledger)
        txnid = ledger.env.info()["last_txnid"]
        fill(disk, MIN_FREE // 2)
        with pytest.raises(StorageFull, match="left, a write of"):
            ledger.apply([batch_of(1)])
        assert ledger.env.info()["last_txnid"] == txnid, "LMDB was asked to commit"
    finally:
        ledger.close()
    with pytest.raises(StorageFull, match=f"the disk under coordinator ledger {data_dir / 'ledger'} is full"):
        open_ledger(data_dir)
    unfill(disk)
    ledger = open_ledger(data_dir)
    try:
        assert sorted(ledger.snapshot().batches) == [0]
    finally:
        ledger.close()


def test_an_eio_is_a_full_disk_only_where_the_disk_is_full(disk, unchecked, tmp_path):
    """Red if: an EIO on a disk with room (a failing device, not a full one) is called a full disk,
    which would tell the operator to free space that is there."""
    env = lmdb.open(str(disk / "env"), map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"a", payload(0))
        fill(disk, PAGE)
        with pytest.raises(lmdb.Error) as caught:
            with env.begin(write=True) as txn:
                txn.put(b"b", payload(1))
    finally:
        env.close()
    exc = caught.value
    assert getattr(exc, "code", None) == errno.EIO, exc
    assert storage_full(exc, "agent store", disk / "env", 1 << 30) is not None
    assert os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize > MIN_FREE
    assert storage_full(exc, "agent store", tmp_path, 1 << 30) is None
