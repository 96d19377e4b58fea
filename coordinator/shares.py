"""Ranks' shares of a batch: which rank of a sharded trainer gets which whole groups.

A trainer of ``W`` processes (``RolloutClient(addr, rank=R, world_size=W)``) asks every rank for
batch ``t``; each rank gets a share: whole groups (GRPO needs a group's rewards together), chosen so
that the tokens (prompt + response, every sample) per rank are balanced. Pure and deterministic:
the same group sizes and ``W`` give the same shares on every coordinator, before and after a restart.

**Algorithm** (:func:`assign`): longest processing time first (LPT, Graham 1969). Groups, most
tokens first (ties: earlier in the batch first), each to the rank with the fewest tokens so far
(ties: fewer groups, then the lower rank). Two bounds hold on every batch:

- the most-loaded rank holds at most ``4/3 - 1/(3W)`` times the tokens of the most-loaded rank of
  the best possible split (Graham's bound for LPT);
- the most- and least-loaded ranks differ by at most the tokens of the batch's largest group
  (each group goes to the least-loaded rank, which after it is at most one group above the least).

Shares are fixed once a batch is recorded (``RecordedBatch.ranks``): a group lost with its node
after some ranks took their shares is replaced on the rank that lost it, so no rank's share moves
under it (``replacement_ranks``).
"""

from __future__ import annotations

import dataclasses
import heapq
import sys
from array import array
from collections.abc import Sequence

from coordinator.records import GroupRef, RecordedBatch


def assign(tokens: Sequence[int], world: int, equal_groups: bool = False) -> list[int]:
    """The rank of each group (aligned with ``tokens``, each group's total tokens) among ``world`` ranks.

    ``equal_groups``: every rank gets ``len(tokens) // world`` groups, the first ``len(tokens) % world`` ranks one
    more (a trainer whose per-process batch has a fixed size, e.g. TRL's); LPT among the ranks with room left."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    ranks = [0] * len(tokens)
    if world == 1:
        return ranks
    room = [len(tokens) // world + (r < len(tokens) % world) for r in range(world)] if equal_groups else None
    heap = [(0, 0, r) for r in range(world)]  # (tokens, groups, rank): the least loaded on top
    for i in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        load, count, rank = heapq.heappop(heap)
        ranks[i] = rank
        if room is None or count + 1 < room[rank]:  # a rank with no room left leaves the heap
            heapq.heappush(heap, (load + int(tokens[i]), count + 1, rank))
    return ranks


def loads(tokens: Sequence[int], ranks: Sequence[int], world: int) -> list[int]:
    """Tokens each rank holds under ``ranks``."""
    out = [0] * world
    for n, rank in zip(tokens, ranks, strict=True):
        out[rank] += int(n)
    return out


def replacement_ranks(
    lost: Sequence[int], tokens: Sequence[int], ranks: Sequence[int], world: int, n: int
) -> list[int]:
    """Ranks for ``n`` groups added to a batch in repair: first the ranks that lost groups (``lost``, in
    order), then the least-loaded ranks among those still waiting (default: all)."""
    out = list(lost[:n])
    current = loads(tokens, ranks, world)
    waiting = sorted(set(lost)) or list(range(world))
    while len(out) < n:
        rank = min(waiting, key=lambda r: (current[r], r))
        out.append(rank)
        current[rank] += 1  # unknown size yet: spread by count
    return out


# ---------------------------------------------------------------------- recorded batches (pure)


def with_shares(batch: RecordedBatch, world: int, equal_groups: bool = False) -> RecordedBatch:
    """``batch`` with shares made for ``world`` ranks (itself if they are; new ones, nobody's taken, if the
    trainer's size or balance changed, e.g. resumed from a checkpoint on another number of processes)."""
    if world <= 1:
        return batch if not batch.world else dataclasses.replace(batch, world=0, ranks=(), taken=(), lost_ranks=())
    same = (batch.world, batch.equal_groups) == (world, equal_groups)
    if same and len(batch.ranks) == len(batch.groups):
        return batch
    ranks = assign([g.tokens for g in batch.groups], world, equal_groups)
    return dataclasses.replace(
        batch, world=world, ranks=tuple(ranks), taken=(), lost_ranks=(), equal_groups=equal_groups
    )


def kept_on_loss(batch: RecordedBatch, lost: list[GroupRef]) -> list[GroupRef]:
    """Of ``lost`` (groups whose payloads are gone), those a rank already holds: they stay in its share,
    trained, and are not replaced (only the ranks still missing theirs get replacements)."""
    if not batch.world or not batch.taken:
        return []
    rank_of = dict(zip(batch.groups, batch.ranks, strict=True))
    return [g for g in lost if rank_of[g] in batch.taken]


def drop_groups(batch: RecordedBatch, lost: list[GroupRef]) -> RecordedBatch:
    """``batch`` without ``lost``; with shares, the ranks that lost them wait for their replacements."""
    gone = set(lost)
    if not batch.world:
        return dataclasses.replace(batch, groups=tuple(g for g in batch.groups if g not in gone))
    pairs = list(zip(batch.groups, batch.ranks, strict=True))
    kept = [(g, r) for g, r in pairs if g not in gone]
    lost_ranks = batch.lost_ranks + tuple(r for g, r in pairs if g in gone)
    return dataclasses.replace(
        batch, groups=tuple(g for g, _ in kept), ranks=tuple(r for _, r in kept), lost_ranks=lost_ranks
    )


def add_groups(batch: RecordedBatch, added: list[GroupRef]) -> RecordedBatch:
    """``batch`` with a repair's ``added`` groups, each on a rank that lost one (``replacement_ranks``)."""
    if not batch.world:
        return dataclasses.replace(batch, groups=batch.groups + tuple(added))
    ranks = replacement_ranks(batch.lost_ranks, [g.tokens for g in batch.groups], batch.ranks, batch.world, len(added))
    return dataclasses.replace(
        batch,
        groups=batch.groups + tuple(added),
        ranks=batch.ranks + tuple(ranks),
        lost_ranks=batch.lost_ranks[len(added) :],
    )


def rank_lengths(batch: RecordedBatch) -> list[bytes] | None:
    """Every rank's sample lengths, in share order, each rank's as little-endian int32 bytes (``decode_lengths``):
    a copy per reply, not a list to encode, when thousands of ranks ask for one batch. None where a group has none
    (recorded before agents reported them)."""
    world = batch.world or 1
    lengths: list[array] = [array("i") for _ in range(world)]
    ranks = batch.ranks if batch.world else (0,) * len(batch.groups)
    for g, r in zip(batch.groups, ranks, strict=True):
        if not g.lengths:
            return None
        lengths[r].extend(g.lengths)
    if sys.byteorder != "little":
        for a in lengths:
            a.byteswap()
    return [a.tobytes() for a in lengths]


def decode_lengths(raw: list[bytes] | None) -> list[list[int]] | None:
    """``rank_lengths``'s bytes as lists of ints."""
    if raw is None:
        return None
    out = []
    for chunk in raw:
        a = array("i", bytes(chunk))
        if sys.byteorder != "little":
            a.byteswap()
        out.append(a.tolist())
    return out


def share_info(batch: RecordedBatch, rank: int, lengths: list[bytes] | None) -> dict:
    """What ``BatchRefs.share`` tells rank ``rank``: its place, and every rank's sample lengths (``rank_lengths``)
    so that each rank counts every rank's micro-batches without a collective."""
    return {"rank": rank, "world_size": batch.world or 1, "lengths": lengths}
