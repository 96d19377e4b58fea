"""The example's figure: mean reward and the trainer/engine logprob difference against step."""

from __future__ import annotations

import json
import math
from pathlib import Path


def load_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(history: list[dict], path: str | Path, *, title: str = "GRPO on single-digit addition") -> Path:
    """Write a PNG: reward (left axis) and ``train/rollout_logprob_abs_diff`` (right axis, log scale)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    diff = [h["train/rollout_logprob_abs_diff"] for h in history]
    fig, (ax_reward, ax_diff) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[3, 2])
    ax_reward.plot(steps, [h["reward"] for h in history], color="tab:blue", label="mean reward (batch)")
    evals = {h["eval_after_step"]: h["eval_reward"] for h in history if "eval_reward" in h}
    if evals:  # client.evaluate passes: greedy accuracy on the weights after that step (-1: before training)
        points = sorted(evals.items())
        ax_reward.plot(
            [s + 1 for s, _ in points], [r for _, r in points], color="tab:green", marker="o", label="greedy eval"
        )
        sampled = sorted({h["eval_after_step"]: h["eval_pass@1"] for h in history if "eval_pass@1" in h}.items())
        if sampled:
            ax_reward.plot(
                [s + 1 for s, _ in sampled], [r for _, r in sampled], color="tab:orange", marker="s",
                label="eval pass@1 (4 samples, T=1)",
            )  # fmt: skip
        ax_reward.legend(loc="lower right", bbox_to_anchor=(1.0, 0.1))
    ax_reward.set_ylabel("mean reward")
    ax_reward.set_ylim(0, 1.02)
    ax_reward.axhline(0.8, color="grey", linestyle=":", linewidth=1)
    ax_reward.grid(alpha=0.3)
    ax_reward.set_title(title)
    if history and "elapsed_s" in history[-1]:
        ax_reward.text(
            0.99, 0.03, f"{history[-1]['elapsed_s'] / 60:.1f} min of RL", transform=ax_reward.transAxes, ha="right"
        )
    ax_diff.semilogy(
        [s for s, d in zip(steps, diff, strict=True) if not math.isnan(d)],
        [d for d in diff if not math.isnan(d)],
        color="tab:red",
        marker=".",
        linestyle="none",
    )
    ax_diff.axhline(1e-3, color="grey", linestyle=":", linewidth=1)
    ax_diff.set_ylabel("|logprob trainer - engine|")
    ax_diff.set_xlabel("step (one batch, one optimizer step, one weight push)")
    ax_diff.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m examples.grpo.plot METRICS.jsonl OUT.png")
    print(plot(load_metrics(sys.argv[1]), sys.argv[2]))
