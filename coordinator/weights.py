"""Weight updates (docs/weights.md): the weight lock and each update's steps. Pure: events in, effects out.

One update at a time. ``UpdateWeights`` takes the **weight lock** for its trainer session, with a
deadline (``timeout``, restarted by every bucket and by ``FinishWeights``); while it is held no
prompt is leased (``core.pump``). Then:

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common import protocol as p
from coordinator.effects import Send
from coordinator.membership import ALIVE
from coordinator.records import LedgerSnapshot, SetWeights, WeightLog

if TYPE_CHECKING:
    from coordinator.core import CoordinatorCore

KINDS = ("disk", "distributed", "catch_up")
BROADCASTS = ("distributed", "catch_up")
"""Kinds whose tensors come from the trainer over a process group (the trainer is rank 0)."""
MEMBER_STATES = ("healthy", "stale")
"""Engine states that join a broadcast group (up; a stale one needs the broadcast to serve again)."""
REPLIES_KEPT = 64


@dataclass
class Update:
    """The update holding the weight lock."""

    update_id: int
    kind: str
    version: int
    path: str
    session: int
    holder: str
    timeout: float
    deadline: float
    step: str
    waiter: tuple[bytes, int] | None = None
    """Whom the result goes to: the UpdateWeights (disk) or the FinishWeights (distributed)."""
    sessions: dict[str, int] = field(default_factory=dict)
    """Agents sent a step, with the session they had: one that changes was lost."""
    waiting: set[str] = field(default_factory=set)
    """Agents whose ``disk``/``finish`` report is awaited."""
    members: dict[str, dict[str, int]] = field(default_factory=dict)
    """Distributed: agent -> {"agent/engine": rank offset}."""
    init_pending: set[str] = field(default_factory=set)
    buckets: dict[int, set[str]] = field(default_factory=dict)
    """Forwarded bucket seq -> agents whose report is awaited."""
    finishing: bool = False
    engines: dict[str, dict] = field(default_factory=dict)
    """Agent -> ``{engine: version}`` from its last report."""
    group_name: str = ""
    world_size: int = 0
    seen: float = 0.0
    """When its trainer was last heard of (any message of its session about the update)."""
    confirmed: dict[str, list[str]] = field(default_factory=dict)
    """Distributed: agent -> the engines it confirmed for the group (its ``begin`` report)."""
    formed: bool = False
    """Distributed: the group is chosen and the ``UpdateWeights`` answered."""
    request: p.UpdateWeights | None = None
    """Distributed: the request that began it (its address, port and backend form the group)."""
    verify: dict = field(default_factory=dict)
    """Distributed: ``FinishWeights.verify``, passed on to every agent's finish step."""


