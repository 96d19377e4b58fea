"""The wire protocol: typed decoding, clear errors."""

import re

import msgpack
import pytest

from common import protocol as p
from common.errors import MessageTooLarge, ProtocolError, VersionMismatch
from common.types import Group, Sample
from coordinator.records import GroupRef

V = p.PROTOCOL_VERSION


def test_round_trip_every_field():
    msg = p.Receipt(session=5, lease=7, data_epoch=1, index=42, key="1:42:7", n_samples=8, stats={"reward_sum": 3.0})
    assert p.decode(p.encode(msg)) == msg


def test_defaults_may_be_omitted_on_the_wire():
    frame = msgpack.packb([p.PROTOCOL_VERSION, "heartbeat", {"session": 3}])
    assert p.decode(frame) == p.Heartbeat(3)


@pytest.mark.parametrize(
    "frame, error, text",
    [
        (b"\xc1", ProtocolError, "not valid msgpack"),
        (msgpack.packb({"a": 1}), ProtocolError, "expected a msgpack array"),
        (msgpack.packb([99, "heartbeat", {"session": 1}]), VersionMismatch, "protocol version 99"),
        (
            msgpack.packb([V, "trainer_control", {"session": 1, "req": 2, "action": "pause"}]),
            ProtocolError,
            "unknown message type",
        ),
        (msgpack.packb([V, "pause", {"session": 1, "req": 2, "drain": "yes"}]), ProtocolError, "field 'drain'"),
        (msgpack.packb([V, "consumed", {"session": 1, "req": 2}]), ProtocolError, "missing field 'rollout_id'"),
        (
            msgpack.packb([V, "missing", {"session": 1, "req": 2, "rollout_id": 0, "keys": [3]}]),
            ProtocolError,
            "field 'keys'",
        ),
        (
            msgpack.packb([V, "detach", {"session": 1, "req": 2, "force": True}]),
            ProtocolError,
            "unknown field(s) ['force']",
        ),
        (msgpack.packb([V, "nope", {}]), ProtocolError, "unknown message type 'nope'"),
        (msgpack.packb([V, "heartbeat", {}]), ProtocolError, "missing field 'session'"),
        (msgpack.packb([V, "heartbeat", {"session": "x"}]), ProtocolError, "field 'session' has type str"),
        (msgpack.packb([V, "heartbeat", {"session": True}]), ProtocolError, "field 'session'"),
        (msgpack.packb([V, "heartbeat", {"session": 1, "extra": 2}]), ProtocolError, "unknown field(s) ['extra']"),
        (
            msgpack.packb([V, "release", {"session": 1, "leases": [1, "a"], "reason": ""}]),
            ProtocolError,
            "field 'leases'",
        ),
    ],
)
def test_bad_frames_raise_clear_errors(frame, error, text):
    with pytest.raises(error) as info:
        p.decode(frame)
    assert text in str(info.value)


@pytest.mark.parametrize(
    "msg",
    [
        p.Pause(1, 2, drain=False, abort=True),
        p.Resume(1, 2),
        p.StateDict(1, 2, consumed=5),
        p.LoadStateDict(1, 2, {"format": 1, "rollout_id": 3}),
        p.Consumed(1, 2, rollout_id=4),
        p.Missing(1, 2, rollout_id=4, keys=["0:1:a"]),
        p.Detach(1, 2),
        p.Stats(2),
    ],
)
def test_each_trainer_request_is_its_own_typed_message(msg):
    assert p.decode(p.encode(msg)) == msg
    assert type(msg) in p.TRAINER_REQUESTS or isinstance(msg, p.Stats)


def test_batch_refs_carry_group_refs_in_their_one_field_order():
    ref = GroupRef(data_epoch=1, index=42, agent_id="n1", key="1:42:7", payload_address="tcp://n1:7000")
    back = p.decode(p.encode(p.BatchRefs(3, 0, [ref.to_wire()], {})))
    assert [GroupRef.from_wire(g) for g in back.groups] == [ref]


def test_oversized_frame_is_refused_before_decoding():
    with pytest.raises(MessageTooLarge, match="exceeds the limit of 100 bytes"):
        p.decode(b"x" * 101, max_bytes=100)


def test_every_message_type_is_declared_once_with_its_direction():
    types = p.message_types()
    assert len(types) == len(set(types))
    for name, cls in types.items():
        assert "->" in (cls.__doc__ or ""), f"{name} lacks its 'sender -> receiver' line"


