"""The supervised warm-up: a few hundred teacher-forced steps on correct answers, stopped early.

A randomly initialised model never writes ``\\boxed{`` by chance, so GRPO would see only zero
rewards and learn nothing. A short warm-up teaches the format (the constant bytes and EOS are
learned long before the sums are), and is stopped while the sums are still mostly wrong: the
example starts RL at a mean reward well under 0.3, and everything above that is learned by RL.
"""

from __future__ import annotations

import random

import torch

from common.tokenizer import ByteTokenizer
from examples.grpo import task
from examples.grpo.policy import response_logprobs


def encode(text: str) -> list[int]:
    return list(text.encode())


def prompt_ids(a: int, b: int, task_module=task) -> list[int]:
    """The prompt's tokens: the task's own ``prompt_tokens`` (a rendered chat prompt), else its text's bytes."""
    if hasattr(task_module, "prompt_tokens"):
        return task_module.prompt_tokens(a, b)
    return encode(task_module.prompt(a, b))


def teacher(a: int, b: int, task_module=task) -> tuple[list[int], list[int]]:
    """A correct response and its loss mask: the task's own ``teacher`` (tool output masked), else the answer."""
    if hasattr(task_module, "teacher"):
        return task_module.teacher(a, b)
    answer = encode(task_module.answer(a, b)) + [ByteTokenizer.EOS]
    return answer, [1] * len(answer)


def warm_up(
    model,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    task_module=task,
    progress=None,
    every=100,
) -> float:
    """Train ``model`` in place on ``steps`` batches of correct responses; returns the last batch's loss.

    ``progress(step, loss)``: called every ``every`` steps and after the last (a long warm-up says how far it is)."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(1, steps + 1):
        batch = [rng.choice(task_module.pairs()) for _ in range(batch_size)]
        prompts = [prompt_ids(a, b, task_module) for a, b in batch]
        taught = [teacher(a, b, task_module) for a, b in batch]
        logprobs, mask = response_logprobs(model, prompts, [t for t, _ in taught])
        mask = mask * _pad_mask([m for _, m in taught], mask.shape[1]).to(mask.device)
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if progress is not None and (step % every == 0 or step == steps):
            progress(step, loss.item())
    model.eval()
    return loss.item()


def warm_up_task(
    model, *, steps, batch_size, seed, task_module, lr=1e-3, log=print, progress=None, every=100, first=True
) -> float:
    """``warm_up`` on ``task_module``, after its ``FIRST_WARMUP`` (a simpler task it builds on) when it has one
    and ``first``."""
    first = getattr(task_module, "FIRST_WARMUP", None) if first else None
    if first is not None:
        warm_up(model, steps=first["steps"], batch_size=first["batch_size"], seed=seed, task_module=first["task"])
        log(f"warm-up: {first['steps']} steps of {first['task'].__name__.rsplit('.', 1)[-1]} first")
    return warm_up(
        model,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        task_module=task_module,
        progress=progress,
        every=every,
    )


def _pad_mask(masks: list[list[int]], width: int) -> torch.Tensor:
    out = torch.zeros((len(masks), width))
    for i, m in enumerate(masks):
        out[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return out


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Responses sampled at temperature 1.0, each ending at EOS (included) or after ``max_new_tokens``.

    A plain loop with no KV cache: the trainer uses it only to report the warm-up's accuracy.
    Prompts must have one length (the task's all do).
    """
    assert len({len(p) for p in prompts}) == 1, "prompts of one length only"
    tokens = torch.tensor(prompts, dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        probs = torch.softmax(model(input_ids=tokens).logits[:, -1].float(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        for row in (~done).nonzero().flatten().tolist():
            out[row].append(nxt[row, 0].item())
        done |= nxt[:, 0] == ByteTokenizer.EOS
        if done.all():
            break
        tokens = torch.cat([tokens, nxt], dim=1)
    return out


def evaluate(model, *, samples_per_pair: int = 4, max_new_tokens: int = 16, seed: int = 0) -> dict:
    """Sampled accuracy (mean reward) and format rate (a closed ``\\boxed{}`` then EOS) over every pair."""
    generator = torch.Generator().manual_seed(seed)
    pairs = task.pairs() * samples_per_pair
    responses = sample(model, [encode(task.prompt(a, b)) for a, b in pairs], max_new_tokens, generator)
    rewards, formatted = [], []
    for (a, b), response in zip(pairs, responses, strict=True):
        text = bytes(t for t in response if t < 256).decode(errors="replace")
        rewards.append(task.reward(text, a + b))
        formatted.append(response[-1:] == [ByteTokenizer.EOS] and text.startswith("\\boxed{") and text.endswith("}"))
    return {"reward": sum(rewards) / len(rewards), "format": sum(formatted) / len(formatted)}


@torch.no_grad()
def call_accuracy(model, *, task_module, n: int = 64, seed: int = 1, whole: bool = False) -> float:
    """The fraction of ``n`` random pairs whose first trained span (the tool call) greedy decoding writes exactly;
    with ``whole``, every trained span (the call and the answer after the tool's result).

    Teacher-forced: one forward pass over prompt + teacher response; a span is right when the argmax at every
    one of its positions is the teacher's token, which is what greedy decoding would then write.
    """
    rng = random.Random(seed)
    batch = [rng.choice(task_module.pairs()) for _ in range(n)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    right = 0
    for a, b in batch:
        prompt = prompt_ids(a, b, task_module)
        tokens, mask = teacher(a, b, task_module)
        end = len(mask) if whole else next((i for i, m in enumerate(mask) if m == 0), len(mask))
        ids = torch.tensor([prompt + tokens[:end]], dtype=torch.long, device=device)
        predicted = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        right += all(p == t for p, t, m in zip(predicted, tokens[:end], mask[:end], strict=True) if m)
    model.train(was_training)
    return right / n
