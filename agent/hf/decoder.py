"""The model thread's side of decoding: one call per step for the whole running batch.

:meth:`Decoder.advance` is the only entry point of a step. In one call, on the model thread,
it (1) drops the rows that left (finished or aborted samples), (2) runs one decode step for the
remaining rows, (3) prefills the rows that join, left-padded together, and merges them into the
batch, and (4) samples one token for every row, old and new, from the concatenated logits. So
one forward pass serves every running sample, and new samples join between steps.

The decoder knows rows only by integer keys; the asyncio side (:mod:`agent.hf.scheduler`) maps
keys to samples and decides when a sample is finished. Nothing here touches a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from agent.hf.batch import KVBatch
from agent.hf.sampler import RowSampling, sample


@dataclass(slots=True)
class Join:
    """A sample entering the batch: its prompt and how it samples."""

    key: int
    prompt: list[int]
    sampling: RowSampling
    input_logprob_start: int = -1  # prompt logprobs from this token on; -1: none


@dataclass(slots=True)
class Produced:
    """One token of one row, with its logprob; a joining row's first token carries its prompt logprobs."""

    key: int
    token: int
    logprob: float
    input_logprobs: list[float | None] | None = None


class Decoder:
    """The running batch of one model (model thread only)."""

    def __init__(self, model: Any, device: torch.device, pad_id: int, seed: int):
        self.batch = KVBatch(model, device, pad_id)
        self.keys: list[int] = []
        self.rows: list[RowSampling] = []
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return len(self.keys)

    def reset(self) -> None:
        """Forget every row (after a failed step)."""
        self.batch.select([])
        self.keys, self.rows = [], []

    def advance(self, leave: set[int], joins: list[Join]) -> list[Produced]:
        """Drop the ``leave`` rows, step the rest, add ``joins``; one token per row now in the batch."""
        if leave:
            keep = [i for i, k in enumerate(self.keys) if k not in leave]
            self.batch.select(keep)
            self.keys = [self.keys[i] for i in keep]
            self.rows = [self.rows[i] for i in keep]
        parts: list[torch.Tensor] = []
        old = len(self.keys)
        if old:
            parts.append(self.batch.step())
        prefilled, full = None, None
        if joins:
            want_prompt = any(j.input_logprob_start >= 0 for j in joins)
            prefilled, logits = self.batch.prefill([j.prompt for j in joins], all_logits=want_prompt)
            if want_prompt:
                full, logits = logits, logits[:, -1]
            parts.append(logits)
        if not parts:
            return []
        rows = self.rows + [j.sampling for j in joins]
        tokens, logprobs = sample(torch.cat(parts), rows, self.generator)
        if old:
            self.batch.last = tokens[:old]
        if prefilled is not None:
            self.batch.merge(prefilled, tokens[old:])
        self.keys += [j.key for j in joins]
        self.rows = rows
        token_list, logprob_list = tokens.tolist(), logprobs.tolist()
        out = [Produced(k, token_list[i], logprob_list[i]) for i, k in enumerate(self.keys)]
        if full is not None:
            for i, join in enumerate(joins):
                if join.input_logprob_start >= 0:
                    out[old + i].input_logprobs = _prompt_logprobs(full[i], join)
        return out


def _prompt_logprobs(logits: torch.Tensor, join: Join) -> list[float | None]:
    """Logprobs of ``join.prompt[start:]`` under the left-padded prefill ``logits`` ``[T, V]`` (first: None)."""
    prompt = join.prompt
    n = len(prompt)
    offset = logits.shape[0] - n  # left padding
    temperature = 1.0 if join.sampling.greedy else join.sampling.temperature
    logprobs = torch.log_softmax(logits[offset : offset + n - 1].float() / temperature, dim=1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    values: list[float | None] = [None]
    values += logprobs.gather(1, targets[:, None])[:, 0].tolist()
    return values[join.input_logprob_start :]
