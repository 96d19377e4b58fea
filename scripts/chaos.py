#!/usr/bin/env python3
"""Long chaos runs: every failure kind while batches flow, then the invariants of a quiesced fleet.

    python scripts/chaos.py --batches 200 --seeds 1 2 3

Each run SIGKILLs agents, engines, the coordinator and the trainer, partitions
an agent's coordinator link past its TTL and loses a node for good (each at
least once) while the trainer pushes a weight update every ``--weights-every``
batches (disk and gloo broadcast in turn), then checks the consumed stream, the
coordinator's prompt accounting, its ledger, every agent's store and every
serving engine's weight version (``harness/chaos_check.py``). It prints one
JSON summary line per seed (failures caused by kind, lost, duplicated,
unaccounted, weight updates by outcome, the first problems) and exits non-zero
if any run missed a failure kind or broke an invariant.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.chaos import run_chaos  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=120)
    ap.add_argument("--agents", type=int, default=3, help="at least 3: one behind the proxy, one lost for good")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--weights-every", type=int, default=3, help="a weight update every K batches (0: none)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--generate",
        default="harness.generate_fns:chaos_turns",
        help="generate function for every sample (default: two turns with a tool's tokens between, half of the "
        "samples through the OpenAI client; '' for one call)",
    )
    ap.add_argument("--evaluate-every", type=int, default=10, help="an evaluation pass every K batches (0: none)")
    ap.add_argument(
        "--gateways",
        type=int,
        default=2,
        help="coordinator serve --gateways; one of them is SIGKILLed as a failure kind (0: none, no such kind)",
    )
    args = ap.parse_args()
    failed = 0
    for seed in args.seeds:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="rollfleet-chaos-")) / f"seed{seed}"
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        report = run_chaos(
            work,
            batches=args.batches,
            agents=args.agents,
            seed=seed,
            weights_every=args.weights_every,
            generate=args.generate,
            evaluate_every=args.evaluate_every,
            gateways=args.gateways,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
        ok = not report.problems
        failed += not ok
        summary = {
            "seed": seed,
            "ok": ok,
            "seconds": round(time.monotonic() - started, 1),
            "batches": report.batches,
            "extra_batches": report.extra_batches,
            "kills": {kind: report.kills[kind] for kind in report.kinds},
            "lost": report.lost,
            "duplicated": report.duplicated,
            "unaccounted": report.unaccounted_prompts,
            "replay_mismatches": report.replay_mismatches,
            "replaced_groups": report.replaced_groups,
            "tool_samples": report.tool_samples,
            "evaluations": report.evaluations,
            "weight_updates": report.weight_updates,
            "problems": report.problems[:20],
            "workdir": str(work),
        }
        print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
