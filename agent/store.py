"""The agent's durable group store (LMDB) with a receipt outbox.

Layout (one environment under ``<data-dir>/store``):
- ``groups``: group key -> encoded ``Group`` payload (what trainers fetch);
- ``outbox``: group key -> the receipt to send; present until the
  coordinator acknowledges it;
- ``meta``: ``agent_id`` (stable across restarts of this data dir) and
  ``incarnation`` (bumped at every start).

Invariants:
- A group and its outbox entry are written in the same transaction, so the
  store never holds a half-written group and never a group whose receipt
  could be forgotten (guarantee 1: commit, then receipt).
- All writes run on one dedicated thread, FIFO, up to ``max_batch`` queued
  writes per transaction (group commit); reads run on other threads and
  never block the writer (MVCC). No transaction is held across an await.
- A commit returns only once durable (``sync=True``). A transaction's commit
  fsyncs the file and then writes its meta page without a second flush; the
  next transaction's fsync (or an ``env.sync`` when the queue is empty)
  makes that page durable, and only then are its callers resolved. A busy
  store thus pays one fsync per transaction, not two (LMDB's
  ``MDB_NOMETASYNC``: an OS crash can undo only commits nobody was told of).
- A full map (``--map-size``) or disk fails the transaction that hit it whole, as
  ``StorageFull`` naming the store and the flag, and calls ``on_full`` once (the
  agent stops): no commit in it returned, so no receipt was sent for it, and
  every earlier commit stands for a restart with a larger ``--map-size`` (or
  once space is freed). A full disk is ENOSPC, EIO with the disk (almost) full
  (LMDB's code for a commit that ran out of space part-way), or a transaction
  refused before its commit because the disk cannot hold it
  (common/lmdb_env.py ``check_space``): never an error of the group in it.
- The flush loop is a task of its own: cancelling a caller abandons only its
  wait, never the writes queued with or behind it; ``drain()`` waits for them.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lmdb
import msgpack

from common.errors import StorageFull
from common.lmdb_env import MAP_SIZE, check_space, lock_dir, open_env, storage_full

log = logging.getLogger("rollfleet.agent.store")


def _resolve(batch: list) -> None:
    for _, f in batch:
        if f is not None and not f.done():
            f.set_result(None)


def _fail(batch: list, exc: BaseException) -> None:
    if any(f is None for _, f in batch):
        log.error("store write failed: %s", exc)
    for _, f in batch:
        if f is None or f.done():
            continue
        if isinstance(exc, Exception):
            f.set_exception(exc)
        else:
            f.cancel()


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """Counters since the store was opened (``GroupStore.statistics()``)."""

    transactions: int  # write transactions committed
    groups: int  # groups committed
    group_bytes: int  # payload bytes of those groups


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MALLOC_KEEP = 256 << 20
"""Freed heap memory glibc may keep (trim threshold) once a store is open."""
MALLOC_MMAP_MIN = 64 << 20
"""Allocations below this come from the heap, not a fresh mmap (glibc's largest dynamic threshold is 32 MiB)."""


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel at once.

    Without ``writemap``, LMDB copies each value into malloc'd dirty pages and frees them after
    the commit. glibc serves MiB-sized blocks with mmap (or trims them off the heap) and returns
    them at free, so every transaction page-faults its dirty pages back in, zeroed: measured on a
    long-lived store, 125 minor faults per MiB committed and half the commit CPU (0.36 ms/MiB,
    0.18 with this). Raising the mmap and trim thresholds keeps those
    pages mapped (the process holds at most ``MALLOC_KEEP`` of freed memory). Process-wide and
    idempotent; False where the C library has no ``mallopt`` (not glibc): only speed differs.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_MIN)) and bool(mallopt(M_TRIM_THRESHOLD, MALLOC_KEEP))


MAX_BATCH = 64
"""Queued writes (a commit, an ack, a trim each) taken into one transaction at most: a bound on a
transaction's size, hence on the wait of the writes queued behind it."""


class _FullIsStorageFull:
    def __init__(self, store: GroupStore):
        self.store = store

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, (lmdb.Error, OSError)):
            full = storage_full(exc, "agent store", self.store.path, self.store.map_size)
            if full is not None:
                raise full from None
        return False


