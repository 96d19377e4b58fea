"""The task: single-digit addition, answered as ``\\boxed{sum}``.

A prompt is ``"3+4="`` (four byte tokens); the answer the reward wants is ``"\\boxed{7}"``
followed by EOS. The coordinator's built-in ``exact`` reward scores it: 1.0 when the last
complete ``\\boxed{}`` holds the label (or the whole response is the label), else 0.0, so the
example needs no custom reward on the agents. (``math`` would also read a bare trailing number,
so ``\\boxed{7`` would score, and RL drifts to dropping the closing brace.) All 100 pairs
``(a, b)`` with ``0 <= a, b <= 9`` form the dataset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from common.rewards import exact_reward
from common.types import Sample

MAX_NEW_TOKENS = 16
WARMUP_STEPS = 90
WARMUP_BATCH_SIZE = 32
BATCH_SIZE = 64
LR = 3e-4


def pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return f"\\boxed{{{a + b}}}"


def rows() -> list[dict]:
    """The dataset rows: ``{"prompt": "3+4=", "label": 7}`` for every pair."""
    return [{"prompt": prompt(a, b), "label": a + b} for a, b in pairs()]


def write_dataset(path: str | Path, *, seed: int = 0) -> Path:
    """Write the rows as JSONL, shuffled once with ``seed`` (the coordinator reshuffles per epoch)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = rows()
    random.Random(seed).shuffle(data)
    path.write_text("".join(json.dumps(row) + "\n" for row in data))
    return path


def reward(text: str, label: int) -> float:
    """The score the agents give a response (``--reward exact``), for evaluating the warm-up locally."""
    sample = Sample([], [], [], [], 0.0, "completed", "", label=label, response_text=text)
    return exact_reward(sample)
