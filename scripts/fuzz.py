"""Fuzz a running cluster: N malformed and random frames at the coordinator and at an agent's payload endpoint.

    .venv/bin/python scripts/fuzz.py                    # 100,000 frames per target, keys off then keys on
    .venv/bin/python scripts/fuzz.py --frames 3000 --modes keys

Each mode starts a fresh loopback cluster (coordinator, two sim agents, a trainer), pulls two
batches, fuzzes (keys on: with the trainer's key, then with a key the fleet does not know), and
checks that no process died, no log holds a Traceback and the next batches are complete and unique
(harness/fuzz.py). Progress goes to stderr; the summary, one JSON object per mode, to stdout.
Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.cluster import Cluster  # noqa: E402
from harness.fuzz import campaign  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=100_000, help="fuzz messages per target and key (100000)")
    ap.add_argument("--modes", nargs="+", choices=("plain", "keys"), default=["plain", "keys"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, default=4, help="batches pulled and checked after fuzzing")
    ap.add_argument("--work-dir", default=None, help="where the clusters' logs go (default: a temp dir, kept)")
    args = ap.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rollfleet-fuzz-"))
    print(f"fuzz: logs in {work}", file=sys.stderr)
    failed = False
    for mode in args.modes:
        keyed = mode == "keys"
        agents = ("agent-0", "agent-1") if keyed else ()
        cluster = Cluster(work / mode, curve_agents=agents, curve_trainers=("trainer",) if keyed else ())

        def progress(done, r, mode=mode):
            if done % 10_000 == 0 or done == args.frames:
                seen = (
                    f"{r.handshakes_refused} handshakes refused"
                    if r.handshakes_refused
                    else (f"{r.probes_answered} probes answered")
                )
                print(f"  [{mode}] {r.target}: {done}/{args.frames} frames, {seen}", file=sys.stderr, flush=True)

        try:
            summary = campaign(cluster, args.frames, keyed=keyed, seed=args.seed, batches=args.batches,
                               progress=progress)  # fmt: skip
            summary["ok"] = True
        except AssertionError as exc:
            failed = True
            summary = {"mode": mode, "ok": False, "error": str(exc)[:3000]}
        finally:
            leaks = cluster.stop_all()
        summary["leaks"] = leaks
        failed |= bool(leaks)
        print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
