"""The field checks ``decode`` compiles once per message type accept exactly what ``_check`` accepts."""

from __future__ import annotations

import enum
import random
import typing
from typing import Any

import pytest

from common import protocol as p
from common.errors import ProtocolError
from common.wire import Record, _check, _compile, _decode_fields, _fast_record, record

VALUES = [0, 1, -3, True, False, 1.5, "x", b"x", None, [], [1, 2], [1, "a"], [True], {}, {"a": 1}, [[1]], ({},)]
HINTS = [int, float, str, bytes, bool, list, dict, Any, list[int], list[str], list[dict], list, int | None, str | None]
HINTS += [p.EngineState, p.EngineInfo, list[p.EngineInfo], list[p.EngineInfo] | None, p.Failure | None, bool | None]
VALUES += ["healthy", "HEALTHY", ["healthy"], [{}], [{"name": "e0"}]]


@pytest.mark.parametrize("hint", HINTS, ids=str)
def test_compiled_check_agrees_with_check(hint):
    compiled = _compile(hint)
    for value in VALUES:
        assert (compiled is None or compiled(value)) == _check(value, hint), (hint, value)


def test_every_message_field_has_a_compiled_check_that_agrees():
    records = [p.EngineInfo, p.FleetWeights, p.Failure, p.EvalOutcome, p.LeaseGrant]
    for cls in [*p.message_types().values(), *records]:
        for name, hint, _required, check, _decode in cls._CHECKS:
            for value in VALUES:
                assert (check is None or check(value)) == _check(value, hint), (cls.__name__, name, value)


def test_decode_still_refuses_a_bool_for_an_int_and_a_list_of_the_wrong_items():
    good = p.encode(p.Heartbeat(1, {}, [1, 2], 2))
    assert p.decode(good) == p.Heartbeat(1, {}, [1, 2], 2)
    with pytest.raises(ProtocolError, match="session"):
        p.decode(p.encode(p.Heartbeat(True, {}, [], 0)))
    with pytest.raises(ProtocolError, match="leases"):
        p.decode(p.encode(p.Heartbeat(1, {}, ["a"], 0)))


def _records_on_the_wire() -> list[type]:
    """Every record class a message field can carry (alone, in a list, optional), found from the hints."""
    found, todo = [], [h for cls in p.message_types().values() for _n, h, *_ in cls._CHECKS]
    while todo:
        hint = todo.pop()
        todo += typing.get_args(hint)
        if getattr(hint, "_IS_RECORD", False) and hint not in found:
            found.append(hint)
            todo += [h for _n, h, *_ in hint._CHECKS]
    return found


_ODD = [None, True, False, 0, 7, -(2**40), 2.5, float("nan"), "", "x", b"x", [], {}, [1], {"k": 1}, "RED?"]


def _valid_values(hint) -> list:
    """Values a field of ``hint`` holds on the wire (the odd ones come from ``_ODD``)."""
    out = []
    for h in (hint, *typing.get_args(hint)):
        if h is type(None):
            out.append(None)
        elif h is str:
            out += ["", "x", "h\u00e9llo"]
        elif h is int:
            out += [0, 7, -(2**40), 2**63 - 1]
        elif h is float:
            out += [2.5, 0, -1, float("nan"), 1e300]
        elif h is bool:
            out += [True, False]
        elif isinstance(h, type) and issubclass(h, enum.Enum):
            out += [m.value for m in h]
    return out or _ODD


class _Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@record
class _EveryPlainField(Record):
    """Each kind of field ``_fast_record`` compiles, plain and optional, some with defaults."""

    s: str
    i: int
    f: float
    b: bool
    c: _Colour
    os: str | None
    oi: int | None
    of: float | None = None
    ob: bool | None = None
    oc: _Colour | None = None
    d: int = 3


@record
class _Checked(Record):
    """With a ``__post_init__``: the fast decoder must call the class, not fill its ``__dict__``."""

    n: int
    tag: str = ""

    def __post_init__(self):
        if self.n < 0:
            object.__setattr__(self, "tag", "negative")


def test_the_fast_record_decoder_agrees_with_the_checked_one_on_random_bodies():
    """A record of plain fields decodes through straight-line code (``_fast_record``) unless the body is odd; what
    it returns must be exactly what the checked path (``_decode_fields``) returns, and every body the checked path
    refuses it must hand back (None) for the error. 3,000 bodies a record, mostly valid, some with mistyped,
    missing or extra fields."""
    rng = random.Random(40)
    fast_records = [(cls, _fast_record(cls)) for cls in [*_records_on_the_wire(), _EveryPlainField, _Checked]]
    fast_records = [(cls, fast) for cls, fast in fast_records if fast is not None]
    assert {p.EngineInfo, p.Failure, _EveryPlainField, _Checked} <= {cls for cls, _ in fast_records}
    for cls, fast in fast_records:
        accepted = refused = 0
        pools = {name: _valid_values(hint) for name, hint, *_ in cls._CHECKS}
        for _ in range(3000):
            # Mostly valid fields, so that a body with one odd field (the case a slip would let through) is common.
            body = {name: rng.choice(pool if rng.random() < 0.9 else _ODD) for name, pool in pools.items()}
            for name in [n for n in body if rng.random() < 0.03]:
                del body[name]
            if rng.random() < 0.05:
                body["extra"] = 1
            try:
                checked = cls(**_decode_fields(cls, body, cls.__name__))
            except ProtocolError:
                checked = None
            made = fast(body)
            if checked is None:
                refused += 1
                assert made is None, (cls.__name__, body, made)
            elif made is not None:
                accepted += 1
                assert made == checked, (cls.__name__, body)
                for name in cls._NAMES:
                    a, b = getattr(made, name), getattr(checked, name)
                    assert type(a) is type(b) and (a == b or a != a), (cls.__name__, name, a, b)
        assert accepted > 100 and refused > 300, (cls.__name__, accepted, refused)
