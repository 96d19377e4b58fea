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
"""

from __future__ import annotations

from dataclasses import field

from common.grant_messages import EVAL_SOURCE, TRAIN_SOURCE, Grant, LeaseGrant  # noqa: F401  (re-exported)
from common.weight_messages import (  # noqa: F401  (re-exported: part of the protocol)
    AbortWeights,
    FinishWeights,
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
    engines: list
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
    """

    TYPE = "heartbeat"
    session: int
    stats: dict = field(default_factory=dict)
    leases: list[int] = field(default_factory=list)
    max_lease: int = 0


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

    ``result`` is ``{"rewards": [float], "lengths": [int], "truncated": int, "versions": [str]}``,
    one entry per sample; nothing is stored on the agent and no ack comes back."""

    TYPE = "eval_result"
    session: int
    lease: int
    name: str
    eval_pass: int
    index: int
    result: dict


@message
class Release(Message):
    """agent -> coordinator: leases given back unfinished (pause with abort, no engine, a failure).

    ``reason`` is free text, except for a lease whose group *failed*: then it is
    ``failed: <kind>: <detail>`` (see ``failure_reason``/``parse_failure``), and the
    coordinator counts the failure against the prompt and the rollout's health.
    """

    TYPE = "release"
    session: int
    leases: list[int]
    reason: str


STOPPED = "stopped: the batch was full (over-sampling)"
"""The ``Release`` reason of leases an agent gave back because the coordinator sent ``Stop`` for them."""


FAILURE_KINDS = ("reward_error", "filter_error", "generation_failed", "generate_error")
"""Why a group failed: its reward raised (or returned a non-number), its filter raised (or returned a
non-verdict), its custom generate function raised (or returned no trajectory), or anything else
(a prompt the engine rejects, a chat template that fails). These are also the reasons a prompt
that keeps failing is filtered with, so they are metric-name safe."""

MAX_FAILURE_DETAIL = 300
"""Characters of a failure's detail (spec and exception) kept on the wire: a message, not a log."""


def failure_reason(kind: str, detail: str) -> str:
    """What an agent puts after ``failed: `` in a ``Release`` for a failed group: ``<kind>: <detail>``."""
    if kind not in FAILURE_KINDS:
        raise ValueError(f"unknown failure kind {kind!r}; one of {FAILURE_KINDS}")
    detail = " ".join(str(detail).split())
    if len(detail) > MAX_FAILURE_DETAIL:
        detail = detail[: MAX_FAILURE_DETAIL - 3] + "..."
    return f"{kind}: {detail}"


def parse_failure(reason: str) -> tuple[str, str] | None:
    """``(kind, detail)`` of a ``Release`` reason for a failed group; None for any other release.

    A reason from an agent that does not tag its failures (``failed: <text>``) is a
    ``generation_failed`` with that text.
    """
    if not reason.startswith("failed"):
        return None
    rest = reason[len("failed") :].lstrip(":").strip()
    kind, sep, detail = rest.partition(": ")
    if not (sep and kind in FAILURE_KINDS):
        kind, detail = "generation_failed", rest
    return kind, detail[:MAX_FAILURE_DETAIL]


@message
class Capacity(Message):
    """agent -> coordinator: the agent's sample concurrency changed (engine lost or back)."""

    TYPE = "capacity"
    session: int
    capacity: int
    engines: list


# --------------------------------------------------------------------------
# Coordinator -> agent
# --------------------------------------------------------------------------


@message
class Welcome(Message):
    """coordinator -> agent: registration accepted; carries the rollout configuration."""

    TYPE = "welcome"
    session: int
    config: dict
    heartbeat_interval: float
    ttl: float
    acks: list
    """``[key, accepted]`` for each unacked receipt of the Register."""
    cancel: list[int]
    """Leases of ``in_flight`` the agent must drop (reissued meanwhile)."""
    paused: bool = False
    trainer_keys: list[str] = field(default_factory=list)
    """CurveZMQ public keys (Z85) the agent's payload endpoint accepts; empty when the fleet runs without keys."""


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

    The agent aborts their engine requests and answers with a ``Release`` (reason ``STOPPED``).
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


# --------------------------------------------------------------------------
# Trainer -> coordinator
# --------------------------------------------------------------------------


@message
class Attach(Message):
    """trainer -> coordinator: open a trainer session; fences any previous trainer."""

    TYPE = "attach"
    req: int
    client_id: str
    config_check: dict = field(default_factory=dict)
    rank: int = 0
    """This process's rank in a trainer of ``world_size`` processes: 0 leads (opens the session, fencing any
    other trainer); a rank above 0 joins the leader's session as a member (``no_leader`` if no leader is
    attached, ``other_leader`` if the one attached has another ``run`` or ``world_size``)."""
    world_size: int = 1
    run: str = ""
    """The launch the ranks belong to (torchrun's run id and restart count): members join only its leader."""
    balance: str = "tokens"
    """The leader's: shares of balanced tokens (``tokens``) or of equal group counts (``groups``)."""


