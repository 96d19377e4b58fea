"""The agent's lease table: one record per lease held, and the engine slots each one takes.

Pure bookkeeping under the session's policy (agent/session.py decides when a
lease starts, is assigned, released or forgotten; this module keeps the books):

- one ``LeaseRecord`` per lease, with its state (``LeaseState``), its engine
  and SGLang request ids while it generates, and whether a pause or a Stop
  aborted it;
- the generation pool (agent/pool.py) and the supervisor's state of each
  engine, as last reported.

Invariant: a record holds pool slots exactly while it is ``GENERATING``
(``assign`` takes them, ``free`` gives them back, once); ``pop`` frees them,
so a forgotten lease never keeps capacity.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent.events import AssignEngine
from agent.pool import GenerationPool
from common import protocol as p
from common.engine_info import EngineInfo, EngineState


class LeaseState(enum.Enum):
    STARTING = "starting"  # runner started, no engine asked for yet
    WAITING = "waiting"  # no healthy engine: assigned when one comes back
    GENERATING = "generating"  # requests on an engine; holds pool slots
    RETRYING = "retrying"  # its engine failed; the runner asks again shortly
    SCORING = "scoring"  # generated; reward and filter running
    COMMITTING = "committing"  # past generation: committing and reporting; shutdown lets it finish


NOT_ON_ENGINE = (LeaseState.STARTING, LeaseState.WAITING, LeaseState.RETRYING)


ABORT_PAUSE = p.ReleaseReason.PAUSED
"""A pause (with abort, or arriving before the lease reached an engine) gave the lease back."""
ABORT_STOP = p.ReleaseReason.STOPPED
"""The coordinator stopped the lease (over-sampling: the batch was full)."""
ABORT_SHUTDOWN = p.ReleaseReason.SHUTDOWN
"""The agent is stopping: leases still generating or just granted are given back."""
NO_ENGINE = p.ReleaseReason.NO_ENGINE
"""Every engine of the agent is retired (its restart budget spent): the lease cannot run here."""


@dataclass(slots=True)
class LeaseRecord:
    """Everything the agent knows about one lease it holds."""

    lease: int
    data_epoch: int
    index: int
    state: LeaseState = LeaseState.STARTING
    engine: str | None = None
    url: str = ""
    request_ids: tuple[str, ...] = ()
    samples: int = 0  # pool slots held on ``engine``
    attempts: int = 0  # engine assignments so far (they name the request ids)
    abort: p.ReleaseReason | None = None
    """Why its requests were aborted (``ABORT_PAUSE``, ``ABORT_STOP``): given back with it once they end."""
    epoch: int = 0  # weight updates begun when it was last put on an engine
    resume: bool = False  # a weight update interrupted it: the next assignment keeps what it generated
    n_samples: int = 0  # its group's size: the fleet's, or an evaluation lease's own (``group_size``)


def group_size(grant: p.LeaseGrant, default: int) -> int:
    """Samples a grant's group has: its own ``n_samples`` (an evaluation lease), else ``default``, the fleet's."""
    return grant.n_samples if grant.n_samples > 0 else default


class LeaseTable:
    def __init__(self, concurrency_per_engine: int):
        self.pool = GenerationPool(concurrency_per_engine)
        self.engine_states: dict[str, EngineState] = {}
        self.engine_layout: dict[str, tuple[int, int | None]] = {}  # name -> (tp, weight version) for EngineInfo
        self.all_retired = False
        self._records: dict[int, LeaseRecord] = {}

    # ---------------------------------------------------------------- records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(self._records)

    def __contains__(self, lease: int) -> bool:
        return lease in self._records

    def __getitem__(self, lease: int) -> LeaseRecord:
        return self._records[lease]

    def get(self, lease: int) -> LeaseRecord | None:
        return self._records.get(lease)

    def records(self, *states: LeaseState) -> list[LeaseRecord]:
        """The records (in grant order), only those in ``states`` if any are given."""
        return [r for r in self._records.values() if not states or r.state in states]

    def add(self, lease: int, data_epoch: int, index: int) -> LeaseRecord:
        rec = self._records[lease] = LeaseRecord(lease, data_epoch, index)
        return rec

    def pop(self, lease: int) -> LeaseRecord | None:
        """Forget a lease, giving back any slots it holds."""
        rec = self._records.pop(lease, None)
        if rec is not None:
            self.free(rec)
        return rec

    # ---------------------------------------------------------------- engines

    def set_engine(self, name: str, state: EngineState, url: str | None = None) -> bool:
        """Record an engine's state; True if the node's capacity changed."""
        self.engine_states[name] = state = EngineState(state)
        return self.pool.set_engine(name, url, state == EngineState.HEALTHY)

    def mark_failed(self, name: str) -> bool:
        """The request path saw ``name`` fail: no more groups go there until it is reported healthy."""
        return self.pool.set_engine(name, None, False)

    def capacity(self) -> int:
        return self.pool.capacity()

    def engines(self) -> list[EngineInfo]:
        """Each engine as the coordinator is told (Register, Capacity, heartbeats): its state as the supervisor
        last reported it, its samples in flight, tp 1 and weight version None until known."""
        out = []
        for slot in self.pool.engines.values():
            state = self.engine_states.get(slot.name, EngineState.HEALTHY)
            tp, version = self.engine_layout.get(slot.name, (1, None))
            out.append(EngineInfo(slot.name, state, slot.url, slot.in_flight, tp, version))
        return out

    def assign(self, rec: LeaseRecord, n: int, epoch: int = 0) -> AssignEngine | None:
        """Put the lease's ``n`` samples on the least-loaded healthy engine; None if none is healthy."""
        slot = self.pool.pick()
        if slot is None:
            return None
        rec.request_ids = tuple(f"rf-{rec.lease:016x}-{rec.attempts:03d}-{i:04d}" for i in range(n))
        rec.attempts += 1
        rec.engine, rec.url, rec.samples, rec.epoch = slot.name, slot.url, n, epoch
        rec.state = LeaseState.GENERATING
        self.pool.start(slot, n)
        return AssignEngine(rec.lease, slot.name, slot.url, rec.request_ids, rec.resume)

    def free(self, rec: LeaseRecord) -> None:
        """Give back the lease's pool slots, if it holds any."""
        if rec.engine is not None:
            slot = self.pool.engines.get(rec.engine)
            if slot is not None:
                self.pool.finish(slot, rec.samples)
            rec.engine, rec.url, rec.request_ids, rec.samples = None, "", (), 0
