"""The weight lock's transition table (coordinator/weight_lock.py), walked row by row: pure, no core.

Each phase is reached through the table itself from NEW (``ROUTES``); every row of ``TABLE`` is then
taken from a fresh update in its phase, and every event a phase has no row for is refused.
"""

from __future__ import annotations

import pytest

from common import protocol as p
from common.weight_step import WeightKind, WeightStep
from coordinator import weight_events as ev
from coordinator.weight_lock import LIVE, SHOWN, TABLE, Phase, UnexpectedEvent, Update, formation, lost, transition

UID = 0x1_0000_0007
TRAINER = b"trainer"
MEMBERS = {"a": {"a/e0": 1}, "b": {"b/e0": 2}}
REQUEST = p.UpdateWeights(5, 10, 4, "distributed", "", "127.0.0.1", 2900, "gloo", 30.0)

_BEGUN = [ev.BeginBroadcast(TRAINER, REQUEST, ("a", "b"))]
_CONFIRMED = [*_BEGUN, *[ev.Reported(a, WeightStep.BEGIN, members=["e0"]) for a in MEMBERS]]
_INIT = [*_CONFIRMED, ev.GroupNew(MEMBERS, 3, "rollfleet-7")]
_BUCKET = [*_INIT, ev.Bucket(TRAINER, p.WeightBucket(5, 11, UID, 0, ["w"], ["float32"], [[2]]), 1.0)]
_FINISH_ASKED = ev.FinishAsked(TRAINER, p.FinishWeights(5, 12, UID), 2.0)
_REPORTED = [ev.Reported(a, WeightStep.INIT) for a in MEMBERS] + [ev.Reported(a, WeightStep.BUCKET) for a in MEMBERS]
_DISK = [ev.BeginDisk(TRAINER, 10, ("a", "b"))]

ROUTES: dict[Phase, tuple[WeightKind, list]] = {
    Phase.NEW: (WeightKind.DISTRIBUTED, []),
    Phase.DISK: (WeightKind.DISK, _DISK),
    Phase.BEGIN: (WeightKind.DISTRIBUTED, _BEGUN),
    Phase.GROUP: (WeightKind.DISTRIBUTED, [*_CONFIRMED, ev.GroupKept(MEMBERS, 3, "rollfleet-6")]),
    Phase.INIT: (WeightKind.DISTRIBUTED, _INIT),
    Phase.BUCKET: (WeightKind.DISTRIBUTED, _BUCKET),
    Phase.GROUP_FINISHING: (WeightKind.DISTRIBUTED, [*_CONFIRMED, ev.GroupKept(MEMBERS, 3, "g"), _FINISH_ASKED]),
    Phase.INIT_FINISHING: (WeightKind.DISTRIBUTED, [*_INIT, _FINISH_ASKED]),
    Phase.BUCKET_FINISHING: (WeightKind.DISTRIBUTED, [*_BUCKET, _FINISH_ASKED]),
    Phase.FINISH: (WeightKind.DISTRIBUTED, [*_BUCKET, _FINISH_ASKED, *_REPORTED, ev.Settled(("a", "b", "c"))]),
    Phase.DONE: (WeightKind.DISK, [*_DISK, *[ev.Reported(a, WeightStep.DISK) for a in "ab"], ev.Settled()]),
    Phase.ABORTED: (WeightKind.DISK, [*_DISK, ev.DeadlinePassed()]),
}
"""How each phase is reached from NEW, through the table."""


def update(kind: WeightKind = WeightKind.DISTRIBUTED) -> Update:
    return Update(UID, kind, 4, "/ckpt" if kind is WeightKind.DISK else "", 5, "t", 30.0, 30.0)


def at(phase: Phase) -> Update:
    """A fresh update brought to ``phase`` through the table."""
    kind, route = ROUTES[phase]
    u = update(kind)
    for event in route:
        transition(u, event)
    assert u.phase is phase
    return u


