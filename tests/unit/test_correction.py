"""rollout_correction on hand-made tensors: every mode's weights and masks against values worked out by hand.

Log ratios are multiples of ``log 2`` given exactly (the rollout logprob 0, the trainer's the log ratio; only
differences enter the formulas), so a ratio "exactly at the clip" is exactly at it, and the inclusive bounds
are tested, not approximated.
"""

import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from coordinator.correction import MODES, rollout_correction  # noqa: E402

L2 = math.log(2.0)


def pair(log_ratios):
    """(trainer, rollout) rows whose differences are exactly ``log_ratios`` (each a list per sequence)."""
    t = torch.tensor(log_ratios, dtype=torch.float64)
    return t, torch.zeros_like(t)


def close(a, b, tol=1e-9):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# Row 0: three counted tokens with ratios 1, 2, 1/2; then one padding token (loss mask 0) whose logprobs are junk.
# Row 1: one counted token (a sequence of length 1) with ratio 4, then a tool token (loss mask 0) and padding.
LOG = [[0.0, L2, -L2, 50.0], [2 * L2, -40.0, 0.0, 0.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float32)


def test_none_weights_are_the_loss_mask_and_metrics_are_the_hand_values():
    t, r = pair(LOG)
    c = rollout_correction(t, r, MASK, mode="none")
    assert c.weights.tolist() == MASK.tolist() and c.mask.tolist() == MASK.tolist()
    m = c.metrics
    lr = torch.tensor([0.0, L2, -L2, 2 * L2], dtype=torch.float64)  # the four counted tokens only
    rho = lr.exp()
    assert m["correction/tokens"] == 4 and m["correction/sequences"] == 2
    assert math.isclose(m["correction/kl_k1"], (-lr).mean().item())
    assert math.isclose(m["correction/kl_k3"], (rho - 1 - lr).mean().item())
    assert math.isclose(m["correction/ratio_mean"], (1 + 2 + 0.5 + 4) / 4)
    assert (m["correction/ratio_min"], m["correction/ratio_max"]) == pytest.approx((0.5, 4.0))
    assert m["correction/masked_token_fraction"] == 0 and m["correction/truncated_fraction"] == 0


def test_k1_and_k3_are_zero_on_policy_and_k3_is_never_negative():
    t = torch.tensor([[-1.0, -2.0, -0.5]])
    c = rollout_correction(t, t.clone(), torch.ones_like(t), mode="token_tis")
    assert c.metrics["correction/kl_k1"] == 0 and c.metrics["correction/kl_k3"] == 0
    assert c.weights.tolist() == [[1.0, 1.0, 1.0]]
    t, r = pair([[0.3, -0.7, 1.1]])
    assert rollout_correction(t, r, torch.ones(1, 3), mode="none").metrics["correction/kl_k3"] > 0


def test_token_tis_truncates_each_ratio_at_the_clip_and_keeps_one_exactly_at_it():
    t, r = pair(LOG)
    c = rollout_correction(t, r, MASK, mode="token_tis", clip=2.0)
    assert close(c.weights, [[1.0, 2.0, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0]])  # 4 -> 2; 2 (at the clip) stays 2
    assert c.mask.tolist() == MASK.tolist()
    assert c.metrics["correction/truncated_fraction"] == 0.25  # only the 4: exactly-at-clip is not truncated
    assert c.metrics["correction/weight_mean"] == pytest.approx((1 + 2 + 0.5 + 2) / 4)


def test_seq_tis_truncates_the_product_over_counted_tokens_only():
    t, r = pair(LOG)
    c = rollout_correction(t, r, MASK, mode="seq_tis", clip=2.0)
    # row 0: 1 * 2 * 1/2 = 1 (the padding token's e^50 never counts); row 1: 4 -> 2.
    assert close(c.weights, [[1.0, 1.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    t, r = pair([[L2, L2, L2]])  # product 8: truncated to 3 with clip 3
    assert close(rollout_correction(t, r, torch.ones(1, 3), mode="seq_tis", clip=3.0).weights, [[3.0] * 3])


def test_seq_mis_masks_sequences_above_the_clip_and_keeps_one_exactly_at_it():
    t, r = pair([[L2, 0.0], [L2, L2], [-L2, -L2]])
    mask = torch.ones(3, 2)
    c = rollout_correction(t, r, mask, mode="seq_mis", clip=2.0)
    # products 2 (exactly the clip: kept, weight 2), 4 (masked), 1/4 (kept, weight 1/4)
    assert close(c.weights, [[2.0, 2.0], [0.0, 0.0], [0.25, 0.25]])
    assert c.mask.tolist() == [[1, 1], [0, 0], [1, 1]]
    assert c.metrics["correction/masked_token_fraction"] == pytest.approx(2 / 6)
    assert c.metrics["correction/masked_seq_fraction"] == pytest.approx(1 / 3)


def test_geo_rs_masks_sequences_whose_geometric_mean_leaves_the_band():
    # geometric means: exp(mean(L2, -L2)) = 1; exp(mean(L2, L2)) = 2 (exactly high: kept); exp(-2 L2 / 2) = 1/2
    # (exactly low: kept); exp(mean(2 L2, 2 L2)) = 4 (masked); length-1 row with ratio 1/4 (masked).
    t, r = pair([[L2, -L2], [L2, L2], [-L2, -L2], [2 * L2, 2 * L2], [-2 * L2, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.float32)
    c = rollout_correction(t, r, mask, mode="geo_rs", low=0.5, high=2.0)
    assert c.weights.tolist() == [[1, 1], [1, 1], [1, 1], [0, 0], [0, 0]]
    assert c.mask.tolist() == c.weights.tolist()
    assert c.metrics["correction/masked_seq_fraction"] == pytest.approx(2 / 5)
    assert c.metrics["correction/masked_token_fraction"] == pytest.approx(3 / 9)


def test_geo_rs_default_band_is_verls_tight_one():
    t, r = pair([[0.0005, -0.0005], [0.01, 0.01]])
    c = rollout_correction(t, r, torch.ones(2, 2), mode="geo_rs")
    assert c.mask.tolist() == [[1, 1], [0, 0]]


def test_icepop_masks_tokens_outside_the_band_keeps_the_bounds_and_weights_kept_tokens_by_their_ratio():
    t, r = pair([[0.0, L2, -L2, 2 * L2, -2 * L2]])
    c = rollout_correction(t, r, torch.ones(1, 5), mode="icepop", low=0.5, high=2.0)
    assert close(c.weights, [[1.0, 2.0, 0.5, 0.0, 0.0]])
    assert c.mask.tolist() == [[1, 1, 1, 0, 0]]
    assert c.metrics["correction/masked_token_fraction"] == pytest.approx(2 / 5)
    assert c.metrics["correction/masked_seq_fraction"] == 1.0
    # the paper's band [0.5, 5] by default
    assert rollout_correction(t, r, torch.ones(1, 5), mode="icepop").mask.tolist() == [[1, 1, 1, 1, 0]]


def test_float32_ratio_exactly_at_the_clip_is_kept_by_every_bounded_mode():
    r = torch.tensor([[-2 * L2]], dtype=torch.float32)
    t = torch.tensor([[-L2]], dtype=torch.float32)  # ratio 2 in float32
    one = torch.ones(1, 1)
    assert rollout_correction(t, r, one, mode="seq_mis", clip=2.0).mask.tolist() == [[1.0]]
    assert rollout_correction(t, r, one, mode="icepop", low=0.25, high=2.0).mask.tolist() == [[1.0]]
    assert rollout_correction(t, r, one, mode="geo_rs", low=0.25, high=2.0).mask.tolist() == [[1.0]]
    assert rollout_correction(t, r, one, mode="token_tis", clip=2.0).metrics["correction/truncated_fraction"] == 0
    w = rollout_correction(t, r, one, mode="token_tis", clip=2.0).weights
    assert w.dtype == torch.float32 and w.item() == pytest.approx(2.0)


def test_long_sequences_do_not_overflow_the_product():
    t, r = pair([[5.0] * 400])  # rho_seq = e^2000
    for mode in ("seq_tis", "seq_mis"):
        c = rollout_correction(t.float(), r.float(), torch.ones(1, 400), mode=mode)
        assert torch.isfinite(c.weights).all(), mode
    assert rollout_correction(t, r, torch.ones(1, 400), mode="seq_tis").weights[0, 0].item() == pytest.approx(2.0)


def test_a_batch_with_no_counted_token_and_bad_arguments():
    t = torch.zeros(2, 3)
    c = rollout_correction(t, t, torch.zeros(2, 3), mode="token_tis")
    assert c.weights.sum() == 0 and c.metrics["correction/tokens"] == 0 and math.isnan(c.metrics["correction/kl_k1"])
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_correction(t, t, t, mode="tis")
    with pytest.raises(ValueError, match="low < high"):
        rollout_correction(t, t, t, mode="icepop", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="clip"):
        rollout_correction(t, t, t, mode="token_tis", clip=0)
    with pytest.raises(ValueError, match="one shape"):
        rollout_correction(t, t[:, :2], t, mode="none")
    nan = t.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        rollout_correction(nan, t, torch.ones(2, 3), mode="none")
    rollout_correction(nan, t, torch.tensor([[0.0, 1, 1], [1, 1, 1]]), mode="none")  # NaN on padding: ignored


def test_metrics_per_staleness_split_the_tokens_by_version():
    t, r = pair([[0.0, L2, -L2, 0.0], [2 * L2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    versions = torch.tensor([[3, 3, 4, -1], [4, -1, -1, -1]])  # row 1's second token: counted, version unknown
    c = rollout_correction(t, r, mask, mode="token_tis", versions=versions)
    m = c.metrics
    assert m["correction/tokens"] == 5
    assert m["correction/staleness_0/tokens"] == 2 and m["correction/staleness_1/tokens"] == 2
    assert m["correction/staleness_0/ratio_mean"] == pytest.approx((0.5 + 4) / 2)
    assert m["correction/staleness_1/kl_k1"] == pytest.approx(-L2 / 2)
    assert m["correction/staleness_0/truncated_fraction"] == 0.5
    c = rollout_correction(t, r, mask, mode="token_tis", versions=versions, current_version=6)
    assert set(k.split("/")[1] for k in c.metrics if "staleness_" in k) == {"staleness_2", "staleness_3"}


# ------------------------------------------------------------------ properties

finite = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 4))
    width = draw(st.integers(1, 6))
    trainer = torch.tensor(draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=n, max_size=n)))
    rollout = torch.tensor(draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=n, max_size=n)))
    mask = torch.tensor(draw(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=width, max_size=width),
                                      min_size=n, max_size=n)))  # fmt: skip
    advantages = torch.tensor(draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n)))
    return trainer, rollout, mask, advantages


