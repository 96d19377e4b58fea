"""Batches: trainer batches, recorded and replayed, their repair, their trimming, and the demand for groups.

Ready groups (``coordinator/ready.py``: committed on an agent, recorded READY in the ledger) wait in
acceptance order; a waiting ``generate`` takes exactly ``rollout_batch_size`` of them, by the mixture's
shares, into a ``RecordedBatch`` with its metrics (``common.metrics.batch_metrics``), or fewer, at
least one, once its ``deadline`` passed (a partial batch, ``coordinator/oversampling.py``). Each rank
of a sharded trainer gets its share of a batch (``coordinator/rank_shares.py``). Pure: events in,
effects out.

Invariants kept here:
- Idempotent: a recorded batch is replayed verbatim for the same rollout id,
  a partial one too; a repair fills a batch to its own size (``target``).
- Batch replies travel in ``Persist.then``, after the batch is durable.
- A retired node's groups leave the batches that hold them (``lost``); when
  a trainer asks for such a batch again it is completed with replacements:
  its lost prompts are generated again if no trainer fetched the batch
  (``consumed_upto``), else they stay delivered and fresh prompts fill it.
- An epoch closes only once every batch holding its prompts was fetched, so
  a lost node can still send its prompts back to pending until then.
- A waiting call is never left waiting for a batch that cannot come: with no engine left
  (``coordinator/capacity.py``) or the rollout starved, it is answered with the reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import protocol as p
from common.metrics import batch_metrics
from coordinator.effects import Persist, Send
from coordinator.frontier import DELIVERED
from coordinator.prompt_key import PromptKey, dataset_of
from coordinator.records import (
    CloseEpoch,
    DropBatch,
    DropPrompt,
    GroupRef,
    LedgerSnapshot,
    Prompt,
    PromptState,
    PutBatch,
    PutPrompt,
    RecordedBatch,
    SetMark,
)

if TYPE_CHECKING:
    from coordinator.capacity import Capacity
    from coordinator.counters import CoreCounters
    from coordinator.lease_book import LeaseBook
    from coordinator.mix_frontier import MixFrontier
    from coordinator.oversampling import OverSampling
    from coordinator.rank_shares import RankShares
    from coordinator.ready import ReadyGroups
    from coordinator.sources import TrainingSource
    from coordinator.staleness import Staleness


@dataclass(slots=True)
class PendingGenerate:
    """A trainer's ``generate`` waiting for enough ready groups (from each rank of a sharded trainer)."""

    waiters: list[tuple[bytes, int, int]]
    """``(peer, req, rank)`` of each call waiting for it: one per rank (a resend replaces its rank's)."""
    rollout_id: int
    since: float = 0.0
    """When the trainer's ``generate`` for it arrived (a resend keeps the first arrival)."""
    deadline: float = 0.0
    """Seconds after ``since`` at which the groups ready make a partial batch; 0: none."""

    def due(self, now: float) -> bool:
        """It has a deadline and reached it (coordinator/oversampling.py: partial batches)."""
        return self.deadline > 0 and now >= self.since + self.deadline


