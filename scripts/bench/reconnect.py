#!/usr/bin/env python3
"""Reconnect time after a silent partition heals (issue 22), on real packets (harness/netfault.py).

For each outage length, a fresh fleet (CurveZMQ on, ``--heartbeat-interval 0.5 --agent-ttl 2
--retire-after 60``, two agents, a trainer pulling batches) and these measurements, each
``--reps`` times:

    agent     a0 fully partitioned; seconds from the heal until the coordinator has heard a0 since
              the heal, alive and holding leases (what test_netfault.py bounds by 2 s)
    payload   only a0's payload endpoint partitioned (the coordinator still hears a0), the trainer's
              fetch_deadline longer than the outage: seconds from the heal until the trainer's next
              batch arrives (its fetch from a0 went through again)

The trainer's own link to the coordinator is not partitioned here: the harness puts agents behind
the router, and the trainer runs beside the coordinator in the root namespace.

    sudo .venv/bin/python scripts/bench/reconnect.py --outages 1 6 15 40 --reps 3

Needs root, iproute2 and nftables. Prints a table (p50 / p99 / max per outage and kind).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from harness.cluster import Cluster  # noqa: E402
from harness.netfault import NetFault, unavailable  # noqa: E402
from harness.polling import wait_for  # noqa: E402

SIM = "--token-latency-ms 5 --output-len-dist fixed --output-len-median 32"
LIVENESS = ("--heartbeat-interval", "0.5", "--agent-ttl", "2", "--retire-after", "60")
AGENTS = ("a0", "a1")
PAYLOAD_PORT = 7100


class Puller:
    """Pulls batches on a thread; records when each one arrived."""

    def __init__(self, client):
        self.client, self.arrivals, self.error = client, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        rollout_id = 0
        try:
            while not self._stop.is_set():
                self.client.generate(rollout_id)
                self.arrivals.append(time.monotonic())
                rollout_id += 1
        except BaseException as exc:
            self.error = exc

    def stop(self):
        self._stop.set()
        self._thread.join(180)


def fleet(net: NetFault, tmp: Path) -> Cluster:
    cluster = Cluster(
        tmp,
        host=net.coordinator_host,
        rows=4000,
        curve_agents=AGENTS,
        curve_trainers=("trainer",),
        dynamic_filter="none",
        rollout_batch_size=4,
        prefetch=8,
    )
    cluster.start_coordinator(*LIVENESS)
    for i, name in enumerate(AGENTS):
        cluster.start_agent(
            name,
            "--payload-bind",
            f"tcp://{net.agent_host(i)}:{PAYLOAD_PORT}",
            concurrency=16,
            sim_args=SIM,
            wrap=lambda argv, i=i: net.agent_argv(i, argv),
        )
    return cluster


def measure_agent(net, cluster, watch, puller, seconds: float) -> float:
    wait_for(lambda: len(puller.arrivals) >= 2, 60, "two batches first")
    net.partition(0)
    time.sleep(seconds)
    net.heal(0)
    healed = time.monotonic()

    def back():
        asked = time.monotonic()
        entry = watch.stats()["agents"]["a0"]
        return entry["status"] == "alive" and asked - entry["silent_s"] > healed and entry["leases"] > 0

    wait_for(back, 60, "a0 back")
    return time.monotonic() - healed


def measure_payload(net, puller, seconds: float) -> float:
    n = len(puller.arrivals)
    wait_for(lambda: len(puller.arrivals) >= n + 2, 60, "two batches first")
    net.partition(0, port=PAYLOAD_PORT)
    time.sleep(seconds)
    before = len(puller.arrivals)
    net.heal(0)
    healed = time.monotonic()
    # The next batch that arrives after the heal; a batch may have come from a1 alone meanwhile.
    wait_for(lambda: any(t > healed for t in puller.arrivals[before:]), 120, "a batch after the heal")
    return min(t for t in puller.arrivals[before:] if t > healed) - healed


def run(kind: str, seconds: float, tmp: Path) -> float:
    with NetFault.create(agents=len(AGENTS)) as net:
        cluster = fleet(net, tmp)
        try:
            watch = cluster.client(attach=False, timeout=10)
            # fetch_deadline beyond the outage: the fetch waits for a0 instead of replacing its groups.
            trainer = cluster.client(timeout=300, fetch_timeout=3, fetch_deadline=seconds + 60)
            puller = Puller(trainer)
            try:
                if kind == "agent":
                    return measure_agent(net, cluster, watch, puller, seconds)
                return measure_payload(net, puller, seconds)
            finally:
                puller.stop()
        finally:
            cluster.stop_all()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outages", type=float, nargs="+", default=[1, 6, 15, 40])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["agent", "payload"], choices=["agent", "payload"])
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"reconnect bench: {why}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="rf-reconnect-") as tmp:
        for seconds in args.outages:
            for kind in args.kinds:
                got = []
                for rep in range(args.reps):
                    got.append(run(kind, seconds, Path(tmp) / f"{kind}-{seconds}-{rep}"))
                    print(f"  {kind} {seconds:g}s rep {rep}: {got[-1]:.2f}s", flush=True)
                rows.append((kind, seconds, got))
    print()
    print("| link | outage s | runs | p50 s | p99 s | max s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind, seconds, got in rows:
        med = statistics.median(got)
        print(f"| {kind} | {seconds:g} | {len(got)} | {med:.2f} | {pct(got, 0.99):.2f} | {max(got):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
