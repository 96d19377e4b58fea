"""The weight lock's update and every step it may take (docs/weights.md). Pure: no I/O, no core, no clock.

An ``Update`` holds the weight lock from the trainer's ``UpdateWeights`` until it is recorded or
aborted. Its ``phase`` changes in one place, :func:`transition`, through one table, ``TABLE``:
``(phase, type(event)) -> (next phase, build)``, where ``build(update, event)`` does the row's
bookkeeping and returns its effects. An event with no row for the phase is a bug in the caller:
``UnexpectedEvent`` says which update, phase and event. Everything that moves an update lives here;
the weights role (coordinator/weights.py) turns messages and ticks into events and carries out the
effects (sends, the log record, the abort's fan-out).

Phases, and the step the status and error texts show for each (``step``)::

    NEW --BeginDisk--> DISK --Settled--> DONE
    NEW --BeginBroadcast--> BEGIN --GroupKept--> GROUP --Bucket--> BUCKET
                                  --GroupNew---> INIT  --Bucket--> BUCKET
                                  --NoneBehind--> DONE           (a catch-up with nothing to send)
    GROUP/INIT/BUCKET --FinishAsked--> GROUP_/INIT_/BUCKET_FINISHING --Settled--> FINISH --Settled--> DONE
    any phase but NEW --(a failure)--> ABORTED

``GROUP_FINISHING``, ``INIT_FINISHING`` and ``BUCKET_FINISHING`` are the trainer's ``FinishWeights``
waiting for the last init and bucket reports: they show ``group``/``init``/``bucket`` (what the
agents still run) and, unlike those, take no bucket. ``formed`` (the group is chosen and the
trainer answered) and ``finishing`` (its ``FinishWeights`` came) are read off the phase.

``Settled`` is fed when an update awaits nothing (``settled``); ``BEGIN`` settles by forming its
group instead (:func:`formation`). A lost agent is a ``MemberLost`` when it is in the group
(:func:`lost`): in a formed group before ``FINISH`` that ends the update.

Invariants: a phase changes only in :func:`transition`; a live phase (not NEW, DONE or ABORTED)
ends only through a row to DONE (effects ``Record`` or ``Release``) or to ABORTED (effect
``Abort``); every failure row names, in its ``Abort.why``, the update and what failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

from common import protocol as p
from common.weight_step import BROADCASTS, WeightKind, WeightStep
from coordinator import weight_events as ev

__all__ = ["TABLE", "Phase", "UnexpectedEvent", "Update", "formation", "lost", "transition"]


class Phase(Enum):
    """Where the update holding the lock is (the module docstring draws them)."""

    NEW = auto()
    DISK = auto()
    BEGIN = auto()
    GROUP = auto()
    INIT = auto()
    BUCKET = auto()
    GROUP_FINISHING = auto()
    INIT_FINISHING = auto()
    BUCKET_FINISHING = auto()
    FINISH = auto()
    DONE = auto()
    ABORTED = auto()


SHOWN: dict[Phase, WeightStep] = {
    Phase.DISK: WeightStep.DISK,
    Phase.BEGIN: WeightStep.BEGIN,
    Phase.GROUP: WeightStep.GROUP,
    Phase.INIT: WeightStep.INIT,
    Phase.BUCKET: WeightStep.BUCKET,
    Phase.GROUP_FINISHING: WeightStep.GROUP,
    Phase.INIT_FINISHING: WeightStep.INIT,
    Phase.BUCKET_FINISHING: WeightStep.BUCKET,
    Phase.FINISH: WeightStep.FINISH,
}
"""The step a live phase shows (status ``weights.lock.step``, error texts)."""

FINISHING = frozenset({Phase.GROUP_FINISHING, Phase.INIT_FINISHING, Phase.BUCKET_FINISHING, Phase.FINISH})
FORMED = frozenset({Phase.GROUP, Phase.INIT, Phase.BUCKET}) | FINISHING
LIVE = frozenset(SHOWN)


class UnexpectedEvent(RuntimeError):
    """An event with no row in ``TABLE`` for the update's phase: the caller fed what cannot happen there."""


