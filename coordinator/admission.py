"""Admission: the agents' side of the core — registration, leases, receipts and liveness.

Handlers for every agent message (``Register``, ``Heartbeat``, ``Receipt``,
``Filtered``, ``Release``, ``Capacity``), the clock (``tick``: TTL and
retirement) and lease issuing (``grant``), all pure: events in, effects out.

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
- A silent agent's work is held, not handed on (``held``): when an agent is
  presumed dead (silent past the TTL) its training leases stay its own, their
  prompts LEASED, so when a partition heals the groups it made meanwhile are
  accepted, not refused as duplicates of a second agent's copies. Held leases
  are out of the in-flight bound (the agent's capacity has left the pool, so
  live agents get the work the waiting batches need: no trainer waits on a
  silent agent while there is other work). A held prompt goes to another
  agent only when nothing else of the open epochs is pending (``grant``,
  before a new epoch is opened); it is pending again
  when its agent is retired or re-registers without it. Under
  ``--max-staleness`` they are released at once, as evaluation leases are:
  a lease the staleness rules cannot see could land too old for its batch.
- A lease goes only where it can start: an agent none of whose serving engines holds the fleet's
  weights (a Register is written before the Welcome names them; a node re-joining after updates is on
  launch weights) has capacity 0 until its ``Capacity`` names one that does (``_capacity``). Otherwise
  a prompt pending again, first in line, would wait there for a re-load while others take fresh ones.
- A lease given back after a ``Stop`` (over-sampling: a ``Release`` with
  reason ``protocol.STOPPED``) is pending again, first in line, and counted
  for the next batch (``coordinator/oversampling.py``); it is not a failure.
- Failing user code loses no data: a group whose reward or filter raised (a ``Release`` tagged
  ``failed: <kind>: <detail>``) is an error outcome, not a filter verdict; its source decides
  (coordinator/sources.py: retried, filtered after ``MAX_FAILURES``, starvation).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from common import protocol as p
from common.mixture import EPOCH_BITS
from coordinator.effects import Send
from coordinator.frontier import DELIVERED, FILTERED, READY
from coordinator.membership import AgentRecord
from coordinator.records import Lease, Prompt
from coordinator.sources import TRAIN, PromptSource, TrainingSource
from coordinator.starvation import Starvation

if TYPE_CHECKING:
    from coordinator.core import CoordinatorCore


class Admission:
    """The lease book: leases in flight from every prompt source (``coordinator/sources.py``), the one
    grant loop, and the agents' messages that start and end leases."""

    def __init__(self, core: CoordinatorCore, now: float):
        self.core = core
        self.leases: dict[int, Lease] = {}
        self.leased_by: dict[tuple[str, int, int], int] = {}  # (source, data_epoch, index) -> lease
        self.held: dict[int, Lease] = {}
        """Bounded leases of agents presumed dead, kept for them (oldest first); not in ``leases``."""
        self.sources: dict[str, PromptSource] = {}
        """Every prompt source by key; a lease's ``source`` names one."""
        self.in_flight: dict[str, int] = {}
        """Leases in ``leases`` by source."""
        self.training = TrainingSource(self, core.sources, core.mixture_schedule)
        self.add_source(self.training)
        self._lease_counter = 0
        self.starvation = Starvation(core.starve_after, core.starve_after_drops)
        self.fenced: dict[str, int] = {}  # messages refused for a stale session, by type
        self._last_tick = now

    # ------------------------------------------------------------------ leases

    def add_source(self, source: PromptSource) -> PromptSource:
        if source.key in self.sources:
            raise ValueError(f"two prompt sources named {source.key!r}")
        self.sources[source.key] = source
        self.in_flight[source.key] = 0
        return source

    def source_of(self, lease: Lease) -> PromptSource:
        return self.sources[lease.source]

    def hold(self, lease: Lease, rec: AgentRecord) -> None:
        self.leases[lease.lease_id] = lease
        rec.leases.add(lease.lease_id)
        rec.max_granted = max(rec.max_granted, lease.lease_id)
        self.in_flight[lease.source] += 1
        self.leased_by[(lease.source, *lease.prompt)] = lease.lease_id
        if lease.source == TRAIN:
            self.training.note_lease(lease, 1)

    def next_lease_id(self) -> int:
        """A lease id no earlier start used: ``generation << 32 | n``."""
        self._lease_counter += 1
        return (self.core.membership.generation << 32) | self._lease_counter

    @property
    def lease_hwm(self) -> int:
        """The highest lease id granted so far (``next_lease_id``'s last)."""
        return (self.core.membership.generation << 32) | self._lease_counter

    @property
    def training_leases(self) -> int:
        """Leases of bounded sources in flight (the training bound; evaluation leases are not in it)."""
        return sum(n for key, n in self.in_flight.items() if self.sources[key].bounded)

    def bounded_leases(self):
        """The leases in flight whose source is bounded (staleness and over-sampling see only these)."""
        return (lease for lease in self.leases.values() if self.sources[lease.source].bounded)

    def give_back(self, lease: Lease) -> None:
        """An ended lease's prompt is pending again in its source, first in line."""
        self.source_of(lease).give_back(lease)

    def end_lease(self, lease_id: int) -> Lease | None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self.in_flight[lease.source] -= 1
        if lease.source == TRAIN:
            self.training.note_lease(lease, -1)
        key = (lease.source, *lease.prompt)
        if self.leased_by.get(key) == lease_id:
            del self.leased_by[key]
        rec = self.core.membership.agents.get(lease.agent_id)
        if rec is not None:
            rec.leases.discard(lease_id)
            self.core.membership.note_room(rec)
        return lease

    def release_agent_leases(self, rec: AgentRecord, keep: set[int] = frozenset()) -> None:
        for lease_id in list(rec.leases):
            if lease_id in keep:
                continue
            lease = self.end_lease(lease_id)
            if lease is not None:
                self.give_back(lease)

    def hold_for_silent(self, rec: AgentRecord) -> int:
        """``rec`` was presumed dead: keep its training leases for it (``held``), release the rest.
        Returns the number released."""
        keep = not self.core.staleness.bounded
        released = 0
        for lease_id in sorted(rec.leases):
            lease = self.end_lease(lease_id)
            if lease is None:
                continue
            if keep and self.source_of(lease).bounded:
                self.held[lease_id] = lease
            else:
                self.give_back(lease)
                released += 1
        return released

    def release_held(self, agent_id: str) -> int:
        """The leases held for ``agent_id`` go back to pending, first in line."""
        gone = [lease_id for lease_id, lease in self.held.items() if lease.agent_id == agent_id]
        for lease_id in gone:
            self.give_back(self.held.pop(lease_id))
        self.core.counters.lease_ended("held_released", len(gone))
        return len(gone)

    def take_held(self, source: int = 0) -> tuple[int, int] | None:
        """Nothing else of the open epochs of training source ``source`` is pending: its oldest held prompt
        goes to a live agent (it stays LEASED; a receipt of the silent agent for it is then refused as a
        duplicate)."""
        if not self.held:
            return None
        lease_id = next((i for i, held in self.held.items() if held.data_epoch >> EPOCH_BITS == source), None)
        if lease_id is None:
            return None
        lease = self.held.pop(lease_id)
        self.core.counters.lease_ended("held_reassigned")
        return lease.prompt

    def grant(self, source: PromptSource, budget: int, rollout_id: int, now: float) -> list[Send]:
        """Lease up to ``budget`` prompts of ``source`` to agents with free capacity: one Grant per agent.
        The one grant loop, for every source."""
        membership = self.core.membership
        granted: list[Send] = []
        for agent_id, n in membership.distribute(budget).items():
            rec = membership.agents[agent_id]
            leases = []
            for _ in range(n):
                taken = source.take(now)
                if taken is None:
                    break
                lease = Lease(
                    self.next_lease_id(), agent_id, *taken, rollout_id, self.core.weights.log.updates, source.key
                )
                self.hold(lease, rec)
                fields = source.grant_fields(lease)
                leases.append(p.LeaseGrant(lease.lease_id, *lease.prompt, rollout_id, source.key, **fields))
            if leases:
                self.core.counters.leases_granted += len(leases)
                granted.append(Send(agent_id, p.Grant(rec.session, leases), with_rows=source.with_rows(rec)))
            membership.note_room(rec)  # the source ran out before its share: it still has room
        return granted

    # ------------------------------------------------------------------ agent messages

    def on_register(self, peer: bytes, msg: p.Register, now: float) -> list:
        core = self.core
        if msg.dataset_fingerprint and self.training.mixed:
            why = (
                f"agent {msg.agent_id} reads its own --dataset, but the coordinator mixes several training "
                f"datasets ({', '.join(self.training.names)}): start the agent without --dataset (rows come in grants)"
            )
            return [Send(peer, p.Error("dataset_mismatch", why))]
        if msg.dataset_fingerprint and (
            msg.dataset_fingerprint != core.dataset_fingerprint or msg.dataset_size != core.dataset_size
        ):
            why = (
                f"agent {msg.agent_id}'s dataset ({msg.dataset_size} rows, fingerprint {msg.dataset_fingerprint[:12]}) "
                f"does not match the coordinator's ({core.dataset_size} rows, "
                f"fingerprint {core.dataset_fingerprint[:12]})"
            )
            return [Send(peer, p.Error("dataset_mismatch", why))]
        if msg.capacity < 0:
            return [Send(peer, p.Error("bad_register", f"capacity must be >= 0, got {msg.capacity}"))]
        n = core.config.n_samples_per_prompt
        if 0 < msg.capacity < n:
            why = (
                f"agent {msg.agent_id}'s total engine concurrency ({msg.capacity}) is smaller than one group "
                f"({n} samples per prompt); raise --concurrency or add engines"
            )
            return [Send(peer, p.Error("too_small", why))]
        old = core.membership.agents.get(msg.agent_id)
        if old is not None and old.same_registration(msg.incarnation, msg.req):
            return self._welcome_again(peer, old, now)
        reported: dict[int, Prompt] = {}
        stale = []  # leases for prompts of closed (or never opened) epochs: drop them
        for item in msg.in_flight:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], int):
                if core.frontier.valid(item[1], item[2]):
                    reported[item[0]] = (item[1], item[2])
                else:
                    stale.append(item[0])
        if old is not None:
            before = len(self.leases)
            self.release_agent_leases(old, keep=set(reported))
            core.counters.lease_ended("reregistered", before - len(self.leases))
        engines = [e for e in msg.engines if isinstance(e, dict)]
        ops: list = core.weights.note_engines(engines)  # before the Welcome, which names the weights
        capacity = self._capacity(msg.capacity, engines)  # none while no engine holds the fleet's weights
        rec = core.membership.register(msg.agent_id, msg.incarnation, peer, capacity, msg.payload_address, engines, now)
        rec.local_dataset = bool(msg.dataset_fingerprint)
        cancel = stale
        for lease_id, (epoch, index) in reported.items():
            owner = self.leases.get(lease_id)
            held = self.held.get(lease_id)
            if held is not None and held.agent_id == msg.agent_id and held.prompt == (epoch, index):
                self.hold(self.held.pop(lease_id), rec)  # kept for it while it was silent
            elif owner is not None and owner.agent_id == msg.agent_id:
                rec.leases.add(lease_id)
            elif owner is None and core.frontier.adopt(epoch, index):
                start = core.weights.log.start_of(lease_id)
                self.hold(Lease(lease_id, msg.agent_id, epoch, index, core.batches.current_rollout_id, start), rec)
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
        self.release_held(msg.agent_id)
        welcome = p.Welcome(
            session=rec.session,
            config={**core.config.to_dict(), "weights": core.weights.log.entry()},
            heartbeat_interval=core.liveness.heartbeat_interval,
            ttl=core.liveness.ttl,
            acks=acks,
            cancel=cancel,
            paused=core.trainer.paused,
            trainer_keys=core.trainer_keys,
        )
        rec.register_req, rec.welcome = msg.req, welcome
        core.counters.registrations += 1
        then: list = [Send(msg.agent_id, welcome), *core.weights.on_register(msg.agent_id, now)]
        # Storage reconciliation: whatever the agent stores that no batch, ready group
        # or pending receipt refers to was consumed behind a checkpoint, refused, or
        # belongs to a closed epoch, and a Trim for it was lost (agent down, restart).
        live = core.batches.keys_on(msg.agent_id)
        live |= {r["key"] for r in msg.unacked if isinstance(r, dict) and isinstance(r.get("key"), str)}
        garbage = [k for k in msg.stored if isinstance(k, str) and k not in live]
        if garbage:
            then.append(Send(msg.agent_id, p.Trim(garbage)))
        # Nothing may reach the agent before its Welcome: grants ride behind it.
        pumped = core.pump(now)
        then += [e for e in pumped if isinstance(e, Send)]
        return [core.persist(ops, then)] + [e for e in pumped if not isinstance(e, Send)]

    def _welcome_again(self, peer: bytes, rec: AgentRecord, now: float) -> list:
        """A resent Register: the same session, the same acks and cancellations (they were recorded
        with the first answer; this Send waits behind its ledger write), today's pause and weights."""
        rec.last_seen, rec.peer = now, peer
        self.core.counters.registers_resent += 1
        config = {**rec.welcome.config, "weights": self.core.weights.log.entry()}
        welcome = dataclasses.replace(rec.welcome, config=config, paused=self.core.trainer.paused)
        return [Send(rec.agent_id, welcome)]

    def session_agent(self, peer: bytes, session: int, now: float) -> AgentRecord | None:
        """The agent of a current ``session`` (its last-seen time and peer noted), or None: then ``fence``."""
        rec = self.core.membership.by_session(session)
        if rec is not None:
            rec.last_seen = now
            rec.peer = peer
        return rec

    def fence(self, peer: bytes, msg: p.Message) -> list:
        """Refuse a message of a dead or superseded session: it changes nothing, the sender must register."""
        self.fenced[msg.TYPE] = self.fenced.get(msg.TYPE, 0) + 1
        return [Send(peer, p.Fence(f"session {msg.session} is not current; register again"))]

    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        engines = msg.stats.get("engines")
        if isinstance(engines, list):  # states, tp and weight versions (docs/weights.md: the update group)
            rec.engines = [e for e in engines if isinstance(e, dict)]
        held = set(msg.leases)
        lost = [lease_id for lease_id in rec.leases if lease_id <= msg.max_lease and lease_id not in held]
        for lease_id in lost:
            lease = self.end_lease(lease_id)
            if lease is not None:
                self.give_back(lease)
                self.core.counters.lease_ended("lost")
        return self.core.pump(now) if lost else []

    def _accept(
        self, rec: AgentRecord, lease_id: int, epoch, index, key: str, stats: dict, ops: list
    ) -> tuple[bool, str]:
        """Record an agent's committed group unless the prompt is already accounted for."""
        frontier, batches = self.core.frontier, self.core.batches
        lease = self.leases.get(lease_id)
        held = self.held.get(lease_id)
        if held is not None and held.agent_id == rec.agent_id and held.prompt == (epoch, index):
            lease = self.held.pop(lease_id)  # made while it was silent, kept for it: accepted below
            self.core.counters.lease_ended("receipt")
        elif lease is not None and lease.agent_id == rec.agent_id:
            self.end_lease(lease_id)
            self.core.counters.lease_ended("receipt")
            self.source_of(lease).committed(lease)
        if isinstance(epoch, int) and frontier.is_closed(epoch):
            return False, "duplicate: its data epoch is complete"
        if not frontier.valid(epoch, index):
            return False, f"index {index!r} / data epoch {epoch!r} is not a prompt of an open epoch"
        state = frontier.state_of(epoch, index)
        if state in (READY, DELIVERED):
            existing = batches.ready_info.get((epoch, index))
            if existing is not None and existing.key == key:
                return True, ""
            if state == DELIVERED and batches.delivered_key(epoch, index) == key:
                return True, ""
            return False, "duplicate: prompt already accepted from another group"
        if state == FILTERED:
            return False, "duplicate: prompt already filtered"
        other = self.leased_by.get((TRAIN, epoch, index))
        if other is not None:
            self.end_lease(other)
        frontier.set(epoch, index, READY)
        start = lease.start if lease is not None else self.core.weights.log.start_of(lease_id)
        batches.add_ready(epoch, index, rec.agent_id, key, stats, ops, start)
        return True, ""

    def on_receipt(self, peer: bytes, msg: p.Receipt, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        ops: list = []
        accepted, reason = self._accept(rec, msg.lease, msg.data_epoch, msg.index, msg.key, msg.stats, ops)
        self._count_receipt(accepted)
        self.starvation.ok()  # a group went through reward and filter
        self.starvation.kept()
        self.training.failures.pop((msg.data_epoch, msg.index), None)
        ack = Send(rec.agent_id, p.ReceiptAck(msg.lease, msg.key, accepted, reason))
        return [self.core.persist(ops, [ack])] + self.core.pump(now)

    def _count_receipt(self, accepted: bool) -> None:
        if accepted:
            self.core.counters.receipts_accepted += 1
        else:
            self.core.counters.receipts_refused += 1

    def on_filtered(self, peer: bytes, msg: p.Filtered, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        self.starvation.ok()  # a filter verdict: reward and filter ran
        lease = self.leases.get(msg.lease)
        if lease is None or lease.agent_id != rec.agent_id:
            return self.core.pump(now)  # lease was reissued; the successor accounts for the prompt
        self.end_lease(msg.lease)
        self.core.counters.lease_ended("filtered")
        # The lease's prompt, whatever the message claims.
        return self.source_of(lease).filtered(lease, rec.agent_id, msg.reason) + self.core.pump(now)

    def on_eval_result(self, peer: bytes, msg: p.EvalResult, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        lease = self.leases.get(msg.lease)
        if lease is not None and lease.agent_id == rec.agent_id:
            self.end_lease(msg.lease)
            self.core.counters.lease_ended("evaluated")
            return self.source_of(lease).result(lease, msg) + self.core.pump(now)
        # A result for a lease this coordinator does not know (granted before a restart) still counts, once.
        return self.core.evaluations.on_result(msg) + self.core.pump(now)

    def on_release(self, peer: bytes, msg: p.Release, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        failure = p.parse_failure(msg.reason)
        out: list = []
        for lease_id in msg.leases:
            lease = self.leases.get(lease_id)
            if lease is not None and lease.agent_id == rec.agent_id:
                self.end_lease(lease_id)
                if msg.reason == p.STOPPED:
                    self.core.oversampling.on_stopped(lease_id)  # over-sampled: pending again, counted
                else:
                    self.core.counters.lease_ended("released" if failure is None else "failed")
                if failure is None:
                    self.give_back(lease)
                else:
                    out += self.source_of(lease).failed(lease, rec.agent_id, *failure)
        return out + self.core.pump(now)

    def _capacity(self, samples: int, engines: list) -> int:
        """Groups an agent reporting ``samples`` of engine concurrency on ``engines`` may be leased at once.

        Zero while none of its serving engines holds the fleet's weights (``WeightUpdates.none_current``):
        a grant there cannot start until they are re-loaded or updated, and a prompt pending again, first in
        line, would wait on it while other agents take fresh prompts (what a node re-joining after a weight
        update did to a requeued prompt in a chaos run). The agent reports again as its engines leave or
        rejoin the pool (``Capacity``), and its capacity counts from then.
        """
        if self.core.weights.none_current(engines):
            return 0
        return max(0, samples) // self.core.config.n_samples_per_prompt

    def on_capacity(self, peer: bytes, msg: p.Capacity, now: float) -> list:
        rec = self.session_agent(peer, msg.session, now)
        if rec is None:
            return self.fence(peer, msg)
        rec.engines = [e for e in msg.engines if isinstance(e, dict)]
        rec.capacity = self._capacity(msg.capacity, rec.engines)
        self.core.membership.note_room(rec)
        return self.core.pump(now)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list:
        core = self.core
        stalled = now - self._last_tick
        if stalled > core.liveness.ttl:
            # We, not the agents, were silent (stopped process, overloaded host):
            # nobody's silence counts for that long.
            for rec in core.membership.agents.values():
                rec.last_seen += stalled
        self._last_tick = now
        dead, retired = core.membership.expire(now, core.liveness.ttl, core.liveness.retire_after)
        core.membership.refresh_room()
        out: list = []
        for rec in dead:
            core.counters.lease_ended("expired", self.hold_for_silent(rec))
        ops: list = []
        for rec in retired:
            self.release_held(rec.agent_id)
            core.batches.retire_agent(rec.agent_id, ops)
        if ops:
            out.append(core.persist(ops, []))
        return out + core.pump(now)
