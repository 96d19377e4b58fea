"""The wire machinery under ``common.protocol``: message registration, encoding, typed decoding.

Wire format: one ZeroMQ frame holding a msgpack array ``[version, type, body]`` where ``body`` is
a map. ``decode`` checks the size limit, the msgpack encoding, the version, the type and every
field's type against the message's annotations; anything wrong raises a ``ProtocolError``
subclass whose text says what was wrong. The messages themselves are declared in
``common.protocol``, which is what the rest of the code imports.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from common.errors import MessageTooLarge, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 9
"""2: one message type per trainer request (was ``trainer_control``); ``BatchRefs`` refs in
``GroupRef`` order. 3: weight updates (``UpdateWeights`` ... ``WeightsReport``). 4: over-sampling
(``Stop``, coordinator -> agent) and ``Generate.deadline`` (partial batches). 5: ``Register.req``
(a resent Register gets the same session) and weight-update failures (``AbortWeights`` and
``WeightsAlive``, trainer -> coordinator; ``WeightsReport.members``, the engines an agent confirmed
for a broadcast group). 6: catch-up updates (``UpdateWeights.kind`` ``catch_up``,
``WeightsBegin.catch_up``, ``WeightsAbort.catch_up``). 7: ``Grant.leases`` are typed records
(``LeaseGrant``: the lease's prompt source, ``source``, instead of an ``eval`` key). 8: mixtures (``SetMixture``;
``LeaseGrant.dataset``, reward and filter per dataset). 9: trainer ranks
(``Attach.rank``/``world_size``/``run``, ``Generate.rank``, ``Consumed.rank``, ``BatchRefs.share``)."""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Application limit. Larger messages get a clear error reply. The ZeroMQ
socket limit (MAXMSGSIZE) is set above it so the peer is not silently cut."""

_REGISTRY: dict[str, type[Message]] = {}


def _typed(cls) -> None:
    """Compile ``cls``'s field checks once (decoding is the coordinator's per-message cost)."""
    hints = typing.get_type_hints(cls)
    cls._FIELDS = {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    }
    cls._NAMES = tuple(cls._FIELDS)
    cls._CHECKS = tuple((name, hint, required, _compile(hint)) for name, (hint, required) in cls._FIELDS.items())
    # Fields holding a list of records: decoded from maps into the record class, encoded back to maps.
    cls._RECORD_LISTS = {
        name: item
        for name, (hint, _) in cls._FIELDS.items()
        if typing.get_origin(hint) is list
        for item in typing.get_args(hint)
        if getattr(item, "_IS_RECORD", False)
    }


def message(cls):
    """Register a message dataclass under its ``TYPE``."""
    cls = dataclass(cls)
    if cls.TYPE in _REGISTRY:
        raise RuntimeError(f"duplicate message type {cls.TYPE}")
    _typed(cls)
    _REGISTRY[cls.TYPE] = cls
    return cls


def record(cls):
    """A typed record a message field carries as ``list[Record]``: on the wire a map whose fields are checked
    like a message's (unknown, missing or mistyped ones refused with the message's name)."""
    cls = dataclass(frozen=True)(cls)
    cls._IS_RECORD = True
    _typed(cls)
    return cls


class Message:
    TYPE: ClassVar[str] = ""
    _FIELDS: ClassVar[dict]
    _NAMES: ClassVar[tuple]
    _CHECKS: ClassVar[tuple]
    _RECORD_LISTS: ClassVar[dict]

    def to_body(self) -> dict:
        body = {name: getattr(self, name) for name in self._NAMES}
        for name in self._RECORD_LISTS:
            body[name] = [{k: getattr(r, k) for k in r._NAMES} for r in body[name]]
        return body


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _compile(hint: Any):
    """``_check(value, hint)`` as a one-argument predicate built once; None: any value passes."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return None
    if origin is typing.Union or str(origin) == "types.UnionType":
        subs = [_compile(h) for h in typing.get_args(hint)]
        if any(c is None for c in subs):
            return None
        return lambda v: any(c(v) for c in subs)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return _is_number
    if hint is int:
        return _is_int
    if getattr(hint, "_IS_RECORD", False):
        return lambda v: isinstance(v, dict)  # its fields are checked as it is decoded (``_decode_fields``)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        each = _compile(item)
        if each is None:
            return lambda v: isinstance(v, list)
        return lambda v: isinstance(v, list) and all(each(x) for x in v)
    if origin is dict:
        return lambda v: isinstance(v, dict)
    return lambda v: isinstance(v, hint)


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
    return cls(**_decode_fields(cls, body, mtype))


def _decode_fields(cls, body: dict, what: str) -> dict:
    unknown = set(body) - set(cls._FIELDS)
    if unknown:
        raise ProtocolError(f"malformed {what}: unknown field(s) {sorted(unknown)}")
    kwargs = {}
    for name, hint, required, check in cls._CHECKS:
        if name not in body:
            if required:
                raise ProtocolError(f"malformed {what}: missing field {name!r}")
            continue
        value = body[name]
        if check is not None and not check(value):
            raise ProtocolError(f"malformed {what}: field {name!r} has type {type(value).__name__}, expected {hint}")
        item = cls._RECORD_LISTS.get(name)
        if item is not None:
            value = [item(**_decode_fields(item, v, f"{what}.{name}[{i}]")) for i, v in enumerate(value)]
        kwargs[name] = value
    return kwargs


def peek_req(frame: bytes) -> int:
    """Best-effort request id of an undecodable frame, so an error reply can be correlated."""
    try:
        obj = msgpack.unpackb(frame, raw=False)
        req = obj[2].get("req", 0)
        return req if isinstance(req, int) and not isinstance(req, bool) else 0
    except Exception:
        return 0


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)
