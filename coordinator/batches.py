"""Batches: ready groups, trainer batches, their repair and their trimming.

Ready groups (committed on an agent, recorded READY in the ledger) wait in
acceptance order; a waiting ``generate`` takes exactly
``rollout_batch_size`` of them into a ``RecordedBatch`` with its metrics
(``common.metrics.batch_metrics``), or fewer, at least one, once its
``deadline`` passed (a partial batch, ``coordinator/oversampling.py``). Pure:
events in, effects out.

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
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import protocol as p
from common.metrics import DropStats, batch_metrics
from common.mixture import EPOCH_BITS, EPOCH_MASK
from coordinator import shares
from coordinator.capacity import no_capacity
from coordinator.effects import Persist, Send
from coordinator.frontier import DELIVERED, READY
from coordinator.oversampling import deadline_due
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
    from coordinator.core import CoordinatorCore


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


class Batches:
    def __init__(self, core: CoordinatorCore, restored: LedgerSnapshot):
        self.core = core
        self.ready: dict[int, deque[Prompt]] = {}
        """Each training source's ready groups in acceptance order (may hold prompts no longer ready)."""
        self.ready_info: dict[Prompt, PromptState] = {}
        self.ready_count: list[int] = [0] * len(core.sources)
        """Entries of ``ready_info`` by training source."""
        self._seq = 0
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
        self.world = 1
        """Processes of the attached trainer (``Attach.world_size``): batches are split into that many shares."""
        self.equal_groups = False
        """Its shares hold equal numbers of groups (``Attach.balance`` ``groups``), else balanced tokens."""
        self._share_lengths: dict[int, tuple[RecordedBatch, list[bytes] | None]] = {}
        self.drops = DropStats()  # filter verdicts since the last batch was assembled
        self.source_drops: list[int] = [0] * len(core.sources)  # filter drops since then, by training source
        self.epoch_last_rollout: dict[int, int] = {}  # epoch -> last batch holding its prompts
        for rollout_id, batch in self.recorded.items():
            for g in batch.groups:
                self._note_epoch(g.data_epoch, rollout_id)

    # ------------------------------------------------------------------ ready groups

    def restore_ready(self, prompts: dict[Prompt, PromptState]) -> None:
        for prompt, st in sorted((kv for kv in prompts.items() if kv[1].ready), key=lambda kv: (kv[1].seq, kv[0])):
            if prompt[0] >> EPOCH_BITS < len(self.ready_count):
                self._put_ready(prompt, st)
            self._seq = max(self._seq, st.seq)

    def _put_ready(self, prompt: Prompt, st: PromptState) -> None:
        source = prompt[0] >> EPOCH_BITS
        self.ready.setdefault(source, deque()).append(prompt)
        self.ready_info[prompt] = st
        self.ready_count[source] += 1

    def _take_ready(self, prompt: Prompt) -> PromptState | None:
        """``prompt``'s ready entry, removed (None if it has none)."""
        st = self.ready_info.pop(prompt, None)
        if st is not None:
            self.ready_count[prompt[0] >> EPOCH_BITS] -= 1
        return st

    def add_ready(
        self, epoch: int, index: int, agent_id: str, key: str, stats: dict, ops: list, start: int = 0
    ) -> None:
        """A group was accepted; ``start``: weight updates pushed when its lease was granted."""
        self._seq += 1
        st = PromptState(READY, agent_id, key, stats, self._seq, start=start)
        self._put_ready((epoch, index), st)
        self.drops.record_kept()
        ops.append(PutPrompt(epoch, index, st))

    def note_drop(self, prompt: Prompt, reason: str) -> None:
        """The filter dropped ``prompt``'s group (or it was filtered for failures)."""
        self.drops.record_dropped(reason)
        self.source_drops[prompt[0] >> EPOCH_BITS] += 1

    def take_back_drop(self, reason: str, prompt: Prompt) -> None:
        """A filter drop counted since the last batch was undone: its prompt is pending again."""
        source = prompt[0] >> EPOCH_BITS
        self.source_drops[source] = max(0, self.source_drops[source] - 1)
        n = self.drops.dropped.get(reason, 0)
        if n > 1:
            self.drops.dropped[reason] = n - 1
        elif n == 1:
            del self.drops.dropped[reason]

    def retire_agent(self, agent_id: str, ops: list) -> None:
        """A retired node's payloads are gone: its ready groups are generated again, its batches lose them."""
        for prompt, st in list(self.ready_info.items()):
            if st.agent_id == agent_id:
                self._take_ready(prompt)
                self.core.frontier.reopen(*prompt)
                ops.append(DropPrompt(*prompt))
        # What happens to a batch's lost prompts is decided when a trainer asks for
        # it again (``start_repair``): only then is it known whether it was fetched.
        for rollout_id, batch in list(self.recorded.items()):
            lost = [g for g in batch.groups if g.agent_id == agent_id]
            if lost:
                self.lose_groups(rollout_id, lost, ops)

    def delivered_key(self, epoch: int, index: int) -> str | None:
        for batch in self.recorded.values():
            for g in batch.groups:
                if g.index == index and g.data_epoch == epoch:
                    return g.key
        return None

    def keys_on(self, agent_id: str) -> set[str]:
        """Keys of the groups on ``agent_id`` that a ready group or recorded batch refers to."""
        live = {st.key for st in self.ready_info.values() if st.agent_id == agent_id}
        live |= {g.key for batch in self.recorded.values() for g in batch.groups if g.agent_id == agent_id}
        return live

    def referenced_agents(self) -> set[str]:
        agents = {st.agent_id for st in self.ready_info.values()}
        agents |= {g.agent_id for batch in self.recorded.values() for g in batch.groups}
        return agents

    # ------------------------------------------------------------------ recorded batches

    def reply(self, req: int, rollout_id: int, rank: int = 0) -> p.BatchRefs:
        """Batch ``rollout_id`` for rank ``rank``: its share's groups (all of them for a trainer of one process)."""
        batch = self.recorded[rollout_id]
        address = self.core.payload_address
        groups = [dataclasses.replace(g, payload_address=address(g.agent_id)).to_wire() for g in batch.share(rank)]
        share = shares.share_info(batch, rank, self._lengths(rollout_id, batch)) if batch.world else {}
        return p.BatchRefs(req, rollout_id, groups, dict(batch.metrics), share)

    def _lengths(self, rollout_id: int, batch: RecordedBatch) -> list[bytes] | None:
        """``shares.rank_lengths`` of ``batch``, made once for every rank's reply (until the batch changes)."""
        cached = self._share_lengths.get(rollout_id)
        if cached is None or cached[0] is not batch:
            cached = self._share_lengths[rollout_id] = (batch, shares.rank_lengths(batch))
            if len(self._share_lengths) > 8:
                self._share_lengths.pop(next(iter(self._share_lengths)))
        return cached[1]

    def shared(self, rollout_id: int, ops: list) -> RecordedBatch:
        """Batch ``rollout_id`` with shares for the attached trainer's ranks (made and recorded if it had none)."""
        batch = self.recorded[rollout_id]
        made = shares.with_shares(batch, self.world, self.equal_groups)
        if made is not batch:
            self.recorded[rollout_id] = made
            ops.append(PutBatch(rollout_id, made))
        return made

    def take(self, rollout_id: int, rank: int, ops: list) -> bool:
        """Rank ``rank`` holds its share of batch ``rollout_id``; True once every rank does (the batch is consumed)."""
        batch = self.recorded.get(rollout_id)
        if batch is None or not batch.world:
            return True
        if rank not in batch.taken:
            batch = dataclasses.replace(batch, taken=(*batch.taken, rank))
            self.recorded[rollout_id] = batch
            ops.append(PutBatch(rollout_id, batch))
        return len(batch.taken) >= batch.world

    def retake(self, rollout_id: int, rank: int, gone: set[str], ops: list) -> None:
        """Rank ``rank`` asks again for a share it took (it restarted): it no longer holds it, and its groups on
        agents in ``gone`` (retired) are lost now, to be replaced."""
        batch = self.recorded[rollout_id]
        if rank not in batch.taken:
            return
        batch = dataclasses.replace(batch, taken=tuple(r for r in batch.taken if r != rank))
        self.recorded[rollout_id] = batch
        ops.append(PutBatch(rollout_id, batch))
        lost = [g for g in batch.share(rank) if g.agent_id in gone]
        if lost:
            self.lose_groups(rollout_id, lost, ops)

    def _deliver(self, prompt: Prompt, st: PromptState, rollout_id: int, ops: list) -> GroupRef:
        epoch, index = prompt
        self.core.frontier.set(epoch, index, DELIVERED)
        self._note_epoch(epoch, rollout_id)
        ops.append(PutPrompt(epoch, index, PromptState(DELIVERED, st.agent_id, st.key, rollout_id=rollout_id)))
        return GroupRef(epoch, index, st.agent_id, st.key, lengths=tuple(st.stats.get("lengths", ())))

    def _pop_ready(self, source: int) -> tuple[Prompt, PromptState | None]:
        """The next ready group of training source ``source`` (``ready_count[source]`` > 0)."""
        queue = self.ready[source]
        if self.core.staleness.bounded:
            # Oldest weights first (docs/weights.md, staleness rule 2), then acceptance order.
            mine = (kv for kv in self.ready_info.items() if kv[0][0] >> EPOCH_BITS == source)
            oldest = min(mine, key=lambda kv: (kv[1].start, kv[1].seq), default=None)
            if oldest is not None:
                self._take_ready(oldest[0])
                if len(queue) > 2 * self.ready_count[source] + 64:  # drop the entries popped out of order
                    self.ready[source] = deque(prompt for prompt in queue if prompt in self.ready_info)
                return oldest
        prompt = queue.popleft()
        return prompt, self._take_ready(prompt)  # None: reopened after its node was retired

    def _fullest(self) -> int:
        """The training source with the most ready groups (ties: the earlier)."""
        return max(range(len(self.ready_count)), key=lambda s: (self.ready_count[s], -s))

    def composition(self, rollout_id: int) -> list[int]:
        """Groups of each training source a full batch ``rollout_id`` holds (the mixture's shares)."""
        return self.core.admission.training.shares(rollout_id)

    def available(self, rollout_id: int) -> list[int]:
        """Of each source's share of batch ``rollout_id``, the groups ready for it now."""
        return [min(n, ready) for n, ready in zip(self.composition(rollout_id), self.ready_count, strict=True)]

    def target(self, batch: RecordedBatch) -> int:
        """Groups ``batch`` holds when complete: a partial batch's own size, else ``rollout_batch_size``."""
        return batch.size or self.core.config.rollout_batch_size

    def assemble(self, g: PendingGenerate, counts: list[int] | None = None) -> Persist:
        """Record batch ``g.rollout_id`` from ``counts[s]`` ready groups of each training source (default: the
        mixture's shares, a full batch; fewer: a partial batch)."""
        full = self.core.config.rollout_batch_size
        counts = self.composition(g.rollout_id) if counts is None else counts
        chosen = []
        for source, n in enumerate(counts):
            taken = 0
            while taken < n:
                prompt, st = self._pop_ready(source)
                if st is not None:
                    chosen.append((prompt, st))
                    taken += 1
        ops: list = []
        groups = tuple(self._deliver(prompt, st, g.rollout_id, ops) for prompt, st in chosen)
        names = self.core.admission.training.names
        mixed = self.core.admission.training.mixed
        metrics = batch_metrics(
            [st.stats for _, st in chosen],
            [prompt[0] & EPOCH_MASK for prompt, _ in chosen],
            self.drops,
            sources=[names[prompt[0] >> EPOCH_BITS] for prompt, _ in chosen] if mixed else None,
            source_drops=dict(zip(names, self.source_drops, strict=True)),
        )
        metrics.update(self.core.staleness.metrics(g.rollout_id, [st.start for _, st in chosen], self.core.now))
        metrics.update(self.core.oversampling.batch_metrics(full, len(groups)))
        batch = shares.with_shares(
            RecordedBatch(groups, metrics, size=len(groups) if len(groups) < full else 0), self.world, self.equal_groups
        )
        if batch.size:
            self.core.counters.partial_batches += 1
        self.recorded[g.rollout_id] = batch
        self.last_rollout_id = max(self.last_rollout_id, g.rollout_id)
        ops.append(PutBatch(g.rollout_id, batch))
        ops.append(SetMark("last_rollout_id", self.last_rollout_id))
        self.drops = DropStats()
        self.source_drops = [0] * len(names)
        self.close_epochs(ops)
        now = self.core.now
        self.core.counters.batch(g.rollout_id, now, max(0.0, now - g.since), len(groups), metrics)
        return self.core.persist(
            ops, [Send(peer, self.reply(req, g.rollout_id, rank)) for peer, req, rank in g.waiters]
        )

    def _note_epoch(self, epoch: int, rollout_id: int) -> None:
        self.epoch_last_rollout[epoch] = max(self.epoch_last_rollout.get(epoch, -1), rollout_id)

    def close_epochs(self, ops: list) -> None:
        """Close complete epochs once every batch holding their prompts was fetched."""
        fetched = lambda e: self.epoch_last_rollout.get(e, -1) <= self.consumed_upto  # noqa: E731
        for closed in self.core.frontier.close_finished(fetched):
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
        held = shares.kept_on_loss(batch, lost)  # in the share of a rank that has it: trained, not replaced
        lost = [g for g in lost if g not in held]
        if not lost:
            return
        metrics = dict(batch.metrics)
        metrics["rollout/replaced_groups"] = metrics.get("rollout/replaced_groups", 0.0) + len(lost)
        lost_prompts = batch.lost + tuple(g.prompt for g in lost)
        batch = shares.drop_groups(batch, lost)
        batch = dataclasses.replace(batch, metrics=metrics, lost=lost_prompts)  # keeps a partial size
        self.recorded[rollout_id] = batch
        ops.append(PutBatch(rollout_id, batch))

    def start_repair(self, rollout_id: int, ops: list) -> None:
        """A trainer asks for a batch that lost groups: refill it.

        If no trainer ever fetched it, its lost prompts were never trained:
        they are generated again. If one did (``consumed_upto``), they stay
        delivered — never trained twice — and fresh prompts fill the batch.
        """
        frontier = self.core.frontier
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
            for source, n in self._missing(rollout_id, batch).items():
                while n > 0:
                    s = self._fullest() if source is None else source
                    if not self.ready_count[s]:
                        break
                    prompt, st = self._pop_ready(s)
                    if st is not None:
                        added.append(self._deliver(prompt, st, rollout_id, ops))
                        n -= 1
            if added:
                batch = shares.add_groups(batch, added)
                self.recorded[rollout_id] = batch
            if len(batch.groups) < size:
                if ops:
                    out.append(self.core.persist(ops + [PutBatch(rollout_id, batch)], []))
                break
            waiters = self.repairs.pop(rollout_id)
            ops.append(PutBatch(rollout_id, batch))
            sends = [Send(peer, self.reply(req, rollout_id, rank)) for peer, req, rank in waiters]
            out.append(self.core.persist(ops, sends))
        return out

    # ------------------------------------------------------------------ demand

    def enqueue(self, peer: bytes, req: int, rollout_id: int, deadline: float = 0.0, rank: int = 0) -> p.Error | None:
        """Wait for batch ``rollout_id`` (or its repair); the error if it can never come.

        ``deadline``: seconds after the first arrival at which a partial batch will do (0: none)."""
        if rollout_id in self.repairs:
            waiters = self.repairs[rollout_id]
            waiters[:] = [w for w in waiters if w[2] != rank] + [(peer, req, rank)]
            self.core.counters.note_waiting(True, self.core.now)
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
        self.pending.append(PendingGenerate([(peer, req, rank)], rollout_id, self.core.now, deadline))
        self.pending.sort(key=lambda g: g.rollout_id)
        self.core.counters.note_waiting(True, self.core.now)
        return None

    @property
    def current_rollout_id(self) -> int:
        if self.pending:
            return self.pending[0].rollout_id
        return self.last_rollout_id + 1

    def _missing(self, rollout_id: int, batch: RecordedBatch) -> dict[int | None, int]:
        """Groups a batch in repair lacks, by training source. A full batch keeps its mixture's shares;
        a partial one (``batch.size``) of a mixture is filled from any source (key None)."""
        lacking = self.target(batch) - len(batch.groups)
        if lacking <= 0:
            return {}
        if len(self.ready_count) == 1:
            return {0: lacking}
        if batch.size:
            return {None: lacking}
        have = [0] * len(self.ready_count)
        for group in batch.groups:
            have[group.data_epoch >> EPOCH_BITS] += 1
        return {s: n - h for s, (n, h) in enumerate(zip(self.composition(rollout_id), have, strict=True)) if n > h}

    def demand(self, prefetch: int) -> int:
        """Groups wanted in flight or ready: waiting batches (over-sampled), repairs and the prefetch."""
        return sum(self.wanted(prefetch))

    def wanted(self, prefetch: int) -> list[int]:
        """``demand`` by training source: each waiting batch's and the prefetch's by the mixture's shares at their
        rollout ids, each repair's by what it lacks."""
        training = self.core.admission.training
        per_batch = self.core.oversampling.demand(self.core.config.rollout_batch_size)
        wanted = [0] * len(self.ready_count)
        for g in self.pending:
            for s, n in enumerate(training.shares(g.rollout_id, per_batch)):
                wanted[s] += n
        for rollout_id in self.repairs:
            batch = self.recorded.get(rollout_id)
            if batch is not None:
                for source, n in self._missing(rollout_id, batch).items():
                    if source is None:
                        for s, k in enumerate(training.shares(self.current_rollout_id, n)):
                            wanted[s] += k
                    else:
                        wanted[source] += n
        for s, n in enumerate(training.shares(self.current_rollout_id, prefetch)):
            wanted[s] += n
        return wanted

    def pump(self) -> list:
        """Complete repairs, then assemble waiting batches (partial ones past their deadline), then
        stop the over-sampled leases no batch needs any more; fail waiting batches that can never come."""
        out: list = self._fill_repairs() if self.repairs else []
        size = self.core.config.rollout_batch_size
        assembled = False
        while self.pending and not self.repairs:
            counts = self.available(self.pending[0].rollout_id)
            n = sum(counts)
            if n < size and not (n and deadline_due(self.pending[0], self.core.now)):
                break
            if self.core.staleness.bounded and self._held(self.pending[0].rollout_id):
                break  # leases in flight need this batch's places (staleness rule 2)
            out.append(self.assemble(self.pending.pop(0), counts))
            assembled = True
        if assembled:
            out += self.core.oversampling.stop_excess()
        # Short of groups (a mixture: of some dataset's share) while no batch can come: fail the waiting calls.
        if self.pending:
            short = sum(self.available(self.pending[0].rollout_id)) < size
        else:
            short = bool(self.repairs) and len(self.ready_info) < size
        if short:
            hopeless = self._hopeless()
            if hopeless is not None:
                out += self._fail_waiting(*hopeless)
        self.core.counters.note_waiting(bool(self.pending or self.repairs), self.core.now)
        return out

    def _held(self, rollout_id: int) -> bool:
        """Staleness rule 2 (coordinator/staleness.py) holds batch ``rollout_id``: of a mixture, for some dataset,
        on its own leases and ready groups against its share (the batch takes each dataset's oldest)."""
        staleness = self.core.staleness
        if len(self.ready_count) == 1:
            leased = (lease.start for lease in self.core.admission.bounded_leases())
            ready = (st.start for st in self.ready_info.values())
            return staleness.holds_batch(rollout_id, leased, ready)
        leased_by: dict[int, list[int]] = {}
        for lease in self.core.admission.bounded_leases():
            leased_by.setdefault(lease.data_epoch >> EPOCH_BITS, []).append(lease.start)
        if not leased_by:
            return False
        ready_by: dict[int, list[int]] = {}
        for (epoch, _), st in self.ready_info.items():
            ready_by.setdefault(epoch >> EPOCH_BITS, []).append(st.start)
        shares = self.composition(rollout_id)
        return any(
            staleness.holds_batch(rollout_id, starts, ready_by.get(source, ()), shares[source])
            for source, starts in leased_by.items()
        )

    def no_capacity(self) -> str | None:
        """Why no engine can generate anything until something changes (coordinator/capacity.py); None while one
        may. Waiting batches and evaluation passes are answered with it."""
        return no_capacity(self.core)

    def _hopeless(self) -> tuple[str, str] | None:
        """``(code, why)`` if no batch can come until something changes; None while one may."""
        why = self.no_capacity()
        if why is not None:
            return "no_capacity", why
        starvation = self.core.admission.starvation
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
            self.core.admission.starvation.answered.update(waiting)
        return [Send(peer, p.Error(code, why, req)) for peer, req in waiting]
