"""Choosing each row's next token from its logits, and the logprob reported for it.

The logprob convention is SGLang's default: the log-softmax of the logits divided by the
temperature, taken *before* top-k / top-p / min-p filtering, of the token that was sampled. A
greedy row (temperature < 1e-6) takes the argmax and reports the log-softmax at temperature 1.
So at temperature 1 with no filter the logprob is the model's own ``log p(token | context)``,
which a trainer recomputes with a plain forward pass.

Before anything else, a row that has produced fewer than ``min_new_tokens`` tokens has its stop
ids (EOS and ``stop_token_ids``) masked to -inf (SGLang's min-new-tokens penalizer); the
reported logprob comes from the masked logits. ``top_k`` keeps the k most likely tokens,
``top_p`` the smallest prefix of them (by probability) whose mass reaches p, ``min_p`` the
tokens at least ``min_p`` times as likely as the most likely one; the sample is drawn from what
is left, renormalised. A row with ``sampling_seed`` draws from its own generator, so the same
seed gives the same tokens; other rows draw from the engine's ``--seed``-ed generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-6


@dataclass(slots=True)
class RowSampling:
    """How one row samples; ``produced`` counts its tokens so far (the model thread updates it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    produced: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _filtered(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """``probs`` with the tokens that top-k, top-p and min-p drop set to 0 (not renormalised)."""
    vocab = probs.shape[1]
    device = probs.device
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], device=device, dtype=probs.dtype)
    min_p = torch.tensor([r.min_p for r in rows], device=device, dtype=probs.dtype)
    sorted_p, order = probs.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    keep = ranks < top_k[:, None]
    keep &= (sorted_p.cumsum(dim=1) - sorted_p) < top_p[:, None]  # the first token is always kept
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    return torch.zeros_like(probs).scatter(1, order, sorted_p * keep)


def sample(
    logits: torch.Tensor, rows: list[RowSampling], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token ``[B]`` of each row of ``logits`` ``[B, V]`` and its logprob ``[B]`` (module docstring).

    Counts the token in each row's ``produced``.
    """
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.stop_ids and row.produced < row.min_new_tokens:
            logits[i, row.stop_ids] = float("-inf")
    temperature = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], device=logits.device)
    logprobs = torch.log_softmax(logits / temperature[:, None], dim=1)
    tokens = logits.argmax(dim=1)
    drawn = [i for i, r in enumerate(rows) if not r.greedy]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        sub = [rows[i] for i in drawn]
        probs = logprobs[index].exp()
        if any(r.filters for r in sub):
            probs = _filtered(probs, sub)
        shared = [j for j, r in enumerate(sub) if r.generator is None]
        if shared:
            picks = torch.multinomial(probs[shared], 1, generator=generator)[:, 0]
            tokens[index[shared]] = picks
        for j, r in enumerate(sub):
            if r.generator is not None:
                tokens[drawn[j]] = torch.multinomial(probs[j], 1, generator=r.generator)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    for row in rows:
        row.produced += 1
    return tokens, chosen
