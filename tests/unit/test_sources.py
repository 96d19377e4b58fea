"""The lease book's prompt sources (coordinator/sources.py): the training dataset and every evaluation
dataset are sources of one interface, and the lease book counts what is in flight by source."""

from __future__ import annotations

import inspect

from common import protocol as p
from coordinator.evaluation import EVAL_EPOCH, EvalSource
from coordinator.sources import TRAIN, PromptSource, TrainingSource
from tests.unit.test_evaluation_core import leases, setup

MEMBERS = [name for name in vars(PromptSource) if not name.startswith("_")]


def test_training_and_evaluation_sources_implement_every_member_of_the_interface():
    assert {"take", "give_back", "filtered", "failed", "committed", "result", "grant_fields", "with_rows"} <= set(
        MEMBERS
    )
    for cls in (TrainingSource, EvalSource):
        for name in MEMBERS:
            if callable(getattr(PromptSource, name, None)):
                mine = getattr(cls, name)
                assert callable(mine), f"{cls.__name__}.{name}"
                wanted = list(inspect.signature(getattr(PromptSource, name)).parameters)
                assert list(inspect.signature(mine).parameters) == wanted, f"{cls.__name__}.{name}"
        assert "bounded" in vars(cls), cls


def test_the_lease_book_counts_leases_by_source_and_only_bounded_ones_in_the_training_bound():
    core, agent, trainer, training = setup()
    book = core.leases
    assert set(book.sources) == {TRAIN, "eval/math"}
    assert training and all(g.eval == "" and g.source == TRAIN for g in training)
    evaluation = leases(core.handle(b"t", p.Evaluate(trainer, 7, "math", "tok"), 0.5))
    assert evaluation and all(g.eval == "math" and g.data_epoch == EVAL_EPOCH for g in evaluation)
    assert book.in_flight == {TRAIN: len(training), "eval/math": len(evaluation)}
    assert book.training_leases == len(training)  # the training bound sees training leases only
    assert {lease.source for lease in book.bounded_leases()} == {TRAIN}
    # A lease given back goes to its own source: the evaluation prompt is granted again, from its pass.
    first = evaluation[0]
    again = leases(core.handle(b"a", p.Release(agent, [first.lease], p.ReleaseReason.PAUSED), 1.0))
    assert [(g.eval, g.index) for g in again] == [("math", first.index)]
    assert book.in_flight == {TRAIN: len(training), "eval/math": len(evaluation)}
