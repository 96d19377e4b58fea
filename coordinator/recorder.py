"""The trainer-side recorder: every batch a client returns, kept as a Parquet file (coordinator/record_format.py).

``RolloutClient(addr, record="DIR")`` hands each batch to a ``Recorder`` as the payload bytes it
fetched (immutable, so nothing the trainer does to its batch afterwards can reach the file) and goes
on; one writer thread unpacks them, builds the table and writes the file. Invariants:

- Whole files only: a file is written under a temporary name, fsynced, renamed into place and the
  directory fsynced; a writer killed at any moment leaves at most a temporary file, which the next
  recorder on the directory removes.
- Once per rollout id: a batch asked for again (``generate`` is idempotent), or already on disk
  from an earlier run on the same directory, is not written again.
- Off the critical path: ``batch()`` only queues references. The queue is bounded
  (``MAX_QUEUED`` batches); only a disk slower than the trainer for that many batches in a row
  makes ``generate`` wait for it.
- A write that fails is logged with the batch named and counted (``statistics()``); the trainer
  goes on, and the same id asked for again is tried again.
- ``close()`` writes what is queued before it returns (the client's ``close`` calls it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

from coordinator.record_format import (
    PARQUET_OPTIONS,
    TMP_PREFIX,
    batch_name,
    batch_table,
    eval_name,
    recorded_ids,
    require_pyarrow,
)

log = logging.getLogger("rollfleet.recorder")

MAX_QUEUED = 8
"""Batches waiting for the writer before ``batch()`` blocks (backpressure from a slow disk)."""


@dataclass(frozen=True)
class RecorderStats:
    written: int
    """Files written by this recorder."""
    skipped: int
    """Batches not written: already written, or on disk from an earlier run."""
    failed: int
    queued: int
    write_seconds: float
    """Writer-thread wall time spent on the files written (unpack, table, Parquet, fsync, rename)."""
    last_write_seconds: float
    write_cpu_seconds: float
    """The writer thread's CPU time on them (the wall time less waiting for the disk)."""


def write_atomic(directory: str, name: str, write) -> str:
    """``write(file)`` into ``directory/name`` so that the name only ever holds a whole file."""
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)
    return final


class Recorder:
    def __init__(self, directory: str):
        require_pyarrow("record=")
        import pyarrow.parquet  # noqa: F401  (now, in the client's constructor: not in the first write)

        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.startswith(TMP_PREFIX):  # a writer killed mid-file left it
                os.unlink(os.path.join(self.directory, name))
        self._lock = threading.Lock()
        self._done: set = set(recorded_ids(self.directory))
        """Rollout ids written or queued (and ``("eval", name, pass)`` keys): never written twice."""
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._written = self._skipped = self._failed = 0
        self._seconds = self._last = self._cpu = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rollfleet-recorder", daemon=True)
        self._thread.start()

    def batch(self, rollout_id: int, payloads: list[bytes], metrics: dict, fleet: dict) -> None:
        """Queue batch ``rollout_id`` (its groups' payload bytes in batch order) unless it is recorded already;
        waits while ``MAX_QUEUED`` batches are queued (call it off an event loop)."""
        self._offer(rollout_id, ("batch", rollout_id, payloads, dict(metrics), fleet), block=True)

    def batch_nowait(self, rollout_id: int, payloads: list[bytes], metrics: dict, fleet: dict) -> bool:
        """``batch`` without waiting: False (nothing done) when the queue is full."""
        return self._offer(rollout_id, ("batch", rollout_id, payloads, dict(metrics), fleet), block=False)

    def evaluation_nowait(self, result: dict, consumed: int) -> bool:
        """Queue an evaluation pass's metrics (``evaluate``'s result), once per (name, pass); False when full."""
        key = ("eval", result.get("name"), result.get("pass"))
        return self._offer(key, ("eval", key, result, consumed), block=False)

    def evaluation(self, result: dict, consumed: int) -> None:
        key = ("eval", result.get("name"), result.get("pass"))
        self._offer(key, ("eval", key, result, consumed), block=True)

    def _offer(self, key, item: tuple, block: bool) -> bool:
        with self._lock:
            if self._closed or key in self._done:
                self._skipped += 1
                return True
            self._done.add(key)
        try:
            self._queue.put(item, block=block)
        except queue.Full:
            with self._lock:
                self._done.discard(key)
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key = item[1]
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                if item[0] == "batch":
                    self._write_batch(*item[1:])
                else:
                    self._write_eval(*item[2:])
            except Exception:
                log.exception("recording %s to %s failed; the trainer goes on without it", _what(key), self.directory)
                with self._lock:
                    self._failed += 1
                    self._done.discard(key)  # asked for again, it is tried again
                continue
            took = time.perf_counter() - started
            with self._lock:
                self._written += 1
                self._seconds += took
                self._last = took
                self._cpu += time.thread_time() - cpu

    def _write_batch(self, rollout_id: int, payloads: list[bytes], metrics: dict, fleet: dict) -> None:
        import pyarrow.parquet as pq

        table = batch_table(rollout_id, payloads, metrics, fleet)
        write_atomic(self.directory, batch_name(rollout_id), lambda f: pq.write_table(table, f, **PARQUET_OPTIONS))

    def _write_eval(self, result: dict, consumed: int) -> None:
        body = {"name": result["name"], "pass": result["pass"], "consumed": consumed, "metrics": result}
        data = json.dumps(body, indent=1, sort_keys=True).encode()
        write_atomic(self.directory, eval_name(result["name"], result["pass"]), lambda f: f.write(data))

    def statistics(self) -> RecorderStats:
        with self._lock:
            return RecorderStats(
                self._written, self._skipped, self._failed, self._queue.qsize(), self._seconds, self._last, self._cpu
            )

    def close(self, timeout: float = 60.0) -> None:
        """Write everything queued, then stop the writer (at most ``timeout`` seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the recorder did not finish writing to %s within %.0fs", self.directory, timeout)


def _what(key) -> str:
    return f"evaluation {key[1]!r} pass {key[2]}" if isinstance(key, tuple) else f"batch {key}"
