"""The field checks ``decode`` compiles once per message type accept exactly what ``_check`` accepts."""

from __future__ import annotations

from typing import Any

import pytest

from common import protocol as p
from common.errors import ProtocolError
from common.wire import _check, _compile

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