@dataclass
class Update:
    """The update holding the weight lock."""

    update_id: int
    kind: WeightKind
    version: int
    path: str
    session: int
    holder: str
    timeout: float
    deadline: float
    phase: Phase = Phase.NEW
    """Changed by :func:`transition` only."""
    waiter: tuple[bytes, int] | None = None
    """Whom the result goes to: the UpdateWeights (disk, begin) or the FinishWeights (distributed)."""
    sessions: dict[str, int] = field(default_factory=dict)
    """Agents sent a step, with the session they had: one that changes was lost (kept by the role)."""
    waiting: set[str] = field(default_factory=set)
    """Agents whose ``disk``/``begin``/``finish`` report is awaited."""
    members: dict[str, dict[str, int]] = field(default_factory=dict)
    """Distributed: agent -> {"agent/engine": rank offset}."""
    init_pending: set[str] = field(default_factory=set)
    buckets: dict[int, set[str]] = field(default_factory=dict)
    """Forwarded bucket seq -> agents whose report is awaited."""
    engines: dict[str, dict] = field(default_factory=dict)
    """Agent -> ``{engine: version}`` from its last ``disk``/``finish`` report."""
    group_name: str = ""
    world_size: int = 0
    seen: float = 0.0
    """When its trainer was last heard of (any message of its session about the update)."""
    confirmed: dict[str, list[str]] = field(default_factory=dict)
    """Distributed: agent -> the engines it confirmed for the group (its ``begin`` report)."""
    request: p.UpdateWeights | None = None
    """Distributed: the request that began it (its address, port and backend form the group)."""
    verify: dict = field(default_factory=dict)
    """Distributed: ``FinishWeights.verify``, passed on to every agent's finish step."""

    @property
    def step(self) -> WeightStep | None:
        """The step shown for it (None before it began and once it ended)."""
        return SHOWN.get(self.phase)

    @property
    def formed(self) -> bool:
        """Distributed: the group is chosen and the ``UpdateWeights`` answered."""
        return self.phase in FORMED

    @property
    def finishing(self) -> bool:
        """Distributed: its trainer's ``FinishWeights`` came."""
        return self.phase in FINISHING

    @property
    def forming(self) -> bool:
        """Distributed: agents are confirming their engines; the group is formed once none is awaited."""
        return self.phase is Phase.BEGIN

    @property
    def settled(self) -> bool:
        """Nothing is awaited from an agent: the update takes its next step (``Settled``, or its group forms)."""
        if self.phase in (Phase.DISK, Phase.BEGIN, Phase.FINISH):
            return not self.waiting
        if self.phase in (Phase.GROUP_FINISHING, Phase.INIT_FINISHING, Phase.BUCKET_FINISHING):
            return not self.init_pending and not any(self.buckets.values())
        return False

    def answers_update(self, req: int) -> bool:
        """``req`` is the ``UpdateWeights`` this update still answers (a resend while it runs)."""
        return self.phase in (Phase.DISK, Phase.BEGIN) and self.waiter is not None and self.waiter[1] == req

    def pending(self) -> str:
        """Whom it waits for, for an error text."""
        agents = set(self.waiting) | set(self.init_pending) | {a for w in self.buckets.values() for a in w}
        if agents:
            return "agents " + ", ".join(sorted(agents))
        return f"the trainer {self.holder}" if self.kind in BROADCASTS else "nothing"


# ---------------------------------------------------------------------------- the table's builders


def _start_disk(u: Update, e: ev.BeginDisk) -> list:
    u.waiter = (e.peer, e.req)
    u.waiting.update(e.agents)
    return [ev.ToAgent(a, p.WeightsFromDisk(u.update_id, u.version, u.path)) for a in e.agents]


def _start_broadcast(u: Update, e: ev.BeginBroadcast) -> list:
    u.request, u.waiter = e.request, (e.peer, e.request.req)
    u.waiting.update(e.agents)
    catch_up = u.kind is WeightKind.CATCH_UP
    return [ev.ToAgent(a, p.WeightsBegin(u.update_id, u.version, catch_up)) for a in e.agents]


def _rewait(u: Update, e: ev.UpdateResent) -> list:
    u.waiter, u.seen = (e.peer, e.req), e.now  # answered when it ends (or its group forms)
    return []


def _join_disk(u: Update, e: ev.Registered) -> list:
    u.waiting.add(e.agent)
    return [ev.ToAgent(e.agent, p.WeightsFromDisk(u.update_id, u.version, u.path))]


def _nothing(u: Update, e: object) -> list:
    return []


def _noted(u: Update, e: ev.Reported) -> list:
    if e.step in (WeightStep.DISK, WeightStep.FINISH):
        # The agent's serving engines once the update is done there (none: every one died or is
        # restarting); the answer lists these, never an earlier step's (a paused engine's old version).
        u.engines[e.agent] = dict(e.engines)
    if e.step == WeightStep.BEGIN and not u.formed:
        u.confirmed[e.agent] = [str(n) for n in e.members]
        u.waiting.discard(e.agent)
    elif e.step in (WeightStep.DISK, WeightStep.FINISH):
        u.waiting.discard(e.agent)
    elif e.step == WeightStep.INIT:
        u.init_pending.discard(e.agent)
    elif e.step == WeightStep.BUCKET and e.seq in u.buckets:
        u.buckets[e.seq].discard(e.agent)
    return []


