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
by ``(client_id, req)`` and gets the same session.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from common.errors import MessageTooLarge, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 2
"""2: one message type per trainer request (was ``trainer_control``); ``BatchRefs`` refs in
``GroupRef`` order."""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Application limit. Larger messages get a clear error reply. The ZeroMQ
socket limit (MAXMSGSIZE) is set above it so the peer is not silently cut."""

_REGISTRY: dict[str, type["Message"]] = {}


def message(cls):
    """Register a message dataclass under its ``TYPE``."""
    cls = dataclass(cls)
    if cls.TYPE in _REGISTRY:
        raise RuntimeError(f"duplicate message type {cls.TYPE}")
    hints = typing.get_type_hints(cls)
    cls._FIELDS = {f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls)}
    _REGISTRY[cls.TYPE] = cls
    return cls


class Message:
    TYPE: ClassVar[str] = ""
    _FIELDS: ClassVar[dict]

    def to_body(self) -> dict:
        return {name: getattr(self, name) for name in self._FIELDS}


def _check(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is typing.Union or str(origin) == "types.UnionType":
        return any(_check(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        if not isinstance(value, list):
            return False
        (item,) = typing.get_args(hint) or (Any,)
        return item is Any or all(_check(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint in (list, dict, str, bytes, bool):
        return isinstance(value, hint)
    return isinstance(value, hint)


def encode(msg: Message, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, msg.TYPE, msg.to_body()], use_bin_type=True)


def decode(frame: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode one frame into its message, or raise a ProtocolError saying why."""
    if len(frame) > max_bytes:
        raise MessageTooLarge(f"message of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"malformed message: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise ProtocolError("malformed message: expected a msgpack array [version, type, body]")
    version, mtype, body = obj
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError(f"malformed message: version must be an integer, got {version!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version {version} is not supported (this side speaks version {PROTOCOL_VERSION}); "
            "upgrade rollfleet so coordinator, agents and trainers match"
        )
    cls = _REGISTRY.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {mtype!r}")
    if not isinstance(body, dict):
        raise ProtocolError(f"malformed {mtype}: body must be a map")
    unknown = set(body) - set(cls._FIELDS)
    if unknown:
        raise ProtocolError(f"malformed {mtype}: unknown field(s) {sorted(unknown)}")
    kwargs = {}
    for name, (hint, required) in cls._FIELDS.items():
        if name not in body:
            if required:
                raise ProtocolError(f"malformed {mtype}: missing field {name!r}")
            continue
        value = body[name]
        if not _check(value, hint):
            raise ProtocolError(f"malformed {mtype}: field {name!r} has type {type(value).__name__}, expected {hint}")
        kwargs[name] = value
    return cls(**kwargs)


def peek_req(frame: bytes) -> int:
    """Best-effort request id of an undecodable frame, so an error reply can be correlated."""
    try:
        obj = msgpack.unpackb(frame, raw=False)
        req = obj[2].get("req", 0)
        return req if isinstance(req, int) and not isinstance(req, bool) else 0
    except Exception:
        return 0


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
class Release(Message):
    """agent -> coordinator: leases given back unfinished (pause with abort, no engine)."""

    TYPE = "release"
    session: int
    leases: list[int]
    reason: str


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


@message
class Grant(Message):
    """coordinator -> agent: new leases, each ``{lease, data_epoch, index, rollout_id, prompt, label, metadata}``."""

    TYPE = "grant"
    session: int
    leases: list[dict]


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
    """coordinator -> agent: ``pause`` (``abort`` in-flight work or let it finish), ``resume`` or ``stop``."""

    TYPE = "control"
    action: str
    abort: bool = False


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


@message
class Generate(Message):
    """trainer -> coordinator: the batch for ``rollout_id`` (same id, same batch)."""

    TYPE = "generate"
    session: int
    req: int
    rollout_id: int
    prefetch: int = -1


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


TRAINER_REQUESTS = (Pause, Resume, StateDict, LoadStateDict, Consumed, Missing, Detach)
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


@message
class Payloads(Message):
    """agent -> trainer: ``found`` keys, in order, followed by one raw frame per found key."""

    TYPE = "payloads"
    req: int
    found: list[str]
    missing: list[str]


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)
