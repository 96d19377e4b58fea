#!/usr/bin/env python3
"""The rollfleet demo: a coordinator, two agents with sim engines, and a trainer loop.

Everything is real: separate processes, ZeroMQ on loopback, LMDB files, HTTP
to the sim engines (which speak SGLang's API). The trainer pulls batches
with ``RolloutClient`` and prints per-batch metrics, including what the
dynamic filter dropped.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.demo_data import write_arithmetic_dataset  # noqa: E402
from coordinator.client import RolloutClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16, help="groups per batch")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="where data dirs and logs go (default: a temp dir)")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rollfleet-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    dataset = write_arithmetic_dataset(work / "arithmetic.jsonl", 2000)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        log = open(work / f"{name}.log", "wb")
        logs.append(log)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        procs.append(proc)
        return proc

    print(f"rollfleet demo: work dir {work}")
    try:
        spawn(
            "coordinator",
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "serve",
                "--dataset",
                str(dataset),
                "--data-dir",
                str(work / "coordinator"),
                "--bind",
                address,
                "--rollout-batch-size",
                str(args.batch_size),
                "--n-samples-per-prompt",
                str(args.samples),
                "--max-new-tokens",
                "256",
                "--reward",
                "math",
                "--dynamic-filter",
                "nonzero_std",
            ],
        )
        for i in range(args.agents):
            spawn(
                f"agent-{i}",
                [
                    sys.executable,
                    "-m",
                    "agent.cli",
                    "join",
                    "--coordinator",
                    address,
                    "--data-dir",
                    str(work / f"agent-{i}"),
                    "--agent-id",
                    f"node-{i}",
                    "--engine",
                    "sim",
                    "--engines",
                    "1",
                    "--concurrency",
                    "64",
                    "--sim-args",
                    f"--token-latency-ms 0.5 --output-len-median 160 --seed {i}",
                ],
            )
        print(f"started coordinator at {address} and {args.agents} agents (1 sim engine each); logs in {work}")
        with RolloutClient(address, timeout=120) as client:
            totals = {"groups": 0, "samples": 0, "dropped": 0}
            started = time.monotonic()
            for step in range(args.batches):
                t0 = time.monotonic()
                batch = client.generate(step)
                dt = time.monotonic() - t0
                m = batch.metrics
                drops = {k.rsplit("/", 1)[1]: int(v) for k, v in m.items() if "/drop_" in k}
                totals["groups"] += len(batch.groups)
                totals["samples"] += len(batch.samples)
                totals["dropped"] += int(m["rollout/dynamic_filter/dropped_groups"])
                nodes = sorted({g.agent_id for g in batch.groups})
                print(
                    f"{bar(step + 1, args.batches)} batch {step}: {len(batch.groups)} groups from {nodes} in {dt:.2f}s"
                )
                print(
                    f"    reward_mean={m['rollout/reward_mean']:.3f} "
                    f"response_len_mean={m['rollout/response_len_mean']:.0f} "
                    f"truncated={m['rollout/truncated_ratio']:.2f} "
                    f"dropped_groups={int(m['rollout/dynamic_filter/dropped_groups'])} "
                    f"dropped_ratio={m['rollout/dynamic_filter/dropped_ratio']:.2f} {drops}"
                )
            elapsed = time.monotonic() - started
            print(
                f"done: {args.batches} batches, {totals['groups']} groups, {totals['samples']} samples, "
                f"{totals['dropped']} groups dropped by the filter, {totals['samples'] / elapsed:.0f} samples/s"
            )
        return 0
    except Exception as exc:
        print(f"demo failed: {exc}; see the logs in {work}", file=sys.stderr)
        for proc, log in zip(procs, logs, strict=False):
            if proc.poll() is not None:
                print(
                    f"--- {log.name} (exited {proc.returncode}) ---\n" + Path(log.name).read_text()[-2000:],
                    file=sys.stderr,
                )
        return 1
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
