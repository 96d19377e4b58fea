"""The coordinator's durable ledger (LMDB): what was accepted, filtered and delivered.

Layout (one environment, four named databases), every value msgpack:
- ``meta``: ``generation`` (bumped at every start; fences pre-restart
  sessions and lease ids), ``dataset`` (size + fingerprint), ``cursors``,
  the marks ``trimmed_upto``, ``consumed_upto`` (highest batch a trainer
  fetched), ``last_checkpoint`` and ``last_rollout_id``, ``paused`` (the
  trainer's pause outlives a coordinator restart) and ``weights`` (the weight
  log: version, updates pushed, kind, path, recent lease-id boundaries).
- ``prompts``: ``(data_epoch, index)`` -> a ``PromptState`` for every prompt
  of an open epoch that is READY, DELIVERED or FILTERED. A closed epoch's
  records are deleted, so the ledger does not grow with run length.
- ``batches``: ``rollout_id`` -> the ``RecordedBatch`` (group refs +
  metrics, and ``size`` for a partial batch), kept until a trainer
  checkpoint moves past it.
- ``evals``: ``name \0 index`` -> the result of one prompt of an evaluation
  dataset's current pass; ``meta`` ``evals`` holds each dataset's
  ``EvalRecord``. A new pass deletes the previous one's results, so the
  ledger holds at most one pass per evaluation dataset.

This module is the only place where ledger records and operations
(``coordinator/records.py``) are encoded and decoded. ``read_ledger`` gives
tests and the chaos checker the same typed ``LedgerSnapshot`` a restart uses.

All writes go through one writer thread, in order; a batch of Persist
effects is applied in one transaction (group commit) with ``sync=True``, and
only after the commit returns are their messages sent.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path

import lmdb
import msgpack

from common.errors import ConfigError
from common.lmdb_env import MAP_SIZE, check_space, lock_dir, open_env, storage_full
from coordinator.records import (
    MARKS,
    CloseEpoch,
    DropBatch,
    DropEvalResults,
    DropPrompt,
    EvalRecord,
    GroupRef,
    LedgerOp,
    LedgerSnapshot,
    PromptState,
    PutBatch,
    PutEvalResult,
    PutPrompt,
    RecordedBatch,
    SetCursors,
    SetEvalPass,
    SetMark,
    SetMixture,
    SetPaused,
    SetWeights,
    WeightLog,
)

_PROMPT = struct.Struct(">QQ")
_BATCH = struct.Struct(">q")
_EPOCH = struct.Struct(">Q")
MAX_DBS = 8


def _pack(v) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def _unpack(b: bytes):
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def _encode_prompt(st: PromptState) -> bytes:
    return _pack([st.status, st.agent_id, st.key, st.stats, st.seq, st.rollout_id, st.reason, st.start])


def _decode_prompt(raw: bytes) -> PromptState:
    # Seven fields in a ledger written before weight updates: start 0.
    status, agent_id, key, stats, seq, rollout_id, reason, *start = _unpack(raw)
    return PromptState(status, agent_id, key, stats, seq, rollout_id, reason, start[0] if start else 0)


def _encode_weights(log: WeightLog) -> bytes:
    return _pack(
        {
            "version": log.version,
            "updates": log.updates,
            "kind": log.kind,
            "path": log.path,
            "boundaries": list(log.boundaries),
        }
    )


def _decode_weights(raw: bytes) -> WeightLog:
    d = _unpack(raw)
    return WeightLog(d["version"], d["updates"], d["kind"], d["path"], tuple(d["boundaries"]))


def _encode_batch(batch: RecordedBatch) -> bytes:
    groups = [
        [g.data_epoch, g.index, g.agent_id, g.key, *([list(g.lengths)] if g.lengths else [])] for g in batch.groups
    ]
    record = {"groups": groups, "metrics": dict(batch.metrics), "lost": [list(x) for x in batch.lost]}
    if batch.size:  # a partial batch only: full batches stay as they were written before partial ones existed
        record["size"] = batch.size
    if batch.world:  # a sharded trainer's shares (coordinator/shares.py)
        record["shares"] = [
            batch.world,
            list(batch.ranks),
            list(batch.taken),
            list(batch.lost_ranks),
            batch.equal_groups,
        ]
    return _pack(record)


def _decode_batch(raw: bytes) -> RecordedBatch:
    d = _unpack(raw)
    groups = tuple(GroupRef(g[0], g[1], g[2], g[3], lengths=tuple(g[4]) if len(g) > 4 else ()) for g in d["groups"])
    world, ranks, taken, lost_ranks, equal = d.get("shares") or (0, (), (), (), False)
    lost = tuple(tuple(x) for x in d["lost"])
    return RecordedBatch(groups, d["metrics"], lost, d.get("size", 0), world, ranks, taken, lost_ranks, equal)


def _eval_key(name: str, index: int) -> bytes:
    return name.encode() + b"\0" + _EPOCH.pack(index)


def _encode_evals(records: dict[str, EvalRecord]) -> bytes:
    return _pack(
        {
            name: {
                "pass": r.pass_id,
                "tokens": list(r.tokens),
                "fingerprint": r.fingerprint,
                "done": r.done,
                "metrics": dict(r.metrics),
            }  # fmt: skip
            for name, r in records.items()
        }
    )


def _decode_evals(raw: bytes) -> dict[str, EvalRecord]:
    return {
        name: EvalRecord(name, d["pass"], tuple(d["tokens"]), d["fingerprint"], d["done"], d["metrics"])
        for name, d in _unpack(raw).items()
    }


def _snapshot(txn, meta, prompts, batches, evals=None) -> LedgerSnapshot:
    snap = LedgerSnapshot()
    raw = txn.get(b"generation", db=meta)
    snap.generation = _unpack(raw) if raw is not None else 0
    raw = txn.get(b"dataset", db=meta)
    if raw is not None:
        known = _unpack(raw)
        snap.dataset_size, snap.dataset_fingerprint = known["size"], known["fingerprint"]
    raw = txn.get(b"cursors", db=meta)
    if raw is not None:
        snap.cursors = {int(k): v for k, v in _unpack(raw).items()}
    raw = txn.get(b"paused", db=meta)
    if raw is not None:
        snap.paused = bool(_unpack(raw))
    raw = txn.get(b"weights", db=meta)
    if raw is not None:
        snap.weights = _decode_weights(raw)
    raw = txn.get(b"mixture", db=meta)
    if raw is not None:
        snap.mixture = [(int(start), [float(x) for x in w]) for start, w in _unpack(raw)]
    for name in MARKS:
        raw = txn.get(name.encode(), db=meta)
        if raw is not None:
            setattr(snap, name, _unpack(raw))
    for k, v in txn.cursor(db=prompts):
        snap.prompts[_PROMPT.unpack(k)] = _decode_prompt(v)
    for k, v in txn.cursor(db=batches):
        snap.batches[_BATCH.unpack(k)[0]] = _decode_batch(v)
    raw = txn.get(b"evals", db=meta)
    if raw is not None:
        snap.evals = _decode_evals(raw)
    if evals is not None:
        for k, v in txn.cursor(db=evals):
            name, index = k[:-9].decode(), _EPOCH.unpack(k[-8:])[0]  # name \0 index (8 bytes)
            snap.eval_results[(name, index)] = _unpack(v)
    return snap


def read_ledger(data_dir: str | os.PathLike) -> LedgerSnapshot:
    """A consistent read-only snapshot of a coordinator's ledger (running or stopped)."""
    env = lmdb.open(str(Path(data_dir) / "ledger"), readonly=True, max_dbs=MAX_DBS, lock=True, create=False)
    try:
        with env.begin() as txn:
            dbs = [env.open_db(name, txn=txn, create=False) for name in (b"meta", b"prompts", b"batches")]
            try:
                evals = env.open_db(b"evals", txn=txn, create=False)
            except lmdb.NotFoundError:  # a ledger from before evaluation passes
                evals = None
            return _snapshot(txn, *dbs, evals)
    finally:
        env.close()


