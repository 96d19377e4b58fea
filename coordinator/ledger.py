"""The coordinator's durable ledger (LMDB): what was accepted, filtered and delivered.

Layout (one environment, three named databases):
- ``meta``: ``generation`` (bumped at every start; fences pre-restart
  sessions and lease ids), ``dataset`` (size + fingerprint), ``cursors``,
  ``trimmed_upto``, ``consumed_upto`` (highest batch a trainer fetched),
  ``last_checkpoint``, ``last_rollout_id``, ``paused`` (the trainer's pause
  outlives a coordinator restart).
- ``prompts``: ``(data_epoch, index)`` -> ``{s: r|d|f, a: agent, k: key, ...}``
  for every prompt of an open epoch that is READY, DELIVERED or FILTERED.
  A closed epoch's records are deleted, so the ledger does not grow with
  run length.
- ``batches``: ``rollout_id`` -> the recorded batch (group refs + metrics),
  kept until a trainer checkpoint moves past it.

All writes go through one writer thread, in order; a batch of Persist
effects is applied in one transaction (group commit) with ``sync=True``, and
only after the commit returns are their messages sent.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgpack

from common.errors import ConfigError
from common.lmdb_env import lock_dir, open_env
from coordinator.core import Restored

_PROMPT = struct.Struct(">QQ")
_BATCH = struct.Struct(">q")


def _pack(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def _unpack(b: bytes):
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


class Ledger:
    def __init__(self, data_dir: str | os.PathLike, *, sync: bool = True):
        self.path = Path(data_dir) / "ledger"
        self._lock = lock_dir(Path(data_dir), "coordinator data dir")
        self.env = open_env(self.path, sync=sync, max_readers=256)
        self.meta = self.env.open_db(b"meta")
        self.prompts = self.env.open_db(b"prompts")
        self.batches = self.env.open_db(b"batches")

    def close(self) -> None:
        self.env.close()
        self._lock.close()

    def open_run(self, dataset_size: int, fingerprint: str) -> Restored:
        """Bump the generation and load everything a restart needs."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"dataset", db=self.meta)
            if raw is not None:
                known = _unpack(raw)
                if known["fingerprint"] != fingerprint or known["size"] != dataset_size:
                    raise ConfigError(
                        f"data dir {self.path.parent} belongs to a run on another dataset "
                        f"({known['size']} rows, fingerprint {known['fingerprint'][:12]}; now {dataset_size} rows, "
                        f"{fingerprint[:12]}); use a fresh --data-dir"
                    )
            txn.put(b"dataset", _pack({"size": dataset_size, "fingerprint": fingerprint}), db=self.meta)
            raw = txn.get(b"generation", db=self.meta)
            generation = (_unpack(raw) if raw else 0) + 1
            txn.put(b"generation", _pack(generation), db=self.meta)
        restored = Restored(generation=generation)
        with self.env.begin() as txn:
            for name in ("cursors", "trimmed_upto", "last_rollout_id", "paused", "consumed_upto", "last_checkpoint"):
                raw = txn.get(name.encode(), db=self.meta)
                if raw is not None:
                    value = _unpack(raw)
                    if name == "cursors":
                        value = {int(k): v for k, v in value.items()}
                    setattr(restored, name, value)
            for k, v in txn.cursor(db=self.prompts):
                restored.prompts[_PROMPT.unpack(k)] = _unpack(v)
            for k, v in txn.cursor(db=self.batches):
                restored.batches[_BATCH.unpack(k)[0]] = _unpack(v)
        return restored

    def apply(self, ops: list) -> None:
        """Apply ops in one durable transaction. Runs on the writer thread only."""
        with self.env.begin(write=True) as txn:
            for op in ops:
                kind = op[0]
                if kind == "prompt":
                    key = _PROMPT.pack(op[1], op[2])
                    if op[3] is None:
                        txn.delete(key, db=self.prompts)
                    else:
                        txn.put(key, _pack(op[3]), db=self.prompts)
                elif kind == "batch":
                    key = _BATCH.pack(op[1])
                    if op[2] is None:
                        txn.delete(key, db=self.batches)
                    else:
                        txn.put(key, _pack(op[2]), db=self.batches)
                elif kind == "meta":
                    txn.put(op[1].encode(), _pack(op[2]), db=self.meta)
                elif kind == "close_epoch":
                    cur = txn.cursor(db=self.prompts)
                    prefix = struct.pack(">Q", op[1])
                    if cur.set_range(prefix):
                        while cur.key().startswith(prefix):
                            if not cur.delete():
                                break
                else:
                    raise ValueError(f"unknown ledger op {kind!r}")
