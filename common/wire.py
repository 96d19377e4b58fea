"""The wire machinery under ``common.protocol``: message registration, encoding, typed decoding.

Wire format: one ZeroMQ frame holding a msgpack array ``[version, type, body]`` where ``body`` is
a map. ``decode`` checks the size limit, the msgpack encoding, the version, the type and every
field's type against the message's annotations; anything wrong raises a ``ProtocolError``
subclass whose text says what was wrong. The messages themselves are declared in
``common.protocol``, which is what the rest of the code imports.

Field types a message (or a record) may declare, besides the plain msgpack ones: a ``Record``
(a map on the wire, its fields checked like a message's), a list of records, an ``enum.Enum`` of
strings (its value on the wire; any other string is refused naming the allowed ones), and either
of those or ``None``. ``decode`` builds the records and enum members, ``encode`` writes their
plain forms; a message's ``problem()`` then judges the fields together (a ``Release`` that says
``failed`` carries its failure).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from common.errors import MessageTooLarge, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 10
"""2: one message type per trainer request (was ``trainer_control``); ``BatchRefs`` refs in
``GroupRef`` order. 3: weight updates (``UpdateWeights`` ... ``WeightsReport``). 4: over-sampling
(``Stop``, coordinator -> agent) and ``Generate.deadline`` (partial batches). 5: ``Register.req``
(a resent Register gets the same session) and weight-update failures (``AbortWeights`` and
``WeightsAlive``, trainer -> coordinator; ``WeightsReport.members``, the engines an agent confirmed
for a broadcast group). 6: catch-up updates (``UpdateWeights.kind`` ``catch_up``,
``WeightsBegin.catch_up``, ``WeightsAbort.catch_up``). 7: ``Grant.leases`` are typed records
(``LeaseGrant``: the lease's prompt source, ``source``, instead of an ``eval`` key). 8: mixtures (``SetMixture``;
``LeaseGrant.dataset``, reward and filter per dataset). 9: trainer ranks
(``Attach.rank``/``world_size``/``run``/``balance``, ``Generate.rank``, ``Consumed.rank``, ``BatchRefs.share``
with every rank's sample lengths as int32 bytes; ``no_leader``/``other_leader`` error codes). 10: a typed
vocabulary: engines are ``EngineInfo`` records with an ``EngineState`` in ``Register``, ``Capacity`` and the
agent's ``Heartbeat.engines`` (were maps, the heartbeat's inside ``stats``); the fleet's weights are
``Welcome.weights`` (a ``FleetWeights``, was ``config["weights"]``); the coordinator's ``Heartbeat`` has typed
``paused`` and ``max_lease`` (were ``stats`` keys); ``Release.reason`` is a ``ReleaseReason`` with a typed
``Release.failure`` (was free text, ``failed: <kind>: <detail>``); ``EvalResult.result`` is an ``EvalOutcome``."""

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Application limit. Larger messages get a clear error reply. The ZeroMQ
socket limit (MAXMSGSIZE) is set above it so the peer is not silently cut."""

_REGISTRY: dict[str, type[Message]] = {}
_UNIONS = (typing.Union, types.UnionType)


class _Typed:
    """Fields compiled once per class (decoding is the coordinator's per-message cost)."""

    _FIELDS: ClassVar[dict]
    _NAMES: ClassVar[tuple]
    _CHECKS: ClassVar[tuple]
    """``(name, hint, required, check, decode)``: ``check`` None passes any value; ``decode`` None keeps it."""
    _ENCODERS: ClassVar[tuple]
    """``(name, encode)`` of the fields whose value is not its own wire form (records, enums)."""

    def to_body(self) -> dict:
        body = {name: getattr(self, name) for name in self._NAMES}
        for name, enc in self._ENCODERS:
            body[name] = enc(body[name])
        return body


