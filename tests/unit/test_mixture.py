"""Mixtures' pure parts: ``--dataset`` parsing, shares by largest remainder, prompt keys, the per-dataset frontier."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from common.mixture import (
    DEFAULT,
    SourceSpec,
    check_sources,
    check_weights,
    epoch_key,
    parse_dataset,
    shares,
    split_key,
)
from coordinator.frontier import DELIVERED, FILTERED, LEASED, READY
from coordinator.mix_frontier import MixFrontier


def test_shares_round_by_largest_remainder_and_always_sum_to_the_batch():
    assert shares([0.5, 0.3, 0.2], 64) == [32, 19, 13]
    assert shares([0.5, 0.3, 0.2], 10) == [5, 3, 2]
    assert shares([1, 1, 1], 4) == [2, 1, 1]  # a tie goes to the dataset named first
    assert shares([0.7, 0.3, 0.0], 7) == [5, 2, 0]
    for total in range(0, 50):
        for weights in ([1, 2, 3], [0.1, 0.1, 5], [3, 0, 1, 1]):
            got = shares(weights, total)
            assert sum(got) == total
            exact = [total * w / sum(weights) for w in weights]
            assert all(abs(g - x) < 1 for g, x in zip(got, exact, strict=True))


def test_a_plain_path_is_the_default_dataset_and_named_ones_take_their_options():
    assert parse_dataset("/data/train.jsonl").spec == SourceSpec(DEFAULT)
    assert parse_dataset("/data/a=b.jsonl").path == "/data/a=b.jsonl"  # '=' inside a path
    arg = parse_dataset("code=/data/code.jsonl,weight=0.3,reward=my.rewards:unit,max_new_tokens=4096,input_key=q")
    assert arg.path == "/data/code.jsonl" and arg.input_key == "q"
    assert arg.spec == SourceSpec("code", 0.3, reward="my.rewards:unit", max_new_tokens=4096)
    assert arg.spec.sampling() == {"max_new_tokens": 4096}
    assert SourceSpec.from_dict(arg.spec.to_dict()) == arg.spec


@pytest.mark.parametrize(
    "text, why",
    [
        ("a=/p,weight=-1", "weight must be a number >= 0"),
        ("a=/p,weight=x", "weight must be a float"),
        ("a=/p,colour=red", "unknown option 'colour'"),
        ("a=/p,weight", "option weight needs a value"),
        ("a=/p,weight=1,weight=2", "option weight given twice"),
        ("a b=/p", "may hold only letters"),
        ("a=,weight=1", "no PATH after a="),
        ("a=/p,top_p=0", "top_p must be in (0, 1]"),
        ("a=/p,n_samples=0", "n_samples must be at least 1"),
    ],
)
def test_bad_dataset_values_name_what_is_wrong(text, why):
    with pytest.raises(ConfigError) as err:
        parse_dataset(text)
    assert why in str(err.value) and repr(text) in str(err.value)


def test_a_mixture_needs_unique_names_and_some_weight():
    with pytest.raises(ConfigError, match="'a' is given twice"):
        check_sources([SourceSpec("a"), SourceSpec("a")])
    with pytest.raises(ConfigError, match="must not all be 0"):
        check_sources([SourceSpec("a", 0.0), SourceSpec("b", 0.0)])
    with pytest.raises(ConfigError, match="each needs a name"):
        check_sources([SourceSpec(DEFAULT), SourceSpec("b")])
    assert check_weights({"b": 2}, ["a", "b"]) == {"a": 0.0, "b": 2.0}  # left out: 0
    with pytest.raises(ConfigError, match=r"unknown dataset name\(s\) in the mixture: \['c'\]"):
        check_weights({"c": 1}, ["a", "b"])
    with pytest.raises(ConfigError, match="weight of dataset 'a' must be a number >= 0"):
        check_weights({"a": True}, ["a", "b"])


def test_prompt_keys_keep_dataset_zero_as_its_epochs():
    assert epoch_key(0, 7) == 7 and split_key(7) == (0, 7)
    assert split_key(epoch_key(3, 2)) == (3, 2) and epoch_key(3, 2) == (3 << 32) + 2


def test_each_dataset_runs_through_its_own_epochs():
    frontier = MixFrontier([2, 5], lambda s, n, e: range(n))
    small = [frontier.take(0.0, source=0) for _ in range(2)]
    assert small == [(0, 0), (0, 1)]
    # The small dataset's epoch 0 is exhausted: its next prompt opens its epoch 1; the large one is in epoch 0.
    assert frontier.take(0.0, source=0) == (1, 0)
    assert frontier.take(0.0, source=1) == (epoch_key(1, 0), 0)
    assert sorted(frontier.epochs) == [0, 1, epoch_key(1, 0)]
    assert frontier.counts(1) == {"pending": 4, "leased": 1, "ready": 0, "delivered": 0, "filtered": 0}
    assert frontier.outstanding(0) == 3
    for index in (0, 1):
        frontier.set(0, index, DELIVERED)
    assert frontier.close_finished() == [0]  # the small dataset's epoch 0 closes; the large one's stays open
    assert frontier.is_closed(0) and not frontier.is_closed(epoch_key(1, 0))
    assert not frontier.valid(epoch_key(2, 0), 0)  # no third dataset
    # A restart rebuilds each dataset's epochs from the keys the ledger holds.
    restored = MixFrontier([2, 5], lambda s, n, e: range(n))
    key = epoch_key(1, 0)
    restored.restore({1: 1, key: 3}, {(key, 0): READY, (key, 1): FILTERED}, now=0.0, orphan_delay=0.0)
    assert restored.state_of(key, 2) == 0  # pending: its lease was lost with the coordinator
    assert restored.take(1.0, source=1) == (key, 2)  # orphans first
    assert restored.state_of(key, 2) == LEASED and restored.cursors() == {1: 1, key: 3}
