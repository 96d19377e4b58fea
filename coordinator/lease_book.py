"""The lease book: every lease in flight, whatever prompt source it came from, and the one grant loop.

A lease is a prompt of one prompt source (``coordinator/sources.py``) given to one agent. The book
keeps the table of leases in flight (``leases``, and which lease holds each prompt), counts them by
source, hands out lease ids, and grants: ``grant`` leases up to a budget of a source's prompts to the
agents with free capacity, one ``Grant`` per agent. What a lease's outcome means (a receipt, a filter
verdict, a failure, a prompt given back) is its source's to decide; the book only starts and ends
leases, and tells the source of each (``PromptSource.note_lease``).

Invariants kept here:
- One table: a lease is in ``leases`` from its grant to its end, in its agent's ``AgentRecord.leases``
  as long, and counted in ``in_flight`` under its source; nothing else starts or ends a lease.
- Lease ids never repeat, across restarts too: ``generation << 32 | n``, the generation bumped (durably)
  at every start, so the highest ids were granted last (over-sampling stops those first).
- A silent agent's work is held, not handed on (``held``): when an agent is presumed dead its bounded
  leases leave the table but stay its own, their prompts leased, so the groups it made meanwhile are
  accepted when a partition heals. A held prompt goes to another agent only when nothing else of the
  open epochs of its dataset is pending (``take_held``); it is pending again when its agent is retired
  or re-registers without it (``release_held``). Under ``--max-staleness`` nothing is held
  (``keep_for_silent`` off): a lease the staleness rules cannot see could land too old for its batch.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common import protocol as p
from coordinator.effects import Send
from coordinator.prompt_key import dataset_of
from coordinator.records import Lease, Prompt

if TYPE_CHECKING:
    from coordinator.counters import CoreCounters
    from coordinator.membership import AgentRecord, Membership
    from coordinator.sources import PromptSource

__all__ = ["LeaseBook"]


class LeaseBook:
    def __init__(self, membership: Membership, counters: CoreCounters, keep_for_silent: bool = True):
        """``membership``: the agents whose records list their leases; ``keep_for_silent``: hold a silent
        agent's bounded leases for it (off under ``--max-staleness``)."""
        self._membership = membership
        self._counters = counters
        self._keep_for_silent = keep_for_silent
        self.leases: dict[int, Lease] = {}
        """Every lease in flight, by id."""
        self._leased_by: dict[tuple[str, int, int], int] = {}  # (source, data_epoch, index) -> lease
        self.held: dict[int, Lease] = {}
        """Bounded leases of agents presumed dead, kept for them (oldest first); not in ``leases``."""
        self.sources: dict[str, PromptSource] = {}
        """Every prompt source by key; a lease's ``source`` names one."""
        self.in_flight: dict[str, int] = {}
        """Leases in ``leases`` by source."""
        self._counter = 0

    def __len__(self) -> int:
        """Leases in flight (held ones not counted)."""
        return len(self.leases)

    # ------------------------------------------------------------------ sources and ids

    def add_source(self, source: PromptSource) -> PromptSource:
        if source.key in self.sources:
            raise ValueError(f"two prompt sources named {source.key!r}")
        self.sources[source.key] = source
        self.in_flight[source.key] = 0
        return source

    def source_of(self, lease: Lease) -> PromptSource:
        return self.sources[lease.source]

    def next_lease_id(self) -> int:
        """A lease id no earlier start used: ``generation << 32 | n``."""
        self._counter += 1
        return self.lease_hwm

    @property
    def lease_hwm(self) -> int:
        """The highest lease id granted so far (``next_lease_id``'s last)."""
        return (self._membership.generation << 32) | self._counter

    @property
    def training_leases(self) -> int:
        """Leases of bounded sources in flight (the training bound; evaluation leases are not in it)."""
        return sum(n for key, n in self.in_flight.items() if self.sources[key].bounded)

    def bounded_leases(self):
        """The leases in flight whose source is bounded (staleness and over-sampling see only these)."""
        return (lease for lease in self.leases.values() if self.sources[lease.source].bounded)

    def of_agent(self, lease_id: int, agent_id: str) -> Lease | None:
        """Lease ``lease_id`` if it is in flight on ``agent_id`` (an agent speaks only for its own leases)."""
        lease = self.leases.get(lease_id)
        return lease if lease is not None and lease.agent_id == agent_id else None

    # ------------------------------------------------------------------ starting and ending leases

    def hold(self, lease: Lease, rec: AgentRecord) -> None:
        """``lease`` is in flight on ``rec``'s agent."""
        self.leases[lease.lease_id] = lease
        rec.leases.add(lease.lease_id)
        rec.max_granted = max(rec.max_granted, lease.lease_id)
        self.in_flight[lease.source] += 1
        self._leased_by[(lease.source, *lease.prompt)] = lease.lease_id
        self.sources[lease.source].note_lease(lease, 1)

    def end(self, lease_id: int) -> Lease | None:
        """End lease ``lease_id`` (None if it is not in flight); its outcome is the caller's to hand on."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self.in_flight[lease.source] -= 1
        self.sources[lease.source].note_lease(lease, -1)
        key = (lease.source, *lease.prompt)
        if self._leased_by.get(key) == lease_id:
            del self._leased_by[key]
        rec = self._membership.agents.get(lease.agent_id)
        if rec is not None:
            rec.leases.discard(lease_id)
            self._membership.note_room(rec)
        return lease

    def end_prompt(self, source: str, prompt: Prompt) -> Lease | None:
        """End the lease in flight on ``prompt`` of ``source``, whoever holds it (its group came from
        another lease)."""
        lease_id = self._leased_by.get((source, *prompt))
        return None if lease_id is None else self.end(lease_id)

    def give_back(self, lease: Lease) -> None:
        """An ended lease's prompt is pending again in its source, first in line."""
        self.source_of(lease).give_back(lease)

    def release_agent(self, rec: AgentRecord, keep: set[int] = frozenset()) -> int:
        """End ``rec``'s leases but those in ``keep``; their prompts are pending again. Returns how many."""
        released = 0
        for lease_id in list(rec.leases):
            if lease_id in keep:
                continue
            lease = self.end(lease_id)
            if lease is not None:
                self.give_back(lease)
                released += 1
        return released

    # ------------------------------------------------------------------ held for silent agents

    def hold_for_silent(self, rec: AgentRecord) -> int:
        """``rec`` was presumed dead: keep its bounded leases for it (``held``), release the rest.
        Returns the number released."""
        released = 0
        for lease_id in sorted(rec.leases):
            lease = self.end(lease_id)
            if lease is None:
                continue
            if self._keep_for_silent and self.source_of(lease).bounded:
                self.held[lease_id] = lease
            else:
                self.give_back(lease)
                released += 1
        return released

    def unhold(self, lease_id: int, agent_id: str, prompt) -> Lease | None:
        """The held lease ``lease_id``, taken out of ``held``, if it was held for ``agent_id`` on ``prompt``
        (the agent came back with it, or with its group); else None and nothing changes."""
        lease = self.held.get(lease_id)
        if lease is None or lease.agent_id != agent_id or lease.prompt != prompt:
            return None
        return self.held.pop(lease_id)

    def release_held(self, agent_id: str) -> int:
        """The leases held for ``agent_id`` go back to pending, first in line."""
        gone = [lease_id for lease_id, lease in self.held.items() if lease.agent_id == agent_id]
        for lease_id in gone:
            self.give_back(self.held.pop(lease_id))
        self._counters.lease_ended("held_released", len(gone))
        return len(gone)

    def take_held(self, dataset: int = 0) -> Prompt | None:
        """Nothing else of the open epochs of training dataset ``dataset`` is pending: its oldest held prompt
        goes to a live agent (it stays LEASED; a receipt of the silent agent for it is then refused as a
        duplicate)."""
        if not self.held:
            return None
        lease_id = next((i for i, held in self.held.items() if dataset_of(held.data_epoch) == dataset), None)
        if lease_id is None:
            return None
        lease = self.held.pop(lease_id)
        self._counters.lease_ended("held_reassigned")
        return lease.prompt

    # ------------------------------------------------------------------ granting

    def grant(self, source: PromptSource, budget: int, rollout_id: int, start: int, now: float) -> list[Send]:
        """Lease up to ``budget`` prompts of ``source`` to agents with free capacity: one Grant per agent.
        The one grant loop, for every source. ``start``: the weight updates pushed so far (each lease's)."""
        membership = self._membership
        granted: list[Send] = []
        for agent_id, n in membership.distribute(budget).items():
            rec = membership.agents[agent_id]
            leases = []
            for _ in range(n):
                taken = source.take(now)
                if taken is None:
                    break
                lease = Lease(self.next_lease_id(), agent_id, *taken, rollout_id, start, source.key)
                self.hold(lease, rec)
                fields = source.grant_fields(lease)
                leases.append(p.LeaseGrant(lease.lease_id, *lease.prompt, rollout_id, source.key, **fields))
            if leases:
                self._counters.leases_granted += len(leases)
                granted.append(Send(agent_id, p.Grant(rec.session, leases), with_rows=source.with_rows(rec)))
            membership.note_room(rec)  # the source ran out before its share: it still has room
        return granted
