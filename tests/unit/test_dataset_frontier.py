"""The frontier on a computed epoch order: a restart finds exactly the orphans below the cursor (pure)."""

from __future__ import annotations

import random

import pytest

from common.dataset import epoch_permutation
from coordinator.frontier import DELIVERED, FILTERED, LEASED, PENDING, READY, STATE_NAMES, Frontier


def brute_orphans(order, state, cursor):
    return [order[pos] for pos in range(cursor) if state[order[pos]] == PENDING]


@pytest.mark.parametrize("seed", [None, 5])
@pytest.mark.parametrize("in_flight_at", ["recent", "spread", "none", "first"])
def test_restore_finds_every_orphan_below_the_cursor_in_position_order(seed, in_flight_at):
    n, cursor = 5000, 3000
    order = epoch_permutation(n, 0, seed)
    rng = random.Random(1)
    positions = list(range(cursor))
    if in_flight_at == "recent":
        in_flight = set(positions[-40:])
    elif in_flight_at == "spread":
        in_flight = set(rng.sample(positions, 40))
    elif in_flight_at == "first":
        in_flight = {0, cursor - 1}
    else:
        in_flight = set()
    records = {(0, order[pos]): rng.choice((READY, DELIVERED, FILTERED)) for pos in positions if pos not in in_flight}
    frontier = Frontier(n, lambda e: epoch_permutation(n, e, seed))
    frontier.restore({0: cursor}, records, now=100.0, orphan_delay=5.0)
    ep = frontier.epochs[0]
    expected = brute_orphans(order, ep.state, cursor)
    assert len(expected) == len(in_flight)
    assert list(ep.orphans) == expected
    # Orphans wait for their agents, then come back before any fresh prompt; nothing is handed out twice.
    assert frontier.take(now=101.0) == (0, order[cursor])
    taken = [frontier.take(now=106.0) for _ in range(len(in_flight))]
    assert taken == [(0, i) for i in expected]
    assert frontier.take(now=106.0) == (0, order[cursor + 1])


def test_restore_of_two_epochs_and_adoption():
    n = 300
    frontier = Frontier(n, lambda e: epoch_permutation(n, e, 9))
    first = [frontier.take(0.0) for _ in range(n + 10)]  # all of epoch 0, then 10 of epoch 1
    assert sorted(i for e, i in first if e == 0) == list(range(n))
    records = {p: DELIVERED for p in first if p[0] == 0}
    del records[first[7]]  # in flight at the crash
    records.update({p: READY for p in first[n : n + 8]})  # epoch 1: two in flight
    restored = Frontier(n, lambda e: epoch_permutation(n, e, 9))
    restored.restore({0: n, 1: 10}, records, now=0.0, orphan_delay=1.0)
    assert list(restored.epochs[0].orphans) == [first[7][1]]
    assert list(restored.epochs[1].orphans) == [first[n + 8][1], first[n + 9][1]]
    assert restored.adopt(*first[n + 9])  # its agent came back with it
    assert restored.state_of(*first[n + 9]) == LEASED
    assert restored.take(2.0) == first[7]
    assert restored.take(2.0) == first[n + 8]
    assert restored.take(2.0) == (1, epoch_permutation(n, 1, 9)[10])


def test_counts_are_tallied_exactly_through_every_transition():
    """``counts()`` reads per-epoch tallies (O(1) for a 10M-row epoch); they match the state bytes."""
    n = 200
    frontier = Frontier(n, lambda e: epoch_permutation(n, e, 3))
    rng = random.Random(4)
    held: list[tuple[int, int]] = []
    for step in range(5000):
        op = rng.random()
        if op < 0.4 and (taken := frontier.take(float(step))) is not None:
            held.append(taken)
        elif held:
            prompt = held.pop(rng.randrange(len(held)))
            if not frontier.is_open(prompt[0]):
                continue
            if op < 0.55:
                frontier.release(*prompt)
            elif op < 0.75:
                frontier.set(*prompt, READY)
                frontier.set(*prompt, rng.choice((DELIVERED, FILTERED)))
            elif op < 0.8:
                frontier.set(*prompt, DELIVERED)
                frontier.reopen(*prompt)  # pending again, requeued
            else:
                frontier.set(*prompt, FILTERED)
        frontier.close_finished()
        if step % 250 == 0:
            epochs = frontier.epochs.values()
            brute = {name: sum(ep.state.count(i) for ep in epochs) for i, name in enumerate(STATE_NAMES)}
            assert frontier.counts() == brute
            for ep in frontier.epochs.values():
                assert ep.finished == ep.state.count(DELIVERED) + ep.state.count(FILTERED)
    assert frontier.floor > 0  # epochs did close along the way
