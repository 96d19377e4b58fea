"""A trainer process for the chaos suite: pulls batches, logs what it consumed, checkpoints.

Run as its own process so the chaos driver can SIGKILL it. It appends one
JSON line per consumed batch to ``--consumed`` (fsynced before the next
pull), and every ``--checkpoint-every`` batches pauses with drain, takes
``state_dict()``, writes it atomically to ``--checkpoint`` and resumes. With
``--resume`` it loads that checkpoint first and continues after it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from coordinator.client import RolloutClient
from harness.chaos_check import batch_record


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--batches", type=int, required=True, help="stop after this rollout id")
    ap.add_argument("--consumed", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--fetch-timeout",
        type=float,
        default=5.0,
        help="give up on a silent node this soon and ask the coordinator again (a lost node's "
        "groups are replaced once it is retired)",
    )
    args = ap.parse_args()

    ckpt = Path(args.checkpoint)
    client = RolloutClient(args.coordinator, retry_interval=0.5, fetch_timeout=args.fetch_timeout)
    with client, open(args.consumed, "a") as log:
        start = 0
        if args.resume and ckpt.exists():
            state = json.loads(ckpt.read_text())
            client.load_state_dict(state)
            start = state["rollout_id"] + 1
            print(f"resumed at rollout {start}", flush=True)
        for rid in range(start, args.batches):
            batch = client.generate(rid)
            record = batch_record(batch, "resumed" if args.resume else "first")
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
            print(f"consumed {rid}", flush=True)
            if (rid + 1) % args.checkpoint_every == 0:
                client.pause(drain=True)
                state = client.state_dict()
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                os.replace(tmp, ckpt)
                client.resume()
                print(f"checkpoint at {rid}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
