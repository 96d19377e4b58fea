#!/usr/bin/env python3
"""Long chaos runs: random SIGKILLs of agents, engines, the coordinator and the trainer.

    python scripts/chaos.py --batches 200 --seeds 1 2 3

Each run prints the actions taken and the invariant checks (no prompt
consumed twice, nothing committed lost, every prompt accounted for) and
exits non-zero if any run broke one.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.chaos import run_chaos  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    failed = 0
    for seed in args.seeds:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="rollfleet-chaos-")) / f"seed{seed}"
        work.mkdir(parents=True, exist_ok=True)
        report = run_chaos(work, batches=args.batches, agents=args.agents, seed=seed, log=lambda m: print(m, file=sys.stderr))
        ok = not report.problems
        failed += not ok
        print(json.dumps({"seed": seed, "ok": ok, "batches": report.batches, "actions": len(report.actions),
                          "duplicated": report.duplicated, "lost": report.lost, "replay_mismatches": report.replay_mismatches,
                          "unaccounted_prompts": report.unaccounted_prompts, "replaced_groups": report.replaced_groups,
                          "problems": report.problems[:20], "workdir": str(work)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
