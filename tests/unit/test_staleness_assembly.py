"""Bounded staleness at assembly (guarantee 8, docs/weights.md "Staleness") on the pure core.

A batch that takes a younger group while older leases are still in flight pushes those older
groups into later batches; once more of them remain than the batches left before their bound can
hold, one of them lands in a batch it may not join. These tests drive the core with events only.
"""

from __future__ import annotations

import random

import pytest

from common import protocol as p
from tests.unit.test_weights_core import (
    attach,
    granted,
    make_core,
    one_update,
    register,
    run_receipts,
    sends,
)


def batches_of(effects):
    return [s.msg for s in sends(effects, p.BatchRefs)]


def test_a_batch_waits_rather_than_push_more_old_groups_into_later_batches_than_fit():
    """ETA 2, B 2: six leases start on weights 0; they must fit in batches 0..2.

    Batch 1 may not take a group started on weights 1 while three of weights 0 are in flight:
    only batch 2 would be left for them, and it holds two.
    """
    core = make_core(batch=2, eta=2, prefetch=16)
    _, eff = register(core, "a")
    old = granted(eff)
    assert len(old) == 6, "rule 1: (0 + 2 + 1) * 2"
    session, _ = attach(core)
    eff = core.handle(b"trainer", p.Generate(session, 5, 0), 0.0) + run_receipts(core, old[:2])
    assert batches_of(eff)[0].metrics["rollout/staleness_max"] == 0.0
    new = granted(one_update(core, session, 1, 6))
    assert len(new) == 2 and all(core.leases.leases[g.lease].start == 1 for g in new)

    eff = core.handle(b"trainer", p.Generate(session, 7, 1), 0.0) + run_receipts(core, old[2:3] + new[:1])
    assert not batches_of(eff), "taking the weights-1 group would leave 3 weights-0 groups for batch 2 alone"
    eff = run_receipts(core, old[3:4])
    batch = batches_of(eff)[0]
    assert sorted(g[1] for g in batch.groups) == sorted(g.index for g in old[2:4])

    eff = one_update(core, session, 2, 8)
    eff = core.handle(b"trainer", p.Generate(session, 9, 2), 0.0) + run_receipts(core, old[4:] + new[1:])
    assert batches_of(eff)[0].metrics["rollout/staleness_max"] == 2.0
    left = [st.start for st in core.ready.info.values()]
    assert left == [1, 1], "every weights-0 group went into batches 0..2; both weights-1 ones wait"


def drive(eta: int, batch: int, prefetch: int, steps: int, seed: int) -> list[float]:
    """The README's loop against one agent whose groups finish in a random order.

    Per step: ``generate(t)`` (receipts for random leases in flight until its batch comes), then
    an update. Returns each batch's ``staleness_max``; fails if a batch can never come.
    """
    rng = random.Random(seed)
    core = make_core(batch=batch, eta=eta, prefetch=prefetch, size=10_000)
    _, eff = register(core, "a", slots=4096)
    in_flight = {g.lease: g for g in granted(eff)}
    session, _ = attach(core)
    maxima = []
    req = 100
    for t in range(steps):
        req += 1
        eff = core.handle(b"trainer", p.Generate(session, req, t), 0.0)
        while True:
            in_flight.update({g.lease: g for g in granted(eff)})
            done = batches_of(eff)
            if done:
                maxima.append(done[0].metrics["rollout/staleness_max"])
                break
            assert in_flight, f"batch {t} waits with no lease in flight"
            lease = rng.choice(sorted(in_flight))
            eff = run_receipts(core, [in_flight.pop(lease)])
        req += 1
        eff = one_update(core, session, t + 1, req)
        in_flight.update({g.lease: g for g in granted(eff)})
    return maxima


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_no_batch_holds_a_group_older_than_the_bound_whatever_order_groups_finish_in(eta, seed):
    maxima = drive(eta, batch=4, prefetch=64, steps=14, seed=seed)
    assert len(maxima) == 14
    assert max(maxima) <= eta, maxima
