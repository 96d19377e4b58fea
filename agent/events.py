"""The vocabulary of the agent's pure core: events in, instructions out.

``AgentSession.handle(event, now)`` (agent/session.py) takes one of the
events below and returns a list of instructions; the asyncio shell
(agent/worker.py, agent/link.py, agent/lease_runner.py) produces the events
and carries out the instructions, in order. Both are small immutable
records, so a test builds them by hand and compares them with ``==``.

Who sends which event:
- the coordinator link: ``Connected``, ``MessageReceived``, ``Tick``;
- the engine supervisor: ``EnginesStarted``, ``EngineChanged``;
- the weights executor (agent/weights.py): ``WeightsStepDone``, ``EngineVersion``;
- a lease runner: ``EngineWanted``, ``GenerationEnded``, ``EngineFailed``,
  ``LeaseScored``, ``LeaseFiltered``, ``LeaseCommitted``, ``LeaseFailed``;
- the agent process: ``ShutdownRequested``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol as p
from common.config import RolloutConfig
from common.engine_info import EngineState

# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PendingReceipt:
    """A committed group's receipt, as the store's outbox keeps it until the coordinator answers."""

    lease: int
    data_epoch: int
    index: int
    key: str
    n_samples: int
    stats: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> PendingReceipt:
        """From the store's encoding; KeyError/TypeError for an entry that is not a receipt."""
        return cls(d["lease"], d["data_epoch"], d["index"], d["key"], d["n_samples"], dict(d.get("stats") or {}))

    def to_dict(self) -> dict:
        return {
            "lease": self.lease,
            "data_epoch": self.data_epoch,
            "index": self.index,
            "key": self.key,
            "n_samples": self.n_samples,
            "stats": self.stats,
        }

    def to_message(self, session: int) -> p.Receipt:
        return p.Receipt(session, self.lease, self.data_epoch, self.index, self.key, self.n_samples, self.stats)


WeightsRecord = p.FleetWeights
"""The fleet's weights as this agent knows them: the Welcome's ``weights``, or what the last update left
(``version``, and ``kind``/``path``: how it was reached)."""


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Connected:
    """A fresh socket to the coordinator is open; the store's view is read in one transaction.

    ``stored`` are the keys of every stored group, ``unacked`` the outbox's
    receipts (as stored): both go into the Register message, read together so
    the coordinator never trims a group whose receipt it has not seen.
    """

    stored: tuple[str, ...] = ()
    unacked: tuple[dict, ...] = ()


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A frame from the coordinator; ``msg`` is None when it could not be decoded (still a sign of life)."""

    msg: p.Message | None


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: the link calls this when ``AgentSession.next_tick_at`` is reached."""

    stored_groups: int = 0
    """Groups in the store now (reported in the heartbeat's statistics)."""


@dataclass(frozen=True, slots=True)
class EnginesStarted:
    """The engines healthy once the supervisor started, as ``(name, url)``."""

    engines: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class EngineChanged:
    """The supervisor moved an engine to ``state``."""

    name: str
    state: EngineState
    url: str | None = None
    all_retired: bool = False
    """Every engine of the node is retired: nothing here will ever generate again."""


@dataclass(frozen=True, slots=True)
class EngineWanted:
    """A lease runner is ready for (another) engine: at its start, or after an engine failed."""

    lease: int


@dataclass(frozen=True, slots=True)
class GenerationEnded:
    """The lease's requests came back. ``aborted``: some sample was cut short (ours or the engine's abort)."""

    lease: int
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The lease's engine was unreachable or crashed mid-group; the runner asks again after a short delay."""

    lease: int
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseScored:
    """Reward and filter done: the lease is past generation and commits (or reports its filtering) next."""

    lease: int
    n_samples: int


@dataclass(frozen=True, slots=True)
class LeaseFiltered:
    """The dynamic filter dropped the group."""

    lease: int
    reason: str
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LeaseEvaluated:
    """An evaluation lease's group was generated and scored: its result goes to the coordinator, nothing is stored."""

    lease: int
    name: str
    eval_pass: int
    result: p.EvalOutcome


@dataclass(frozen=True, slots=True)
class LeaseCommitted:
    """The group and its receipt are durable in the store (the commit returned)."""

    lease: int
    receipt: PendingReceipt


@dataclass(frozen=True, slots=True)
class LeaseFailed:
    """The lease failed for a reason of its own (reward code, a rejected request, a bad row): ``failure``
    says at which step and why, and the coordinator counts it as one of the prompt's failed attempts.

    ``failure`` None: not the prompt's fault (the agent's store is full); it is given back uncounted."""

    lease: int
    failure: p.Failure | None


