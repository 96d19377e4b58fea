"""Off-policy correction from the data every batch carries: importance weights, rejection masks, mismatch metrics.

Every rollfleet sample records ``rollout_logprobs``, the engine's logprob of each token it sampled
(the behaviour policy ``mu``), and which weight version produced which span of it. A trainer
that recomputes the same tokens' logprobs under the policy it is about to update (``pi``, the
``trainer_logprobs``) has everything an off-policy correction needs: the per-token ratio

    rho_t = pi(y_t | y_<t) / mu(y_t | y_<t) = exp(trainer_logprob_t - rollout_logprob_t)

measures both sources of off-policyness at once: staleness (``mu`` is the weights of an older
version, up to ``--max-staleness`` updates behind) and the engine/trainer numeric mismatch
(another kernel, another precision). :func:`rollout_correction` turns the ratios into
``weights`` to multiply a policy-gradient loss with, a ``mask`` of the tokens kept, and metrics.

Modes (``rho_t`` per token; a sequence's ratio ``rho_seq = prod_t rho_t = exp(sum_t log rho_t)``
and geometric mean ``rho_geo = exp(mean_t log rho_t)``, over its counted tokens):

==========  =========================================  ==================================================
mode        weight of counted token ``t`` of seq ``i``  masked (weight 0)
==========  =========================================  ==================================================
none        ``1``                                       nothing
token_tis   ``min(rho_t, clip)``  (truncated IS)        nothing
seq_tis     ``min(rho_seq_i, clip)``                    nothing
seq_mis     ``rho_seq_i``                               sequences with ``rho_seq_i > clip``
geo_rs      ``1``  (rejection only)                     sequences with ``rho_geo_i`` outside ``[low, high]``
icepop      ``rho_t``                                   tokens with ``rho_t`` outside ``[low, high]``
==========  =========================================  ==================================================

``seq_mis`` is masked importance sampling (``rho * 1[rho <= C]``, Liu et al. 2025, "When Speed
Kills Stability"), ``icepop`` is IcePop's masking function ``M(rho) = rho * 1[low <= rho <= high]``
(Ling team, Ring-1T, 2025), ``geo_rs`` is verl's geometric-mean rejection. Bounds are inclusive:
a ratio exactly at ``clip``, ``low`` or ``high`` is kept. Defaults follow verl's rollout-correction
presets and IcePop's paper: ``clip = 2.0`` (``decoupled_token_is`` / ``decoupled_seq_is``),
``[low, high] = [0.999, 1.001]`` for ``geo_rs`` (``decoupled_geo_rs``: it is meant for engine
mismatch, and rejects nearly everything once weights are stale; widen it for stale data), and
``[0.5, 5.0]`` for ``icepop``.

Counted tokens are those with ``loss_mask > 0``: padding, prompt and tokens a generate function
inserted (loss mask 0) never count, in the ratios, the sequence products, the metrics or the
weights (which are 0 there). Ratios are computed in log space (``log rho_t = trainer - rollout``);
a sequence's product is ``exp`` of a sum, so a long sequence cannot overflow before the truncation
(``min`` is taken in log space) and the weights are finite for finite inputs. The weights are
detached: they change the measure, not the objective.

Using them, with ``pg_loss`` the per-token policy-gradient loss (PPO's clipped surrogate, or
``-A * logprob``)::

    c = rollout_correction(new_logprobs.detach(), t["rollout_logprobs"], t["loss_mask"], mode="token_tis")
    loss = (pg_loss * c.weights).sum() / t["loss_mask"].sum()   # masked tokens stay in the count (IcePop)
    # or / c.mask.sum(): masked tokens leave the count too (verl's rejection)
    log(c.metrics)

Metrics (floats; ``rho_t`` over counted tokens, before truncation or masking):

- ``correction/kl_k1 = mean_t(rollout_t - trainer_t) = mean_t(-log rho_t)`` and
  ``correction/kl_k3 = mean_t(rho_t - 1 - log rho_t)``: Schulman's k1 and k3 estimators of
  ``KL(mu || pi)`` from tokens sampled by ``mu`` (k3 is never negative; both are ~0 on policy);
- ``correction/ratio_mean``, ``correction/ratio_min``, ``correction/ratio_max`` of ``rho_t``;
- ``correction/weight_mean``: the mean weight over counted tokens (masked ones as 0);
- ``correction/truncated_fraction``: counted tokens whose weight the clip lowered (``*_tis``);
- ``correction/masked_token_fraction``: counted tokens whose weight is 0 by the mode's mask;
- ``correction/masked_seq_fraction``: sequences (with a counted token) that lost at least one token
  to the mask (for the sequence modes: sequences rejected);
- ``correction/tokens``, ``correction/sequences``: what was counted.

With ``versions`` (``to_tensors()["versions"]``: the weight version of each token, -1 where
unknown), the KL, ratio and masked-fraction metrics are also given per staleness ``s =
current_version - version`` as ``correction/staleness_<s>/<metric>`` (with ``tokens``), over the
counted tokens of known version. ``current_version`` defaults to the newest version among them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MODES = ("none", "token_tis", "seq_tis", "seq_mis", "geo_rs", "icepop")
"""Every ``mode`` :func:`rollout_correction` takes."""

DEFAULT_CLIP = 2.0
"""Truncation of ``token_tis`` and ``seq_tis``, rejection bound of ``seq_mis`` (verl's preset threshold)."""

DEFAULT_BAND = {"geo_rs": (0.999, 1.001), "icepop": (0.5, 5.0)}
"""``(low, high)`` of the band modes when not given: verl's ``decoupled_geo_rs``, IcePop's paper."""


@dataclass(frozen=True)
class Correction:
    """What :func:`rollout_correction` returns: multiply the per-token loss by ``weights``."""

    weights: torch.Tensor
    """Per token, same shape as the inputs: the factor for the policy-gradient loss (0 where not counted or masked)."""
    mask: torch.Tensor
    """Per token, 1.0 on counted tokens the mode keeps, 0.0 elsewhere (padding, loss mask 0, rejected)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``correction/...`` floats (module docstring)."""


def rollout_correction(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mode: str,
    clip: float = DEFAULT_CLIP,
    low: float | None = None,
    high: float | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
) -> Correction:
    """Importance weights, rejection mask and mismatch metrics for one batch (formulas: the module docstring).

    ``trainer_logprobs``, ``rollout_logprobs``, ``loss_mask`` (and ``versions``): ``[sequences,
    tokens]``, aligned (e.g. the full rows of ``batch.to_tensors()``, or response-only rows).
    ``trainer_logprobs`` is detached here. ``mode``: one of :data:`MODES`. ``clip`` (> 0) is the
    truncation of ``token_tis``/``seq_tis`` and the bound of ``seq_mis``; ``low < high`` (> 0) the
    band of ``geo_rs`` and ``icepop`` (defaults: :data:`DEFAULT_BAND`).

    Raises ``ValueError`` for an unknown mode, bad bounds, mismatched shapes, or a NaN logprob on
    a counted token.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
    default_low, default_high = DEFAULT_BAND.get(mode, (0.5, 5.0))
    low = default_low if low is None else low
    high = default_high if high is None else high
    if not (0 < low < high and math.isfinite(high)):
        raise ValueError(f"need 0 < low < high < inf, got low={low!r}, high={high!r}")
    shape = trainer_logprobs.shape
    if trainer_logprobs.dim() != 2 or rollout_logprobs.shape != shape or loss_mask.shape != shape:
        raise ValueError(
            "trainer_logprobs, rollout_logprobs and loss_mask must be [sequences, tokens] of one shape; got "
            f"{tuple(shape)}, {tuple(rollout_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if versions is not None and versions.shape != shape:
        raise ValueError(f"versions must have the logprobs' shape {tuple(shape)}, got {tuple(versions.shape)}")

    # Compute in the inputs' floating dtype (at least float32), so that a ratio built exactly at a bound in that
    # dtype compares equal to the bound's log taken in the same dtype.
    dtype = torch.promote_types(torch.promote_types(trainer_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    device = trainer_logprobs.device
    counted = loss_mask.to(device) > 0
    trainer = trainer_logprobs.detach().to(dtype)
    rollout = rollout_logprobs.detach().to(device=device, dtype=dtype)
    raw = trainer - rollout
    if torch.isnan(raw[counted]).any():
        raise ValueError("a counted token has a NaN logprob (trainer or rollout)")
    log_ratio = torch.where(counted, raw, torch.zeros((), dtype=dtype, device=device))  # 0: ratio 1 off the mask
    count_f = counted.to(dtype)

    def log_bound(x: float) -> torch.Tensor:
        return torch.log(torch.tensor(float(x), dtype=dtype, device=device))

    per_seq = count_f.sum(dim=1, keepdim=True)
    seq_log = log_ratio.sum(dim=1, keepdim=True)  # log rho_seq
    keep = counted.clone()
    truncated = torch.zeros_like(counted)
    if mode == "none":
        log_w = torch.zeros_like(log_ratio)
    elif mode == "token_tis":
        log_w = torch.clamp(log_ratio, max=log_bound(clip))
        truncated = counted & (log_ratio > log_bound(clip))
    elif mode == "seq_tis":
        log_w = torch.clamp(seq_log, max=log_bound(clip)).expand_as(log_ratio)
        truncated = counted & (seq_log > log_bound(clip))
    elif mode == "seq_mis":
        keep = counted & (seq_log <= log_bound(clip))
        log_w = seq_log.expand_as(log_ratio)
    elif mode == "geo_rs":
        geo = seq_log / per_seq.clamp(min=1)
        keep = counted & (geo >= log_bound(low)) & (geo <= log_bound(high))
        log_w = torch.zeros_like(log_ratio)
    else:  # icepop
        keep = counted & (log_ratio >= log_bound(low)) & (log_ratio <= log_bound(high))
        log_w = log_ratio
    # Masked and uncounted tokens get weight 0 before exp ever sees a large log (seq_mis: rho_seq > clip).
    zero = torch.zeros((), dtype=dtype, device=device)
    weights = torch.where(keep, torch.exp(torch.where(keep, log_w, zero)), zero)
    mask = keep.to(dtype)

    metrics = _metrics(log_ratio, counted, keep, truncated, weights, prefix="correction/")
    if versions is not None:
        known = counted & (versions.to(device) >= 0)
        if known.any():
            v = versions.to(device).long()
            newest = int(v[known].max()) if current_version is None else int(current_version)
            staleness = newest - v
            for s in sorted(int(x) for x in torch.unique(staleness[known])):
                at = known & (staleness == s)
                part = _metrics(log_ratio, at, keep & at, truncated & at, weights, prefix=f"correction/staleness_{s}/")
                metrics.update({k: x for k, x in part.items() if not k.endswith(("sequences", "masked_seq_fraction"))})
    return Correction(weights=weights.to(trainer_logprobs.dtype), mask=mask.to(trainer_logprobs.dtype), metrics=metrics)


def _metrics(
    log_ratio: torch.Tensor,
    counted: torch.Tensor,
    keep: torch.Tensor,
    truncated: torch.Tensor,
    weights: torch.Tensor,
    *,
    prefix: str,
) -> dict[str, float]:
    """The module docstring's metrics over the ``counted`` tokens (NaN for a ratio or KL of no token)."""
    n = int(counted.sum())
    rows = counted.any(dim=1)
    out = {f"{prefix}tokens": float(n), f"{prefix}sequences": float(rows.sum())}
    if n == 0:
        nan = float("nan")
        for key in ("kl_k1", "kl_k3", "ratio_mean", "ratio_min", "ratio_max", "weight_mean"):
            out[prefix + key] = nan
        for key in ("truncated_fraction", "masked_token_fraction", "masked_seq_fraction"):
            out[prefix + key] = 0.0
        return out
    lr = log_ratio[counted].double()
    rho = torch.exp(lr)
    masked = counted & ~keep
    out.update(
        {
            f"{prefix}kl_k1": (-lr).mean().item(),
            f"{prefix}kl_k3": (rho - 1 - lr).mean().item(),
            f"{prefix}ratio_mean": rho.mean().item(),
            f"{prefix}ratio_min": rho.min().item(),
            f"{prefix}ratio_max": rho.max().item(),
            f"{prefix}weight_mean": weights[counted].double().mean().item(),
            f"{prefix}truncated_fraction": truncated.sum().item() / n,
            f"{prefix}masked_token_fraction": masked.sum().item() / n,
            f"{prefix}masked_seq_fraction": masked.any(dim=1).sum().item() / max(1, int(rows.sum())),
        }
    )
    return out
