"""What the weight lock (coordinator/weight_lock.py) hears and what it asks for. Pure records.

Events are fed to ``transition`` by the weights role (coordinator/weights.py), which makes them of
trainer requests, agent reports, membership changes and ticks; effects are what a row asks the role
to do. Each record is frozen; a message it carries is the one received.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol as p

# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class BeginDisk:
    """Its ``UpdateWeights`` (disk) took the lock: every alive agent (``agents``) loads the checkpoint."""

    peer: bytes
    req: int
    agents: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BeginBroadcast:
    """Its ``UpdateWeights`` (distributed, catch-up) took the lock: ``agents`` confirm their engines."""

    peer: bytes
    request: p.UpdateWeights
    agents: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UpdateResent:
    """Its trainer sent the ``UpdateWeights`` again (same request id) before it was answered."""

    peer: bytes
    req: int
    now: float


@dataclass(frozen=True, slots=True)
class Bucket:
    """The trainer's next ``WeightBucket``."""

    peer: bytes
    msg: p.WeightBucket
    now: float


@dataclass(frozen=True, slots=True)
class FinishAsked:
    """The trainer's ``FinishWeights``: every bucket was broadcast."""

    peer: bytes
    msg: p.FinishWeights
    now: float


@dataclass(frozen=True, slots=True)
class Registered:
    """An agent (re)registered while the update runs."""

    agent: str


@dataclass(frozen=True, slots=True)
class Reported:
    """An agent's ``WeightsReport`` of a step that succeeded there."""

    agent: str
    step: str
    seq: int = 0
    engines: dict = field(default_factory=dict)
    members: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepFailed:
    """An agent's ``WeightsReport`` of a step that failed there; ``error`` names the engine."""

    agent: str
    step: str
    error: str


@dataclass(frozen=True, slots=True)
class AgentLost:
    """An agent sent a step died or registered again; it is not in the group (:func:`lost`)."""

    agent: str


@dataclass(frozen=True, slots=True)
class MemberLost:
    """An agent of the broadcast group died or registered again (:func:`lost`)."""

    agent: str


@dataclass(frozen=True, slots=True)
class GroupNew:
    """Every agent answered ``begin``; the group differs from the last one formed: its engines join it."""

    members: dict[str, dict[str, int]]
    world_size: int
    group_name: str


@dataclass(frozen=True, slots=True)
class GroupKept:
    """Every agent answered ``begin``; the group is the last one formed, still joined."""

    members: dict[str, dict[str, int]]
    world_size: int
    group_name: str


@dataclass(frozen=True, slots=True)
class NoneConfirmed:
    """Every agent answered ``begin`` and no engine was confirmed: no engine can receive the update."""


@dataclass(frozen=True, slots=True)
class NoneBehind:
    """A catch-up's agents confirmed no engine: every one behind came back another way meanwhile."""


@dataclass(frozen=True, slots=True)
class Settled:
    """Nothing is awaited from an agent (``Update.settled``); ``agents``: the alive ones."""

    agents: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeadlinePassed:
    """The lock's deadline passed."""


@dataclass(frozen=True, slots=True)
class TrainerSilent:
    """Its trainer sent nothing about the update for ``silent`` seconds, past the session TTL."""

    silent: float
    ttl: float


@dataclass(frozen=True, slots=True)
class TrainerGone:
    """Its trainer was fenced or detached."""

    why: str


@dataclass(frozen=True, slots=True)
class TrainerAborted:
    """Its trainer's ``AbortWeights``: its own side of the update failed."""

    why: str


@dataclass(frozen=True, slots=True)
class Replaced:
    """Its trainer began a new update: it gave this one up."""


# ---------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class ToAgent:
    """Send ``msg`` to ``agent`` (the role notes the session it had: ``Update.sessions``)."""

    agent: str
    msg: p.Message


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the trainer's ``peer``; ``key`` (session, request id): kept, so a resend gets it again."""

    peer: bytes
    msg: p.Message
    key: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """The update is done: record the log, release the lock, then send ``answer`` (if any)."""

    answer: Answer | None


@dataclass(frozen=True, slots=True)
class Release:
    """The update is done with nothing to record (a catch-up): release the lock."""


@dataclass(frozen=True, slots=True)
class Abort:
    """The update failed (``why``): agents abort it, its waiter gets ``why``, the lock is released."""

    why: str