def _forget(u: Update, e: ev.AgentLost | ev.MemberLost) -> list:
    # A disk update goes on without it: it loads the recorded checkpoint when it registers.
    u.sessions.pop(e.agent, None)
    u.waiting.discard(e.agent)
    u.init_pending.discard(e.agent)
    for waiting in u.buckets.values():
        waiting.discard(e.agent)
    return []


def _group_answer(u: Update, e: ev.GroupNew | ev.GroupKept, init: bool) -> list:
    peer, req = u.waiter
    u.waiter, u.members, u.world_size, u.group_name = None, e.members, e.world_size, e.group_name
    result = {
        "update_id": u.update_id,
        "world_size": e.world_size,
        "group_name": e.group_name,
        "init": init,
        "rank_offsets": {k: v for offsets in e.members.values() for k, v in offsets.items()},
    }
    return [ev.Answer(peer, p.Ok(req, result), (u.session, req))]


def _init_group(u: Update, e: ev.GroupNew) -> list:
    msg = u.request
    out = []
    for agent_id, offsets in e.members.items():
        init = p.WeightsInitGroup(
            u.update_id, msg.master_address, msg.master_port, e.world_size, e.group_name, msg.backend, dict(offsets)
        )
        out.append(ev.ToAgent(agent_id, init))
        u.init_pending.add(agent_id)
    return out + _group_answer(u, e, True)


def _keep_group(u: Update, e: ev.GroupKept) -> list:
    return _group_answer(u, e, False)


def _nothing_behind(u: Update, e: ev.NoneBehind) -> list:
    peer, req = u.waiter
    reply = p.Ok(req, {"update_id": u.update_id, "world_size": 0, "engines": {}})
    return [ev.Answer(peer, reply, (u.session, req)), ev.Release()]


def _forward(u: Update, e: ev.Bucket) -> list:
    u.deadline, u.seen = e.now + u.timeout, e.now
    ok = ev.Answer(e.peer, p.Ok(e.msg.req, {"seq": e.msg.seq}))
    if e.msg.seq in u.buckets:
        return [ok]  # resent: forwarded already
    u.buckets[e.msg.seq] = set(u.members)
    m = e.msg
    out: list = [
        ev.ToAgent(
            a,
            p.WeightsBucket(
                u.update_id, m.seq, u.group_name, list(m.names), list(m.dtypes), [list(s) for s in m.shapes]
            ),
        )
        for a in u.members
    ]
    return out + [ok]


def _finish_asked(u: Update, e: ev.FinishAsked) -> list:
    u.waiter, u.verify = (e.peer, e.msg.req), dict(e.msg.verify)
    u.deadline, u.seen = e.now + u.timeout, e.now
    return []


def _refused(why: str) -> Callable[[Update, ev.Bucket | ev.FinishAsked], list]:
    """A trainer request the phase cannot take: answered ``bad_request``, saying ``why``."""
    return lambda u, e: [ev.Answer(e.peer, p.Error("bad_request", f"update {u.update_id:#x} {why}", e.msg.req))]


_no_more_buckets = _refused("takes no more buckets")
_not_broadcast = _refused("is a disk update")
_no_group_yet = _refused("has no group yet")


def _send_finish(u: Update, e: ev.Settled) -> list:
    # A catch-up finishes on its members only; a version update everywhere (engines outside the group
    # are behind it now).
    agents = e.agents if u.kind is WeightKind.DISTRIBUTED else [a for a in e.agents if a in u.members]
    u.waiting.update(agents)
    return [ev.ToAgent(a, p.WeightsFinish(u.update_id, u.version, u.verify)) for a in agents]


def _done(u: Update, e: ev.Settled) -> list:
    engines = {f"{a}/{name}": v for a, engs in sorted(u.engines.items()) for name, v in sorted(engs.items())}
    if u.kind is WeightKind.CATCH_UP:  # the version is the log's already: nothing to record
        caught = {key for offsets in u.members.values() for key in offsets}
        engines = {key: v for key, v in engines.items() if key in caught}
    answer = None
    if u.waiter is not None:
        peer, req = u.waiter
        reply = p.Ok(req, {"update_id": u.update_id, "version": u.version, "engines": engines})
        answer = ev.Answer(peer, reply, (u.session, req))
    if u.kind is WeightKind.CATCH_UP:
        return [answer, ev.Release()] if answer is not None else [ev.Release()]
    return [ev.Record(answer)]


