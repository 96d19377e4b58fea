"""Core turns: messages handled together defer their pump to the end of the turn, and change nothing else."""

from __future__ import annotations

from common import protocol as p
from coordinator.core import Persist
from coordinator.frontier import DELIVERED
from coordinator.records import SetCursors
from tests.unit.test_core import N, attach, grants, make_core, register, sends


def _receipt(session, g):
    key = f"{g.data_epoch}:{g.index}:{g.lease:x}"
    return p.Receipt(session, g.lease, g.data_epoch, g.index, key, N, {"n_samples": N})


def test_a_turn_of_receipts_refills_each_agent_with_one_grant_behind_one_cursor_write():
    core = make_core(size=100, batch=4, prefetch=8)
    wa, eff = register(core, "a")
    wb, eff2 = register(core, "b")
    held = {"a": grants(eff), "b": grants(eff2)}
    assert sum(map(len, held.values())) == 8
    session = attach(core)
    core.begin_turn()
    # Two batches take the eight groups, so the whole prefetch is free again.
    effects = core.handle(b"trainer", p.Generate(session, 1, 0), 1.0) + core.handle(
        b"trainer", p.Generate(session, 2, 1), 1.0
    )
    for agent, welcome in (("a", wa), ("b", wb)):
        for g in held[agent]:
            effects += core.handle(agent.encode(), _receipt(welcome.session, g), 1.0)
    assert not grants(effects), "no grant inside the turn"
    acks = sends(effects, p.ReceiptAck)
    assert len(acks) == 8 and all(a.msg.accepted for a in acks)
    assert all(isinstance(e, Persist) for e in effects if sends([e], p.ReceiptAck)), "acks wait on the ledger"
    end = core.end_turn(1.0)
    by_agent = {s.to: s.msg.leases for s in sends(end, p.Grant)}
    assert sorted(by_agent) == ["a", "b"] and sum(map(len, by_agent.values())) == 8
    carriers = [e for e in end if isinstance(e, Persist) and sends([e], p.Grant)]
    assert len(carriers) == 1 and isinstance(carriers[0].ops[-1], SetCursors), "grants behind one cursor write"
    assert carriers[0].ops[-1].cursors == core.frontier.cursors()
    assert len(sends(end, p.BatchRefs)) == 2
    for g in held["a"] + held["b"]:
        assert core.frontier.state_of(g.data_epoch, g.index) == DELIVERED


def test_a_turn_gives_the_same_state_as_one_message_at_a_time():
    def run(turn: bool):
        core = make_core(size=100, batch=2, prefetch=4)
        w, eff = register(core, "a")
        session = attach(core)
        leased = grants(eff)
        msgs = [(b"a", _receipt(w.session, g)) for g in leased] + [(b"trainer", p.Generate(session, 7, 0))]
        out = []
        if turn:
            core.begin_turn()
        for peer, msg in msgs:
            out += core.handle(peer, msg, 1.0)
        if turn:
            out += core.end_turn(1.0)
        batch = sends(out, p.BatchRefs)[0].msg
        return core.frontier.cursors(), core.statistics().leased, [g[:2] for g in batch.groups]

    assert run(True) == run(False)


def test_an_empty_turn_pumps_nothing():
    core = make_core()
    core.begin_turn()
    assert core.end_turn(0.0) == []


def test_a_turn_whose_pump_grants_nothing_still_ends_behind_one_cursor_write():
    core = make_core(size=100, batch=4, prefetch=4)
    w, eff = register(core, "a")
    leased = grants(eff)
    core.handle(b"trainer", p.Pause(attach(core), 1), 1.0)  # paused: the pump grants nothing
    core.begin_turn()
    effects = [e for g in leased for e in core.handle(b"a", _receipt(w.session, g), 1.0)]
    persisted = [e for e in effects if isinstance(e, Persist)]
    assert persisted and not any(isinstance(op, SetCursors) for e in persisted for op in e.ops), "stamped at the end"
    end = core.end_turn(1.0)
    assert not grants(end)
    last = [e for e in end if isinstance(e, Persist)][-1]
    assert last.ops[-1] == SetCursors(core.frontier.cursors())