def read_config_changes(data_dir: str | os.PathLike) -> list[dict]:
    """The batch-setting changes recorded by ``--allow-config-change`` restarts, oldest first:
    ``{"generation": g, "changed": {field: [old, new]}}``."""
    env = lmdb.open(str(Path(data_dir) / "ledger"), readonly=True, max_dbs=MAX_DBS, lock=True, create=False)
    try:
        with env.begin() as txn:
            raw = txn.get(b"config_changes", db=env.open_db(b"meta", txn=txn, create=False))
            return _unpack(raw) if raw is not None else []
    finally:
        env.close()


def _full_is_storage_full(method):
    """A full map or disk under a ledger write is a StorageFull naming the ledger and --map-size.

    A full disk is ENOSPC, or EIO with the disk (almost) full (a commit that ran out of space
    part-way), or a transaction whose writes the disk cannot hold, refused before its commit
    (``check_space``). LMDB aborts the transaction that hit it whole (and a refused one is aborted
    by the ``with``): the effects waiting on it are never sent, so nothing that write would have
    acknowledged was acknowledged."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (lmdb.Error, OSError) as exc:
            full = storage_full(exc, "coordinator ledger", self.path, self.map_size)
            if full is None:
                raise
            raise full from None

    return wrapper


class Ledger:
    def __init__(self, data_dir: str | os.PathLike, *, sync: bool = True, map_size: int = MAP_SIZE):
        self.path = Path(data_dir) / "ledger"
        self.map_size = map_size
        # Before anything is written: LMDB sets up its lock file through a shared mapping, and a page of it
        # that a full disk cannot back is a SIGBUS, not an error.
        check_space(self.path, 0, "coordinator ledger")
        self._lock = lock_dir(Path(data_dir), "coordinator data dir")
        self.env = open_env(self.path, sync=sync, max_readers=256, map_size=map_size, max_dbs=MAX_DBS)
        self.meta = self.env.open_db(b"meta")
        self.prompts = self.env.open_db(b"prompts")
        self.batches = self.env.open_db(b"batches")
        self.evals = self.env.open_db(b"evals")

    def close(self) -> None:
        self.env.close()
        self._lock.close()

    def usage(self) -> dict[str, int]:
        """``{"bytes", "prompts", "batches"}``: pages in use and entries (a read transaction on meta pages only,
        a few microseconds: called from the event loop at scrape time)."""
        info = self.env.info()
        with self.env.begin() as txn:
            prompts, batches = txn.stat(self.prompts)["entries"], txn.stat(self.batches)["entries"]
        return {"bytes": (info["last_pgno"] + 1) * self.env.stat()["psize"], "prompts": prompts, "batches": batches}

    def snapshot(self) -> LedgerSnapshot:
        with self.env.begin() as txn:
            return _snapshot(txn, self.meta, self.prompts, self.batches, self.evals)

    @_full_is_storage_full
    def open_run(
        self, dataset_size: int, fingerprint: str, *, config: dict | None = None, allow_change: bool = False
    ) -> LedgerSnapshot:
        """Bump the generation and load everything a restart needs.

        ``config`` (how batches are made: ``RolloutConfig.batch_shape()`` and the shuffle seed) must
        equal the one stored by the last start: a change is a ConfigError listing the differing
        flags, unless ``allow_change``, which appends it to ``config_changes`` in ``meta``.
        Nothing is written when the start is refused.
        """
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
            changed: dict = {}
            if config is not None:
                changed = self._check_config(txn, _unpack(_pack(config)), allow_change, generation)
            check_space(self.path, 0, "coordinator ledger")  # a small write: the reserve is the margin
        snap = self.snapshot()
        snap.changed = changed
        return snap

    def _check_config(self, txn, config: dict, allow_change: bool, generation: int) -> dict:
        """The settings changed since the last start (``{field: [old, new]}``), recorded; ConfigError if not allowed."""
        raw = txn.get(b"config", db=self.meta)
        known = _unpack(raw) if raw is not None else config  # a ledger from before configs were kept
        if config.get("shuffle_seed") is not None and known.get("shuffle_seed") is not None:
            # A ledger from before the order was recorded was shuffled by order 1. Never allowed to change,
            # --allow-config-change or not: the cursor is a position, and a position names another row.
            old, new = known.get("shuffle_order") or 1, config.get("shuffle_order") or 1
            if old != new:
                raise ConfigError(
                    f"data dir {self.path.parent} was shuffled with shuffle order {old} (--shuffle-seed "
                    f"{known['shuffle_seed']}) and this build shuffles with order {new}: the prompts it recorded "
                    "by position would name other rows; finish the run with the build that started it, or use "
                    "a fresh --data-dir"
                )
        # Only settings both starts know: a field added to the config since is taken as it comes.
        changed = {k: [known[k], config[k]] for k in sorted(set(known) & set(config)) if known[k] != config[k]}
        if changed and not allow_change:
            listed = ", ".join(f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ConfigError(
                f"data dir {self.path.parent} was run with other batch settings: {listed}; restart with the "
                "same flags, or pass --allow-config-change to record the change in the ledger and go on"
            )
        if changed:
            raw = txn.get(b"config_changes", db=self.meta)
            history = _unpack(raw) if raw is not None else []
            history.append({"generation": generation, "changed": changed})
            txn.put(b"config_changes", _pack(history), db=self.meta)
        txn.put(b"config", _pack(config), db=self.meta)
        return changed

    @_full_is_storage_full
    def apply(self, ops: list[LedgerOp]) -> None:
        """Apply ops in one durable transaction. Runs on the writer thread only.

        Every ``Persist`` carries the cursors; in one transaction only the last ``SetCursors``
        is written (each one overwrites the same key, so the result is the same)."""
        last_cursors = next((i for i in range(len(ops) - 1, -1, -1) if type(ops[i]) is SetCursors), -1)
        need = 0  # bytes of keys and values written: the disk must hold them (check_space) before the commit

        def put(key: bytes, value: bytes, db) -> None:
            nonlocal need
            need += len(key) + len(value)
            txn.put(key, value, db=db)

        with self.env.begin(write=True) as txn:
            evals = None  # the eval records, read once if this transaction changes them
            for i, op in enumerate(ops):
                if isinstance(op, PutPrompt):
                    put(_PROMPT.pack(op.data_epoch, op.index), _encode_prompt(op.state), db=self.prompts)
                elif isinstance(op, DropPrompt):
                    txn.delete(_PROMPT.pack(op.data_epoch, op.index), db=self.prompts)
                elif isinstance(op, PutBatch):
                    put(_BATCH.pack(op.rollout_id), _encode_batch(op.batch), db=self.batches)
                elif isinstance(op, DropBatch):
                    txn.delete(_BATCH.pack(op.rollout_id), db=self.batches)
                elif isinstance(op, SetCursors):
                    if i == last_cursors:
                        put(b"cursors", _pack(dict(op.cursors)), db=self.meta)
                elif isinstance(op, SetPaused):
                    put(b"paused", _pack(op.paused), db=self.meta)
                elif isinstance(op, SetMark):
                    put(op.name.encode(), _pack(op.rollout_id), db=self.meta)
                elif isinstance(op, SetWeights):
                    put(b"weights", _encode_weights(op.log), db=self.meta)
                elif isinstance(op, SetMixture):
                    put(b"mixture", _pack([[start, list(w)] for start, w in op.schedule]), db=self.meta)
                elif isinstance(op, CloseEpoch):
                    _delete_prefix(txn.cursor(db=self.prompts), _EPOCH.pack(op.data_epoch))
                elif isinstance(op, PutEvalResult):
                    put(_eval_key(op.name, op.index), _pack(op.result), db=self.evals)
                elif isinstance(op, DropEvalResults):
                    _delete_prefix(txn.cursor(db=self.evals), op.name.encode() + b"\0")
                elif isinstance(op, SetEvalPass):
                    if evals is None:
                        raw = txn.get(b"evals", db=self.meta)
                        evals = _decode_evals(raw) if raw is not None else {}
                    evals[op.record.name] = op.record
                    put(b"evals", _encode_evals(evals), db=self.meta)
                else:
                    raise TypeError(f"not a ledger operation: {op!r}")
            check_space(self.path, need, "coordinator ledger")  # raised inside the with: the transaction is aborted


def _delete_prefix(cur, prefix: bytes) -> None:
    if cur.set_range(prefix):
        while cur.key().startswith(prefix):
            if not cur.delete():
                break