def _typed(cls) -> None:
    hints = typing.get_type_hints(cls)
    cls._FIELDS = {
        f.name: (hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    }
    cls._NAMES = tuple(cls._FIELDS)
    codecs = {name: _codec(hint) for name, (hint, _) in cls._FIELDS.items()}
    cls._CHECKS = tuple(
        (name, hint, required, _compile(hint), codecs[name][1] if codecs[name] else None)
        for name, (hint, required) in cls._FIELDS.items()
    )
    cls._ENCODERS = tuple((name, codec[0]) for name, codec in codecs.items() if codec is not None)


def message(cls):
    """Register a message dataclass under its ``TYPE``."""
    cls = dataclass(cls)
    if cls.TYPE in _REGISTRY:
        raise RuntimeError(f"duplicate message type {cls.TYPE}")
    _typed(cls)
    _REGISTRY[cls.TYPE] = cls
    return cls


def record(cls):
    """A typed record a message field carries (alone, in a list, or ``| None``): on the wire a map whose fields
    are checked like a message's (unknown, missing or mistyped ones refused with the message's name)."""
    if not issubclass(cls, Record):
        raise TypeError(f"record {cls.__name__} must subclass common.wire.Record")
    cls = dataclass(frozen=True)(cls)
    _typed(cls)
    return cls


class Record(_Typed):
    """Base of the records ``record`` declares: immutable, compared by value, ``to_body()`` their wire map."""

    _IS_RECORD: ClassVar[bool] = True


class Message(_Typed):
    TYPE: ClassVar[str] = ""

    def problem(self) -> str:
        """What is wrong with the fields taken together ("" if nothing): ``decode`` refuses the message with it."""
        return ""


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _enum_values(hint: type[enum.Enum]) -> frozenset:
    values = frozenset(m.value for m in hint)
    if not all(isinstance(v, str) for v in values):
        raise TypeError(f"{hint.__name__}: only enums of strings travel on the wire")
    return values


def _check(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in _UNIONS:
        return any(_check(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if getattr(hint, "_IS_RECORD", False):
        return isinstance(value, dict)
    if _is_enum(hint):
        return isinstance(value, str) and value in _enum_values(hint)
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
    if origin in _UNIONS:
        subs = [_compile(h) for h in typing.get_args(hint)]
        if any(c is None for c in subs):
            return None
        others = [c for h, c in zip(typing.get_args(hint), subs, strict=True) if h is not type(None)]
        if len(others) == 1 and len(subs) == 2:  # ``X | None``, the common case: no generator per value
            (one,) = others
            return lambda v: v is None or one(v)
        return lambda v: any(c(v) for c in subs)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return _is_number
    if hint is int:
        return _is_int
    if getattr(hint, "_IS_RECORD", False):
        return lambda v: isinstance(v, dict)  # its fields are checked as it is decoded (``_decode_fields``)
    if _is_enum(hint):
        values = _enum_values(hint)
        return lambda v: isinstance(v, str) and v in values
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        each = _compile(item)
        if each is None:
            return lambda v: isinstance(v, list)
        return lambda v: isinstance(v, list) and all(each(x) for x in v)
    if origin is dict:
        return lambda v: isinstance(v, dict)
    return lambda v: isinstance(v, hint)


def _codec(hint: Any):
    """``(encode, decode)`` for a field whose value is not its own wire form (a record, an enum, a list or an
    optional one of those), or None. ``decode(value, what)`` takes a value that passed the field's check;
    ``what`` names the field in errors."""
    origin = typing.get_origin(hint)
    if getattr(hint, "_IS_RECORD", False):
        fast = _fast_record(hint)
        if fast is None:
            return (lambda r: r.to_body()), (lambda v, what: hint(**_decode_fields(hint, v, what)))

        def decode_record(v, what):
            made = fast(v)  # None unless every field is there and plain: then the checked path says what is wrong
            return made if made is not None else hint(**_decode_fields(hint, v, what))

        return (lambda r: r.to_body()), decode_record
    if _is_enum(hint):
        members = {m.value: m for m in hint}  # the value passed the field's check: one dict lookup, not hint(v)
        return (lambda m: m.value if isinstance(m, enum.Enum) else m), (lambda v, what: members[v])
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        inner = _codec(item)
        if inner is None:
            return None
        enc, dec = inner
        decode_each = lambda vs, what: [dec(v, (what, "[", i, "]")) for i, v in enumerate(vs)]  # noqa: E731
        return (lambda xs: [enc(x) for x in xs]), decode_each
    if origin in _UNIONS:
        args = [h for h in typing.get_args(hint) if h is not type(None)]
        inner = _codec(args[0]) if len(args) == 1 else None
        if inner is None:
            return None
        enc, dec = inner
        return (lambda x: None if x is None else enc(x)), (lambda v, what: None if v is None else dec(v, what))
    return None


def _fast_record(cls):
    """A decoder for a record whose fields are all plain (str, int, float, bool, a str enum, or one of those or
    None), built once as straight-line code: ``fast(body)`` is the record when ``body`` holds exactly its fields,
    each of its type, else None (the checked path, ``_decode_fields``, then refuses it naming what is wrong).
    Records ride in every heartbeat (an agent's engines), so their decoding is on the control plane's hot path.
    None where some field is not plain."""
    env: dict[str, Any] = {"cls": cls}
    names, conds, args = [], [], []
    for i, (name, hint, _required, _check, _dec) in enumerate(cls._CHECKS):
        var = f"v{i}"
        optional = typing.get_origin(hint) in _UNIONS and type(None) in typing.get_args(hint)
        inner = [h for h in typing.get_args(hint) if h is not type(None)] if optional else [hint]
        if len(inner) != 1:
            return None
        (base,) = inner
        if base is str or base is int or base is bool:
            cond, expr = f"type({var}) is {base.__name__}", var
        elif base is float:
            cond, expr = f"type({var}) in (int, float)", var
        elif _is_enum(base):
            env[f"m{i}"] = {m.value: m for m in base}
            cond, expr = f"type({var}) is str and {var} in m{i}", f"m{i}[{var}]"
        else:
            return None
        if optional:
            cond, expr = f"({var} is None or {cond})", f"(None if {var} is None else {expr})"
        names.append(f"{var} = body[{name!r}]")
        conds.append(cond)
        args.append(f"{name}={expr}")
    src = (
        "def fast(body):\n"
        f"    if len(body) != {len(names)}:\n        return None\n"
        "    try:\n" + "".join(f"        {line}\n" for line in names) + "    except KeyError:\n        return None\n"
        f"    if not ({' and '.join(conds) or 'True'}):\n        return None\n"
        + (
            f"    return cls({', '.join(args)})\n"
            if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__")
            # A frozen dataclass's __init__ sets each field through object.__setattr__; its __dict__ is the same
            # state, filled at once (no __post_init__ to run).
            else f"    made = new(cls)\n    made.__dict__.update({', '.join(args)})\n    return made\n"
        )
    )
    env["new"] = object.__new__
    exec(src, env)  # noqa: S102 -- code built above from the record's own field names and types only
    return env["fast"]


def _expected(value: Any, hint: Any) -> str:
    """How a refused field is described: its type against the hint, or the values an enum allows."""
    for h in (hint, *typing.get_args(hint)):
        if _is_enum(h) and isinstance(value, str):
            return f"is {value!r}, expected one of {sorted(_enum_values(h))}"
    return f"has type {type(value).__name__}, expected {hint}"


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
    msg = cls(**_decode_fields(cls, body, mtype))
    why = msg.problem()
    if why:
        raise ProtocolError(f"malformed {mtype}: {why}")
    return msg


def _decode_fields(cls, body: dict, what) -> dict:
    """``body``'s fields, checked and decoded, as ``cls``'s keyword arguments. ``what`` names the message or the
    field holding this record, a string or a path of pieces (``_named``) joined only for an error's text."""
    unknown = body.keys() - cls._FIELDS.keys()
    if unknown:
        raise ProtocolError(f"malformed {_named(what)}: unknown field(s) {sorted(unknown)}")
    kwargs = {}
    for name, hint, required, check, dec in cls._CHECKS:
        if name not in body:
            if required:
                raise ProtocolError(f"malformed {_named(what)}: missing field {name!r}")
            continue
        value = body[name]
        if check is not None and not check(value):
            raise ProtocolError(f"malformed {_named(what)}: field {name!r} {_expected(value, hint)}")
        kwargs[name] = value if dec is None else dec(value, (what, ".", name))
    return kwargs


def _named(what) -> str:
    """A field's path as errors print it (``Heartbeat.engines[2].state``), from the pieces decoding passed down."""
    if isinstance(what, tuple):
        return "".join(_named(piece) for piece in what)
    return str(what)


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