def example(event_type: type, u: Update):
    """One event of ``event_type`` for ``u``, as the weights role would make it."""
    return {
        ev.BeginDisk: lambda: ev.BeginDisk(TRAINER, 10, ("a", "b")),
        ev.BeginBroadcast: lambda: ev.BeginBroadcast(TRAINER, REQUEST, ("a", "b")),
        ev.UpdateResent: lambda: ev.UpdateResent(b"again", 10, 3.0),
        ev.Bucket: lambda: ev.Bucket(TRAINER, p.WeightBucket(5, 13, UID, 1, ["v"], ["float32"], [[1]]), 3.0),
        ev.FinishAsked: lambda: ev.FinishAsked(TRAINER, p.FinishWeights(5, 14, UID, {"rows": 1}), 3.0),
        ev.Registered: lambda: ev.Registered("c"),
        ev.Reported: lambda: ev.Reported("a", u.step or WeightStep.DISK, 0, {"e0": 4}, ["e0"]),
        ev.StepFailed: lambda: ev.StepFailed("a", u.step or WeightStep.DISK, "engine e0 of agent a: refused"),
        ev.AgentLost: lambda: ev.AgentLost("c"),
        ev.MemberLost: lambda: ev.MemberLost("a"),
        ev.GroupNew: lambda: ev.GroupNew(MEMBERS, 3, "rollfleet-7"),
        ev.GroupKept: lambda: ev.GroupKept(MEMBERS, 3, "rollfleet-6"),
        ev.NoneConfirmed: ev.NoneConfirmed,
        ev.NoneBehind: ev.NoneBehind,
        ev.Settled: lambda: ev.Settled(("a", "b")),
        ev.DeadlinePassed: ev.DeadlinePassed,
        ev.TrainerSilent: lambda: ev.TrainerSilent(12.5, 10.0),
        ev.TrainerGone: lambda: ev.TrainerGone("its trainer detached"),
        ev.TrainerAborted: lambda: ev.TrainerAborted("Connection closed by peer"),
        ev.Replaced: ev.Replaced,
    }[event_type]()


EFFECTS = (ev.ToAgent, ev.Answer, ev.Record, ev.Release, ev.Abort)
EVENTS = [t for t in vars(ev).values() if isinstance(t, type) and t.__module__ == ev.__name__ and t not in EFFECTS]
ROWS = [(phase, event) for phase, rows in TABLE.items() for event in rows]
MISSING = [(phase, event) for phase in Phase for event in EVENTS if event not in TABLE.get(phase, {})]


def test_the_table_covers_every_phase_and_event_and_routes_reach_every_phase():
    assert set(ROUTES) == set(Phase)
    assert {event for _, event in ROWS} == set(EVENTS), "an event no phase takes"
    assert {after for rows in TABLE.values() for after, _ in rows.values()} == set(Phase) - {Phase.NEW}
    assert set(TABLE) == LIVE | {Phase.NEW}, "DONE and ABORTED take no event"
    assert len(ROWS) == 119, "the table changed: check the phases drawn in weight_lock's docstring"


@pytest.mark.parametrize(("phase", "event_type"), ROWS, ids=[f"{p.name}-{e.__name__}" for p, e in ROWS])
def test_every_row(phase, event_type):
    u = at(phase)
    after, _ = TABLE[phase][event_type]
    effects = transition(u, example(event_type, u))
    assert u.phase is after
    assert u.formed == (after in {Phase.GROUP, Phase.INIT, Phase.BUCKET} or u.finishing)
    kinds = [type(e) for e in effects]
    if after is Phase.ABORTED:
        [abort] = effects
        assert isinstance(abort, ev.Abort) and (f"{UID:#x}" in abort.why or str(UID) in abort.why)
    elif after is Phase.DONE:
        assert kinds in ([ev.Record], [ev.Answer, ev.Release])
    else:
        assert set(kinds) <= {ev.ToAgent, ev.Answer}, "only a row to DONE or ABORTED ends the update"


@pytest.mark.parametrize(("phase", "event_type"), MISSING, ids=[f"{p.name}-{e.__name__}" for p, e in MISSING])
def test_an_event_a_phase_has_no_row_for_is_refused_naming_both(phase, event_type):
    u = at(phase)
    with pytest.raises(
        UnexpectedEvent, match=f"{UID:#x}.*in phase {phase.name} has no transition on {event_type.__name__}"
    ):
        transition(u, example(event_type, u))
    assert u.phase is phase


# ---------------------------------------------------------------------------- the paths, and what they send


def test_a_disk_update_sends_every_agent_the_checkpoint_and_records_once_each_reported():
    u = update(WeightKind.DISK)
    sent = transition(u, ev.BeginDisk(TRAINER, 10, ("a", "b")))
    assert sent == [ev.ToAgent(a, p.WeightsFromDisk(UID, 4, "/ckpt")) for a in "ab"]
    assert u.step is WeightStep.DISK and u.waiter == (TRAINER, 10)
    assert transition(u, ev.Registered("c")) == [ev.ToAgent("c", p.WeightsFromDisk(UID, 4, "/ckpt"))]
    transition(u, ev.AgentLost("b"))  # it re-loads the recorded checkpoint when it registers
    for agent in "ac":
        assert not u.settled
        transition(u, ev.Reported(agent, WeightStep.DISK, engines={"e0": 4}))
    assert u.settled
    [record] = transition(u, ev.Settled())
    assert record == ev.Record(
        ev.Answer(TRAINER, p.Ok(10, {"update_id": UID, "version": 4, "engines": {"a/e0": 4, "c/e0": 4}}), (5, 10))
    )
    assert u.phase is Phase.DONE


