"""Packed micro-batches (issue 41, item 3): coordinator/packing.py and RolloutBatch.micro_batches."""

import ast
import itertools
import random
from pathlib import Path

import pytest

from common.types import Group, Sample
from coordinator.client import RolloutBatch
from coordinator.packing import count_micro_batches, first_fit_decreasing, pack, split_to

ROOT = Path(__file__).resolve().parents[2]


def check_packing(bins, lengths, max_tokens, k=None):
    """The rules, recomputed from the lengths alone."""
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths))), "every sample exactly once"
    for b in bins:
        assert len(b) <= 1 or sum(lengths[i] for i in b) <= max_tokens, (b, [lengths[i] for i in b])
        assert b == sorted(b)
    if k is not None:
        assert len(bins) == k


# ---- the pure packing -------------------------------------------------------------------------------------


def test_ffd_and_lpt_on_a_hand_worked_example():
    lengths, n = [5, 4, 3, 3, 2, 1], 8
    # FFD, longest first to the first bin with room: 5|4|3->0 (8)|3->1 (7)|2 fits none: new|1->1 (8)
    assert first_fit_decreasing(lengths, n) == [[0, 2], [1, 3, 5], [4]]
    assert count_micro_batches(lengths, n) == 3
    # LPT into 3, longest first to the lightest: 5->0, 4->1, 3->2, 3->2 (6), 2->1 (6), 1->0 (6)
    assert pack(lengths, n) == [[0, 5], [1, 4], [2, 3]]


def test_where_lpt_would_overflow_the_ffd_packing_is_kept():
    lengths, n = [3, 3, 2, 2, 2], 6
    # LPT into 2: 3|3|2->0 (5)|2->1 (5)|2->0 (7 > 6): over the budget, so FFD's [3 3][2 2 2]
    assert count_micro_batches(lengths, n) == 2
    assert pack(lengths, n) == [[0, 1], [2, 3, 4]]
    # forced to 3, LPT fits: 3->0, 3->1, 2->2, 2->2 (4), 2->0 (5; 0 and 1 tie at 3, the lower first)
    assert pack(lengths, n, 3) == [[0, 4], [1], [2, 3]]


def test_split_to_reaches_the_forced_count_inside_the_budget():
    lengths = [3, 3, 2, 2, 2]
    # both bins hold 6: the one with the lower first sample is split first
    assert split_to(lengths, [[0, 1], [2, 3, 4]], 3) == [[0], [1], [2, 3, 4]]
    # then [2 2 2] by LPT: 2->a, 2->b, 2->a
    assert split_to(lengths, [[0, 1], [2, 3, 4]], 4) == [[0], [1], [2, 4], [3]]
    assert split_to(lengths, [[0, 1], [2, 3, 4]], 7) == [[0], [1], [2], [3], [4], [], []]


def test_a_sample_longer_than_the_budget_is_alone_and_others_never_join_it():
    lengths, n = [2, 10, 3, 9, 1], 4
    bins = pack(lengths, n)
    assert [1] in bins and [3] in bins
    check_packing(bins, lengths, n)
    assert count_micro_batches(lengths, n) == len(bins) == 4  # 10 | 9 | 3 1 | 2


def test_forced_counts():
    lengths, n = [5, 4, 3, 3, 2, 1], 8
    with pytest.raises(ValueError, match="at least 3"):
        pack(lengths, n, 2)
    for k in range(3, 10):
        bins = pack(lengths, n, k)
        check_packing(bins, lengths, n, k)
        assert sum(1 for b in bins if not b) == max(0, k - len(lengths))
    assert pack([], n) == [] and count_micro_batches([], n) == 0
    assert pack([], n, 2) == [[], []]
    with pytest.raises(ValueError):
        pack(lengths, 0)