@dataclass(frozen=True, slots=True)
class ShutdownRequested:
    """An orderly stop (SIGTERM/SIGINT) began."""


@dataclass(frozen=True, slots=True)
class WeightsStepDone:
    """The weights executor finished one coordinator step (``RunWeightsStep``) on this agent's engines.

    ``engines`` maps engine name to the version it reports now; ``error`` names the engine(s) that
    failed. ``record``: the weights every serving engine holds after a successful ``disk`` or ``finish``
    step, or after an ``abort``; None otherwise.
    """

    update_id: int
    step: str
    ok: bool
    seq: int = 0
    engines: dict = field(default_factory=dict)
    error: str = ""
    record: WeightsRecord | None = None
    report: bool = True
    members: list = field(default_factory=list)
    """``begin``: the engines confirmed for the broadcast group."""
    """False for a step the agent ran on its own (no coordinator waits for it)."""


@dataclass(frozen=True, slots=True)
class EngineVersion:
    """An engine's weight version (None: unknown) and tensor-parallel size, for its Register/heartbeat entry."""

    name: str
    version: int | None
    tp: int = 1


Event = (
    Connected
    | MessageReceived
    | Tick
    | EnginesStarted
    | EngineChanged
    | EngineWanted
    | GenerationEnded
    | EngineFailed
    | LeaseScored
    | LeaseFiltered
    | LeaseCommitted
    | LeaseFailed
    | ShutdownRequested
    | WeightsStepDone
    | EngineVersion
)


# --------------------------------------------------------------------------- instructions


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``msg`` to the coordinator (fire and forget: repairs are the protocol's business)."""

    msg: p.Message


@dataclass(frozen=True, slots=True)
class StartLease:
    """Start a runner task for a granted lease (it asks for an engine with ``EngineWanted``)."""

    lease: int
    grant: dict


@dataclass(frozen=True, slots=True)
class AssignEngine:
    """Answer a runner's ``EngineWanted``: run the group on ``url`` under these SGLang request ids."""

    lease: int
    engine: str
    url: str
    request_ids: tuple[str, ...]
    resume: bool = False
    """A weight update interrupted the lease's generation: keep what it generated (finished samples, and
    partial outputs when partial rollout is on) instead of starting the group over."""


@dataclass(frozen=True, slots=True)
class CancelLease:
    """Cancel the lease's runner task; the core has already forgotten the lease (and said so if needed)."""

    lease: int


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort these SGLang requests on the engine at ``url`` (pause with abort, a Stop)."""

    url: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AckReceipt:
    """The coordinator answered a receipt: clear it from the outbox; a refused group is deleted."""

    key: str
    accepted: bool


@dataclass(frozen=True, slots=True)
class TrimGroups:
    """Delete these stored groups: no trainer can ask for them again."""

    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReportEngineFailure:
    """Tell the supervisor the request path saw ``engine`` fail, so it checks it now."""

    engine: str
    reason: str


@dataclass(frozen=True, slots=True)
class Configure:
    """A new rollout configuration: load its reward and filter before the next lease starts."""

    config: RolloutConfig


@dataclass(frozen=True, slots=True)
class Reconnect:
    """The session is over (fenced, or the coordinator went silent): reopen the link and register again."""

    reason: str


@dataclass(frozen=True, slots=True)
class CloseLink:
    """The session is over while the agent shuts down: the link ends instead of reconnecting."""

    reason: str


@dataclass(frozen=True, slots=True)
class Exit:
    """The coordinator refused this agent for good (dataset mismatch, too small): the agent stops."""

    reason: str


@dataclass(frozen=True, slots=True)
class RunWeightsStep:
    """Run one step of a weight update (a ``Weights*`` coordinator message) on this agent's engines;
    the executor answers with ``WeightsStepDone``. Steps run one at a time, in order; an abort cancels
    the step of its update that is still running."""

    msg: p.Message
    report: bool = True


@dataclass(frozen=True, slots=True)
class SetWeights:
    """The fleet's current weights (from the Welcome): engines behind them leave the pool until they hold them."""

    record: WeightsRecord


@dataclass(frozen=True, slots=True)
class Log:
    """A line for the agent's log (``level`` as in :mod:`logging`)."""

    level: int
    text: str


Instruction = (
    Send
    | StartLease
    | AssignEngine
    | CancelLease
    | AbortRequests
    | AckReceipt
    | TrimGroups
    | ReportEngineFailure
    | Configure
    | Reconnect
    | CloseLink
    | Exit
    | RunWeightsStep
    | SetWeights
    | Log
)
