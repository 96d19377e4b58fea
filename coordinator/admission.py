"""Admission: the agents' side of the core — registration, receipts, outcomes and liveness.

Handlers for every agent message (``Register``, ``Heartbeat``, ``Receipt``,
``Filtered``, ``Release``, ``Capacity``, ``EvalResult``) and the clock (``tick``:
TTL and retirement), all pure: events in, effects out. The leases themselves are
the lease book's (``coordinator/lease_book.py``): admission starts and ends them as
the agents' messages say, and hands each outcome to the lease's prompt source.

Invariants kept here:
- Exactly once: a prompt ``(data_epoch, index)`` is accepted at most once.
  A receipt for a prompt already READY/DELIVERED under another group key is
  refused and the agent deletes that group; a retransmitted receipt (same
  key) is acknowledged again.
- Commit before acknowledgement: ``ReceiptAck`` and ``Welcome`` (with its
  acks) travel in ``Persist.then``, after the ledger commit.
- One registration per attempt: a resent Register (same agent id,
  incarnation and ``req``) whose session is still current gets that session's
  Welcome again, not a new session (coordinator/membership.py).
- Fencing: every agent message carries its session; a superseded or unknown
  session gets ``Fence`` and changes nothing. A lease is ended only by the
  agent that holds it.
- A lease lost in transit (a dropped Grant, Filtered or Release) is released
  by heartbeat reconciliation, never leaked.
- A silent agent's work is held, not handed on (``LeaseBook.held``): when an
  agent is presumed dead (silent past the TTL) its training leases stay its own,
  their prompts LEASED, so when a partition heals the groups it made meanwhile are
  accepted, not refused as duplicates of a second agent's copies. Held leases
  are out of the in-flight bound (the agent's capacity has left the pool, so
  live agents get the work the waiting batches need: no trainer waits on a
  silent agent while there is other work). They are pending again when their
  agent is retired or re-registers without them.
- Nothing reaches an agent before its Welcome: the Welcome travels in the
  register's ``Persist.then`` and the grants that fill the new capacity come from
  the pump after it (coordinator/core.py), in a later ``Persist``; the shell sends
  the messages for one destination in order.
- A lease goes only where it can start: an agent none of whose serving engines holds the fleet's
  weights (a Register is written before the Welcome names them; a node re-joining after updates is on
  launch weights) has capacity 0 until its ``Capacity`` names one that does (``_capacity``). Otherwise
  a prompt pending again, first in line, would wait there for a re-load while others take fresh ones.
- A lease given back after a ``Stop`` (over-sampling: a ``Release`` with
  reason ``ReleaseReason.STOPPED``) is pending again, first in line, and counted
  for the next batch (``coordinator/oversampling.py``); it is not a failure.
- Failing user code loses no data: a group whose reward or filter raised (a ``Release`` with
  reason ``failed`` and its ``Failure``) is an error outcome, not a filter verdict; its source decides
  (coordinator/sources.py: retried, filtered after ``MAX_FAILURES``, starvation).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from common import protocol as p
from coordinator.effects import Persist, Send
from coordinator.frontier import DELIVERED, FILTERED, READY
from coordinator.membership import AgentRecord
from coordinator.records import TRAIN, Lease, Prompt

if TYPE_CHECKING:
    from coordinator.batches import Batches
    from coordinator.core_settings import CoreSettings
    from coordinator.counters import CoreCounters
    from coordinator.evaluation import Evaluations
    from coordinator.faces import PauseFace, WeightsFace
    from coordinator.lease_book import LeaseBook
    from coordinator.membership import Membership
    from coordinator.mix_frontier import MixFrontier
    from coordinator.oversampling import OverSampling
    from coordinator.ready import ReadyGroups
    from coordinator.sources import TrainingSource


class Admission:
    """The agents' messages that start and end leases, and the clock that expires silent agents."""

    def __init__(
        self,
        settings: CoreSettings,
        now: float,
        *,
        membership: Membership,
        leases: LeaseBook,
        frontier: MixFrontier,
        training: TrainingSource,
        ready: ReadyGroups,
        batches: Batches,
        weights: WeightsFace,
        pause: PauseFace,
        oversampling: OverSampling,
        evaluations: Evaluations,
        counters: CoreCounters,
    ):
        """Its parts: membership (sessions, registration, expiry); the lease book; the mixture's frontier and the
        training source, whose prompts receipts and verdicts are about; the ready groups a receipt adds to and the
        batches whose groups an agent still stores; the weight updates (what a Welcome names, which engines may
        start a lease); the trainer's pause; over-sampling (stopped leases) and evaluation (a result of a lease
        from before a restart)."""
        self._settings = settings
        self._membership = membership
        self._leases = leases
        self._frontier = frontier
        self._training = training
        self._ready = ready
        self._batches = batches
        self._weights = weights
        self._pause = pause
        self._oversampling = oversampling
        self._evaluations = evaluations
        self._counters = counters
        self.fenced: dict[str, int] = {}  # messages refused for a stale session, by type
        self._last_tick = now

    # ------------------------------------------------------------------ agent messages

    def on_register(self, peer: bytes, msg: p.Register, now: float) -> list:
        settings, membership, leases, weights = self._settings, self._membership, self._leases, self._weights
        if msg.dataset_fingerprint and self._training.mixed:
            why = (
                f"agent {msg.agent_id} reads its own --dataset, but the coordinator mixes several training "
                f"datasets ({', '.join(self._training.names)}): start the agent without --dataset (rows come in grants)"
            )
            return [Send(peer, p.Error("dataset_mismatch", why))]
        if msg.dataset_fingerprint and (
            msg.dataset_fingerprint != settings.fingerprint or msg.dataset_size != settings.dataset_size
        ):
            why = (
                f"agent {msg.agent_id}'s dataset ({msg.dataset_size} rows, fingerprint {msg.dataset_fingerprint[:12]}) "
                f"does not match the coordinator's ({settings.dataset_size} rows, "
                f"fingerprint {settings.fingerprint[:12]})"
            )
            return [Send(peer, p.Error("dataset_mismatch", why))]
        if msg.capacity < 0:
            return [Send(peer, p.Error("bad_register", f"capacity must be >= 0, got {msg.capacity}"))]
        n = settings.config.n_samples_per_prompt
        if 0 < msg.capacity < n:
            why = (
                f"agent {msg.agent_id}'s total engine concurrency ({msg.capacity}) is smaller than one group "
                f"({n} samples per prompt); raise --concurrency or add engines"
            )
            return [Send(peer, p.Error("too_small", why))]
        old = membership.agents.get(msg.agent_id)
        if old is not None and old.same_registration(msg.incarnation, msg.req):
            return self._welcome_again(peer, old, now)
        reported: dict[int, Prompt] = {}
        stale = []  # leases for prompts of closed (or never opened) epochs: drop them
        for item in msg.in_flight:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], int):
                if self._frontier.valid(item[1], item[2]):
                    reported[item[0]] = (item[1], item[2])
                else:
                    stale.append(item[0])
        if old is not None:
            self._counters.lease_ended("reregistered", leases.release_agent(old, keep=set(reported)))
        engines = list(msg.engines)
        ops: list = weights.note_engines(engines)  # before the Welcome, which names the weights
        capacity = self._capacity(msg.capacity, engines)  # none while no engine holds the fleet's weights
        rec = membership.register(msg.agent_id, msg.incarnation, peer, capacity, msg.payload_address, engines, now)
        rec.local_dataset = bool(msg.dataset_fingerprint)
        cancel = stale
        for lease_id, (epoch, index) in reported.items():
            owner = leases.leases.get(lease_id)
            held = leases.unhold(lease_id, msg.agent_id, (epoch, index))
            if held is not None:
                leases.hold(held, rec)  # kept for it while it was silent
            elif owner is not None and owner.agent_id == msg.agent_id:
                rec.leases.add(lease_id)
            elif owner is None and self._frontier.adopt(epoch, index):
                start = weights.log.start_of(lease_id)
                leases.hold(Lease(lease_id, msg.agent_id, epoch, index, self._batches.current_rollout_id, start), rec)
            else:
                cancel.append(lease_id)
        acks = []
        for receipt in msg.unacked:
            try:
                lease_id, epoch, index, key = receipt["lease"], receipt["data_epoch"], receipt["index"], receipt["key"]
                stats = receipt.get("stats", {})
            except (TypeError, KeyError):
                continue
            if not (isinstance(lease_id, int) and isinstance(key, str) and isinstance(stats, dict)):
                continue
            accepted, _ = self._accept(rec, lease_id, epoch, index, key, stats, ops)
            self._count_receipt(accepted)
            acks.append([key, accepted])
        # Held for it, and it holds them no more (lost with a restart, or never received): pending again.
        leases.release_held(msg.agent_id)
        welcome = p.Welcome(
            session=rec.session,
            config=settings.config.to_dict(),
            heartbeat_interval=settings.liveness.heartbeat_interval,
            ttl=settings.liveness.ttl,
            acks=acks,
            cancel=cancel,
            paused=self._pause.paused,
            trainer_keys=list(settings.trainer_keys),
            weights=p.FleetWeights.from_dict(weights.log.entry()),
        )
        rec.register_req, rec.welcome = msg.req, welcome
        self._counters.registrations += 1
        then: list = [Send(msg.agent_id, welcome), *weights.on_register(msg.agent_id, now)]
        # Storage reconciliation: whatever the agent stores that no batch, ready group
        # or pending receipt refers to was consumed behind a checkpoint, refused, or
        # belongs to a closed epoch, and a Trim for it was lost (agent down, restart).
        live = self._batches.keys_on(msg.agent_id)
        live |= {r["key"] for r in msg.unacked if isinstance(r, dict) and isinstance(r.get("key"), str)}
        garbage = [k for k in msg.stored if isinstance(k, str) and k not in live]
        if garbage:
            then.append(Send(msg.agent_id, p.Trim(garbage)))
        return [Persist(ops, then)]

    def _welcome_again(self, peer: bytes, rec: AgentRecord, now: float) -> list:
        """A resent Register: the same session, the same acks and cancellations (they were recorded
        with the first answer; this Send waits behind its ledger write), today's pause and weights."""
        rec.last_seen, rec.peer = now, peer
        self._counters.registers_resent += 1
        weights = p.FleetWeights.from_dict(self._weights.log.entry())
        welcome = dataclasses.replace(rec.welcome, weights=weights, paused=self._pause.paused)
        return [Send(rec.agent_id, welcome)]

    def session_agent(self, peer: bytes, session: int, now: float) -> AgentRecord | None:
        """The agent of a current ``session`` (its last-seen time and peer noted), or None: then ``fence``."""
        rec = self._membership.by_session(session)
        if rec is not None:
            rec.last_seen = now
            rec.peer = peer
        return rec

    def fence(self, peer: bytes, msg: p.Message) -> list:
        """Refuse a message of a dead or superseded session: it changes nothing, the sender must register."""
        self.fenced[msg.TYPE] = self.fenced.get(msg.TYPE, 0) + 1
        return [Send(peer, p.Fence(f"session {msg.session} is not current; register again"))]

    def on_weights_report(self, peer: bytes, msg: p.WeightsReport, now: float) -> list:
        """An agent's report of a weight update step: its session is checked here, the update is the weight
        updates' (coordinator/weights.py)."""
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        return self._weights.on_report(rec, msg, now)

    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        if msg.engines is not None:  # states, tp and weight versions (docs/weights.md: the update group)
            rec.engines = list(msg.engines)
        held = set(msg.leases)
        lost = [lease_id for lease_id in rec.leases if lease_id <= msg.max_lease and lease_id not in held]
        for lease_id in lost:
            lease = self._leases.end(lease_id)
            if lease is not None:
                self._leases.give_back(lease)
                self._counters.lease_ended("lost")
        return []

    def _accept(
        self, rec: AgentRecord, lease_id: int, epoch, index, key: str, stats: dict, ops: list
    ) -> tuple[bool, str]:
        """Record an agent's committed group unless the prompt is already accounted for."""
        frontier, leases = self._frontier, self._leases
        lease = leases.of_agent(lease_id, rec.agent_id)
        held = leases.unhold(lease_id, rec.agent_id, (epoch, index))
        if held is not None:
            lease = held  # made while it was silent, kept for it: accepted below
            self._counters.lease_ended("receipt")
        elif lease is not None:
            leases.end(lease_id)
            self._counters.lease_ended("receipt")
            leases.source_of(lease).committed(lease)
        else:
            lease = leases.leases.get(lease_id)  # another agent's lease of that id dates the group as before
        if isinstance(epoch, int) and frontier.is_closed(epoch):
            return False, "duplicate: its data epoch is complete"
        if not frontier.valid(epoch, index):
            return False, f"index {index!r} / data epoch {epoch!r} is not a prompt of an open epoch"
        state = frontier.state_of(epoch, index)
        if state in (READY, DELIVERED):
            if self._ready.key_of((epoch, index)) == key:
                return True, ""
            if state == DELIVERED and self._batches.delivered_key(epoch, index) == key:
                return True, ""
            return False, "duplicate: prompt already accepted from another group"
        if state == FILTERED:
            return False, "duplicate: prompt already filtered"
        leases.end_prompt(TRAIN, (epoch, index))  # another agent's lease of it: its group is here
        frontier.set(epoch, index, READY)
        start = lease.start if lease is not None else self._weights.log.start_of(lease_id)
        self._ready.add(epoch, index, rec.agent_id, key, stats, ops, start)
        self._training.note_kept()
        return True, ""

    def on_receipt(self, peer: bytes, msg: p.Receipt, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        ops: list = []
        accepted, reason = self._accept(rec, msg.lease, msg.data_epoch, msg.index, msg.key, msg.stats, ops)
        self._count_receipt(accepted)
        starvation = self._training.starvation
        starvation.ok()  # a group went through reward and filter
        starvation.kept()
        self._training.failures.pop((msg.data_epoch, msg.index), None)
        ack = Send(rec.agent_id, p.ReceiptAck(msg.lease, msg.key, accepted, reason))
        return [Persist(ops, [ack])]

    def _count_receipt(self, accepted: bool) -> None:
        if accepted:
            self._counters.receipts_accepted += 1
        else:
            self._counters.receipts_refused += 1

    def on_filtered(self, peer: bytes, msg: p.Filtered, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        self._training.starvation.ok()  # a filter verdict: reward and filter ran
        lease = self._leases.of_agent(msg.lease, rec.agent_id)
        if lease is None:
            return []  # lease was reissued; the successor accounts for the prompt
        self._leases.end(msg.lease)
        self._counters.lease_ended("filtered")
        # The lease's prompt, whatever the message claims.
        return self._leases.source_of(lease).filtered(lease, rec.agent_id, msg.reason)

    def on_eval_result(self, peer: bytes, msg: p.EvalResult, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        lease = self._leases.of_agent(msg.lease, rec.agent_id)
        if lease is not None:
            self._leases.end(msg.lease)
            self._counters.lease_ended("evaluated")
            return self._leases.source_of(lease).result(lease, msg)
        # A result for a lease this coordinator does not know (granted before a restart) still counts, once.
        return self._evaluations.on_result(msg)

    def on_release(self, peer: bytes, msg: p.Release, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        failure = msg.failure if msg.reason == p.ReleaseReason.FAILED else None
        out: list = []
        leases = self._leases
        for lease_id in msg.leases:
            lease = leases.of_agent(lease_id, rec.agent_id)
            if lease is not None:
                leases.end(lease_id)
                if msg.reason == p.ReleaseReason.STOPPED:
                    self._oversampling.on_stopped(lease_id)  # over-sampled: pending again, counted
                else:
                    self._counters.lease_ended("released" if failure is None else "failed")
                if failure is None:
                    leases.give_back(lease)
                else:
                    detail = failure.detail[: p.MAX_FAILURE_DETAIL]
                    out += leases.source_of(lease).failed(lease, rec.agent_id, str(failure.kind), detail)
        return out

    def _capacity(self, samples: int, engines: list) -> int:
        """Groups an agent reporting ``samples`` of engine concurrency on ``engines`` may be leased at once.

        Zero while none of its serving engines holds the fleet's weights (``WeightUpdates.none_current``):
        a grant there cannot start until they are re-loaded or updated, and a prompt pending again, first in
        line, would wait on it while other agents take fresh prompts (what a node re-joining after a weight
        update did to a requeued prompt in a chaos run). The agent reports again as its engines leave or
        rejoin the pool (``Capacity``), and its capacity counts from then.
        """
        if self._weights.none_current(engines):
            return 0
        return max(0, samples) // self._settings.config.n_samples_per_prompt

    def on_capacity(self, peer: bytes, msg: p.Capacity, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        rec.engines = list(msg.engines)
        rec.capacity = self._capacity(msg.capacity, rec.engines)
        self._membership.note_room(rec)
        return []

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list:
        membership, liveness = self._membership, self._settings.liveness
        stalled = now - self._last_tick
        if stalled > liveness.ttl:
            # We, not the agents, were silent (stopped process, overloaded host):
            # nobody's silence counts for that long.
            for rec in membership.agents.values():
                rec.last_seen += stalled
        self._last_tick = now
        dead, retired = membership.expire(now, liveness.ttl, liveness.retire_after)
        membership.refresh_room()
        for rec in dead:
            self._counters.lease_ended("expired", self._leases.hold_for_silent(rec))
        ops: list = []
        for rec in retired:
            self._leases.release_held(rec.agent_id)
            self._batches.retire_agent(rec.agent_id, ops)
        return [Persist(ops, [])] if ops else []
