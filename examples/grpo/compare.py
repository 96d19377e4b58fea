"""Several GRPO runs in one figure: reward against step and against wall time, mismatch KL against step.

    .venv/bin/python -m examples.grpo.compare OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each ``RUN_DIR`` is an ``examples.grpo.run --out`` directory (its ``metrics.jsonl``). The KL is
``correction/kl_k3``, the k3 estimate of ``KL(rollout || trainer)`` per token: how far the policy
being trained has moved from the weights that generated its batch (staleness) plus the
engine/trainer numeric mismatch. A summary line per run is printed: first step with a reward of
0.8 or more (and its wall time), the final reward, the mean and largest KL.
"""

from __future__ import annotations

import sys
from pathlib import Path

from examples.grpo.plot import load_metrics


def summary(label: str, history: list[dict]) -> str:
    reached = next((h for h in history if h["reward"] >= 0.8), None)
    kl = [h["correction/kl_k3"] for h in history]
    first = f"step {reached['step']} ({reached['elapsed_s']:.0f}s)" if reached else "never"
    last3 = sum(h["reward"] for h in history[-3:]) / len(history[-3:])
    by_staleness: dict[int, list[float]] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("correction/staleness_") and key.endswith("/kl_k3"):
                by_staleness.setdefault(int(key.split("/")[1].removeprefix("staleness_")), []).append(value)
    per = ", ".join(f"{s}: {sum(v) / len(v):.1e}" for s, v in sorted(by_staleness.items()))
    return (
        f"{label}: {len(history)} steps in {history[-1]['elapsed_s']:.0f}s; reward {history[0]['reward']:.2f} -> "
        f"{history[-1]['reward']:.2f} (mean of the last 3: {last3:.2f}); first >= 0.8: {first}; "
        f"KL k3 mean {sum(kl) / len(kl):.2e}, max {max(kl):.2e}; mean KL k3 by staleness {per}"
    )


def smooth(values: list[float], window: int = 5) -> list[float]:
    """Trailing mean over ``window`` steps (the batch mean reward is noisy)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def compare(runs: dict[str, list[dict]], path: str | Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time, ax_kl) = plt.subplots(1, 3, figsize=(15, 4.4))
    for label, history in runs.items():
        steps = [h["step"] for h in history]
        reward = smooth([h["reward"] for h in history])
        (line,) = ax_step.plot(steps, reward, label=label)
        ax_time.plot([h["elapsed_s"] for h in history], reward, color=line.get_color(), label=label)
        # Step 0 is on policy (KL ~1e-14, the engine/trainer numeric mismatch): floored at 1e-6 to keep the scale.
        ax_kl.semilogy(steps, [max(h["correction/kl_k3"], 1e-6) for h in history], color=line.get_color(), label=label)
    for ax in (ax_step, ax_time):
        ax.set_ylabel("mean reward (5-step trailing mean)")
        ax.set_ylim(0, 1.02)
        ax.axhline(0.8, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("seconds of training")
    ax_kl.set_xlabel("step")
    ax_kl.set_ylabel("KL(rollout || trainer), k3 per token")
    ax_kl.set_ylim(bottom=1e-6)
    ax_kl.grid(alpha=0.3)
    ax_step.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    runs = {}
    for arg in argv[1:]:
        label, run_dir = arg.split("=", 1)
        runs[label] = load_metrics(Path(run_dir) / "metrics.jsonl")
        print(summary(label, runs[label]))
    print(compare(runs, argv[0], title="GRPO on single-digit addition, 2 CPU cores, seed 0"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
