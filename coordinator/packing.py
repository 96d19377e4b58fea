"""Packed micro-batches: whole samples into micro-batches of at most ``max_tokens`` tokens each.

RL's response lengths are long-tailed, so ``RolloutBatch.to_tensors()`` (every row padded to the
longest sample of the batch) is mostly padding. A trainer with variable-length attention
(flash-attn's ``cu_seqlens``, HF's packed ``position_ids``) packs samples end to end instead, into
micro-batches of a token budget, and accumulates gradients over them.

The packing is pure (lengths in, lists of sample indices out; no torch here at module level) and
deterministic: the same lengths, budget and count give the same micro-batches on every process.

Algorithms, with ``n`` samples, length ``l_i`` (prompt + response) and budget ``N``:

- **Count** (:func:`count_micro_batches`): *first-fit decreasing* (FFD) bin packing. Samples longer
  than ``N`` are each alone (they are in any packing); the others, longest first (ties: lower index
  first), go to the first micro-batch with room. FFD never uses more than ``11/9 OPT + 6/9``
  micro-batches, OPT the fewest possible (Dósa 2007, tight), so it is within about 22% of optimal.
  It is a function of the lengths and ``N`` only: a rank that knows every rank's lengths (a batch's
  metadata) knows every rank's count, and the max over ranks, without a collective.
- **Assignment** (:func:`pack`) into ``k`` micro-batches (``k`` = the count, or a larger one forced
  by the caller so that every rank runs the same number of gradient-accumulation steps):
  *longest processing time first* (LPT, Graham 1969), samples longest first to the micro-batch
  with the fewest tokens so far. Its largest micro-batch is at most ``4/3 - 1/(3k)`` times the
  smallest largest-micro-batch any assignment into ``k`` can have. Where LPT would put more than
  ``N`` tokens in a micro-batch of two or more samples, the FFD packing is used instead and its
  fullest micro-batches are split in two (by LPT of their samples) until there are ``k``: every
  micro-batch then still fits ``N``. Where ``k`` exceeds the number of samples, the extra
  micro-batches are empty (a rank still steps through them, to keep the collectives in lockstep).

Invariants (all paths): every sample is in exactly one micro-batch, whole; a micro-batch holds more
than ``N`` tokens only when it is one sample alone that is longer than ``N``; within a micro-batch
samples keep their batch order; micro-batches are ordered by their first sample, empty ones last.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence

from common.errors import RolloutError


def _check(lengths: Sequence[int], max_tokens: int) -> list[int]:
    if isinstance(max_tokens, bool) or not hasattr(max_tokens, "__index__") or operator.index(max_tokens) < 1:
        raise ValueError(f"max_tokens must be an int >= 1, not {max_tokens!r}")
    out = [int(n) for n in lengths]
    if any(n < 0 for n in out):
        raise ValueError("sample lengths must be >= 0")
    return out


def _decreasing(lengths: list[int], indices) -> list[int]:
    """``indices`` longest first, ties by index: the one order every algorithm here walks."""
    return sorted(indices, key=lambda i: (-lengths[i], i))


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """FFD bins of sample indices, each bin's lengths summing to ``<= max_tokens`` or one sample alone."""
    lengths = _check(lengths, max_tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _decreasing(lengths, range(len(lengths))):
        n = lengths[i]
        if n > max_tokens:
            bins.append([i])
            loads.append(max_tokens + 1)  # full: nothing joins an oversized sample
            continue
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def count_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches ``micro_batches(max_tokens)`` gives for samples of these lengths (FFD's count).

    Pure: the same on every rank that knows ``lengths``. 0 for no sample.
    """
    return len(first_fit_decreasing(lengths, max_tokens))


def _lpt(lengths: list[int], indices, k: int) -> list[list[int]]:
    """Longest processing time first: each sample, longest first, to the bin with the fewest tokens (lowest first)."""
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, j) for j in range(k)]  # (load, bin): the lightest on top, ties to the lower bin
    for i in _decreasing(lengths, indices):
        load, b = heap[0]
        bins[b].append(i)
        heapq.heapreplace(heap, (load + lengths[i], b))
    return bins


def _fits(lengths: list[int], bins: list[list[int]], max_tokens: int) -> bool:
    return all(len(b) <= 1 or sum(lengths[i] for i in b) <= max_tokens for b in bins)


def pack(lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None) -> list[list[int]]:
    """Sample indices of each micro-batch: ``num_micro_batches`` of them (default :func:`count_micro_batches`).

    LPT into that many when it fits ``max_tokens``, else FFD split up to that many (module docstring).
    ``num_micro_batches`` below the count raises ``ValueError``: FFD found no packing that small.
    """
    lengths = _check(lengths, max_tokens)
    max_tokens = operator.index(max_tokens)
    ffd = first_fit_decreasing(lengths, max_tokens)
    k = len(ffd) if num_micro_batches is None else num_micro_batches
    if isinstance(k, bool) or not hasattr(k, "__index__") or (k := operator.index(k)) < len(ffd):
        raise ValueError(
            f"num_micro_batches={num_micro_batches!r}: these {len(lengths)} samples need at least "
            f"{len(ffd)} micro-batches of {max_tokens} tokens (count_micro_batches)"
        )
    if k == 0:
        return []
    bins = _lpt(lengths, range(len(lengths)), k)
    if not _fits(lengths, bins, max_tokens):
        bins = split_to(lengths, ffd, k)
    return _ordered(bins)


def split_to(lengths: Sequence[int], bins: list[list[int]], k: int) -> list[list[int]]:
    """``bins`` (each fitting a budget) made ``k``: the fullest bin of two or more samples split in two by LPT,
    again until there are ``k``; then empty bins. Every new bin is part of an old one, so it still fits."""
    bins = [list(b) for b in bins]
    while len(bins) < k:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -min(bins[b])))
        bins[fullest], other = _lpt(list(lengths), bins[fullest], 2)
        bins.append(other)
    return _ordered(bins + [[] for _ in range(k - len(bins))])


def _ordered(bins: list[list[int]]) -> list[list[int]]:
    """Each bin in batch order; bins by their first sample, empty ones last."""
    bins = [sorted(b) for b in bins]
    return sorted(bins, key=lambda b: (not b, b[0] if b else 0))


def packed_tensors(batch, bins: list[list[int]], *, current_version: int | None = None) -> list[dict]:
    """One dict of torch tensors per entry of ``bins`` (indices into ``batch.samples``).

    The keys, shapes and dtypes are documented on ``RolloutBatch.micro_batches``.
    """
    try:
        import torch
    except ImportError as exc:
        raise RolloutError("micro_batches() needs torch: pip install 'rollfleet[torch]'") from exc
    from common.types import as_array
    from coordinator.token_spans import token_spans

    samples = batch.samples
    group_of = [g.index for g in batch.groups for _ in g.samples]
    out = []
    for b in bins:
        lens = [len(samples[i].prompt_tokens) + len(samples[i].response_tokens) for i in b]
        total = sum(lens)
        tokens = torch.zeros((1, total), dtype=torch.long)
        position_ids = torch.zeros((1, total), dtype=torch.long)
        loss_mask = torch.zeros((1, total), dtype=torch.float32)
        logprobs = torch.zeros((1, total), dtype=torch.float32)
        versions = torch.full((1, total), -1, dtype=torch.long)
        cu = [0]
        for i, n in zip(b, lens, strict=True):
            s, start = samples[i], cu[-1]
            lp, lr = len(s.prompt_tokens), len(s.response_tokens)
            if lp:
                tokens[0, start : start + lp] = torch.frombuffer(as_array("i", s.prompt_tokens), dtype=torch.int32)
            if lr:
                r0, r1 = start + lp, start + lp + lr
                tokens[0, r0:r1] = torch.frombuffer(as_array("i", s.response_tokens), dtype=torch.int32)
                loss_mask[0, r0:r1] = torch.frombuffer(as_array("b", s.loss_mask), dtype=torch.int8)
                logprobs[0, r0:r1] = torch.frombuffer(as_array("d", s.response_logprobs), dtype=torch.float64)
                for version, v0, v1 in token_spans(s):
                    versions[0, r0 + v0 : r0 + v1] = version
            position_ids[0, start : start + n] = torch.arange(n, dtype=torch.long)
            cu.append(start + n)
        mb = {
            "tokens": tokens,
            "position_ids": position_ids,
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "versions": versions,
            "rewards": torch.tensor([samples[i].reward for i in b], dtype=torch.float32),
            "prompt_lengths": torch.tensor([len(samples[i].prompt_tokens) for i in b], dtype=torch.long),
            "response_lengths": torch.tensor([len(samples[i].response_tokens) for i in b], dtype=torch.long),
            "group_index": torch.tensor([group_of[i] for i in b], dtype=torch.long),
            "sample_index": torch.tensor(b, dtype=torch.long),
        }
        if current_version is not None:
            mb["staleness"] = torch.where(versions >= 0, int(current_version) - versions, -1)
        out.append(mb)
    return out
