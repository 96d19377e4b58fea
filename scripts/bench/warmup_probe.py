"""How many supervised warm-up steps a task's model needs before it writes its tool calls right.

Prints, every ``--every`` steps of the GRPO example's own warm-up (``examples/grpo/warmup.py``), the loss and
``call_accuracy``: the fraction of 64 pairs whose tool call greedy decoding writes exactly. It chose the
example's warm-up for ``--task openai-calculator``::

    python -m scripts.bench.warmup_probe --task openai-calculator --steps 1500 --batch-size 8
    python -m scripts.bench.warmup_probe --task openai-calculator --steps 1500 --batch-size 8 --no-first
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from agent.hf.model import load_model, make_model
    from examples.grpo.run import task_module
    from examples.grpo.warmup import call_accuracy, warm_up_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="openai-calculator", choices=("calculator", "openai-calculator"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-first", action="store_true", help="skip the task's FIRST_WARMUP (openai-calculator: calculator first)"
    )
    args = ap.parse_args()
    module = task_module(args.task)
    for lr in args.lr:
        with tempfile.TemporaryDirectory() as tmp:
            make_model(tmp, preset=args.preset, seed=args.seed)
            model, _ = load_model(tmp)
        model.to(args.device)
        t0 = time.monotonic()

        def progress(step: int, loss: float, lr=lr, model=model, t0=t0) -> None:
            right = call_accuracy(model, task_module=module)
            whole = call_accuracy(model, task_module=module, whole=True)
            print(
                f"preset {args.preset} lr {lr:g} batch {args.batch_size} step {step}: loss {loss:.4f}, "
                f"calls right {right:.2f}, whole answers right {whole:.2f}, {time.monotonic() - t0:.0f}s",
                flush=True,
            )

        warm_up_task(
            model,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=lr,
            seed=args.seed,
            task_module=module,
            log=lambda line, t0=t0: print(f"{line}, {time.monotonic() - t0:.0f}s", flush=True),
            progress=progress,
            every=args.every,
            first=not args.no_first,
        )


if __name__ == "__main__":
    main()
