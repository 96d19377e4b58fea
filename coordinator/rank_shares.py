"""Share bookkeeping: the attached trainer's ranks, each one's share of a recorded batch, and who took it.

A trainer of ``W`` processes (``Attach.world_size``) gets every batch split into ``W`` shares of whole
groups (``coordinator/shares.py``: balanced tokens, or equal numbers of groups with ``Attach.balance``
``groups``). This role keeps the attached trainer's ``world`` and balance, makes a recorded batch's
shares for them (``fit``), marks a rank's share taken when the rank says it holds it (``taken``) or
given back when a restarted rank asks again (``given_back``), takes lost groups out of the shares and
puts a repair's groups in (``lose``, ``add``), and answers each rank with its share (``reply``), with
every rank's sample lengths made once per batch, not once per rank.

The recorded batches are the batch book's (``coordinator/batches.py``): these verbs take a batch and
return the batch to record, and the batch book records it.

Invariants:
- Shares are fixed once recorded: a batch is re-split only when the trainer's size or balance changed
  (resumed on another number of processes), and then nobody's share counts as taken.
- A batch is consumed once every rank took its share (``taken`` reaches ``world``).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common import protocol as p
from coordinator import shares
from coordinator.records import GroupRef, RecordedBatch

__all__ = ["RankShares"]

LENGTHS_KEPT = 8
"""Batches whose ranks' sample lengths are kept made (the newest)."""


class RankShares:
    def __init__(self, payload_address: Callable[[str], str]):
        """``payload_address(agent_id)``: where trainers fetch an agent's payloads (membership's)."""
        self.world = 1
        """Processes of the attached trainer (``Attach.world_size``): batches are split into that many shares."""
        self.equal_groups = False
        """Its shares hold equal numbers of groups (``Attach.balance`` ``groups``), else balanced tokens."""
        self._address = payload_address
        self._lengths: dict[int, tuple[RecordedBatch, list[bytes] | None]] = {}

    def attach(self, world: int, equal_groups: bool) -> None:
        """A trainer of ``world`` processes attached."""
        self.world, self.equal_groups = world, equal_groups

    def fit(self, batch: RecordedBatch) -> RecordedBatch:
        """``batch`` with shares for the attached trainer's ranks (itself if it has them)."""
        return shares.with_shares(batch, self.world, self.equal_groups)

    @staticmethod
    def lose(batch: RecordedBatch, lost: list[GroupRef]) -> tuple[RecordedBatch, list[GroupRef]]:
        """``batch`` without ``lost`` (groups whose payloads are gone for good), the ranks that lost them waiting
        for replacements, and the groups that left; a group in the share of a rank that took it stays (trained,
        not replaced)."""
        held = shares.kept_on_loss(batch, lost)
        lost = [g for g in lost if g not in held]
        return (shares.drop_groups(batch, lost), lost) if lost else (batch, [])

    @staticmethod
    def add(batch: RecordedBatch, added: list[GroupRef]) -> RecordedBatch:
        """``batch`` with a repair's ``added`` groups, each on a rank that lost one."""
        return shares.add_groups(batch, added)

    @staticmethod
    def taken(batch: RecordedBatch, rank: int) -> RecordedBatch:
        """``batch`` with rank ``rank``'s share taken (itself if it was)."""
        if rank in batch.taken:
            return batch
        return dataclasses.replace(batch, taken=(*batch.taken, rank))

    @staticmethod
    def given_back(batch: RecordedBatch, rank: int) -> RecordedBatch:
        """``batch`` with rank ``rank``'s share no longer taken (it restarted without it)."""
        return dataclasses.replace(batch, taken=tuple(r for r in batch.taken if r != rank))

    def reply(self, req: int, rollout_id: int, batch: RecordedBatch, rank: int = 0) -> p.BatchRefs:
        """Batch ``rollout_id`` for rank ``rank``: its share's groups (all of them for a trainer of one process)."""
        address = self._address
        groups = [dataclasses.replace(g, payload_address=address(g.agent_id)).to_wire() for g in batch.share(rank)]
        share = shares.share_info(batch, rank, self._rank_lengths(rollout_id, batch)) if batch.world else {}
        return p.BatchRefs(req, rollout_id, groups, dict(batch.metrics), share)

    def _rank_lengths(self, rollout_id: int, batch: RecordedBatch) -> list[bytes] | None:
        """``shares.rank_lengths`` of ``batch``, made once for every rank's reply (until the batch changes)."""
        cached = self._lengths.get(rollout_id)
        if cached is None or cached[0] is not batch:
            cached = self._lengths[rollout_id] = (batch, shares.rank_lengths(batch))
            if len(self._lengths) > LENGTHS_KEPT:
                self._lengths.pop(next(iter(self._lengths)))
        return cached[1]
