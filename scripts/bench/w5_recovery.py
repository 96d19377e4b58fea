#!/usr/bin/env python3
"""W5 — recovery: how fast rollfleet heals, and that healing loses and duplicates nothing.

A cluster (coordinator, 2 agents with one sim engine each) serves a trainer
process that pulls batches throughout. The bench then, in order:

- SIGKILLs an agent mid-rollout: ``release_s`` is the time until the
  coordinator has taken back all its leases (they are reissued to the other
  agent). Reported with the configured TTL, which bounds it from below;
- SIGKILLs the coordinator and starts it again on the same data dir:
  ``first_batch_s`` is the time from the restart until the trainer's
  in-flight ``generate`` call returns its batch;
- SIGKILLs one engine: ``engine_back_s`` is the time until the supervisor has
  it healthy again and the coordinator sees the agent's capacity restored.

At the end the consumed stream, the ledger and the agents' stores are checked
as in the chaos suite: ``lost`` and ``duplicated`` must be 0.
Output: one JSON object per line; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.chaos import ChaosReport, _read_consumed, check  # noqa: E402
from harness.cluster import Cluster  # noqa: E402
from harness.polling import wait_for  # noqa: E402


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": "W5", "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def say(msg: str) -> None:
    print(f"[w5] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of each event (under a minute)")
    ap.add_argument("--rounds", type=int, default=3, help="repetitions of each event (default mode)")
    ap.add_argument("--ttl", type=float, default=2.0, help="agent TTL given to the coordinator")
    ap.add_argument("--heartbeat", type=float, default=0.5)
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds

    work = Path(tempfile.mkdtemp(prefix="rollfleet-w5-"))
    cluster = Cluster(work, rows=5000, rollout_batch_size=8, n_samples_per_prompt=4, max_new_tokens=64)
    consumed = work / "consumed.jsonl"
    ckpt = work / "checkpoint.json"
    sim = "--token-latency-ms 2 --output-len-median 32 --output-len-max 64"
    batches = 10_000
    trainer = None
    release, first_batch, engine_back = [], [], []
    coord_args = ("--heartbeat-interval", str(args.heartbeat), "--agent-ttl", str(args.ttl), "--retire-after", "600")
    try:
        cluster.start_coordinator(*coord_args)
        for name in ("agent-0", "agent-1"):
            cluster.start_agent(name, concurrency=32, sim_args=sim)
        trainer_log = open(work / "trainer.log", "ab")
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness.chaos_trainer",
                "--coordinator",
                cluster.address,
                "--batches",
                str(batches),
                "--consumed",
                str(consumed),
                "--checkpoint",
                str(ckpt),
                "--checkpoint-every",
                "1000000",
            ],
            stdout=trainer_log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )

        def n_consumed() -> int:
            return len(_read_consumed(consumed))

        wait_for(lambda: n_consumed() >= 3, 60, "the trainer's first batches")
        for r in range(rounds):
            # 1. agent SIGKILL -> leases released
            victim = "agent-1"
            wait_for(lambda: cluster.stats()["agents"][victim]["leases"] > 0, 30, f"{victim} to hold leases")
            cluster.agents[victim].signal(signal.SIGKILL)
            t0 = time.monotonic()
            cluster.agents[victim].wait(10)
            wait_for(
                lambda: (lambda a: a["status"] != "alive" and a["leases"] == 0)(cluster.stats()["agents"][victim]),
                60,
                "leases to be released",
                interval=0.02,
            )
            release.append(time.monotonic() - t0)
            say(f"round {r}: release_s={release[-1]:.2f} (ttl {args.ttl})")
            cluster.start_agent(victim, concurrency=32, sim_args=sim)

            # 2. coordinator SIGKILL + restart -> first batch
            before = n_consumed()
            wait_for(lambda: n_consumed() > before, 60, "a batch before the coordinator kill")
            cluster.coordinator.signal(signal.SIGKILL)
            cluster.coordinator.wait(10)
            settled = n_consumed()
            t0 = time.monotonic()
            cluster.start_coordinator(*coord_args)
            wait_for(lambda: n_consumed() > settled, 120, "the first batch after the restart", interval=0.01)
            first_batch.append(time.monotonic() - t0)
            say(f"round {r}: first_batch_s={first_batch[-1]:.2f}")

            # 3. engine SIGKILL -> back to healthy with capacity restored
            name = "agent-0"
            wait_for(
                lambda: (
                    cluster.stats()["agents"][name]["capacity"] > 0
                    and cluster.stats()["agents"][name]["status"] == "alive"
                ),
                60,
                "agent-0 ready",
            )
            pid = cluster.engine_pids_of(name)[-1]
            capacity = cluster.stats()["agents"][name]["capacity"]
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()

            def back() -> bool:
                a = cluster.stats()["agents"][name]
                return (
                    len(cluster.engine_pids_of(name)) > 0
                    and cluster.engine_pids_of(name)[-1] != pid
                    and a["capacity"] == capacity
                    and all(e.get("state") == "healthy" for e in a["engines"])
                )

            wait_for(back, 120, "the engine to come back", interval=0.02)
            engine_back.append(time.monotonic() - t0)
            say(f"round {r}: engine_back_s={engine_back[-1]:.2f}")
        done = n_consumed()
        wait_for(lambda: n_consumed() >= done + 2, 60, "batches after the last event")
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
        cluster.stop_all()

    report = ChaosReport()
    records = _read_consumed(consumed)
    check(report, cluster, consumed, ["agent-0", "agent-1"], batches=len({r["rid"] for r in records}))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    emit(
        "release_s",
        round(med(release), 3),
        "s",
        ttl_s=args.ttl,
        ratio_to_ttl=round(med(release) / args.ttl, 3),
        samples=[round(x, 3) for x in release],
    )
    emit("first_batch_s", round(med(first_batch), 3), "s", samples=[round(x, 3) for x in first_batch])
    emit("engine_back_s", round(med(engine_back), 3), "s", samples=[round(x, 3) for x in engine_back])
    emit("lost", report.lost, "groups")
    emit("duplicated", report.duplicated, "groups", batches=report.batches, problems=report.problems[:10])
    return 0 if report.lost == 0 and report.duplicated == 0 and not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
