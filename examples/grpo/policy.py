"""The GRPO math, in plain torch: response logprobs, group-normalised advantages, the clipped loss.

Token alignment, the one thing every RL trainer must get exactly right: a sample is
``prompt_tokens + response_tokens``; the logits at position ``i`` predict token ``i + 1``, so
response token ``j`` (at position ``len(prompt) + j``) is scored by the logits at
``len(prompt) + j - 1``. Its logprob is ``log_softmax(logits)[token]``, which is what the engine
reports at temperature 1.0 (it reports ``log_softmax(logits / temperature)``). The trainer's
recomputation and the engine's numbers agree to ~1e-6 in fp32 when the weights match; the example
measures that on every step (``train/rollout_logprob_abs_diff``).
"""

from __future__ import annotations

import torch

from common.tokenizer import ByteTokenizer


def response_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], params: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, mask)``, both ``[n, longest response]``: each response token's logprob under ``model``.

    ``mask`` is 1.0 on real response tokens and 0.0 on padding. Rows are right-padded, so causal
    attention never lets a real token see padding and no attention mask is needed. ``params``
    (a name -> tensor dict) runs the model with those weights instead of its own.
    """
    n = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    longest = max(len(r) for r in responses)
    tokens = torch.full((n, width), ByteTokenizer.PAD, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        tokens[row, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
    if params is None:
        logits = model(input_ids=tokens).logits
    else:
        logits = torch.func.functional_call(model, params, args=(), kwargs={"input_ids": tokens})
        logits = logits.logits
    # token_lp[:, i] = logprob of token i + 1 given tokens 0..i
    token_lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    prompt_len = torch.tensor([len(p) for p in prompts])
    response_len = torch.tensor([len(r) for r in responses])
    steps = torch.arange(longest)
    index = (prompt_len[:, None] - 1 + steps[None, :]).clamp(max=width - 2)
    mask = (steps[None, :] < response_len[:, None]).float()
    return token_lp.gather(1, index) * mask, mask


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean, over the group's std. ``rewards`` is ``[groups, n]``.

    A group whose rewards are all equal gets advantage 0: it carries no signal about which answer is better.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def clipped_pg_loss(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate on response tokens, averaged over every token of the batch.

    The importance ratio is against the logprobs the engine sampled with, so samples generated on
    older weights (staleness up to ``max_staleness``) are corrected, and clipped at ``1 +- clip``.
    ``advantages`` is one value per sample (``[n]``), shared by its tokens.
    """
    ratio = torch.exp(logprobs - rollout_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    tokens = mask.sum().clamp(min=1)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = (((ratio - 1).abs() > clip).float() * mask).sum() / tokens
    return loss, {"train/clip_fraction": clipped.item(), "train/ratio_mean": ((ratio * mask).sum() / tokens).item()}