def test_a_broadcast_forms_its_group_forwards_each_bucket_once_and_finishes_after_the_last_report():
    u = update()
    assert [e.msg for e in transition(u, ev.BeginBroadcast(TRAINER, REQUEST, ("a", "b")))] == [
        p.WeightsBegin(UID, 4)
    ] * 2
    transition(u, ev.Reported("a", WeightStep.BEGIN, members=["e0"]))
    assert not u.settled and u.step is WeightStep.BEGIN
    transition(u, ev.Reported("b", WeightStep.BEGIN, members=["e0"]))
    assert u.settled and u.confirmed == {"a": ["e0"], "b": ["e0"]}
    effects = transition(u, formation(u, MEMBERS, 3, "rollfleet-7", True))
    assert [type(e.msg) for e in effects] == [p.WeightsInitGroup, p.WeightsInitGroup, p.Ok]
    assert effects[-1].msg.result["init"] and effects[-1].key == (5, 10) and u.waiter is None
    assert u.step is WeightStep.INIT and u.formed and not u.finishing
    bucket = ev.Bucket(TRAINER, p.WeightBucket(5, 11, UID, 0, ["w"], ["float32"], [[2]]), 1.0)
    assert len(transition(u, bucket)) == 3 and u.step is WeightStep.BUCKET and u.deadline == 31.0
    assert transition(u, bucket) == [ev.Answer(TRAINER, p.Ok(11, {"seq": 0}))], "a resent bucket: answered only"
    transition(u, _FINISH_ASKED)
    assert u.step is WeightStep.BUCKET and u.finishing, "the status shows what the agents still run"
    assert "takes no more buckets" in transition(u, bucket)[0].msg.message
    for event in _REPORTED:
        assert not u.settled
        transition(u, event)
    assert u.settled
    finish = transition(u, ev.Settled(("a", "b", "c")))
    assert [(e.agent, type(e.msg)) for e in finish] == [(a, p.WeightsFinish) for a in "abc"]
    assert u.step is WeightStep.FINISH
    for agent in "abc":
        transition(u, ev.Reported(agent, WeightStep.FINISH, engines={"e0": 4}))
    assert [type(e) for e in transition(u, ev.Settled())] == [ev.Record]


def test_a_catch_up_finishes_on_its_members_only_and_one_with_nothing_behind_is_released():
    u = update(WeightKind.CATCH_UP)
    transition(u, ev.BeginBroadcast(TRAINER, REQUEST, ("b",)))
    transition(u, ev.Reported("b", WeightStep.BEGIN, members=[]))
    assert u.settled and u.confirmed == {"b": []}
    event = formation(u, {}, 1, "rollfleet-7", True)
    assert event == ev.NoneBehind()
    [answer, release] = transition(u, event)
    assert answer.msg.result == {"update_id": UID, "world_size": 0, "engines": {}} and release == ev.Release()
    u = update(WeightKind.CATCH_UP)
    for event in (ev.BeginBroadcast(TRAINER, REQUEST, ("b",)), ev.GroupNew({"b": {"b/e0": 1}}, 2, "g"), _FINISH_ASKED):
        transition(u, event)
    transition(u, ev.Reported("b", WeightStep.INIT))
    assert [e.agent for e in transition(u, ev.Settled(("a", "b")))] == ["b"]


# ---------------------------------------------------------------------------- the failure edges


BROADCAST_PHASES = [ph for ph in LIVE if ph is not Phase.DISK]
FORMED_BEFORE_FINISH = [ph for ph in BROADCAST_PHASES if ph not in (Phase.BEGIN, Phase.FINISH)]


@pytest.mark.parametrize("phase", sorted(LIVE, key=lambda ph: ph.name))
def test_an_engine_failing_its_step_aborts_the_update_in_every_phase_naming_agent_step_and_engine(phase):
    u = at(phase)
    [abort] = transition(u, ev.StepFailed("b", SHOWN[phase], "engine e1 of agent b: /update_weights_from_disk 500"))
    assert abort.why == (
        f"weight update {UID:#x} to version 4 failed at step {SHOWN[phase]}: engine e1 of agent b: "
        "/update_weights_from_disk 500"
    )
    [abort] = transition(at(phase), ev.StepFailed("b", "bucket", ""))
    assert abort.why.endswith("failed at step bucket: agent b: no detail")


