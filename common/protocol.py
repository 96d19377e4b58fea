"""The rollfleet wire protocol: every coordinator <-> agent <-> trainer message.

Wire format: one ZeroMQ frame holding a msgpack array ``[version, type, body]``
where ``body`` is a map. Bulk payload replies (agent -> trainer) append raw
frames after it so group bytes are never re-encoded.

Rules every receiver follows:
- ``decode`` checks the size limit, the msgpack encoding, the version, the
  type and every field's type; anything wrong raises a ``ProtocolError``
  subclass whose text says what was wrong. The receiver answers with an
  ``Error`` message and keeps serving; it never crashes on input.
- A message's type is declared exactly once below, with "sender -> receiver".
- Unknown fields are rejected: a field added to a message is a protocol change
  and bumps ``PROTOCOL_VERSION``.

Correlation: requests carry ``req`` (an int unique per sender process);
replies echo it. Every trainer request is idempotent by what it asks
(``generate`` by rollout id, ``pause``/``resume``/``consumed`` by the state
they set), so a resent request is harmless; a resent ``attach`` is recognised
by ``(client_id, req)`` and gets the same session, and a resent ``register`` by
``(agent_id, incarnation, req)`` gets the same session too (one registration per outage).

Typed vocabulary: what fields carry is declared as records and enums (``EngineInfo`` with its
``EngineState``, ``FleetWeights``, ``ReleaseReason`` and ``Failure``, ``EvalOutcome``, ``LeaseGrant``),
checked as the message is decoded; a map field (``stats``, ``config``, ``metrics``) is one the receiver
only passes on or shows. ``PROTOCOL_VERSION`` and its history are in common/wire.py.
"""

from __future__ import annotations

from dataclasses import field

from common.engine_info import EngineInfo, EngineState  # noqa: F401  (re-exported)
from common.grant_messages import EVAL_SOURCE, TRAIN_SOURCE, Grant, LeaseGrant  # noqa: F401  (re-exported)
from common.lease_outcomes import (  # noqa: F401  (re-exported: part of the protocol)
    FAILURE_KINDS,
    MAX_FAILURE_DETAIL,
    EvalOutcome,
    Failure,
    FailureKind,
    ReleaseReason,
)
from common.trainer_messages import (  # noqa: F401  (re-exported: part of the protocol)
    TRAINER_REQUESTS,
    Attach,
    BatchRefs,
    Consumed,
    Detach,
    Evaluate,
    Fetch,
    Generate,
    LoadStateDict,
    Missing,
    Pause,
    Payloads,
    Resume,
    SetMixture,
    StateDict,
    Stats,
)
from common.weight_messages import (  # noqa: F401  (re-exported: part of the protocol)
    AbortWeights,
    FinishWeights,
    FleetWeights,
    UpdateWeights,
    WeightBucket,
    WeightsAbort,
    WeightsAlive,
    WeightsBegin,
    WeightsBucket,
    WeightsFinish,
    WeightsFromDisk,
    WeightsInitGroup,
    WeightsReport,
)
from common.wire import (  # noqa: F401  (re-exported: the protocol's public surface)
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Message,
    Record,
    decode,
    encode,
    message,
    message_types,
    peek_req,
    record,
)

# --------------------------------------------------------------------------
# Both directions
# --------------------------------------------------------------------------


@message
class Error(Message):
    """any -> any: a request could not be served. ``code`` is machine-readable."""

    TYPE = "error"
    code: str
    message: str
    req: int = 0


@message
class Ok(Message):
    """coordinator -> trainer: a request without a payload succeeded."""

    TYPE = "ok"
    req: int
    result: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# Agent -> coordinator
# --------------------------------------------------------------------------


@message
class Register(Message):
    """agent -> coordinator: join (or re-join) the fleet.

    ``capacity`` is the agent's total engine concurrency in samples (the
    coordinator divides by samples per prompt). ``unacked`` are receipts of
    groups committed to the agent's store whose acknowledgement never
    arrived; ``in_flight`` are ``[lease, data_epoch, index]`` it still works on.
    ``req`` is the same for every resend of one registration attempt: the
    coordinator answers a resend with the session it already made for it.
    """

    TYPE = "register"
    agent_id: str
    incarnation: int
    capacity: int
    payload_address: str
    engines: list[EngineInfo]
    unacked: list
    in_flight: list
    dataset_fingerprint: str = ""
    dataset_size: int = -1
    stored: list[str] = field(default_factory=list)
    """Keys of every group in the agent's store: those no longer needed are trimmed."""
    req: int = 0
    """Registration attempt, unique per agent process; 0: none (every Register is a new attempt)."""