def test_group_payload_round_trip_keeps_exact_logprobs():
    s = Sample(
        [1, 2],
        [3, 4, 5],
        [-0.1, -1e-9, -12.123456789],
        [1, 1, 0],
        1.0,
        "truncated",
        "v3",
        label=7,
        metadata={"k": "v"},
        response_text="abc",
        weight_versions=[["v2", 0, 1], ["v3", 1, 3]],
    )
    g = Group(index=9, samples=[s, s], data_epoch=2, rollout_id=4, label=7, agent_id="n1", gen_seconds=0.5)
    back = Group.from_wire(g.to_wire())
    assert back == g
    assert back.samples[0].response_logprobs.tolist() == [-0.1, -1e-9, -12.123456789]


def test_a_grant_carries_typed_lease_records_and_a_malformed_one_is_refused_naming_it():
    grant = p.Grant(
        3,
        [
            p.LeaseGrant(1, 0, 5, 2, prompt="1+1", label=2),
            p.LeaseGrant(2, -1, 3, 2, source="eval/math", eval_pass=1, n_samples=2, sampling={"temperature": 0.0}),
        ],
    )
    back = p.decode(p.encode(grant))
    assert back == grant and back.leases[0].eval == "" and back.leases[1].eval == "math"
    for lease, why in (
        ({"lease": 1, "data_epoch": 0, "index": "5", "rollout_id": 0}, "grant.leases[0]: field 'index' has type str"),
        ({"lease": 1, "data_epoch": 0, "index": 5}, "grant.leases[0]: missing field 'rollout_id'"),
        ({"lease": 1, "data_epoch": 0, "index": 5, "rollout_id": 0, "eval": "m"}, "unknown field(s) ['eval']"),
        (7, "grant: field 'leases' has type list"),
    ):
        frame = msgpack.packb([p.PROTOCOL_VERSION, "grant", {"session": 3, "leases": [lease]}])
        with pytest.raises(ProtocolError, match=re.escape(why)):
            p.decode(frame)


FULL = {"name": "e0", "state": "healthy", "url": "http://e0", "in_flight": 0, "tp": 1, "version": None}
"""An engine entry with every field, as agents send it."""


def test_the_vocabulary_travels_typed_and_a_malformed_entry_is_refused_naming_it():
    engines = [p.EngineInfo("e0", p.EngineState.STALE, "http://e0", 3, 2, 7), p.EngineInfo("e1", "retired")]
    for msg in (
        p.Register("a", 1, 8, "tcp://a:1", engines, [], []),
        p.Capacity(5, 8, engines),
        p.Heartbeat(5, {"in_flight": 1}, [1], 1, engines),
        p.Heartbeat(5, max_lease=9, paused=True),
        p.Welcome(5, {}, 1.0, 5.0, [], [], weights=p.FleetWeights(3, "disk", "/ckpt/3")),
        p.Release(5, [1], p.ReleaseReason.STOPPED),
        p.EvalResult(5, 1, "math", 0, 2, p.EvalOutcome([1.0, 0], [3, 4], 1, ["3"])),
    ):
        back = p.decode(p.encode(msg))
        assert back == msg and type(back.to_body()) is dict
    back = p.decode(p.encode(p.Capacity(5, 8, engines)))
    assert back.engines[1].state is p.EngineState.RETIRED and back.engines[0].to_dict()["state"] == "stale"
    register = p.Register("a", 1, 8, "tcp://a:1", [], [], []).to_body()
    for entry, why in (
        ({"name": "e0", "state": "up"}, "register.engines[0]: field 'state' is 'up', expected one of"),
        ({"name": "e0"}, "register.engines[0]: missing field 'state'"),
        ({"name": "e0", "state": "healthy", "tp": "2"}, "register.engines[0]: field 'tp' has type str"),
        ("e0", "register: field 'engines' has type list"),
        # Every field there, one wrong: the fast decoder of plain records declines, the checked path names it.
        ({**FULL, "state": "up"}, "register.engines[0]: field 'state' is 'up', expected one of"),
        ({**FULL, "tp": True}, "register.engines[0]: field 'tp' has type bool"),
        ({**FULL, "version": "3"}, "register.engines[0]: field 'version' has type str"),
        ({**FULL, "in_flight": 1.5}, "register.engines[0]: field 'in_flight' has type float"),
        ({**{k: v for k, v in FULL.items() if k != "url"}, "host": "e0"}, "register.engines[0]: unknown field(s)"),
    ):
        frame = msgpack.packb([V, "register", {**register, "engines": [entry]}])
        with pytest.raises(ProtocolError, match=re.escape(why)):
            p.decode(frame)
    with pytest.raises(ProtocolError, match=re.escape("field 'reason' is 'aborted by pause', expected one of")):
        p.decode(msgpack.packb([V, "release", {"session": 1, "leases": [1], "reason": "aborted by pause"}]))