class Batches:
    def __init__(
        self,
        restored: LedgerSnapshot,
        *,
        batch_size: int,
        ready: ReadyGroups,
        shares: RankShares,
        training: TrainingSource,
        leases: LeaseBook,
        frontier: MixFrontier,
        staleness: Staleness,
        oversampling: OverSampling,
        capacity: Capacity,
        counters: CoreCounters,
    ):
        """Its parts: the ready groups it takes batches from; the ranks' shares of its batches; the training
        source (the mixture's shares, its filter verdicts and its starvation record); the lease book's bounded
        leases (staleness rule 2 waits on them); the mixture's frontier (delivered prompts, closed epochs);
        the staleness rules, over-sampling (demand, stops) and the capacity check."""
        self.batch_size = batch_size
        self.ready = ready
        self.shares = shares
        self._training = training
        self._leases = leases
        self._frontier = frontier
        self._staleness = staleness
        self._oversampling = oversampling
        self._capacity = capacity
        self._counters = counters
        self.recorded: dict[int, RecordedBatch] = dict(restored.batches)
        self.trimmed_upto = restored.trimmed_upto
        # Highest rollout id a trainer has fetched completely (ever): its prompts were trained on.
        self.consumed_upto = max(restored.consumed_upto, restored.trimmed_upto)
        self.last_rollout_id = (
            max(restored.last_rollout_id, *self.recorded) if self.recorded else restored.last_rollout_id
        )
        self.last_checkpoint = restored.last_checkpoint
        self.pending: list[PendingGenerate] = []
        self.repairs: dict[int, list[tuple[bytes, int, int]]] = {}  # batch -> (peer, req, rank) waiting for it
        self.epoch_last_rollout: dict[int, int] = {}  # epoch -> last batch holding its prompts
        for rollout_id, batch in self.recorded.items():
            for g in batch.groups:
                self._note_epoch(g.data_epoch, rollout_id)

    # ------------------------------------------------------------------ agents

    def retire_agent(self, agent_id: str, ops: list) -> None:
        """A retired node's payloads are gone: its ready groups are generated again, its batches lose them."""
        for prompt in self.ready.take_agent(agent_id):
            self._frontier.reopen(*prompt)
            ops.append(DropPrompt(*prompt))
        # What happens to a batch's lost prompts is decided when a trainer asks for
        # it again (``start_repair``): only then is it known whether it was fetched.
        for rollout_id, batch in list(self.recorded.items()):
            lost = [g for g in batch.groups if g.agent_id == agent_id]
            if lost:
                self.lose_groups(rollout_id, lost, ops)

    def delivered_key(self, epoch: int, index: int) -> str | None:
        """The key of the group delivered for prompt ``(epoch, index)`` in a recorded batch; None if none is."""
        for batch in self.recorded.values():
            for g in batch.groups:
                if g.index == index and g.data_epoch == epoch:
                    return g.key
        return None

    def keys_on(self, agent_id: str) -> set[str]:
        """Keys of the groups on ``agent_id`` that a ready group or recorded batch refers to."""
        recorded = self.recorded.values()
        return self.ready.keys_on(agent_id) | {g.key for b in recorded for g in b.groups if g.agent_id == agent_id}

    def referenced_agents(self) -> set[str]:
        """The agents holding a ready group or a group of a recorded batch."""
        return self.ready.agents() | {g.agent_id for batch in self.recorded.values() for g in batch.groups}

    # ------------------------------------------------------------------ recorded batches

    def reply(self, req: int, rollout_id: int, rank: int = 0) -> p.BatchRefs:
        """Batch ``rollout_id`` for rank ``rank``: its share's groups (all of them for a trainer of one process)."""
        return self.shares.reply(req, rollout_id, self.recorded[rollout_id], rank)

    def _record(self, rollout_id: int, batch: RecordedBatch, ops: list) -> RecordedBatch:
        """Record ``batch`` as batch ``rollout_id`` unless it is the one recorded."""
        if batch is not self.recorded.get(rollout_id):
            self.recorded[rollout_id] = batch
            ops.append(PutBatch(rollout_id, batch))
        return batch

    def shared(self, rollout_id: int, ops: list) -> RecordedBatch:
        """Batch ``rollout_id`` with shares for the attached trainer's ranks (made and recorded if it had none)."""
        return self._record(rollout_id, self.shares.fit(self.recorded[rollout_id]), ops)

    def take(self, rollout_id: int, rank: int, ops: list) -> bool:
        """Rank ``rank`` holds its share of batch ``rollout_id``; True once every rank does (the batch is consumed)."""
        batch = self.recorded.get(rollout_id)
        if batch is None or not batch.world:
            return True
        batch = self._record(rollout_id, self.shares.taken(batch, rank), ops)
        return len(batch.taken) >= batch.world

    def retake(self, rollout_id: int, rank: int, gone: set[str], ops: list) -> None:
        """Rank ``rank`` asks again for a share it took (it restarted): it no longer holds it, and its groups on
        agents in ``gone`` (retired) are lost now, to be replaced."""
        batch = self.recorded[rollout_id]
        if rank not in batch.taken:
            return
        batch = self._record(rollout_id, self.shares.given_back(batch, rank), ops)
        lost = [g for g in batch.share(rank) if g.agent_id in gone]
        if lost:
            self.lose_groups(rollout_id, lost, ops)

    def _deliver(self, prompt: Prompt, st: PromptState, rollout_id: int, ops: list) -> GroupRef:
        epoch, index = prompt
        self._frontier.set(epoch, index, DELIVERED)
        self._note_epoch(epoch, rollout_id)
        ops.append(PutPrompt(epoch, index, PromptState(DELIVERED, st.agent_id, st.key, rollout_id=rollout_id)))
        return GroupRef(epoch, index, st.agent_id, st.key, lengths=tuple(st.stats.get("lengths", ())))

    def composition(self, rollout_id: int) -> list[int]:
        """Groups of each training dataset a full batch ``rollout_id`` holds (the mixture's shares)."""
        return self._training.shares(rollout_id)

    def available(self, rollout_id: int) -> list[int]:
        """Of each dataset's share of batch ``rollout_id``, the groups ready for it now."""
        return [min(n, ready) for n, ready in zip(self.composition(rollout_id), self.ready.count, strict=True)]

    def target(self, batch: RecordedBatch) -> int:
        """Groups ``batch`` holds when complete: a partial batch's own size, else ``rollout_batch_size``."""
        return batch.size or self.batch_size

    def assemble(self, g: PendingGenerate, counts: list[int] | None, now: float) -> Persist:
        """Record batch ``g.rollout_id`` from ``counts[d]`` ready groups of each training dataset (default: the
        mixture's shares, a full batch; fewer: a partial batch)."""
        full = self.batch_size
        counts = self.composition(g.rollout_id) if counts is None else counts
        chosen = []
        for dataset, n in enumerate(counts):
            taken = 0
            while taken < n:
                prompt, st = self.ready.pop(dataset)
                if st is not None:
                    chosen.append((prompt, st))
                    taken += 1
        ops: list = []
        groups = tuple(self._deliver(prompt, st, g.rollout_id, ops) for prompt, st in chosen)
        training = self._training
        drops, dataset_drops = training.take_drops()
        keys = [PromptKey.of(*prompt) for prompt, _ in chosen]
        metrics = batch_metrics(
            [st.stats for _, st in chosen],
            [key.epoch for key in keys],
            drops,
            sources=[training.names[key.dataset] for key in keys] if training.mixed else None,
            source_drops=dict(zip(training.names, dataset_drops, strict=True)),
        )
        metrics.update(self._staleness.metrics(g.rollout_id, [st.start for _, st in chosen], now))
        metrics.update(self._oversampling.batch_metrics(full, len(groups)))
        batch = self.shares.fit(RecordedBatch(groups, metrics, size=len(groups) if len(groups) < full else 0))
        if batch.size:
            self._counters.partial_batches += 1
        self.recorded[g.rollout_id] = batch
        self.last_rollout_id = max(self.last_rollout_id, g.rollout_id)
        ops.append(PutBatch(g.rollout_id, batch))
        ops.append(SetMark("last_rollout_id", self.last_rollout_id))
        self.close_epochs(ops)
        self._counters.batch(g.rollout_id, now, max(0.0, now - g.since), len(groups), metrics)
        return Persist(ops, [Send(peer, self.reply(req, g.rollout_id, rank)) for peer, req, rank in g.waiters])

    def _note_epoch(self, epoch: int, rollout_id: int) -> None:
        self.epoch_last_rollout[epoch] = max(self.epoch_last_rollout.get(epoch, -1), rollout_id)

    def close_epochs(self, ops: list) -> None:
        """Close complete epochs once every batch holding their prompts was fetched."""
        fetched = lambda e: self.epoch_last_rollout.get(e, -1) <= self.consumed_upto  # noqa: E731
        for closed in self._frontier.close_finished(fetched):
            self.epoch_last_rollout.pop(closed, None)
            ops.append(CloseEpoch(closed))

    def consume(self, rollout_id: int, ops: list) -> None:
        """A trainer fetched batch ``rollout_id`` completely (every rank its share); its prompts count as trained."""
        self.consumed_upto = max(self.consumed_upto, rollout_id)
        ops.append(SetMark("consumed_upto", self.consumed_upto))
        self.close_epochs(ops)

    def checkpoint(self, consumed: int, ops: list) -> dict[str, list[str]]:
        """Record a trainer checkpoint at ``consumed``; returns the group keys now trimmable, by agent.

        Trims only behind the *previous* checkpoint: the trainer may die before
        it has saved this one, and must then be able to resume from the last.
        """
        by_agent: dict[str, list[str]] = {}
        previous = self.last_checkpoint
        for rollout_id in sorted(r for r in self.recorded if r <= previous):
            for g in self.recorded.pop(rollout_id).groups:
                by_agent.setdefault(g.agent_id, []).append(g.key)
            ops.append(DropBatch(rollout_id))
        if previous > self.trimmed_upto:
            self.trimmed_upto = previous
            ops.append(SetMark("trimmed_upto", previous))
        if consumed > self.last_checkpoint:
            self.last_checkpoint = consumed
            ops.append(SetMark("last_checkpoint", consumed))
        return by_agent

    # ------------------------------------------------------------------ repair

    def lose_groups(self, rollout_id: int, lost: list[GroupRef], ops: list) -> None:
        """Groups of a recorded batch whose payloads are gone for good (node retired, disk wiped)."""
        batch = self.recorded[rollout_id]
        left, lost = self.shares.lose(batch, lost)
        if lost:
            metrics = dict(batch.metrics)
            metrics["rollout/replaced_groups"] = metrics.get("rollout/replaced_groups", 0.0) + len(lost)
            lost_prompts = batch.lost + tuple(g.prompt for g in lost)  # its repair: generated again or replaced
            self._record(rollout_id, dataclasses.replace(left, metrics=metrics, lost=lost_prompts), ops)

    def start_repair(self, rollout_id: int, ops: list) -> None:
        """A trainer asks for a batch that lost groups: refill it.

        If no trainer ever fetched it, its lost prompts were never trained:
        they are generated again. If one did (``consumed_upto``), they stay
        delivered — never trained twice — and fresh prompts fill the batch.
        """
        frontier = self._frontier
        batch = self.recorded[rollout_id]
        if rollout_id > self.consumed_upto:
            for epoch, index in batch.lost:
                if frontier.is_open(epoch):
                    frontier.reopen(epoch, index)
                    ops.append(DropPrompt(epoch, index))
        batch = dataclasses.replace(batch, lost=())
        self.recorded[rollout_id] = batch
        ops.append(PutBatch(rollout_id, batch))
        self.repairs[rollout_id] = []

    def _fill_repairs(self) -> list:
        out = []
        for rollout_id in sorted(self.repairs):
            batch = self.recorded.get(rollout_id)
            if batch is None:  # trimmed meanwhile
                self.repairs.pop(rollout_id)
                continue
            size = self.target(batch)
            ops: list = []
            added: list[GroupRef] = []
            for dataset, n in self._missing(rollout_id, batch).items():
                while n > 0:
                    d = self.ready.fullest() if dataset is None else dataset
                    if not self.ready.count[d]:
                        break
                    prompt, st = self.ready.pop(d)
                    if st is not None:
                        added.append(self._deliver(prompt, st, rollout_id, ops))
                        n -= 1
            if added:
                batch = self.shares.add(batch, added)
                self.recorded[rollout_id] = batch
            if len(batch.groups) < size:
                if ops:
                    out.append(Persist(ops + [PutBatch(rollout_id, batch)], []))
                break
            waiters = self.repairs.pop(rollout_id)
            ops.append(PutBatch(rollout_id, batch))
            sends = [Send(peer, self.reply(req, rollout_id, rank)) for peer, req, rank in waiters]
            out.append(Persist(ops, sends))
        return out

    # ------------------------------------------------------------------ demand

    def enqueue(
        self, peer: bytes, req: int, rollout_id: int, now: float, deadline: float = 0.0, rank: int = 0
    ) -> p.Error | None:
        """Wait for batch ``rollout_id`` (or its repair); the error if it can never come.

        ``deadline``: seconds after the first arrival at which a partial batch will do (0: none)."""
        if rollout_id in self.repairs:
            waiters = self.repairs[rollout_id]
            waiters[:] = [w for w in waiters if w[2] != rank] + [(peer, req, rank)]
            self._counters.note_waiting(True, now)
            return None
        if rollout_id <= self.trimmed_upto:
            why = (
                f"rollout {rollout_id} is behind the checkpointed frontier ({self.trimmed_upto}); "
                "its groups were consumed"
            )
            return p.Error("trimmed", why, req)
        if rollout_id <= self.last_rollout_id:
            why = (
                f"rollout id {rollout_id} was never generated and is older than the last batch ({self.last_rollout_id})"
            )
            return p.Error("bad_rollout_id", why, req)
        for g in self.pending:
            if g.rollout_id == rollout_id:
                g.waiters = [w for w in g.waiters if w[2] != rank] + [(peer, req, rank)]
                if rank == 0 or not g.deadline:
                    g.deadline = deadline
                return None
        self.pending.append(PendingGenerate([(peer, req, rank)], rollout_id, now, deadline))
        self.pending.sort(key=lambda g: g.rollout_id)
        self._counters.note_waiting(True, now)
        return None

    def take_waiting(self, now: float) -> list[tuple[bytes, int]]:
        """``(peer, req)`` of every waiting ``generate`` call (from every rank), no longer waiting: the caller
        answers them (a newer trainer session attached)."""
        waiting = [(peer, req) for g in self.pending for peer, req, _ in g.waiters]
        self.pending.clear()
        self._counters.note_waiting(bool(self.repairs), now)
        return waiting

    @property
    def current_rollout_id(self) -> int:
        if self.pending:
            return self.pending[0].rollout_id
        return self.last_rollout_id + 1

    def _missing(self, rollout_id: int, batch: RecordedBatch) -> dict[int | None, int]:
        """Groups a batch in repair lacks, by training dataset. A full batch keeps its mixture's shares;
        a partial one (``batch.size``) of a mixture is filled from any dataset (key None)."""
        lacking = self.target(batch) - len(batch.groups)
        if lacking <= 0:
            return {}
        if len(self.ready.count) == 1:
            return {0: lacking}
        if batch.size:
            return {None: lacking}
        have = [0] * len(self.ready.count)
        for group in batch.groups:
            have[dataset_of(group.data_epoch)] += 1
        return {d: n - h for d, (n, h) in enumerate(zip(self.composition(rollout_id), have, strict=True)) if n > h}

    def wanted(self, prefetch: int) -> list[int]:
        """Groups wanted in flight or ready, by training dataset: each waiting batch's (over-sampled) and the
        prefetch's by the mixture's shares at their rollout ids, each repair's by what it lacks."""
        training = self._training
        per_batch = self._oversampling.demand(self.batch_size)
        wanted = [0] * len(self.ready.count)
        for g in self.pending:
            for d, n in enumerate(training.shares(g.rollout_id, per_batch)):
                wanted[d] += n
        for rollout_id in self.repairs:
            batch = self.recorded.get(rollout_id)
            if batch is not None:
                for dataset, n in self._missing(rollout_id, batch).items():
                    if dataset is None:
                        for d, k in enumerate(training.shares(self.current_rollout_id, n)):
                            wanted[d] += k
                    else:
                        wanted[dataset] += n
        for d, n in enumerate(training.shares(self.current_rollout_id, prefetch)):
            wanted[d] += n
        return wanted

    def pump(self, now: float, prefetch: int) -> list:
        """Complete repairs, then assemble waiting batches (partial ones past their deadline), then
        stop the over-sampled leases no batch needs any more; fail waiting batches that can never come."""
        out: list = self._fill_repairs() if self.repairs else []
        size = self.batch_size
        assembled = False
        while self.pending and not self.repairs:
            counts = self.available(self.pending[0].rollout_id)
            n = sum(counts)
            if n < size and not (n and self.pending[0].due(now)):
                break
            if self._staleness.bounded and self._held(self.pending[0].rollout_id):
                break  # leases in flight need this batch's places (staleness rule 2)
            out.append(self.assemble(self.pending.pop(0), counts, now))
            assembled = True
        if assembled:
            out += self._oversampling.stop_excess(self.wanted(prefetch), self.ready.count)
        # Short of groups (a mixture: of some dataset's share) while no batch can come: fail the waiting calls.
        if self.pending:
            short = sum(self.available(self.pending[0].rollout_id)) < size
        else:
            short = bool(self.repairs) and len(self.ready) < size
        if short:
            hopeless = self._hopeless()
            if hopeless is not None:
                out += self._fail_waiting(*hopeless)
        self._counters.note_waiting(bool(self.pending or self.repairs), now)
        return out

    def _held(self, rollout_id: int) -> bool:
        """Staleness rule 2 (coordinator/staleness.py) holds batch ``rollout_id``: of a mixture, for some dataset,
        on its own leases and ready groups against its share (the batch takes each dataset's oldest)."""
        staleness = self._staleness
        if len(self.ready.count) == 1:
            leased = (lease.start for lease in self._leases.bounded_leases())
            return staleness.holds_batch(rollout_id, leased, self.ready.starts())
        leased_by: dict[int, list[int]] = {}
        for lease in self._leases.bounded_leases():
            leased_by.setdefault(dataset_of(lease.data_epoch), []).append(lease.start)
        if not leased_by:
            return False
        ready_by = self.ready.starts_by_dataset()
        shares = self.composition(rollout_id)
        return any(
            staleness.holds_batch(rollout_id, starts, ready_by.get(dataset, ()), shares[dataset])
            for dataset, starts in leased_by.items()
        )

    def _hopeless(self) -> tuple[str, str] | None:
        """``(code, why)`` if no batch can come until something changes; None while one may."""
        why = self._capacity.why_none()
        if why is not None:
            return "no_capacity", why
        starvation = self._training.starvation
        if starvation.starved:
            return "starved", starvation.reason
        return None

    def _fail_waiting(self, code: str, why: str) -> list[Send]:
        """Answer every waiting ``generate`` (and repair) with an error: never left waiting."""
        waiting = [(peer, req) for g in self.pending for peer, req, _ in g.waiters]
        waiting += [(peer, req) for waiters in self.repairs.values() for peer, req, _ in waiters]
        self.pending.clear()
        for waiters in self.repairs.values():
            waiters.clear()
        if code == "starved":
            self._training.starvation.answered.update(waiting)
        return [Send(peer, p.Error(code, why, req)) for peer, req in waiting]