@message
class Heartbeat(Message):
    """agent -> coordinator and coordinator -> agent: liveness; any message also counts.

    From an agent it also lists the leases it works on, ``leases``, and the
    highest lease id it has seen granted, ``max_lease``: the coordinator
    releases leases it believes the agent holds that are <= ``max_lease`` and
    not listed (a lost Filtered/Release message must not leak capacity).
    From the coordinator it repairs a lost Grant or Control: ``max_lease`` is the
    highest lease granted to the agent's session, ``paused`` the trainer's pause.
    """

    TYPE = "heartbeat"
    session: int
    stats: dict = field(default_factory=dict)
    """The agent's counters (groups by outcome, samples, leases in flight, stored groups), shown in the status."""
    leases: list[int] = field(default_factory=list)
    max_lease: int = 0
    engines: list[EngineInfo] | None = None
    """The agent's engines now (states, tp, weight versions); None from the coordinator."""
    paused: bool | None = None
    """The coordinator's: admission is paused; None from an agent."""


@message
class Receipt(Message):
    """agent -> coordinator: an accepted group is durable in the agent's store."""

    TYPE = "receipt"
    session: int
    lease: int
    data_epoch: int
    index: int
    key: str
    n_samples: int
    stats: dict = field(default_factory=dict)


@message
class Filtered(Message):
    """agent -> coordinator: the dynamic filter rejected the group of a lease."""

    TYPE = "filtered"
    session: int
    lease: int
    data_epoch: int
    index: int
    reason: str
    stats: dict = field(default_factory=dict)


@message
class EvalResult(Message):
    """agent -> coordinator: one evaluation prompt's group was generated and scored (coordinator/evaluation.py).

    Nothing is stored on the agent and no ack comes back."""

    TYPE = "eval_result"
    session: int
    lease: int
    name: str
    eval_pass: int
    index: int
    result: EvalOutcome


@message
class Release(Message):
    """agent -> coordinator: leases given back unfinished (a pause, a Stop, no engine left, a failure).

    ``failure`` comes with reason ``failed`` and only then: the coordinator counts it against the
    prompt and the rollout's health.
    """

    TYPE = "release"
    session: int
    leases: list[int]
    reason: ReleaseReason
    failure: Failure | None = None

    def problem(self) -> str:
        if (self.reason is ReleaseReason.FAILED) != (self.failure is not None):
            return f"reason {self.reason.value!r} with failure {self.failure!r}: a failure comes with 'failed' only"
        return ""


@message
class Capacity(Message):
    """agent -> coordinator: the agent's sample concurrency changed (engine lost or back)."""

    TYPE = "capacity"
    session: int
    capacity: int
    engines: list[EngineInfo]


# --------------------------------------------------------------------------
# Coordinator -> agent
# --------------------------------------------------------------------------


@message
class Welcome(Message):
    """coordinator -> agent: registration accepted; carries the rollout configuration and the fleet's weights."""

    TYPE = "welcome"
    session: int
    config: dict
    """``RolloutConfig.to_dict()``."""
    heartbeat_interval: float
    ttl: float
    acks: list
    """``[key, accepted]`` for each unacked receipt of the Register."""
    cancel: list[int]
    """Leases of ``in_flight`` the agent must drop (reissued meanwhile)."""
    paused: bool = False
    trainer_keys: list[str] = field(default_factory=list)
    """CurveZMQ public keys (Z85) the agent's payload endpoint accepts; empty when the fleet runs without keys."""
    weights: FleetWeights | None = None
    """The weights every engine must serve (the coordinator always names them; None: keep what the agent holds)."""


@message
class ReceiptAck(Message):
    """coordinator -> agent: the ledger recorded (``accepted``) or refused a receipt; refused groups are deleted."""

    TYPE = "receipt_ack"
    lease: int
    key: str
    accepted: bool
    reason: str = ""


@message
class Control(Message):
    """coordinator -> agent: ``pause`` (``abort`` in-flight work or let it finish) or ``resume``. Over-sampled
    leases are stopped by their own message, ``Stop``."""

    TYPE = "control"
    action: str
    abort: bool = False


@message
class Stop(Message):
    """coordinator -> agent: over-sampled leases no batch needs now; abort them and give them back.

    The agent aborts their engine requests and answers with a ``Release`` (reason ``stopped``).
    A lease it no longer holds, or one already past generation, is left alone (its Receipt or
    Filtered answers for it); a paused agent ignores the message. Losing it loses nothing: the
    groups simply complete.
    """

    TYPE = "stop"
    session: int
    leases: list[int]


@message
class Trim(Message):
    """coordinator -> agent: delete these group payloads; no trainer can ask for them again."""

    TYPE = "trim"
    keys: list[str]


@message
class Fence(Message):
    """coordinator -> agent: your session is unknown or superseded; register again."""

    TYPE = "fence"
    reason: str