# Failures: each ends the update with what failed.


def _replaced(u: Update, e: ev.Replaced) -> list:
    return [ev.Abort(f"weight update {u.update_id} was replaced by a new update from its trainer")]


def _trainer_aborted(u: Update, e: ev.TrainerAborted) -> list:
    why = e.why or "no detail"
    return [ev.Abort(f"weight update {u.update_id:#x} to version {u.version} failed in its trainer: {why}")]


def _trainer_gone(u: Update, e: ev.TrainerGone) -> list:
    return [ev.Abort(f"weight update {u.update_id:#x} aborted: {e.why}")]


def _trainer_silent(u: Update, e: ev.TrainerSilent) -> list:
    return [
        ev.Abort(
            f"weight update {u.update_id:#x} to version {u.version} aborted at step {u.step}: its trainer "
            f"{u.holder} was silent for {e.silent:.1f}s (session TTL {e.ttl:g}s), presumed dead"
        )
    ]


def _missed(u: Update, e: ev.DeadlinePassed) -> list:
    return [
        ev.Abort(
            f"weight update {u.update_id:#x} to version {u.version} missed its deadline "
            f"({u.timeout:g}s) at step {u.step}: waiting for {u.pending()}"
        )
    ]


def _step_failed(u: Update, e: ev.StepFailed) -> list:
    error = e.error or "no detail"
    if e.agent not in error:
        error = f"agent {e.agent}: {error}"
    return [ev.Abort(f"weight update {u.update_id:#x} to version {u.version} failed at step {e.step}: {error}")]


def _member_lost(u: Update, e: ev.MemberLost) -> list:
    return [ev.Abort(f"weight update {u.update_id:#x} aborted: agent {e.agent}, in the group, was lost")]


def _no_engine(u: Update, e: ev.NoneConfirmed) -> list:
    return [
        ev.Abort(
            f"weight update {u.update_id:#x} to version {u.version}: no engine is up to receive it "
            "(no alive agent confirmed an engine: every one is dead, restarting, or still held by a failed update)"
        )
    ]


# ---------------------------------------------------------------------------- the table

Build = Callable[[Update, object], list]

_FAILURES: dict[type, tuple[Phase, Build]] = {
    ev.Replaced: (Phase.ABORTED, _replaced),
    ev.TrainerAborted: (Phase.ABORTED, _trainer_aborted),
    ev.DeadlinePassed: (Phase.ABORTED, _missed),
    ev.StepFailed: (Phase.ABORTED, _step_failed),
}
"""Every live phase: the update ends."""

_BROADCAST_FAILURES: dict[type, tuple[Phase, Build]] = {
    **_FAILURES,
    ev.TrainerSilent: (Phase.ABORTED, _trainer_silent),
    ev.TrainerGone: (Phase.ABORTED, _trainer_gone),
}
"""Every broadcast phase: the update ends, also when its trainer (rank 0 of the group) is gone."""


def _sending(phase: Phase, finishing: Phase) -> dict[type, tuple[Phase, Build]]:
    """A formed group taking buckets (``phase``): GROUP, INIT or BUCKET."""
    return {
        ev.Bucket: (Phase.BUCKET, _forward),
        ev.FinishAsked: (finishing, _finish_asked),
        ev.Registered: (phase, _nothing),  # the group is fixed; outside it the agent gets WeightsFinish
        ev.Reported: (phase, _noted),
        ev.AgentLost: (phase, _forget),
        ev.MemberLost: (Phase.ABORTED, _member_lost),
        **_BROADCAST_FAILURES,
    }


def _draining(phase: Phase) -> dict[type, tuple[Phase, Build]]:
    """The trainer's FinishWeights waits for the last init and bucket reports (``phase``)."""
    return {
        ev.Settled: (Phase.FINISH, _send_finish),
        ev.FinishAsked: (phase, _finish_asked),  # a new request id: it is the one answered
        ev.Bucket: (phase, _no_more_buckets),
        ev.Registered: (phase, _nothing),
        ev.Reported: (phase, _noted),
        ev.AgentLost: (phase, _forget),
        ev.MemberLost: (Phase.ABORTED, _member_lost),
        **_BROADCAST_FAILURES,
    }


