"""The running batch: left-padded sequences sharing one KV cache, decoded one token per step.

Layout: row ``i`` of every tensor is one sample. ``mask`` ``[B, T]`` is 0 on left padding and 1 on
real tokens; ``cache`` holds keys and values ``[B, heads, T, head_dim]`` per layer for the same
``T`` columns; ``next_pos`` ``[B]`` is the position of the token a row feeds next (its count of
real tokens so far), so rotary positions never count padding; ``last`` ``[B]`` is that token.

Invariants: ``mask.shape[1]`` equals the cache length; every column but the padding ones holds
a real token of its row; after :meth:`KVBatch.select` no leading column is padding in every row
(trimmed), so ``T`` stays bounded by the longest live row.

- :meth:`prefill` runs left-padded prompts through the model with a fresh cache and returns their
  last logits (and, when asked, every prompt position's logits);
- :meth:`merge` appends prefilled rows: keys, values and mask are left-padded to the common
  ``T`` and concatenated along the batch;
- :meth:`step` feeds ``last`` of every row and returns the next logits;
- :meth:`select` keeps some rows (finished or aborted ones leave).

Not thread-safe: one thread (the engine's model thread) owns a batch. Newer transformers 5.x
releases name the cache argument and output ``cache`` (``past_key_values`` is then a deprecated
alias); older ones know only ``past_key_values``: :func:`_cache_names` picks by the model's signature.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache


def _cache_names(model: Any) -> tuple[str, str]:
    """The forward keyword and the output attribute that carry the KV cache for this transformers version."""
    if "cache" in inspect.signature(model.forward).parameters:
        return "cache", "cache"
    return "past_key_values", "past_key_values"


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class Prefilled:
    """Rows fresh from :meth:`KVBatch.prefill`, to be merged into the running batch."""

    __slots__ = ("mask", "cache", "next_pos")

    def __init__(self, mask: torch.Tensor, cache: Any, next_pos: torch.Tensor):
        self.mask = mask
        self.cache = cache
        self.next_pos = next_pos


class KVBatch:
    """Running sequences of one model, left-padded, with their KV cache."""

    def __init__(self, model: Any, device: torch.device, pad_id: int):
        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.mask: torch.Tensor | None = None
        self.cache: Any = None
        self.next_pos: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self._cache_arg, self._cache_out = _cache_names(model)

    def __len__(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Columns of the cache (``T``)."""
        return 0 if self.mask is None else int(self.mask.shape[1])

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> tuple[Prefilled, torch.Tensor]:
        """Run ``prompts`` (left-padded together); ``[N, V]`` last logits, or ``[N, T, V]`` with ``all_logits``."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self._cache_arg: DynamicCache()},
        )
        logits = out.logits if all_logits else out.logits[:, -1]
        return Prefilled(mask, getattr(out, self._cache_out), positions[:, -1] + 1), logits

    def merge(self, part: Prefilled, first: torch.Tensor) -> None:
        """Append ``part``'s rows, whose next input tokens are ``first``, after the running ones."""
        if self.mask is None:
            self.mask, self.cache, self.next_pos, self.last = part.mask, part.cache, part.next_pos, first
            return
        width = max(self.width, int(part.mask.shape[1]))
        old, new = _layers(self.cache), _layers(part.cache)
        layers = [
            (
                torch.cat([_left_pad(k0, width, 2), _left_pad(k1, width, 2)]),
                torch.cat([_left_pad(v0, width, 2), _left_pad(v1, width, 2)]),
            )
            for (k0, v0), (k1, v1) in zip(old, new, strict=True)
        ]
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(part.mask, width, 1)])
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.next_pos = torch.cat([self.next_pos, part.next_pos])  # type: ignore[list-item]
        self.last = torch.cat([self.last, first])  # type: ignore[list-item]

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feed every row's ``last`` token; the ``[B, V]`` logits of the next one."""
        assert self.mask is not None and self.last is not None and self.next_pos is not None
        rows = len(self)
        self.mask = torch.cat([self.mask, self.mask.new_ones((rows, 1))], dim=1)
        out = self.model(
            input_ids=self.last[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            use_cache=True,
            **{self._cache_arg: self.cache},
        )
        self.cache = getattr(out, self._cache_out)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]

    def select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (ascending), drop the rest, and trim columns that are padding in every row."""
        if not keep:
            self.mask = self.cache = self.next_pos = self.last = None
            return
        if len(keep) == len(self):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]  # type: ignore[index]
        self.next_pos = self.next_pos[index]  # type: ignore[index]
        self.last = self.last[index]  # type: ignore[index]
        used = self.mask.any(dim=0)
        start = int(used.to(torch.uint8).argmax())
        if start > 0:
            self.mask = self.mask[:, start:]
            layers = [(k[:, :, start:], v[:, :, start:]) for k, v in _layers(self.cache)]
            self.cache = DynamicCache(ddp_cache_data=layers)