@pytest.mark.parametrize("phase", sorted(FORMED_BEFORE_FINISH, key=lambda ph: ph.name))
def test_a_group_member_lost_before_finish_aborts_the_broadcast(phase):
    u = at(phase)
    event = lost(u, "a")
    assert event == ev.MemberLost("a") and lost(u, "c") == ev.AgentLost("c")
    [abort] = transition(u, event)
    assert abort.why == f"weight update {UID:#x} aborted: agent a, in the group, was lost"


@pytest.mark.parametrize(
    ("phase", "step", "others"),
    [(Phase.DISK, WeightStep.DISK, "a"), (Phase.BEGIN, WeightStep.BEGIN, "a"), (Phase.FINISH, WeightStep.FINISH, "ac")],
)
def test_an_agent_lost_where_no_group_needs_it_is_forgotten_and_the_update_goes_on(phase, step, others):
    u = at(phase)
    for agent in others:
        transition(u, ev.Reported(agent, step, members=["e0"]))
    u.sessions["b"] = 3
    assert not u.settled
    assert transition(u, lost(u, "b")) == []
    assert u.phase is phase and u.settled and "b" not in u.sessions


@pytest.mark.parametrize("phase", sorted(LIVE, key=lambda ph: ph.name))
def test_the_deadline_aborts_every_phase_naming_its_step_and_whom_it_waits_for(phase):
    u = at(phase)
    pending = u.pending()
    [abort] = transition(u, ev.DeadlinePassed())
    step = SHOWN[phase]
    assert (
        abort.why
        == f"weight update {UID:#x} to version 4 missed its deadline (30s) at step {step}: waiting for {pending}"
    )
    idle = phase in (Phase.GROUP, Phase.GROUP_FINISHING)  # nothing awaited of an agent: the trainer's turn
    assert pending == ("the trainer t" if idle else "agents a, b, c" if phase is Phase.FINISH else "agents a, b")


@pytest.mark.parametrize("phase", sorted(LIVE, key=lambda ph: ph.name))
def test_a_silent_or_gone_trainer_aborts_a_broadcast_and_leaves_a_disk_update_alone(phase):
    for event in (ev.TrainerSilent(12.5, 10.0), ev.TrainerGone("its trainer was replaced by t2")):
        u = at(phase)
        effects = transition(u, event)
        if phase is Phase.DISK:
            assert effects == [] and u.phase is Phase.DISK
            continue
        [abort] = effects
        assert u.phase is Phase.ABORTED
        assert abort.why in (
            f"weight update {UID:#x} to version 4 aborted at step {SHOWN[phase]}: its trainer t was silent for "
            "12.5s (session TTL 10s), presumed dead",
            f"weight update {UID:#x} aborted: its trainer was replaced by t2",
        )


@pytest.mark.parametrize("phase", sorted(LIVE, key=lambda ph: ph.name))
def test_the_trainers_own_abort_or_a_new_update_of_its_ends_every_phase(phase):
    [abort] = transition(at(phase), ev.TrainerAborted(""))
    assert abort.why == f"weight update {UID:#x} to version 4 failed in its trainer: no detail"
    [abort] = transition(at(phase), ev.Replaced())
    assert abort.why == f"weight update {UID} was replaced by a new update from its trainer"


def test_no_engine_confirmed_aborts_a_distributed_update():
    u = at(Phase.BEGIN)
    event = formation(u, {}, 1, "g", False)
    assert event == ev.NoneConfirmed()
    [abort] = transition(u, event)
    assert "no engine is up to receive it" in abort.why and u.phase is Phase.ABORTED


def test_requests_a_phase_cannot_take_are_answered_with_the_reason():
    for phase, event_type, why in (
        (Phase.DISK, ev.Bucket, "takes no more buckets"),
        (Phase.BEGIN, ev.Bucket, "takes no more buckets"),
        (Phase.FINISH, ev.Bucket, "takes no more buckets"),
        (Phase.DISK, ev.FinishAsked, "is a disk update"),
        (Phase.BEGIN, ev.FinishAsked, "has no group yet"),
    ):
        u = at(phase)
        [answer] = transition(u, example(event_type, u))
        assert answer.msg.code == "bad_request" and f"update {UID:#x} {why}" == answer.msg.message
        assert answer.key is None and u.phase is phase
    u = at(Phase.BEGIN)
    assert u.answers_update(10) and not u.answers_update(11) and not at(Phase.GROUP).answers_update(10)
