"""Ranks' shares (coordinator/shares.py): whole groups, every group once, tokens balanced within the bounds the
docs state, the same on every call; repairs keep each rank's share in place."""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator import shares
from coordinator.records import GroupRef, RecordedBatch


def best_max_load(tokens: list[int], world: int) -> int:
    """The smallest possible largest rank load, by brute force (small inputs only)."""
    best = sum(tokens)
    for ranks in itertools.product(range(world), repeat=len(tokens)):
        best = min(best, max(shares.loads(tokens, ranks, world)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_every_group_goes_to_one_rank_and_loads_keep_both_bounds(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 4)
    tokens = [int(rng.paretovariate(1.2) * 100) for _ in range(rng.randint(1, 8))]
    ranks = shares.assign(tokens, world)
    assert len(ranks) == len(tokens) and all(0 <= r < world for r in ranks)
    loads = shares.loads(tokens, ranks, world)
    assert sum(loads) == sum(tokens)
    assert max(loads) - min(loads) <= max(tokens)  # at most the largest group apart
    assert max(loads) <= (4 / 3 - 1 / (3 * world)) * best_max_load(tokens, world) + 1e-9  # Graham's LPT bound
    assert shares.assign(tokens, world) == ranks  # deterministic


def test_equal_groups_spread_by_count_and_one_rank_takes_all():
    assert sorted(shares.assign([0] * 6, 3)) == [0, 0, 1, 1, 2, 2]
    assert shares.assign([5, 7, 9], 1) == [0, 0, 0]
    with pytest.raises(ValueError):
        shares.assign([1], 0)


def group(i: int, n: int) -> GroupRef:
    return GroupRef(0, i, "a", f"k{i}", lengths=(n,))


def test_a_lost_groups_replacement_lands_on_the_rank_that_lost_it():
    batch = shares.with_shares(RecordedBatch([group(i, 100 * (i + 1)) for i in range(6)], {}), 3)
    before = {r: [g.index for g in batch.share(r)] for r in range(3)}
    victim = batch.share(2)[0]
    dropped = shares.drop_groups(batch, [victim])
    assert dropped.lost_ranks == (2,)
    repaired = shares.add_groups(dropped, [group(9, 50)])
    after = {r: [g.index for g in repaired.share(r)] for r in range(3)}
    assert after[0] == before[0] and after[1] == before[1]
    assert sorted(after[2]) == sorted([i for i in before[2] if i != victim.index] + [9])
    assert repaired.lost_ranks == ()


def test_groups_a_rank_holds_stay_when_their_node_is_lost():
    batch = shares.with_shares(RecordedBatch([group(i, 10) for i in range(4)], {}), 2)
    held = batch.share(0)
    taken = RecordedBatch(batch.groups, {}, world=2, ranks=batch.ranks, taken=(0,))
    assert shares.kept_on_loss(taken, list(batch.groups)) == held
    assert shares.kept_on_loss(batch, list(batch.groups)) == []  # nobody took anything yet


def test_share_info_gives_every_ranks_lengths_or_none_without_them():
    batch = shares.with_shares(RecordedBatch([group(0, 30), group(1, 20), group(2, 10)], {}), 2)
    raw = shares.rank_lengths(batch)
    assert all(isinstance(chunk, bytes) for chunk in raw)
    info = shares.share_info(batch, 1, raw)
    assert info["rank"] == 1 and info["world_size"] == 2
    decoded = shares.decode_lengths(info["lengths"])
    assert decoded == [[g.lengths[0] for g in batch.share(r)] for r in range(2)]
    assert sorted(x for lengths in decoded for x in lengths) == [10, 20, 30]
    old = shares.with_shares(RecordedBatch([GroupRef(0, 0, "a", "k")], {}), 2)
    assert shares.rank_lengths(old) is None and shares.decode_lengths(None) is None


def test_a_trainer_of_another_size_gets_new_shares():
    batch = shares.with_shares(RecordedBatch([group(i, 10 + i) for i in range(6)], {}, taken=()), 3)
    taken = shares.with_shares(RecordedBatch(batch.groups, {}, world=3, ranks=batch.ranks, taken=(0, 1)), 2)
    assert taken.world == 2 and taken.taken == () and len(taken.ranks) == 6
    assert shares.with_shares(batch, 1).world == 0


@pytest.mark.parametrize("seed", range(20))
def test_equal_group_shares_hold_the_same_number_of_groups(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 4)
    tokens = [int(rng.paretovariate(1.2) * 100) for _ in range(world * rng.randint(1, 4) + rng.randrange(world))]
    ranks = shares.assign(tokens, world, equal_groups=True)
    counts = [ranks.count(r) for r in range(world)]
    assert counts == [len(tokens) // world + (r < len(tokens) % world) for r in range(world)]
    batch = shares.with_shares(RecordedBatch([group(i, n) for i, n in enumerate(tokens)], {}), world, True)
    assert batch.equal_groups and [len(batch.share(r)) for r in range(world)] == counts