class GroupStore:
    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        agent_id: str | None = None,
        sync: bool = True,
        max_batch: int = MAX_BATCH,
        map_size: int = MAP_SIZE,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        keep_freed_memory()
        self.path = Path(data_dir) / "store"
        # Before anything is written: LMDB sets up its lock file through a shared mapping, and a page of it
        # that a full disk cannot back is a SIGBUS, not an error.
        check_space(self.path, 0, "agent store")
        self.sync = sync
        self.max_batch = max_batch
        self._lock = lock_dir(Path(data_dir), "agent data dir")
        # Meta pages are flushed by the next commit or an explicit sync (see _flush), never skipped.
        self.map_size = map_size
        self.on_full: Callable[[StorageFull], None] | None = None  # called once, at the first full write
        self.full: StorageFull | None = None
        self.env = open_env(self.path, sync=sync, metasync=False, max_readers=512, map_size=map_size)
        self.groups = self.env.open_db(b"groups")
        self.outbox = self.env.open_db(b"outbox")
        self.meta = self.env.open_db(b"meta")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-reader")
        self._queue: list[tuple[list, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._transactions = self._groups = self._group_bytes = 0  # written by the writer thread only
        try:
            self._start(str(data_dir), agent_id, sync)
        except BaseException:  # a full disk or another agent's data dir: nothing stays open behind the error
            self.close()
            raise

    def _start(self, data_dir: str, agent_id: str | None, sync: bool) -> None:
        """Read (or make) this data dir's agent id and bump its incarnation, durably."""
        with self._writing(), self.env.begin(write=True) as txn:
            stored = txn.get(b"agent_id", db=self.meta)
            if stored is None:
                stored = (agent_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}").encode()
                txn.put(b"agent_id", stored, db=self.meta)
            elif agent_id and agent_id.encode() != stored:
                raise ValueError(f"data dir {data_dir} belongs to agent {stored.decode()!r}, not {agent_id!r}")
            self.agent_id = stored.decode()
            raw = txn.get(b"incarnation", db=self.meta)
            self.incarnation = (int(raw) if raw else 0) + 1
            txn.put(b"incarnation", str(self.incarnation).encode(), db=self.meta)
        if sync:
            with self._writing():
                self.env.sync(True)  # the bump is durable before anyone sees this incarnation

    # ---------------------------------------------------------------- writes

    async def _submit(self, ops: list) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((ops, fut))
        # The flush loop is its own task: a caller cancelled while waiting (a lease
        # cancelled at shutdown or by the coordinator) must not stop the writes
        # queued behind it, nor leave their callers waiting forever.
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name="store-flush")
        await fut

    def _submit_nowait(self, ops: list) -> None:
        """Queue writes without waiting for their commit (for idempotent bookkeeping)."""
        self._queue.append((ops, None))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="store-flush")

    async def _flush(self) -> None:
        """Write the queue, ``max_batch`` entries per transaction, and resolve each commit once durable.

        With ``sync`` on, the environment runs without meta sync: a commit fsyncs the file, then
        only writes its meta page. That page is durable once the next flush returned, which is
        either the next transaction's commit (its fsync comes before its own meta write) or an
        ``env.sync`` when nothing else is queued. So a busy store pays one fsync per transaction,
        and a caller's future is resolved only after the flush that made its commit durable.
        """
        loop = asyncio.get_running_loop()
        unflushed: list = []  # committed batches whose meta page is written, not yet flushed
        batch: list = []
        try:
            while self._queue or unflushed:
                if not self._queue:
                    batch, unflushed = unflushed, []
                    try:
                        await loop.run_in_executor(self._writer, self._sync)
                    except Exception as exc:
                        if isinstance(exc, StorageFull):
                            self._report_full(exc)
                        _fail(batch, exc)
                    else:
                        _resolve(batch)
                    batch = []
                    continue
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                ops = [op for ops, _ in batch for op in ops]
                try:
                    flushed = await loop.run_in_executor(self._writer, self._apply, ops)
                except Exception as exc:
                    if isinstance(exc, StorageFull):
                        self._report_full(exc)
                    _fail(batch, exc)
                    batch = []
                    continue
                if not self.sync:
                    _resolve(batch)  # --no-sync: nothing is flushed, and the callers chose that
                elif flushed:  # this commit's fsync came after every earlier meta write
                    _resolve(unflushed)
                    unflushed = batch
                else:
                    unflushed += batch
                batch = []
        except BaseException as exc:
            # Cancelled (the loop is closing): no caller may believe a write durable that was not flushed.
            _fail(unflushed + batch + self._queue, exc)
            self._queue = []
            raise

    def _writing(self):
        """A context turning a full map or disk into StorageFull (naming this store and --map-size)."""
        return _FullIsStorageFull(self)

    def _report_full(self, exc: StorageFull) -> None:
        if self.full is None:
            self.full = exc
            log.error("%s", exc)
            if self.on_full is not None:
                self.on_full(exc)

    def _sync(self) -> None:
        """Flush the file: every commit so far, meta page included, is durable once this returns."""
        with self._writing():
            self.env.sync(True)

    async def drain(self) -> None:
        """Wait until every write submitted so far is committed (or failed)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.wait({self._flusher})

    def _apply(self, ops: list) -> bool:
        """One write transaction; True if it changed anything (LMDB skips the commit's fsync otherwise)."""
        groups = group_bytes = 0
        changed = False
        check_space(self.path, sum(len(key) + len(value or b"") for _, key, value in ops), "agent store")
        with self._writing(), self.env.begin(write=True) as txn:
            for kind, key, value in ops:
                if kind == "group":
                    changed |= txn.put(key, value, db=self.groups)
                    groups += 1
                    group_bytes += len(value)
                elif kind == "outbox":
                    changed |= txn.put(key, value, db=self.outbox)
                elif kind == "del_outbox":
                    changed |= txn.delete(key, db=self.outbox)
                elif kind == "del_group":
                    changed |= txn.delete(key, db=self.groups)
        self._transactions += 1
        self._groups += groups
        self._group_bytes += group_bytes
        return changed

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(self._transactions, self._groups, self._group_bytes)

    async def commit(self, key: str, payload: bytes, receipt: dict) -> None:
        """Durably store a group with its pending receipt; returns after the commit."""
        k = key.encode()
        await self._submit([("group", k, payload), ("outbox", k, msgpack.packb(receipt, use_bin_type=True))])

    async def ack(self, key: str, accepted: bool) -> None:
        """The coordinator answered a receipt: clear the outbox; a refused group is deleted."""
        k = key.encode()
        ops = [("del_outbox", k, None)]
        if not accepted:
            ops.append(("del_group", k, None))
        await self._submit(ops)

    def ack_nowait(self, key: str, accepted: bool) -> None:
        """``ack`` without waiting: a lost outbox delete only means one receipt is resent (and deduplicated)."""
        k = key.encode()
        self._submit_nowait([("del_outbox", k, None)] + ([] if accepted else [("del_group", k, None)]))

    async def trim(self, keys: list[str]) -> None:
        await self._submit([("del_group", k.encode(), None) for k in keys])

    def trim_nowait(self, keys: list[str]) -> None:
        self._submit_nowait([("del_group", k.encode(), None) for k in keys])

    # ---------------------------------------------------------------- reads

    def meta_get(self, name: str) -> str | None:
        with self.env.begin() as txn:
            raw = txn.get(name.encode(), db=self.meta)
        return raw.decode() if raw is not None else None

    def meta_put(self, name: str, value: str) -> None:
        """A small synchronous write, for start-up only (never from the event loop)."""
        check_space(self.path, len(name) + len(value), "agent store")
        with self._writing(), self.env.begin(write=True) as txn:
            txn.put(name.encode(), value.encode(), db=self.meta)
        if self.sync:
            self.env.sync(True)

    def snapshot(self) -> tuple[list[str], list[dict]]:
        """Stored group keys and unacknowledged receipts, read in one transaction."""
        with self.env.begin() as txn:
            keys = [k.decode() for k, _ in txn.cursor(db=self.groups)]
            unacked = [msgpack.unpackb(v, raw=False) for _, v in txn.cursor(db=self.outbox)]
        return keys, unacked

    def unacked(self) -> list[dict]:
        with self.env.begin() as txn:
            return [msgpack.unpackb(v, raw=False) for _, v in txn.cursor(db=self.outbox)]

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        with self.env.begin(buffers=False) as txn:
            return [txn.get(k.encode(), db=self.groups) for k in keys]

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        return await asyncio.get_running_loop().run_in_executor(self._readers, self._get_many, keys)

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.groups)["entries"]

    def usage(self) -> tuple[int, int]:
        """``(groups stored, bytes of the LMDB in use)``: meta pages only, cheap enough for the loop at scrape time."""
        info = self.env.info()
        with self.env.begin() as txn:
            groups = txn.stat(self.groups)["entries"]
        return groups, (info["last_pgno"] + 1) * self.env.stat()["psize"]

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()
        self._lock.close()