def test_random_length_lists_keep_every_rule_for_every_count_and_are_deterministic():
    rng = random.Random(41)
    for _ in range(150):
        n = rng.randint(1, 64)
        lengths = [int(rng.paretovariate(1.2) * 8) for _ in range(rng.randint(0, 40))]
        c = count_micro_batches(lengths, n)
        assert c == len(first_fit_decreasing(lengths, n))
        assert c >= -(-sum(min(x, n) for x in lengths) // n)  # no packing can use fewer than this
        for k in (None, c, c + 1, c + 3):
            bins = pack(lengths, n, k)
            check_packing(bins, lengths, n, c if k is None else k)
            assert bins == pack(list(lengths), n, k)


def test_ffd_count_within_its_bound_of_the_optimum_on_small_cases():
    """FFD <= 11/9 OPT + 6/9, OPT by exhaustive search."""

    def optimum(lengths, n):
        for k in itertools.count(1):
            for assign in itertools.product(range(k), repeat=len(lengths)):
                loads = [0] * k
                for x, b in zip(lengths, assign, strict=True):
                    loads[b] += x
                if max(loads) <= n:
                    return k

    rng = random.Random(7)
    for _ in range(40):
        lengths = [rng.randint(1, 10) for _ in range(rng.randint(1, 6))]
        opt = optimum(lengths, 10)
        assert opt <= count_micro_batches(lengths, 10) <= 11 / 9 * opt + 6 / 9


def test_the_packing_module_imports_no_torch_at_module_level():
    tree = ast.parse((ROOT / "coordinator" / "packing.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(m.split(".")[0] == "torch" for m in names), names


# ---- the tensors --------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


def make_batch(rng, groups=6, per_group=4, long_tail=False):
    out = []
    for g in range(groups):
        samples = []
        for _ in range(per_group):
            lp = rng.randint(0, 6) if not long_tail else rng.randint(20, 60)
            lr = rng.randint(0, 9) if not long_tail else min(2000, int(rng.paretovariate(1.1) * 40))
            spans = []
            if lr and rng.random() < 0.5:
                cut = rng.randint(0, lr)
                spans = [["3", 0, cut], ["4", cut, lr]]
            samples.append(
                Sample(
                    [rng.randint(1, 999) for _ in range(lp)],
                    [rng.randint(1, 999) for _ in range(lr)],
                    [-rng.random() for _ in range(lr)],
                    [rng.randint(0, 1) for _ in range(lr)],
                    float(rng.randint(0, 1)),
                    "completed",
                    "4",
                    weight_versions=spans,
                )
            )
        out.append(Group(index=100 + g, samples=samples))
    return RolloutBatch(0, out)


def expected_versions(s):
    """Per token, recomputed from the spans (not through batch.token_spans)."""
    vs = [-1] * len(s.prompt_tokens) + [-1] * len(s.response_tokens)
    spans = s.weight_versions or [[s.weight_version, 0, len(s.response_tokens)]]
    for label, a, b in spans:
        for t in range(a, b):
            vs[len(s.prompt_tokens) + t] = int(label)
    return vs


@pytest.mark.parametrize("max_tokens", [1, 7, 16, 40])
def test_packed_tensors_hold_each_sample_unpadded_with_its_boundaries(max_tokens):
    batch = make_batch(random.Random(max_tokens))
    samples = batch.samples
    padded = batch.to_tensors(current_version=6)
    mbs = batch.micro_batches(max_tokens, current_version=6)
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    assert len(mbs) == count_micro_batches(lengths, max_tokens)
    check_packing([mb["sample_index"].tolist() for mb in mbs], lengths, max_tokens)
    for mb in mbs:
        rows = mb["sample_index"].tolist()
        total = sum(lengths[r] for r in rows)
        for key in ("tokens", "position_ids", "loss_mask", "rollout_logprobs", "versions", "staleness"):
            assert mb[key].shape == (1, total), key
            assert mb[key].dtype == (padded[key].dtype if key in padded else torch.long), key
        assert mb["cu_seqlens"].dtype == torch.int32
        assert mb["cu_seqlens"].tolist() == list(itertools.accumulate([lengths[r] for r in rows], initial=0))
        positions = mb["position_ids"][0].tolist()
        for j, r in enumerate(rows):
            a, b = mb["cu_seqlens"][j].item(), mb["cu_seqlens"][j + 1].item()
            s = samples[r]
            assert positions[a:b] == list(range(lengths[r]))
            assert mb["tokens"][0, a:b].tolist() == s.prompt_tokens.tolist() + s.response_tokens.tolist()
            assert mb["loss_mask"][0, a:b].tolist() == [0] * len(s.prompt_tokens) + s.loss_mask.tolist()
            assert mb["versions"][0, a:b].tolist() == expected_versions(s)
            for key in ("tokens", "loss_mask", "rollout_logprobs", "versions", "staleness"):
                assert torch.equal(mb[key][0, a:b], padded[key][r, : lengths[r]]), key
        for key in ("rewards", "prompt_lengths", "response_lengths", "group_index"):
            assert mb[key].dtype == padded[key].dtype
            assert torch.equal(mb[key], padded[key][rows]), key
        assert "attention_mask" not in mb


def test_a_forced_count_gives_empty_micro_batches_with_zero_length_tensors():
    batch = make_batch(random.Random(3), groups=1, per_group=2)
    mbs = batch.micro_batches(10_000, num_micro_batches=4)
    assert [mb["sample_index"].tolist() for mb in mbs] == [[0], [1], [], []]  # LPT spreads them first
    empty = mbs[-1]
    assert empty["tokens"].shape == (1, 0) and empty["cu_seqlens"].tolist() == [0]
    assert empty["rewards"].shape == (0,)
    with pytest.raises(ValueError):
        batch.micro_batches(1, num_micro_batches=1)


def test_same_batch_same_micro_batches():
    a = make_batch(random.Random(5)).micro_batches(20)
    b = make_batch(random.Random(5)).micro_batches(20)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_padding_fraction_of_padded_rows_against_packed_micro_batches_on_a_long_tailed_batch():
    batch = make_batch(random.Random(11), groups=16, per_group=8, long_tail=True)
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in batch.samples]
    real = sum(lengths)
    t = batch.to_tensors()
    padded_fraction = 1 - real / t["tokens"].numel()
    budget = 4096
    mbs = batch.micro_batches(budget)
    # packed: no padding inside; a trainer that pads every micro-batch to the budget (static shapes) pays this
    budget_fraction = 1 - real / sum(max(budget, mb["tokens"].shape[1]) for mb in mbs)
    assert sum(mb["tokens"].shape[1] for mb in mbs) == real
    print(
        f"\nlong-tailed batch: {len(lengths)} samples, {real} tokens, longest {max(lengths)}, median "
        f"{sorted(lengths)[len(lengths) // 2]}; to_tensors() {tuple(t['tokens'].shape)}: "
        f"{padded_fraction:.1%} padding; micro_batches({budget}): {len(mbs)} micro-batches, 0.0% padding "
        f"({budget_fraction:.1%} if each were padded to the budget); loads "
        f"{[mb['tokens'].shape[1] for mb in mbs]}"
    )
    assert padded_fraction > 0.5
