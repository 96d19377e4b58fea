"""The coordinator's LMDB ledger: typed operations written, read back identical to the in-memory fold."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from coordinator.frontier import DELIVERED, FILTERED, READY
from coordinator.ledger import Ledger, read_ledger
from coordinator.records import (
    CloseEpoch,
    DropBatch,
    DropPrompt,
    GroupRef,
    LedgerSnapshot,
    PromptState,
    PutBatch,
    PutPrompt,
    RecordedBatch,
    SetCursors,
    SetMark,
    SetPaused,
)

OPS = [
    PutPrompt(0, 1, PromptState(READY, "a", "0:1:1", {"n_samples": 4, "reward_sum": 2.0}, seq=3)),
    PutPrompt(0, 2, PromptState(DELIVERED, "b", "0:2:2", rollout_id=0)),
    PutPrompt(0, 3, PromptState(FILTERED, "a", reason="zero_std_0")),
    PutPrompt(1, 0, PromptState(READY, "a", "1:0:9", seq=4)),
    PutBatch(0, RecordedBatch([GroupRef(0, 2, "b", "0:2:2")], {"rollout/groups": 1.0}, lost=[(0, 7)])),
    PutBatch(1, RecordedBatch([GroupRef(1, 5, "a", "1:5:3")], {})),
    DropBatch(1),
    DropPrompt(0, 1),
    SetCursors({0: 10, 1: 2}),
    SetPaused(True),
    SetMark("last_rollout_id", 1),
    SetMark("consumed_upto", 0),
]


def test_written_ledger_reads_back_as_the_in_memory_fold(tmp_path):
    ledger = Ledger(tmp_path, sync=False)
    try:
        opened = ledger.open_run(20, "fp")
        assert opened.generation == 1 and opened.prompts == {} and opened.batches == {}
        ledger.apply(OPS[:5])
        ledger.apply(OPS[5:])
        expected = LedgerSnapshot(generation=1, dataset_size=20, dataset_fingerprint="fp")
        expected.apply(OPS)
        assert ledger.snapshot() == expected
    finally:
        ledger.close()
    assert read_ledger(tmp_path) == expected  # what tests and the chaos checker read
    ledger = Ledger(tmp_path, sync=False)
    try:
        ledger.apply([CloseEpoch(0)])
        assert set(ledger.snapshot().prompts) == {(1, 0)}
    finally:
        ledger.close()
    ledger = Ledger(tmp_path, sync=False)
    try:
        again = ledger.open_run(20, "fp")
        assert again.generation == 2 and set(again.prompts) == {(1, 0)}
        assert again.paused and again.cursors == {0: 10, 1: 2}
        assert again.batches[0].lost == ((0, 7),) and again.consumed_upto == 0
        with pytest.raises(ConfigError, match="another dataset"):
            ledger.open_run(21, "fp")
    finally:
        ledger.close()


def test_unknown_marks_and_states_are_refused():
    with pytest.raises(ValueError, match="unknown ledger mark"):
        SetMark("cursor", 3)
    with pytest.raises(ValueError, match="ready, delivered or filtered"):
        PromptState(0, "a")
