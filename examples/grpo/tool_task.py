"""The calculator task: two-digit addition the model cannot do in its head, with a tool that can.

A prompt is ``"23+48="`` (``a, b`` in 10..59). A correct rollout calls the calculator with the
prompt's operands and copies its answer into ``\\boxed{}``::

    calc(23+48)=71\\boxed{71}<eos>      ("=71" is the tool's, loss mask 0)

so the reward (the built-in ``exact``) is earned only by using the tool right; a 1.8 M model
has no chance of adding two-digit numbers itself. The same interface as ``task.py`` (rows,
dataset, reward) plus what the warm-up trains on: ``teacher(a, b)`` -> (tokens, loss mask).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from common.tokenizer import ByteTokenizer
from examples.grpo.task import reward  # noqa: F401  (the same exact reward)
from examples.tools.calculator import tool_output

GENERATE = "examples.tools.calculator:rollout"
MAX_NEW_TOKENS = 32
WARMUP_STEPS = 75
WARMUP_BATCH_SIZE = 32
BATCH_SIZE = 64
LR = 3e-4


def pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10, 60) for b in range(10, 60)]


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def rows() -> list[dict]:
    return [{"prompt": prompt(a, b), "label": a + b} for a, b in pairs()]


def write_dataset(path: str | Path, *, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = rows()
    random.Random(seed).shuffle(data)
    path.write_text("".join(json.dumps(row) + "\n" for row in data))
    return path


def teacher(a: int, b: int) -> tuple[list[int], list[int]]:
    """The correct rollout's tokens and loss mask (the tool's output masked out, as in RL)."""
    call = f"calc({a}+{b})"
    result = tool_output(call)
    answer = f"\\boxed{{{a + b}}}"
    tokens = list(call.encode()) + list(result.encode()) + list(answer.encode()) + [ByteTokenizer.EOS]
    mask = [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
    return tokens, mask
