"""A mixture under ``--max-staleness`` on the pure core (issue 39; coordinator/staleness.py, rule 1 by shares).

Three datasets of 40, 24 and 8 rows at weights 0.5/0.3/0.2, batches of 10 (5/3/2 groups), one agent of 8
groups at once, no filter. The old admission spent rule 1's budget on whichever dataset lacked most groups for
the waiting batches *and* the prefetch, so the groups admitted before a push came in the wrong mix (ready 7/2/1
where the batch needed 5/3/2) and nothing more was leased until a push the trainer could only make after the
batch: ``generate`` never returned. Every batch the bound admits must now be completed with exactly its shares,
and a batch past the bound is explained (``waiting_for_update``), never a silent wait.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.mixture import EPOCH_BITS, SourceSpec
from coordinator.core import CoordinatorCore, CoreSettings
from tests.unit.test_weights_core import attach, disk_update, granted, report, sends

SAMPLES = 4
SIZES = [40, 24, 8]
SHARES = {0: 5, 1: 3, 2: 2}


def make_core(eta=1, sizes=SIZES, weights=(0.5, 0.3, 0.2), prefetch=-1, batch=10):
    mixture = [SourceSpec(name, w).to_dict() for name, w in zip(("math", "code", "tool"), weights, strict=False)]
    cfg = RolloutConfig(
        rollout_batch_size=batch,
        n_samples_per_prompt=SAMPLES,
        prefetch=prefetch,
        max_staleness=eta,
        mixture=mixture[: len(sizes)] if len(sizes) > 1 else [],
    )
    sizes = tuple(sizes) if len(sizes) > 1 else (sum(sizes),)
    return CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 10.0), sizes, "fp"))


class Fleet:
    """One agent of ``slots`` samples (the sim's ``--concurrency``) whose groups finish in a random order."""

    def __init__(self, core: CoordinatorCore, seed: int, slots: int = 32):
        self.core, self.rng = core, random.Random(seed)
        engines = [p.EngineInfo("e0", p.EngineState.HEALTHY)]
        eff = core.handle(b"a", p.Register("a", 1, slots, "tcp://a:1", engines, [], []), 0)
        self.in_flight = {g.lease: g for g in granted(eff)}
        self.session, _ = attach(core)
        self.req = 100

    def note(self, effects) -> list:
        self.in_flight.update({g.lease: g for g in granted(effects)})
        return [s.msg for s in sends(effects, p.BatchRefs)]

    def finish_one(self) -> list:
        """One random lease's group is committed; the effects."""
        g = self.in_flight.pop(self.rng.choice(sorted(self.in_flight)))
        session = self.core.membership.agents["a"].session
        key = f"{g.data_epoch}:{g.index}:{g.lease:x}"
        receipt = p.Receipt(session, g.lease, g.data_epoch, g.index, key, SAMPLES, {"n_samples": SAMPLES})
        return self.core.handle(b"a", receipt, 0.0)

    def generate(self, rollout_id: int):
        """``generate(rollout_id)`` answered while groups finish; its batch, or None once nothing is in flight."""
        self.req += 1
        eff = self.core.handle(b"trainer", p.Generate(self.session, self.req, rollout_id), 0.0)
        while True:
            done = self.note(eff)
            if done:
                return done[0]
            if not self.in_flight:
                return None
            eff = self.finish_one()

    def push(self, version: int) -> None:
        self.req += 1
        eff = disk_update(self.core, self.session, version, req=self.req)
        uid = sends(eff, p.WeightsFromDisk)[0].msg.update_id
        self.note(report(self.core, "a", uid, "disk"))


def composition(batch) -> dict[int, int]:
    return dict(Counter(g[0] >> EPOCH_BITS for g in batch.groups))


@pytest.mark.parametrize("seed", range(8))
def test_a_trainer_one_step_behind_gets_every_batch_with_its_shares(seed):
    """The issue's loop: generate(0), generate(1), push 1, generate(2), push 2, ... (η = 1 allows it)."""
    core = make_core()
    fleet = Fleet(core, seed)
    for t in range(8):
        batch = fleet.generate(t)
        assert batch is not None, (
            f"batch {t} never came: ready by dataset {core.ready.count}, leased {len(core.leases)}"
        )
        assert composition(batch) == SHARES, (t, composition(batch))
        assert batch.metrics["rollout/staleness_max"] <= 1.0
        if t >= 1:
            fleet.push(t)


@pytest.mark.parametrize("seed", range(8))
def test_batches_up_to_the_bound_complete_before_any_push_and_the_next_one_says_it_waits(seed):
    """η = 1, no push yet: batches 0 and 1 come whole; batch 2 waits for a push, and the status says so."""
    core = make_core()
    fleet = Fleet(core, seed)
    for t in (0, 1):
        batch = fleet.generate(t)
        assert batch is not None, f"batch {t} never came: ready by dataset {core.ready.count}"
        assert composition(batch) == SHARES
    assert core.statistics().waiting_for_update is None
    assert fleet.generate(2) is None and not core.leases
    why = core.statistics().waiting_for_update
    assert why is not None and "rollout 2 waits for 1 more weight update" in why and "--max-staleness 1" in why
    assert "0 update(s) were pushed" in why and "math, code, tool lack their share" in why
    fleet.push(1)
    assert core.statistics().waiting_for_update is None, "the push admits batch 2's groups"
    while (batch := fleet.note([])) == [] and fleet.in_flight:
        batches = fleet.note(fleet.finish_one())
        if batches:
            batch = batches
            break
    assert batch and composition(batch[0]) == SHARES
    assert core.statistics().waiting_for_update is None


def test_the_budget_goes_by_shares_of_the_batches_the_bound_admits():
    """Before any push, η = 1: batches 0 and 1, 10/6/4 groups, whatever the prefetch wants of each."""
    core = make_core(prefetch=40)
    fleet = Fleet(core, 0, slots=4 * 64)
    assert Counter(g.data_epoch >> EPOCH_BITS for g in fleet.in_flight.values()) == {0: 10, 1: 6, 2: 4}
    fleet.push(1)  # one more batch: 5/3/2 more
    assert Counter(g.data_epoch >> EPOCH_BITS for g in fleet.in_flight.values()) == {0: 15, 1: 9, 2: 6}


def test_without_a_mixture_a_batch_past_the_bound_waits_and_says_why():
    core = make_core(sizes=[40], eta=0, batch=4)
    fleet = Fleet(core, 1)
    assert fleet.generate(0) is not None
    assert fleet.generate(1) is None
    why = core.statistics().waiting_for_update
    assert why is not None and why.startswith("rollout 1 waits for 1 more weight update(s)") and "lack" not in why
    fleet.push(1)
    assert core.statistics().waiting_for_update is None


def test_allowance_sums_each_datasets_shares_over_the_mixtures_changes():
    core = make_core()
    training = core.training
    assert training.allowance(0, 1) == [10, 6, 4]
    assert training.allowance(3, 2) == [0, 0, 0]
    training.schedule[:] = [(0, [0.5, 0.3, 0.2]), (2, [0.0, 0.0, 1.0]), (2, [1.0, 0.0, 0.0]), (4, [0.0, 1.0, 0.0])]
    expected = [0, 0, 0]
    for r in range(1, 6):
        for s, n in enumerate(training.shares(r)):
            expected[s] += n
    assert training.allowance(1, 5) == expected == [25, 23, 2]


@pytest.mark.parametrize("eta, behind", [(0, 0), (1, 0), (2, 0), (4, 0), (1, 1), (2, 1), (4, 1)])
@pytest.mark.parametrize("seed", range(6))
def test_no_batch_of_a_mixture_holds_a_group_older_than_the_bound_whatever_order_groups_finish_in(eta, behind, seed):
    """The README's loop (``behind`` 0: push t before generate(t+1)) or one step behind (``behind`` 1, η >= 1),
    groups finishing in a random order: every batch has its shares and no group past the bound. Rule 2 on the
    whole batch let a batch take a younger group of one dataset while older ones of it were in flight (a group of
    staleness 3 at η = 2): it holds per dataset."""
    core = make_core(eta=eta, sizes=[400, 240, 80], prefetch=40, batch=10)
    fleet = Fleet(core, seed, slots=4 * 24)
    for t in range(12):
        batch = fleet.generate(t)
        assert batch is not None, f"batch {t} never came: {core.statistics().waiting_for_update}"
        assert composition(batch) == SHARES
        assert batch.metrics["rollout/staleness_max"] <= eta, (t, batch.metrics["rollout/staleness_max"])
        if t + 1 - behind >= 1:
            fleet.push(t + 1 - behind)