@settings(max_examples=200, deadline=None)
@given(batches())
def test_none_leaves_the_loss_unchanged_and_every_modes_weights_are_finite(batch):
    trainer, rollout, mask, advantages = batch
    pg = -advantages[:, None] * trainer  # REINFORCE's per-token loss
    tokens = mask.sum().clamp(min=1)
    plain = (pg * mask).sum() / tokens
    c = rollout_correction(trainer, rollout, mask, mode="none")
    assert ((pg * c.weights).sum() / tokens).item() == plain.item()
    for mode in MODES:
        c = rollout_correction(trainer, rollout, mask, mode=mode)
        assert torch.isfinite(c.weights).all(), mode
        assert (c.weights >= 0).all() and (c.weights[mask == 0] == 0).all(), mode
        assert ((c.mask == 0) | (c.mask == 1)).all() and (c.mask <= mask).all(), mode
        assert all(isinstance(v, float) for v in c.metrics.values())


def test_fleet_rollouts_refuses_an_unknown_correction_before_connecting():
    from common.errors import ConfigError
    from coordinator.correction import MODES as modes
    from coordinator.integrations.trl import CORRECTION_MODES, FleetRollouts

    assert CORRECTION_MODES == modes  # the TRL module's copy (it imports without torch) is the same list
    with pytest.raises(ConfigError, match="correction must be one of"):
        FleetRollouts("tcp://127.0.0.1:9", correction="tis")
    with pytest.raises(ConfigError, match="correction_args takes clip, low and high"):
        FleetRollouts("tcp://127.0.0.1:9", correction="icepop", correction_args={"band": 1})