@message
class Generate(Message):
    """trainer -> coordinator: the batch for ``rollout_id`` (same id, same batch)."""

    TYPE = "generate"
    session: int
    req: int
    rollout_id: int
    prefetch: int = -1
    deadline: float = 0.0
    """Seconds after the coordinator first got this ``generate`` at which it returns a partial batch
    of the groups ready (at least one); 0: none, wait for the full batch."""
    rank: int = 0
    """The asking rank: it gets its share of the batch (coordinator/shares.py)."""


@message
class BatchRefs(Message):
    """coordinator -> trainer: a batch as references to group payloads on agents.

    ``groups`` entries are ``[data_epoch, index, agent_id, key, payload_address]``
    (``coordinator.records.GroupRef`` in wire form).
    """

    TYPE = "batch"
    req: int
    rollout_id: int
    groups: list[list]
    metrics: dict
    share: dict = field(default_factory=dict)
    """For a trainer of several processes: ``{"rank", "world_size", "lengths"}``, ``groups`` being that rank's
    share and ``lengths`` every rank's sample lengths, one little-endian int32 array (bytes) per rank (None in a
    batch recorded without them); ``metrics`` are the whole batch's. Empty for a trainer of one process."""


@message
class Pause(Message):
    """trainer -> coordinator: stop admission (durably); ``abort`` in-flight work or let it finish.

    With ``drain`` the ``Ok`` comes once no lease is in flight (results durable).
    """

    TYPE = "pause"
    session: int
    req: int
    drain: bool = True
    abort: bool = False


@message
class Resume(Message):
    """trainer -> coordinator: admission on again (durably)."""

    TYPE = "resume"
    session: int
    req: int


@message
class SetMixture(Message):
    """trainer -> coordinator: the training datasets' weights from the next batch not yet recorded on (durably)."""

    TYPE = "set_mixture"
    session: int
    req: int
    weights: dict


@message
class StateDict(Message):
    """trainer -> coordinator: checkpoint the stream at ``consumed`` (highest batch trained on).

    Only while paused and drained; trims what is behind the previous checkpoint.
    """

    TYPE = "state_dict"
    session: int
    req: int
    consumed: int


@message
class LoadStateDict(Message):
    """trainer -> coordinator: check that a checkpoint taken by ``StateDict`` can be resumed here."""

    TYPE = "load_state_dict"
    session: int
    req: int
    state: dict


@message
class Consumed(Message):
    """trainer -> coordinator: batch ``rollout_id`` was fetched completely; its prompts count as trained."""

    TYPE = "consumed"
    session: int
    req: int
    rollout_id: int
    rank: int = 0
    """The rank that holds its share now: the batch is consumed once every rank does."""


@message
class Missing(Message):
    """trainer -> coordinator: an agent that is up no longer holds these groups of a batch; replace them."""

    TYPE = "missing"
    session: int
    req: int
    rollout_id: int
    keys: list[str]


@message
class Detach(Message):
    """trainer -> coordinator: leave the fleet to the next trainer (only the current session may)."""

    TYPE = "detach"
    session: int
    req: int


@message
class Stats(Message):
    """trainer (or ``coordinator status``) -> coordinator: the coordinator's statistics; needs no session."""

    TYPE = "stats"
    req: int


@message
class Evaluate(Message):
    """trainer -> coordinator: one pass over evaluation dataset ``name``; answered with its metrics when done.

    ``token`` names the call: a resend (or the same call after a restart) joins the same pass."""

    TYPE = "evaluate"
    session: int
    req: int
    name: str
    token: str


TRAINER_REQUESTS = (Pause, Resume, SetMixture, StateDict, LoadStateDict, Consumed, Missing, Detach)
"""Trainer requests that carry a session and are refused for any but the current trainer's."""


# --------------------------------------------------------------------------
# Trainer -> agent (data plane)
# --------------------------------------------------------------------------


@message
class Fetch(Message):
    """trainer -> agent: send these group payloads."""

    TYPE = "fetch"
    req: int
    keys: list[str]
    requester: str = ""
    """Who asks (the trainer's client id, with its rank): the agent's debug log of what it served to whom."""


@message
class Payloads(Message):
    """agent -> trainer: ``found`` keys, in order, followed by one raw frame per found key."""

    TYPE = "payloads"
    req: int
    found: list[str]
    missing: list[str]