class WeightUpdates:
    def __init__(self, core: CoordinatorCore, restored: LedgerSnapshot):
        self.core = core
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

    # ------------------------------------------------------------------ views

    @property
    def locked(self) -> bool:
        return self.lock is not None

    @property
    def stops_admission(self) -> bool:
        """No prompt is leased: an update that changes the fleet's weights runs (a catch-up does not)."""
        return self.lock is not None and self.lock.kind != "catch_up"

    def behind(self) -> dict[str, list[str]]:
        """Alive agents' engines that are up but out of the pool (``stale``): agent -> engine names."""
        out: dict[str, list[str]] = {}
        for rec in self.core.membership.alive():
            names = [str(e["name"]) for e in rec.engines if e.get("state") == "stale" and "name" in e]
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
        serving = [e.get("version") for e in engines if isinstance(e, dict) and e.get("state", "healthy") == "healthy"]
        known = [v for v in serving if isinstance(v, int) and not isinstance(v, bool)]
        return bool(serving) and len(known) == len(serving) and max(known) < self.log.version

    def statistics(self, now: float) -> dict:
        lock = self.lock
        engines = {}
        for rec in self.core.membership.alive():
            for e in rec.engines:
                if e.get("state") in MEMBER_STATES and "name" in e:
                    engines[f"{rec.agent_id}/{e['name']}"] = e.get("version")
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
        for rec in sorted(self.core.membership.alive(), key=lambda r: r.agent_id):
            names = set(confirmed.get(rec.agent_id, ()))
            known = {str(e["name"]): e for e in rec.engines if "name" in e}
            for e in sorted(
                (known.get(n, {"name": n}) for n in names),
                key=lambda e: str(e["name"]),
            ):
                tp = e.get("tp") or 1
                tp = tp if isinstance(tp, int) and tp > 0 else 1
                key = f"{rec.agent_id}/{e['name']}"
                members.setdefault(rec.agent_id, {})[key] = offset
                identity.append((key, e.get("url"), tp, rec.session))
                offset += tp
        return members, offset, tuple(identity)

    # ------------------------------------------------------------------ trainer requests

    def _refuse(self, peer: bytes, msg: p.Message) -> list | None:
        return self.core.trainer.session_error(peer, msg.session, msg.req)

    def _remember(self, key: tuple[int, int], reply: p.Message) -> None:
        self._replies[key] = reply
        while len(self._replies) > REPLIES_KEPT:
            del self._replies[next(iter(self._replies))]

    def on_update(self, peer: bytes, msg: p.UpdateWeights, now: float) -> list:
        refused = self._refuse(peer, msg)
        if refused:
            return refused
        key = (msg.session, msg.req)
        lock = self.lock
        if key in self._replies:
            return [Send(peer, self._replies[key])]  # a resent request: the same answer
        if lock is not None and lock.session == msg.session and lock.waiter is not None:
            if lock.waiter[1] == msg.req and not lock.finishing:
                lock.waiter = (peer, msg.req)  # a resend while it runs: answered when it ends (or its group forms)
                lock.seen = now
                return []

        def bad(code: str, why: str) -> list:
            return [Send(peer, p.Error(code, why, msg.req))]

        if msg.kind not in KINDS:
            return bad("bad_request", f"weight update kind must be one of {KINDS}, got {msg.kind!r}")
        if not (msg.timeout > 0):
            return bad("bad_request", f"weight update timeout must be > 0 seconds, got {msg.timeout!r}")
        if msg.kind == "disk" and not msg.path:
            return bad("bad_request", "a disk weight update needs a checkpoint path")
        if msg.kind in BROADCASTS and not (msg.master_address and 0 < msg.master_port < 65536 and msg.backend):
            why = (
                "a distributed weight update needs master_address, master_port and backend, got "
                f"{msg.master_address!r}:{msg.master_port} {msg.backend!r}"
            )
            return bad("bad_request", why)
        if msg.kind == "catch_up":
            return self._begin_catch_up(peer, msg, now)
        out: list = []
        if lock is not None:
            if lock.session != msg.session:
                why = (
                    f"weight update {lock.update_id} (version {lock.version}) of {lock.holder} is in flight "
                    f"(step {lock.step}, deadline in {lock.deadline - now:.0f}s); one update at a time"
                )
                return bad("weights_busy", why)
            # Its own trainer begins anew: the update it left in flight was given up.
            out += self.abort(f"weight update {lock.update_id} was replaced by a new update from its trainer", now)
        if msg.version <= self.log.version:
            why = (
                f"weight version {msg.version} is not greater than the fleet's current version "
                f"{self.log.version}; versions never move backwards"
            )
            return out + bad("weights_version", why)
        self._started_any = True
        update = self._take_lock(msg, msg.path, now)
        if msg.kind == "disk":
            update.waiter = (peer, msg.req)
            for rec in self.core.membership.alive():
                out.append(self._to(rec.agent_id, p.WeightsFromDisk(update.update_id, msg.version, msg.path)))
                update.waiting.add(rec.agent_id)
            return out + self._advance(now)
        return out + self._begin_distributed(peer, msg, update, now)

    def _begin_distributed(
        self, peer: bytes, msg: p.UpdateWeights, update: Update, now: float, agents: list[str] | None = None
    ) -> list:
        """Every alive agent (or just ``agents``) confirms its engines; the group is formed once they all answered."""
        update.request = msg
        update.waiter = (peer, msg.req)
        update.step = "begin"
        out: list = []
        catch_up = msg.kind == "catch_up"
        for agent_id in agents if agents is not None else [r.agent_id for r in self.core.membership.alive()]:
            out.append(self._to(agent_id, p.WeightsBegin(update.update_id, msg.version, catch_up)))
            update.waiting.add(agent_id)
        return out + self._advance(now)

    def _begin_catch_up(self, peer: bytes, msg: p.UpdateWeights, now: float) -> list:
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
        behind = self.behind() if self.log.kind == "distributed" else {}
        if not behind:
            return [Send(peer, p.Ok(msg.req, {"update_id": 0, "world_size": 0, "engines": {}}))]
        update = self._take_lock(msg, "", now)
        return self._begin_distributed(peer, msg, update, now, sorted(behind))

    def _take_lock(self, msg: p.UpdateWeights, path: str, now: float) -> Update:
        """A new update of ``msg`` holds the weight lock (its id: generation, then a counter)."""
        self._counter += 1
        self.lock = Update(
            (self.core.membership.generation << 32) | self._counter,
            msg.kind,
            msg.version,
            path,
            msg.session,
            self.core.trainer.client,
            msg.timeout,
            now + msg.timeout,
            msg.kind,
            seen=now,
        )
        return self.lock

    def _form_group(self, now: float) -> list:
        """Every agent confirmed its engines: the group is those engines; answer the ``UpdateWeights``."""
        update = self.lock
        msg = update.request
        peer, req = update.waiter
        members, world_size, identity = self.group(update.confirmed)
        if not members and update.kind == "catch_up":
            # Every engine behind came back another way meanwhile (a restart that loaded the version,
            # an engine that died): nothing to send. The agents asked confirmed none and resumed.
            self.lock = None
            reply = p.Ok(req, {"update_id": update.update_id, "world_size": 0, "engines": {}})
            self._remember((msg.session, req), reply)
            return [Send(peer, reply)] + self.core.pump(now)
        if not members:
            return self.abort(
                f"weight update {update.update_id:#x} to version {update.version}: no engine is up to receive it "
                "(no alive agent confirmed an engine: every one is dead, restarting, or still held by a failed update)",
                now,
            )
        update.waiter, update.formed = None, True
        identity = (identity, msg.session, msg.master_address, msg.backend)
        out: list = []
        catch_up = update.kind == "catch_up"
        init = catch_up or identity != self._last_group  # a catch-up's group is its own, and ends with it
        update.members, update.world_size, update.step = members, world_size, "group"
        update.group_name = f"rollfleet-{update.update_id:x}" if init else self._group_name
        if init:
            if not catch_up:
                self._last_group, self._group_name = identity, update.group_name
            update.step = "init"
            for agent_id, offsets in members.items():
                out.append(
                    self._to(
                        agent_id,
                        p.WeightsInitGroup(
                            update.update_id,
                            msg.master_address,
                            msg.master_port,
                            world_size,
                            update.group_name,
                            msg.backend,
                            dict(offsets),
                        ),
                    )
                )
                update.init_pending.add(agent_id)
        result = {
            "update_id": update.update_id,
            "world_size": world_size,
            "group_name": update.group_name,
            "init": init,
            "rank_offsets": {k: v for offsets in members.values() for k, v in offsets.items()},
        }
        reply = p.Ok(req, result)
        self._remember((msg.session, req), reply)
        return out + [Send(peer, reply)]

    def _current(self, peer: bytes, msg: p.Message) -> tuple[Update | None, list]:
        """The distributed update ``msg`` names, or the error to answer."""
        lock = self.lock
        if lock is not None and lock.update_id == msg.update_id and lock.session == msg.session:
            return lock, []
        why = self._failed.get(msg.update_id) or f"no weight update {msg.update_id:#x} of this trainer is in flight"
        return None, [Send(peer, p.Error("weights", why, msg.req))]

    def on_bucket(self, peer: bytes, msg: p.WeightBucket, now: float) -> list:
        refused = self._refuse(peer, msg)
        if refused:
            return refused
        lock, err = self._current(peer, msg)
        if lock is None:
            return err
        if lock.kind not in BROADCASTS or lock.finishing or not lock.formed:
            return [Send(peer, p.Error("bad_request", f"update {lock.update_id:#x} takes no more buckets", msg.req))]
        lock.deadline, lock.seen = now + lock.timeout, now
        if msg.seq in lock.buckets:
            return [Send(peer, p.Ok(msg.req, {"seq": msg.seq}))]  # resent: forwarded already
        lock.step = "bucket"
        lock.buckets[msg.seq] = set(lock.members)
        out = [
            self._to(
                agent_id,
                p.WeightsBucket(
                    lock.update_id,
                    msg.seq,
                    lock.group_name,
                    list(msg.names),
                    list(msg.dtypes),
                    [list(s) for s in msg.shapes],
                ),
            )
            for agent_id in lock.members
        ]
        return out + [Send(peer, p.Ok(msg.req, {"seq": msg.seq}))]

    def on_finish(self, peer: bytes, msg: p.FinishWeights, now: float) -> list:
        refused = self._refuse(peer, msg)
        if refused:
            return refused
        key = (msg.session, msg.req)
        if key in self._replies:
            return [Send(peer, self._replies[key])]
        lock, err = self._current(peer, msg)
        if lock is None:
            return err
        if lock.kind not in BROADCASTS:
            return [Send(peer, p.Error("bad_request", f"update {lock.update_id:#x} is a disk update", msg.req))]
        if not lock.formed:
            return [Send(peer, p.Error("bad_request", f"update {lock.update_id:#x} has no group yet", msg.req))]
        lock.waiter = (peer, msg.req)
        lock.verify = dict(msg.verify)
        lock.finishing = True
        lock.deadline, lock.seen = now + lock.timeout, now
        return self._advance(now)

    def on_abort_request(self, peer: bytes, msg: p.AbortWeights, now: float) -> list:
        """The trainer's own side of its update failed: end it now, not at its deadline."""
        refused = self._refuse(peer, msg)
        if refused:
            return refused
        lock = self.lock
        out: list = []
        if lock is not None and lock.update_id == msg.update_id and lock.session == msg.session:
            why = msg.why or "no detail"
            out = self.abort(
                f"weight update {lock.update_id:#x} to version {lock.version} failed in its trainer: {why}", now
            )
        return out + [Send(peer, p.Ok(msg.req, {"update_id": msg.update_id}))]

    def on_alive(self, peer: bytes, msg: p.WeightsAlive, now: float) -> list:
        """The trainer of a broadcast in flight is alive (its heartbeat while the call runs)."""
        refused = self._refuse(peer, msg)
        if refused:
            return refused
        lock = self.lock
        if lock is not None and lock.session == msg.session:
            lock.seen = now
        failed = self._failed.get(msg.update_id) if msg.update_id else None
        return [Send(peer, p.Ok(msg.req, {"update_id": lock.update_id if lock is not None else 0, "failed": failed}))]

    def trainer_gone(self, session: int, why: str, now: float) -> list:
        """The trainer of ``session`` was fenced or detached: its distributed update cannot finish."""
        lock = self.lock
        if lock is None or lock.session != session or lock.kind not in BROADCASTS:
            return []
        return self.abort(f"weight update {lock.update_id:#x} aborted: {why}", now)

    # ------------------------------------------------------------------ agents

    def _to(self, agent_id: str, msg: p.Message) -> Send:
        rec = self.core.membership.agents.get(agent_id)
        if self.lock is not None and rec is not None:
            self.lock.sessions[agent_id] = rec.session
        return Send(agent_id, msg)

    def on_report(self, peer: bytes, msg: p.WeightsReport, now: float) -> list:
        rec = self.core.admission.session_agent(peer, msg.session, now)
        if rec is None:
            return self.core.admission.fence(peer, msg)
        lock = self.lock
        if lock is None or msg.update_id != lock.update_id or msg.step == "abort":
            return []  # a report of an update already over
        agent = rec.agent_id
        if msg.step in ("disk", "finish"):
            # The agent's serving engines once the update is done there (none: every one died or is
            # restarting); the answer lists these, never an earlier step's (a paused engine's old version).
            lock.engines[agent] = dict(msg.engines)
        if msg.ok:  # the status shows an engine's new version now, not at the agent's next heartbeat
            for e in rec.engines:
                if e.get("name") in msg.engines:
                    e["version"] = msg.engines[e["name"]]
        if not msg.ok:
            error = msg.error or "no detail"
            if agent not in error:
                error = f"agent {agent}: {error}"
            return self.abort(
                f"weight update {lock.update_id:#x} to version {lock.version} failed at step {msg.step}: {error}", now
            )
        if msg.step == "begin" and not lock.formed:
            lock.confirmed[agent] = [str(n) for n in msg.members]
            lock.waiting.discard(agent)
        elif msg.step in ("disk", "finish"):
            lock.waiting.discard(agent)
        elif msg.step == "init":
            lock.init_pending.discard(agent)
        elif msg.step == "bucket" and msg.seq in lock.buckets:
            lock.buckets[msg.seq].discard(agent)
        return self._advance(now)

    def on_register(self, agent_id: str, now: float) -> list[Send]:
        """An agent (re)registered during an update: it joins a disk update; a broadcast group loses it."""
        lock = self.lock
        if lock is None:
            return []
        if lock.kind == "disk":
            lock.waiting.add(agent_id)
            return [self._to(agent_id, p.WeightsFromDisk(lock.update_id, lock.version, lock.path))]
        return []  # distributed: lost by ``_lost`` if it was a member; outside the group it gets WeightsFinish

    def note_engines(self, engines: list) -> list:
        """Engines an agent registered with: a version above the log's (an update recorded nowhere, e.g.
        a coordinator that died before recording it) becomes the log's, at the first registrations only."""
        if self._started_any or self.lock is not None:
            return []
        versions = [e.get("version") for e in engines if isinstance(e.get("version"), int)]
        top = max(versions, default=-1)
        if top <= self.log.version:
            return []
        self.log = WeightLog(top, self.log.updates + 1, "distributed", "", self.log.boundaries + (self._lease_hwm(),))
        return [SetWeights(self.log)]

    # ------------------------------------------------------------------ progress

    def _lost(self) -> list[str]:
        """Agents sent a step of the update that are dead or registered again since."""
        agents = self.core.membership.agents
        lock = self.lock
        return [
            a
            for a, s in lock.sessions.items()
            if a not in agents or agents[a].status != ALIVE or agents[a].session != s
        ]

    def _advance(self, now: float) -> list:
        lock = self.lock
        if lock is None:
            return []
        for agent in self._lost():
            if lock.kind in BROADCASTS and agent in lock.members and lock.formed and lock.step != "finish":
                return self.abort(
                    f"weight update {lock.update_id:#x} aborted: agent {agent}, in the group, was lost", now
                )
            # A disk update goes on without it: it loads the recorded checkpoint when it registers.
            lock.sessions.pop(agent, None)
            lock.waiting.discard(agent)
            lock.init_pending.discard(agent)
            for waiting in lock.buckets.values():
                waiting.discard(agent)
        if lock.kind in BROADCASTS and not lock.formed:
            return [] if lock.waiting else self._form_group(now)
        if lock.kind in BROADCASTS and lock.step != "finish":
            if not (lock.finishing and not lock.init_pending and not any(lock.buckets.values())):
                return []
            lock.step = "finish"
            # A catch-up finishes on its members only; a version update everywhere (engines outside
            # the group are behind it now).
            alive = [r.agent_id for r in self.core.membership.alive()]
            out = []
            for agent_id in alive if lock.kind == "distributed" else [a for a in alive if a in lock.members]:
                out.append(self._to(agent_id, p.WeightsFinish(lock.update_id, lock.version, lock.verify)))
                lock.waiting.add(agent_id)
            return out + self._advance(now)
        if lock.waiting:
            return []
        return self._complete(now)

    def _lease_hwm(self) -> int:
        return self.core.admission.lease_hwm

    def _complete(self, now: float) -> list:
        lock, self.lock = self.lock, None
        engines = {f"{a}/{name}": v for a, engs in sorted(lock.engines.items()) for name, v in sorted(engs.items())}
        if lock.kind == "catch_up":  # the version is the log's already: nothing to record
            caught = {key for offsets in lock.members.values() for key in offsets}
            engines = {key: v for key, v in engines.items() if key in caught}
            reply = p.Ok(lock.waiter[1], {"update_id": lock.update_id, "version": lock.version, "engines": engines})
            self._remember((lock.session, lock.waiter[1]), reply)
            return [Send(lock.waiter[0], reply)] + self.core.pump(now)
        self.partial = ""
        log = self.log
        self.log = WeightLog(
            lock.version,
            log.updates + 1,
            lock.kind,
            lock.path if lock.kind == "disk" else "",
            log.boundaries + (self._lease_hwm(),),
        )
        then = []
        if lock.waiter is not None:
            reply = p.Ok(lock.waiter[1], {"update_id": lock.update_id, "version": lock.version, "engines": engines})
            self._remember((lock.session, lock.waiter[1]), reply)
            then.append(Send(lock.waiter[0], reply))
        return [self.core.persist([SetWeights(self.log)], then)] + self.core.pump(now)

    def abort(self, why: str, now: float) -> list:
        """End the update in flight: agents abort it, the waiting call gets ``why``, the lock is released."""
        lock, self.lock = self.lock, None
        if lock is None:
            return []
        catch_up = lock.kind == "catch_up"
        if not catch_up:
            self._last_group = None  # a catch-up's group was its own: the fleet's stays
        if (lock.kind == "disk" or lock.buckets) and not catch_up:
            self.partial = why
        self._failed[lock.update_id] = why
        while len(self._failed) > REPLIES_KEPT:
            del self._failed[next(iter(self._failed))]
        path = self.log.path if self.log.kind == "disk" else ""
        out: list = [
            Send(r.agent_id, p.WeightsAbort(lock.update_id, self.log.version, path, catch_up))
            for r in self.core.membership.alive()
            if not catch_up or r.agent_id in lock.sessions
        ]
        if lock.waiter is not None:
            error = p.Error("weights", why, lock.waiter[1])
            self._remember((lock.session, lock.waiter[1]), error)
            out.append(Send(lock.waiter[0], error))
        return out + self.core.pump(now)

    def tick(self, now: float) -> list:
        """The lock's deadline, and agents lost meanwhile."""
        lock = self.lock
        if lock is None:
            return []
        if now > lock.deadline:
            return self.abort(
                f"weight update {lock.update_id:#x} to version {lock.version} missed its deadline "
                f"({lock.timeout:g}s) at step {lock.step}: waiting for {self._pending(lock)}",
                now,
            )
        ttl = self.core.liveness.ttl
        if lock.kind in BROADCASTS and now - lock.seen > ttl:
            return self.abort(
                f"weight update {lock.update_id:#x} to version {lock.version} aborted at step {lock.step}: its "
                f"trainer {lock.holder} was silent for {now - lock.seen:.1f}s (session TTL {ttl:g}s), presumed dead",
                now,
            )
        return self._advance(now)

    def _pending(self, lock: Update) -> str:
        agents = set(lock.waiting) | set(lock.init_pending) | {a for w in lock.buckets.values() for a in w}
        if agents:
            return "agents " + ", ".join(sorted(agents))
        return f"the trainer {lock.holder}" if lock.kind in BROADCASTS else "nothing"
