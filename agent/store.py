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
- All writes run on one dedicated thread, FIFO, several commits per
  transaction (group commit, ``sync=True``); reads run on other threads and
  never block the writer (MVCC). No transaction is held across an await.
- The flush loop is a task of its own: cancelling a caller abandons only its
  wait, never the writes queued with or behind it; ``drain()`` waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack

from common.lmdb_env import lock_dir, open_env

log = logging.getLogger("rollfleet.agent.store")


class GroupStore:
    def __init__(self, data_dir: str | os.PathLike, *, agent_id: str | None = None, sync: bool = True):
        self.path = Path(data_dir) / "store"
        self._lock = lock_dir(Path(data_dir), "agent data dir")
        self.env = open_env(self.path, sync=sync, max_readers=512)
        self.groups = self.env.open_db(b"groups")
        self.outbox = self.env.open_db(b"outbox")
        self.meta = self.env.open_db(b"meta")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-reader")
        self._queue: list[tuple[list, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        with self.env.begin(write=True) as txn:
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
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await loop.run_in_executor(self._writer, self._apply, [op for ops, _ in batch for op in ops])
            except BaseException as exc:
                if any(f is None for _, f in batch):
                    log.error("store write failed: %s", exc)
                for _, f in batch:
                    if f is None or f.done():
                        continue
                    if isinstance(exc, Exception):
                        f.set_exception(exc)
                    else:
                        f.cancel()
                if not isinstance(exc, Exception):
                    raise
            else:
                for _, f in batch:
                    if f is not None and not f.done():
                        f.set_result(None)

    async def drain(self) -> None:
        """Wait until every write submitted so far is committed (or failed)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.wait({self._flusher})

    def _apply(self, ops: list) -> None:
        with self.env.begin(write=True) as txn:
            for kind, key, value in ops:
                if kind == "group":
                    txn.put(key, value, db=self.groups)
                elif kind == "outbox":
                    txn.put(key, value, db=self.outbox)
                elif kind == "del_outbox":
                    txn.delete(key, db=self.outbox)
                elif kind == "del_group":
                    txn.delete(key, db=self.groups)

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
        with self.env.begin(write=True) as txn:
            txn.put(name.encode(), value.encode(), db=self.meta)

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

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()
        self._lock.close()
