"""Synthetic arithmetic prompts for the demo, tests and benchmarks.

The sim engine recognises ``a + b`` style questions and answers them right
part of the time, so the ``math`` reward gets a realistic spread.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def arithmetic_rows(n: int, *, seed: int = 0, prompt_bytes: int | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = f"Question {i}: what is {a} {op} {b}? Put the answer in \\boxed{{}}."
        if prompt_bytes is not None:
            # Pad at the front so the question stays last (the sim engine reads the last expression).
            filler = "Think step by step. " * (prompt_bytes // 20 + 1)
            prompt = (
                (filler[: max(0, prompt_bytes - len(prompt))] + prompt)[-prompt_bytes:]
                if len(prompt) < prompt_bytes
                else prompt
            )
        rows.append({"prompt": prompt, "label": answer, "source": "arithmetic"})
    return rows


def write_arithmetic_dataset(path: str | Path, n: int, *, seed: int = 0, prompt_bytes: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in arithmetic_rows(n, seed=seed, prompt_bytes=prompt_bytes):
            f.write(json.dumps(row) + "\n")
    return path
