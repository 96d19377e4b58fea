"""Weight updates (docs/weights.md): the weights role. Pure: messages and ticks in, effects out.

The role checks each trainer request, turns messages and ticks into the lock's events and carries out
the effects; the update holding the lock, its phases and every transition between them live in
coordinator/weight_lock.py (one table). The role keeps what outlives an update: the weight log, the
last group formed, the answers kept for resends and why recent updates failed. A request or report
reaches it only from a current session: the trainer sessions (coordinator/trainer.py) and admission
(coordinator/admission.py) check the sender first, as for their own messages.

One update at a time. ``UpdateWeights`` takes the **weight lock** for its trainer session, with a
deadline (``timeout``, restarted by every bucket and by ``FinishWeights``); while it is held no
prompt is leased (the core's pump, coordinator/core.py). Then:

- ``disk``: every alive agent gets ``WeightsFromDisk``; once each of them (and any agent that
  registers meanwhile) reported ``disk`` ok, the log is recorded and the trainer answered.
- ``distributed``: every alive agent gets ``WeightsBegin`` and confirms its engines (process
  alive, free of any earlier group, one bounded probe); once every one of them reported (or was
  lost), the group is the confirmed engines (``healthy`` or ``stale``: a stale engine is one a
  broadcast must reach), ordered by ``(agent_id, engine name)``: engine ``i`` has rank offset
  ``1 + sum(tp before it)``, ``world_size = 1 + sum(tp)``. Only then is the ``UpdateWeights``
  answered. ``WeightsInitGroup`` goes to the member agents only when the group differs from the
  last one formed (members, their tp, the trainer session, its address or backend) and the last
  update did not fail; the answer says ``init``. Each ``WeightBucket`` is forwarded once (a resent one,
  same ``(update_id, seq)``, is only answered again); ``FinishWeights`` waits for every init and
  bucket report, then every alive agent gets ``WeightsFinish`` (agents outside the group mark
  their engines behind), and once they reported, the log is recorded and the trainer answered.

Invariants:
- Versions never move backwards: an update must name a version above the log's, and recovery
  takes the highest of the log and what engines report at their first registration.
- Persist, then answer: the trainer's ``Ok`` travels behind the ``SetWeights`` commit.
- Every failure ends the update the same way: an error report (naming agent and engine), a
  missed deadline, a group member lost, its trainer reporting its own broadcast failed
  (``AbortWeights``), silent past the TTL (``WeightsAlive`` is its heartbeat while a broadcast
  runs) or fenced or detached (distributed only: a disk update does not need its trainer) sends
  ``WeightsAbort`` (with the last recorded disk checkpoint, if any) to every alive agent, answers
  the waiting call with ``Error("weights")`` naming what failed, forgets the group (the next
  update forms a new one, under a new name) and releases the lock; admission resumes in the same
  turn.
- A trainer that begins a new update while its own is in flight gave the old one up: it is
  aborted first. A resent ``UpdateWeights``/``FinishWeights`` (same request id) gets the same answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common import protocol as p
from common.engine_info import EngineState
from common.weight_step import BROADCASTS, WeightKind, WeightStep
from coordinator import weight_events as ev
from coordinator.effects import Persist, Send
from coordinator.membership import ALIVE
from coordinator.records import LedgerSnapshot, SetWeights, WeightLog
from coordinator.weight_lock import Update, formation, lost, transition

if TYPE_CHECKING:
    from common.config import Liveness
    from coordinator.lease_book import LeaseBook
    from coordinator.membership import AgentRecord, Membership

KINDS = tuple(kind.value for kind in WeightKind)
"""Engine states that join a broadcast group (up; a stale one needs the broadcast to serve again)."""
REPLIES_KEPT = 64


class WeightUpdates:
    def __init__(self, restored: LedgerSnapshot, *, membership: Membership, leases: LeaseBook, liveness: Liveness):
        """Its parts: membership (the agents an update goes to, their engines and sessions, the generation in an
        update's id), the lease book (its highest lease id bounds each update in the log) and the liveness settings
        (a trainer silent past the TTL loses its update). The trainer's session and the agent's are checked before a
        request or a report reaches it (coordinator/trainer.py, coordinator/admission.py)."""
        self._membership = membership
        self._leases = leases
        self._liveness = liveness
        self.log: WeightLog = restored.weights
        self.lock: Update | None = None
        self._counter = 0
        self._last_group: tuple | None = None
        self._group_name = ""
        self._replies: dict[tuple[int, int], p.Message] = {}  # (session, req) -> answer, for resends
        self._failed: dict[int, str] = {}  # update id -> why it was aborted
        self._started_any = False
        self.partial = ""
        """Why engines may hold part of an update: the last update failed after weights were sent
        (a bucket forwarded, or a disk load begun); "" once an update completes."""
        self._effects = {
            ev.ToAgent: self._send_agent,
            ev.Answer: self._answer,
            ev.Record: self._complete,
            ev.Release: self._release,
            ev.Abort: lambda effect, now: self.abort(effect.why, now),
        }
        self._requests = {
            p.WeightBucket: self.on_bucket,
            p.FinishWeights: self.on_finish,
            p.AbortWeights: self.on_abort_request,
            p.WeightsAlive: self.on_alive,
        }

    # ------------------------------------------------------------------ views

    @property
    def locked(self) -> bool:
        return self.lock is not None

    @property
    def stops_admission(self) -> bool:
        """No prompt is leased: an update that changes the fleet's weights runs (a catch-up does not)."""
        return self.lock is not None and self.lock.kind is not WeightKind.CATCH_UP

    def behind(self) -> dict[str, list[str]]:
        """Alive agents' engines that are up but out of the pool (``stale``): agent -> engine names."""
        out: dict[str, list[str]] = {}
        for rec in self._membership.alive():
            names = [e.name for e in rec.engines if e.state is EngineState.STALE]
            if names:
                out[rec.agent_id] = names
        return out

    def none_current(self, engines: list) -> bool:
        """No serving engine of ``engines`` (an agent's list: Register, Capacity) may hold the fleet's weights:
        there is one, and each is known to hold an older version than the log's.

        The agent's capacity counts its ``healthy`` engines, and a Register is written before the agent
        knows the fleet's weights (the Welcome tells it; it then takes the engines behind them out of its
        pool, one at a time, until they re-load the recorded checkpoint or an update reaches them). Leases
        granted on such a capacity cannot start. An engine of unknown version, or at or above the log's
        (an update not recorded yet), may serve.
        """
        serving = [e.version for e in engines if e.serving]
        known = [v for v in serving if isinstance(v, int) and not isinstance(v, bool)]
        return bool(serving) and len(known) == len(serving) and max(known) < self.log.version

    def statistics(self, now: float) -> dict:
        lock = self.lock
        engines = {}
        for rec in self._membership.alive():
            for e in rec.engines:
                if e.state.up:
                    engines[f"{rec.agent_id}/{e.name}"] = e.version
        held = None
        if lock is not None:
            held = {
                "holder": lock.holder,
                "kind": lock.kind,
                "update_id": lock.update_id,
                "step": lock.step,
                "deadline_in_s": round(lock.deadline - now, 3),
            }
        return {
            "version": self.log.version,
            "updates": self.log.updates,
            "kind": self.log.kind,
            "path": self.log.path,
            "lock": held,
            "engines": engines,
            "behind": sorted(f"{agent}/{name}" for agent, names in self.behind().items() for name in names),
        }

    def group(self, confirmed: dict[str, list[str]]) -> tuple[dict[str, dict[str, int]], int, tuple]:
        """``(agent -> {"agent/engine": rank offset}, world_size, identity)`` of the ``confirmed`` engines."""
        members: dict[str, dict[str, int]] = {}
        identity = []
        offset = 1
        for rec in sorted(self._membership.alive(), key=lambda r: r.agent_id):
            names = set(confirmed.get(rec.agent_id, ()))
            known = {e.name: e for e in rec.engines}
            for name in sorted(names):
                e = known.get(name)  # confirmed but not in its agent's last report: one rank, no URL known
                tp = e.tp if e is not None and e.tp > 0 else 1
                key = f"{rec.agent_id}/{name}"
                members.setdefault(rec.agent_id, {})[key] = offset
                identity.append((key, e.url if e is not None else None, tp, rec.session))
                offset += tp
        return members, offset, tuple(identity)

    # ------------------------------------------------------------------ trainer requests

    def _remember(self, key: tuple[int, int], reply: p.Message) -> None:
        self._replies[key] = reply
        while len(self._replies) > REPLIES_KEPT:
            del self._replies[next(iter(self._replies))]

    def on_request(self, peer: bytes, msg: p.Message, holder: str, now: float) -> list:
        """A trainer's weight request of the current session (coordinator/trainer.py checked it); ``holder``, the
        client attached, names the holder of a lock it takes."""
        if type(msg) is p.UpdateWeights:
            return self.on_update(peer, msg, holder, now)
        return self._requests[type(msg)](peer, msg, now)

    def on_update(self, peer: bytes, msg: p.UpdateWeights, holder: str, now: float) -> list:
        key = (msg.session, msg.req)
        lock = self.lock
        if key in self._replies:
            return [Send(peer, self._replies[key])]  # a resent request: the same answer
        if lock is not None and lock.session == msg.session and lock.answers_update(msg.req):
            return self._feed(ev.UpdateResent(peer, msg.req, now), now)

        def bad(code: str, why: str) -> list:
            return [Send(peer, p.Error(code, why, msg.req))]

        if msg.kind not in KINDS:
            return bad("bad_request", f"weight update kind must be one of {KINDS}, got {msg.kind!r}")
        if not (msg.timeout > 0):
            return bad("bad_request", f"weight update timeout must be > 0 seconds, got {msg.timeout!r}")
        if msg.kind == WeightKind.DISK and not msg.path:
            return bad("bad_request", "a disk weight update needs a checkpoint path")
        if msg.kind in BROADCASTS and not (msg.master_address and 0 < msg.master_port < 65536 and msg.backend):
            why = (
                "a distributed weight update needs master_address, master_port and backend, got "
                f"{msg.master_address!r}:{msg.master_port} {msg.backend!r}"
            )
            return bad("bad_request", why)
        if msg.kind == WeightKind.CATCH_UP:
            return self._begin_catch_up(peer, msg, holder, now)
        out: list = []
        if lock is not None:
            if lock.session != msg.session:
                why = (
                    f"weight update {lock.update_id} (version {lock.version}) of {lock.holder} is in flight "
                    f"(step {lock.step}, deadline in {lock.deadline - now:.0f}s); one update at a time"
                )
                return bad("weights_busy", why)
            # Its own trainer begins anew: the update it left in flight was given up.
            out += self._feed(ev.Replaced(), now)
        if msg.version <= self.log.version:
            why = (
                f"weight version {msg.version} is not greater than the fleet's current version "
                f"{self.log.version}; versions never move backwards"
            )
            return out + bad("weights_version", why)
        self._started_any = True
        self._take_lock(msg, msg.path, holder, now)
        agents = tuple(rec.agent_id for rec in self._membership.alive())
        if msg.kind == WeightKind.DISK:
            return out + self._feed(ev.BeginDisk(peer, msg.req, agents), now) + self._advance(now)
        return out + self._feed(ev.BeginBroadcast(peer, msg, agents), now) + self._advance(now)

    def _begin_catch_up(self, peer: bytes, msg: p.UpdateWeights, holder: str, now: float) -> list:
        """The fleet's current version again, to the engines behind it only; the others keep serving.

        Answered at once (``world_size`` 0) when no engine is behind, or when the fleet's weights came
        from disk (agents re-load those themselves). Admission goes on meanwhile (``stops_admission``)."""
        lock = self.lock
        if lock is not None:
            why = (
                f"weight update {lock.update_id} (version {lock.version}) of {lock.holder} is in flight "
                f"(step {lock.step}); one update at a time"
            )
            return [Send(peer, p.Error("weights_busy", why, msg.req))]
        if msg.version != self.log.version:
            why = (
                f"a catch-up sends the fleet's current version {self.log.version}, got version {msg.version} "
                "(push a new version with update_weights)"
            )
            return [Send(peer, p.Error("weights_version", why, msg.req))]
        behind = self.behind() if self.log.kind == WeightKind.DISTRIBUTED else {}
        if not behind:
            return [Send(peer, p.Ok(msg.req, {"update_id": 0, "world_size": 0, "engines": {}}))]
        self._take_lock(msg, "", holder, now)
        return self._feed(ev.BeginBroadcast(peer, msg, tuple(sorted(behind))), now) + self._advance(now)

    def _take_lock(self, msg: p.UpdateWeights, path: str, holder: str, now: float) -> Update:
        """A new update of ``msg``, by ``holder``, holds the weight lock (its id: generation, then a counter)."""
        self._counter += 1
        self.lock = Update(
            (self._membership.generation << 32) | self._counter,
            WeightKind(msg.kind),
            msg.version,
            path,
            msg.session,
            holder,
            msg.timeout,
            now + msg.timeout,
            seen=now,
        )
        return self.lock

    def _form_group(self, lock: Update):
        """Every agent answered ``begin``: the group is the engines confirmed (the lock's event for it)."""
        msg = lock.request
        members, world_size, identity = self.group(lock.confirmed)
        identity = (identity, msg.session, msg.master_address, msg.backend)
        catch_up = lock.kind is WeightKind.CATCH_UP
        new = catch_up or identity != self._last_group  # a catch-up's group is its own, and ends with it
        name = f"rollfleet-{lock.update_id:x}" if new else self._group_name
        if members and new and not catch_up:
            self._last_group, self._group_name = identity, name
        return formation(lock, members, world_size, name, new)

    def _current(self, peer: bytes, msg: p.Message) -> tuple[Update | None, list]:
        """The distributed update ``msg`` names, or the error to answer."""
        lock = self.lock
        if lock is not None and lock.update_id == msg.update_id and lock.session == msg.session:
            return lock, []
        why = self._failed.get(msg.update_id) or f"no weight update {msg.update_id:#x} of this trainer is in flight"
        return None, [Send(peer, p.Error("weights", why, msg.req))]

    def on_bucket(self, peer: bytes, msg: p.WeightBucket, now: float) -> list:
        lock, err = self._current(peer, msg)
        if lock is None:
            return err
        return self._feed(ev.Bucket(peer, msg, now), now)

    def on_finish(self, peer: bytes, msg: p.FinishWeights, now: float) -> list:
        key = (msg.session, msg.req)
        if key in self._replies:
            return [Send(peer, self._replies[key])]
        lock, err = self._current(peer, msg)
        if lock is None:
            return err
        return self._feed(ev.FinishAsked(peer, msg, now), now) + self._advance(now)

    def on_abort_request(self, peer: bytes, msg: p.AbortWeights, now: float) -> list:
        """The trainer's own side of its update failed: end it now, not at its deadline."""
        lock = self.lock
        out: list = []
        if lock is not None and lock.update_id == msg.update_id and lock.session == msg.session:
            out = self._feed(ev.TrainerAborted(msg.why), now)
        return out + [Send(peer, p.Ok(msg.req, {"update_id": msg.update_id}))]

    def on_alive(self, peer: bytes, msg: p.WeightsAlive, now: float) -> list:
        """The trainer of a broadcast in flight is alive (its heartbeat while the call runs)."""
        lock = self.lock
        if lock is not None and lock.session == msg.session:
            lock.seen = now
        failed = self._failed.get(msg.update_id) if msg.update_id else None
        return [Send(peer, p.Ok(msg.req, {"update_id": lock.update_id if lock is not None else 0, "failed": failed}))]

    def trainer_gone(self, session: int, why: str, now: float) -> list:
        """The trainer of ``session`` was fenced or detached: its distributed update cannot finish."""
        lock = self.lock
        if lock is None or lock.session != session:
            return []
        return self._feed(ev.TrainerGone(why), now)

    # ------------------------------------------------------------------ agents

    def _to(self, agent_id: str, msg: p.Message) -> Send:
        rec = self._membership.agents.get(agent_id)
        if self.lock is not None and rec is not None:
            self.lock.sessions[agent_id] = rec.session
        return Send(agent_id, msg)

    def on_report(self, rec: AgentRecord, msg: p.WeightsReport, now: float) -> list:
        """A report of agent ``rec``'s current session (coordinator/admission.py checked it)."""
        lock = self.lock
        if lock is None or msg.update_id != lock.update_id or msg.step == WeightStep.ABORT:
            return []  # a report of an update already over
        if msg.ok:  # the status shows an engine's new version now, not at the agent's next heartbeat
            rec.note_versions(msg.engines)
        if not msg.ok:
            return self._feed(ev.StepFailed(rec.agent_id, msg.step, msg.error), now)
        event = ev.Reported(rec.agent_id, msg.step, msg.seq, dict(msg.engines), list(msg.members))
        return self._feed(event, now) + self._advance(now)

    def on_register(self, agent_id: str, now: float) -> list[Send]:
        """An agent (re)registered during an update: it joins a disk update; a broadcast group loses it
        (``_lost``), and outside the group it gets ``WeightsFinish``."""
        if self.lock is None:
            return []
        return self._feed(ev.Registered(agent_id), now)

    def note_engines(self, engines: list) -> list:
        """Engines an agent registered with: a version above the log's (an update recorded nowhere, e.g.
        a coordinator that died before recording it) becomes the log's, at the first registrations only."""
        if self._started_any or self.lock is not None:
            return []
        versions = [e.version for e in engines if e.version is not None]
        top = max(versions, default=-1)
        if top <= self.log.version:
            return []
        self.log = WeightLog(
            top, self.log.updates + 1, WeightKind.DISTRIBUTED.value, "", self.log.boundaries + (self._leases.lease_hwm,)
        )
        return [SetWeights(self.log)]

    # ------------------------------------------------------------------ progress

    def _feed(self, event: object, now: float) -> list:
        """``event`` through the lock's table (coordinator/weight_lock.py); its effects carried out."""
        out: list = []
        for effect in transition(self.lock, event):
            out += self._effects[type(effect)](effect, now)
        return out

    def _send_agent(self, effect: ev.ToAgent, now: float) -> list:
        return [self._to(effect.agent, effect.msg)]

    def _answer(self, effect: ev.Answer, now: float) -> list:
        if effect.key is not None:
            self._remember(effect.key, effect.msg)
        return [Send(effect.peer, effect.msg)]

    def _lost(self) -> list[str]:
        """Agents sent a step of the update that are dead or registered again since."""
        agents = self._membership.agents
        lock = self.lock
        return [
            a
            for a, s in lock.sessions.items()
            if a not in agents or agents[a].status != ALIVE or agents[a].session != s
        ]

    def _advance(self, now: float) -> list:
        """Agents lost meanwhile, then the next step of an update that awaits nothing (until one awaits)."""
        out: list = []
        while (lock := self.lock) is not None:
            for agent in self._lost():
                out += self._feed(lost(lock, agent), now)
                if self.lock is None:
                    return out
            if not lock.settled:
                return out
            alive = tuple(r.agent_id for r in self._membership.alive())
            out += self._feed(self._form_group(lock) if lock.forming else ev.Settled(alive), now)
        return out

    def _release(self, effect: ev.Release, now: float) -> list:
        self.lock = None
        return []  # admission resumes at the turn's pump (coordinator/core.py)

    def _complete(self, effect: ev.Record, now: float) -> list:
        """The update is done everywhere: record it, then answer its trainer."""
        lock, self.lock = self.lock, None
        self.partial = ""
        log = self.log
        self.log = WeightLog(
            lock.version,
            log.updates + 1,
            lock.kind.value,
            lock.path if lock.kind is WeightKind.DISK else "",
            log.boundaries + (self._leases.lease_hwm,),
        )
        then = self._answer(effect.answer, now) if effect.answer is not None else []
        return [Persist([SetWeights(self.log)], then)]

    def abort(self, why: str, now: float) -> list:
        """End the update in flight: agents abort it, the waiting call gets ``why``, the lock is released."""
        lock, self.lock = self.lock, None
        if lock is None:
            return []
        catch_up = lock.kind is WeightKind.CATCH_UP
        if not catch_up:
            self._last_group = None  # a catch-up's group was its own: the fleet's stays
        if (lock.kind is WeightKind.DISK or lock.buckets) and not catch_up:
            self.partial = why
        self._failed[lock.update_id] = why
        while len(self._failed) > REPLIES_KEPT:
            del self._failed[next(iter(self._failed))]
        path = self.log.path if self.log.kind == WeightKind.DISK else ""
        out: list = [
            Send(r.agent_id, p.WeightsAbort(lock.update_id, self.log.version, path, catch_up))
            for r in self._membership.alive()
            if not catch_up or r.agent_id in lock.sessions
        ]
        if lock.waiter is not None:
            error = p.Error("weights", why, lock.waiter[1])
            self._remember((lock.session, lock.waiter[1]), error)
            out.append(Send(lock.waiter[0], error))
        return out

    def tick(self, now: float) -> list:
        """The lock's deadline, its trainer's silence, and agents lost meanwhile."""
        lock = self.lock
        if lock is None:
            return []
        if now > lock.deadline:
            return self._feed(ev.DeadlinePassed(), now)
        ttl = self._liveness.ttl
        if now - lock.seen > ttl:
            out = self._feed(ev.TrainerSilent(now - lock.seen, ttl), now)  # a disk update does not need its trainer
            if self.lock is None:
                return out
        return self._advance(now)
