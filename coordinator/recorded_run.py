"""A directory of recorded batches, read for a replay (coordinator/record_format.py has the format).

The directory is listed once, at open: the rollout ids with a whole file, the evaluation passes by
name, and the fleet the recording trainer attached to (from the lowest id's file metadata only).
A batch is read when it is first asked for and kept, decoded and as payload bytes, in a small
cache (``CACHED`` batches), so a replay's memory does not grow with the run it serves.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

from common.errors import ConfigError
from coordinator.record_format import (
    BATCH_FILE,
    EVAL_FILE,
    BatchFile,
    batch_name,
    describe_ids,
    read_batch,
    recorded_ids,
    require_pyarrow,
)

CACHED = 4
"""Batches kept decoded: the one being fetched, and a few asked for again."""


class RecordedRun:
    def __init__(self, directory: str):
        require_pyarrow("coordinator replay")
        if not os.path.isdir(directory):
            raise ConfigError(f"--from {directory}: no such directory")
        self.directory = directory
        self.ids = recorded_ids(directory)
        """Rollout ids recorded, ascending."""
        self._known = set(self.ids)
        self.evals: dict[str, list[dict]] = {}
        """Evaluation name -> its recorded passes (``{"name", "pass", "consumed", "metrics"}``), by pass."""
        for name in sorted(os.listdir(directory)):
            m = EVAL_FILE.match(name)
            if m:
                with open(os.path.join(directory, name)) as f:
                    rec = json.load(f)
                self.evals.setdefault(rec["name"], []).append(rec)
        for passes in self.evals.values():
            passes.sort(key=lambda r: r["pass"])
        if not self.ids and not self.evals:
            others = [n for n in os.listdir(directory) if not BATCH_FILE.match(n)][:5]
            raise ConfigError(
                f"--from {directory}: no recorded batches (rollout-<id>.parquet) there"
                + (f"; it holds {others}" if others else "")
            )
        self.fleet: dict = self._read_fleet()
        """The recording trainer's fleet: ``config``, ``dataset_size``, ``dataset_fingerprint``, ``weights_version``."""
        self._cache: OrderedDict[int, tuple[BatchFile, list[bytes]]] = OrderedDict()

    def _read_fleet(self) -> dict:
        if not self.ids:
            return {}
        import pyarrow.parquet as pq

        meta = pq.read_schema(self.path(self.ids[0])).metadata or {}
        raw = meta.get(b"rollfleet.fleet")
        return json.loads(raw) if raw else {}

    def path(self, rollout_id: int) -> str:
        return os.path.join(self.directory, batch_name(rollout_id))

    def __contains__(self, rollout_id: int) -> bool:
        return rollout_id in self._known

    def describe(self) -> str:
        """``0-9 (10 batches)``: the ids there are, for messages."""
        return f"{describe_ids(self.ids)} ({len(self.ids)} batch{'es' if len(self.ids) != 1 else ''})"

    def batch(self, rollout_id: int) -> tuple[BatchFile, list[bytes]]:
        """Recorded batch ``rollout_id`` and its groups as payload bytes (``Group.to_wire``), in batch order."""
        hit = self._cache.get(rollout_id)
        if hit is not None:
            self._cache.move_to_end(rollout_id)
            return hit
        recorded = read_batch(self.path(rollout_id))
        entry = (recorded, [g.to_wire() for g in recorded.groups])
        self._cache[rollout_id] = entry
        while len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return entry
