"""A restart on the same data dir keeps how batches are made, or records the change."""

from __future__ import annotations

import pytest

from common.config import RolloutConfig
from common.errors import ConfigError
from coordinator.ledger import Ledger, read_config_changes, read_ledger


def _open(data_dir, config: RolloutConfig, seed=None, **kwargs):
    ledger = Ledger(data_dir, sync=False)
    try:
        return ledger.open_run(10, "f" * 16, config={**config.batch_shape(), "shuffle_seed": seed}, **kwargs)
    finally:
        ledger.close()


def test_changed_batch_settings_are_refused_and_nothing_is_written(tmp_path):
    _open(tmp_path, RolloutConfig(rollout_batch_size=4))
    for changed, flag in (
        (RolloutConfig(rollout_batch_size=8), "--rollout-batch-size 4 -> 8"),
        (RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2), "--n-samples-per-prompt 8 -> 2"),
        (RolloutConfig(rollout_batch_size=4, temperature=0.5), "--temperature 1.0 -> 0.5"),
        (RolloutConfig(rollout_batch_size=4, dynamic_filter="none"), "--dynamic-filter 'nonzero_std' -> 'none'"),
    ):
        with pytest.raises(ConfigError, match=flag) as info:
            _open(tmp_path, changed)
        assert "--allow-config-change" in str(info.value)
    with pytest.raises(ConfigError, match="--shuffle-seed None -> 3"):
        _open(tmp_path, RolloutConfig(rollout_batch_size=4), seed=3)
    assert read_ledger(tmp_path).generation == 1, "refused starts wrote to the ledger"
    assert _open(tmp_path, RolloutConfig(rollout_batch_size=4, prefetch=9)).generation == 2  # prefetch is free


def test_an_allowed_change_is_recorded_and_becomes_the_new_setting(tmp_path):
    _open(tmp_path, RolloutConfig(rollout_batch_size=4))
    _open(tmp_path, RolloutConfig(rollout_batch_size=8, reward="exact"), allow_change=True)
    assert read_config_changes(tmp_path) == [
        {"generation": 2, "changed": {"reward": ["math", "exact"], "rollout_batch_size": [4, 8]}}
    ]
    _open(tmp_path, RolloutConfig(rollout_batch_size=8, reward="exact"))
    with pytest.raises(ConfigError, match="--rollout-batch-size 8 -> 4"):
        _open(tmp_path, RolloutConfig(rollout_batch_size=4, reward="exact"))
    assert len(read_config_changes(tmp_path)) == 1


def test_a_setting_the_stored_config_does_not_know_is_not_a_change(tmp_path):
    """A ledger written before a config field existed restarts without --allow-config-change."""
    ledger = Ledger(tmp_path, sync=False)
    try:
        shape = {**RolloutConfig().batch_shape(), "shuffle_seed": None}
        older = {k: v for k, v in shape.items() if k != "top_k"}
        ledger.open_run(10, "f" * 16, config=older)
        ledger.open_run(10, "f" * 16, config=shape)
    finally:
        ledger.close()
    assert read_config_changes(tmp_path) == []


def test_a_data_dir_shuffled_by_another_algorithm_is_refused_even_with_allow_config_change(tmp_path):
    """The frontier's cursor is a position in the epoch's order: another order would name other rows."""
    from common.shuffle import SHUFFLE_ORDER

    shape = {**RolloutConfig().batch_shape(), "shuffle_seed": 7}
    ledger = Ledger(tmp_path, sync=False)
    try:
        ledger.open_run(10, "f" * 16, config=shape)  # an older build recorded no order: it shuffled with order 1
        current = {**shape, "shuffle_order": SHUFFLE_ORDER}
        for allow in (False, True):
            with pytest.raises(ConfigError, match=f"shuffle order 1 .* this build shuffles with order {SHUFFLE_ORDER}"):
                ledger.open_run(10, "f" * 16, config=current, allow_change=allow)
    finally:
        ledger.close()
    assert read_ledger(tmp_path).generation == 1, "a refused start wrote to the ledger"
    # A run recorded with the current order restarts as before.
    for _ in range(2):
        _open_ordered(tmp_path / "current", 7, SHUFFLE_ORDER)
    assert read_ledger(tmp_path / "current").generation == 2


def _open_ordered(data_dir, seed, order):
    ledger = Ledger(data_dir, sync=False)
    try:
        shape = {**RolloutConfig().batch_shape(), "shuffle_seed": seed, "shuffle_order": order}
        return ledger.open_run(10, "f" * 16, config=shape)
    finally:
        ledger.close()