TABLE: dict[Phase, dict[type, tuple[Phase, Build]]] = {
    Phase.NEW: {
        ev.BeginDisk: (Phase.DISK, _start_disk),
        ev.BeginBroadcast: (Phase.BEGIN, _start_broadcast),
    },
    Phase.DISK: {
        ev.Settled: (Phase.DONE, _done),
        ev.UpdateResent: (Phase.DISK, _rewait),
        ev.Registered: (Phase.DISK, _join_disk),  # it loads the checkpoint too
        ev.Reported: (Phase.DISK, _noted),
        ev.AgentLost: (Phase.DISK, _forget),  # it loads the recorded checkpoint when it registers
        ev.Bucket: (Phase.DISK, _no_more_buckets),
        ev.FinishAsked: (Phase.DISK, _not_broadcast),
        ev.TrainerSilent: (Phase.DISK, _nothing),  # a disk update does not need its trainer
        ev.TrainerGone: (Phase.DISK, _nothing),
        **_FAILURES,
    },
    Phase.BEGIN: {
        ev.GroupNew: (Phase.INIT, _init_group),
        ev.GroupKept: (Phase.GROUP, _keep_group),
        ev.NoneBehind: (Phase.DONE, _nothing_behind),
        ev.NoneConfirmed: (Phase.ABORTED, _no_engine),
        ev.UpdateResent: (Phase.BEGIN, _rewait),
        ev.Registered: (Phase.BEGIN, _nothing),  # it was not asked: outside the group, it gets WeightsFinish
        ev.Reported: (Phase.BEGIN, _noted),
        ev.AgentLost: (Phase.BEGIN, _forget),  # its engines are not confirmed
        ev.Bucket: (Phase.BEGIN, _no_more_buckets),
        ev.FinishAsked: (Phase.BEGIN, _no_group_yet),
        **_BROADCAST_FAILURES,
    },
    Phase.GROUP: _sending(Phase.GROUP, Phase.GROUP_FINISHING),
    Phase.INIT: _sending(Phase.INIT, Phase.INIT_FINISHING),
    Phase.BUCKET: _sending(Phase.BUCKET, Phase.BUCKET_FINISHING),
    Phase.GROUP_FINISHING: _draining(Phase.GROUP_FINISHING),
    Phase.INIT_FINISHING: _draining(Phase.INIT_FINISHING),
    Phase.BUCKET_FINISHING: _draining(Phase.BUCKET_FINISHING),
    Phase.FINISH: {
        ev.Settled: (Phase.DONE, _done),
        ev.FinishAsked: (Phase.FINISH, _finish_asked),
        ev.Bucket: (Phase.FINISH, _no_more_buckets),
        ev.Registered: (Phase.FINISH, _nothing),  # WeightsFinish went to the agents alive then
        ev.Reported: (Phase.FINISH, _noted),
        ev.AgentLost: (Phase.FINISH, _forget),
        ev.MemberLost: (Phase.FINISH, _forget),  # its weights arrived: the update completes without it
        **_BROADCAST_FAILURES,
    },
}
"""Every transition: ``TABLE[phase][type(event)] = (next phase, build)``. DONE and ABORTED have none."""


def transition(update: Update, event: object) -> list:
    """Take ``event``'s row for ``update``'s phase: its bookkeeping, its next phase; returns its effects.

    The only place an update's phase changes. UnexpectedEvent when the phase has no row for the event."""
    row = TABLE.get(update.phase, {}).get(type(event))
    if row is None:
        raise UnexpectedEvent(
            f"weight update {update.update_id:#x} ({update.kind}) in phase {update.phase.name} has no transition "
            f"on {type(event).__name__}"
        )
    after, build = row
    effects = build(update, event)
    update.phase = after
    return effects


# ---------------------------------------------------------------------------- events read off the update


def lost(update: Update, agent: str) -> ev.AgentLost | ev.MemberLost:
    """The event for ``agent`` lost (dead, or registered again) while sent a step of ``update``."""
    return ev.MemberLost(agent) if agent in update.members else ev.AgentLost(agent)


def formation(
    update: Update, members: dict[str, dict[str, int]], world_size: int, group_name: str, new: bool
) -> ev.GroupNew | ev.GroupKept | ev.NoneConfirmed | ev.NoneBehind:
    """The event for ``update``'s group once no ``begin`` is awaited: ``members`` (agent -> {"agent/engine":
    rank offset}), formed anew (``new``: its engines join ``group_name``) or kept."""
    if not members:
        return ev.NoneBehind() if update.kind is WeightKind.CATCH_UP else ev.NoneConfirmed()
    return (ev.GroupNew if new else ev.GroupKept)(members, world_size, group_name)
