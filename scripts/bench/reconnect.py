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
    trainer   the trainer fully partitioned (its link to the coordinator and its fetches from both
              agents): seconds from the heal until its next batch arrives

For ``agent`` and ``payload`` the trainer is a thread of this process, beside the coordinator in the
root namespace. For ``trainer`` it is a process of its own (``reconnect.py _trainer``) in a host slot
of the harness after the agents', behind the router like them, printing each batch's wall-clock
arrival; this process reads them from its log.

    sudo .venv/bin/python scripts/bench/reconnect.py --outages 1 6 15 40 --reps 3

Needs root, iproute2 and nftables. Prints a line per run (with a0's registrations during the run,
the statuses the coordinator gave a0 during the outage and groups refused as duplicates) and a table
(p50 / p99 / max per outage and kind; with 3 runs p99 is the max).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from harness.cluster import Cluster, Proc  # noqa: E402
from harness.netfault import NetFault, NetFaultUnavailable, unavailable  # noqa: E402
from harness.polling import WaitAborted, wait_for  # noqa: E402

SIM = "--token-latency-ms 5 --output-len-dist fixed --output-len-median 32"
LIVENESS = ("--heartbeat-interval", "0.5", "--agent-ttl", "2", "--retire-after", "60")
AGENTS = ("a0", "a1")
PAYLOAD_PORT = 7100
TRAINER_SLOT = len(AGENTS)
"""The harness host slot (network namespace) the ``trainer`` kind runs its trainer in: the one after the agents'."""
KINDS = ("agent", "payload", "trainer")
MAX_BATCHES = 100_000
"""The trainer process's loop bound (it is stopped long before, with its fleet)."""
BATCH_LINE = re.compile(r"^batch (\d+) (\d+\.\d+)$", re.M)
REGISTERED = re.compile(r"registered \(session \w+")
REFUSED = re.compile(r"coordinator refused (?:group \S+ \(duplicate|\d+ recovered groups)")


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


def outage(net, slot: int, seconds: float, watch, port: int | None = None, trainer: Proc | None = None) -> tuple:
    """Partition ``slot`` (with ``port``: only TCP connections to that port) for ``seconds``, then heal.

    Returns the heal's times (monotonic, wall clock) and what the outage showed: the statuses the
    coordinator gave a0 meanwhile and the packets the partition dropped.
    """
    seen = set()
    net.partition(slot, port=port)
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:  # bounded by the outage; meanwhile, what the coordinator makes of a0
        try:
            seen.add(watch.stats().agents["a0"].status)
        except Exception as exc:  # the watch's own link is never partitioned: say so, do not stop the outage
            seen.add(f"status failed: {type(exc).__name__}")
        if trainer is not None and not trainer.alive():
            raise RuntimeError(f"the trainer process exited during the outage: {trainer.text()[-3000:]}")
        time.sleep(min(0.5, max(0.0, ends - time.monotonic())))
    shown = {"a0_statuses": sorted(seen), "dropped": net.dropped(slot)}
    net.heal(slot)
    return time.monotonic(), time.time(), shown


def measure_agent(net, cluster, watch, puller, seconds: float) -> tuple[float, dict]:
    wait_for(lambda: len(puller.arrivals) >= 2, 60, "two batches first")
    healed, _, shown = outage(net, 0, seconds, watch)

    def back():
        asked = time.monotonic()
        entry = watch.stats().agents["a0"]
        return entry.status == "alive" and asked - entry.silent_s > healed and entry.leases > 0

    wait_for(back, 60, "a0 back")
    return time.monotonic() - healed, shown


def measure_payload(net, watch, puller, seconds: float) -> tuple[float, dict]:
    n = len(puller.arrivals)
    wait_for(lambda: len(puller.arrivals) >= n + 2, 60, "two batches first")
    before = len(puller.arrivals)
    healed, _, shown = outage(net, 0, seconds, watch, port=PAYLOAD_PORT)
    # The next batch that arrives after the heal; a batch may have come from a1 alone meanwhile.
    wait_for(lambda: any(t > healed for t in puller.arrivals[before:]), 120, "a batch after the heal")
    return min(t for t in puller.arrivals[before:] if t > healed) - healed, shown


def batch_times(proc: Proc) -> list[float]:
    """Wall-clock arrivals the trainer process printed, in order; aborts the wait when it has exited."""
    times = [float(m.group(2)) for m in BATCH_LINE.finditer(proc.text())]
    if not proc.alive():
        raise WaitAborted(f"the trainer process exited: {proc.text()[-3000:]}")
    return times


def start_trainer(net, cluster, seconds: float) -> Proc:
    """The trainer as a process of its own inside harness slot TRAINER_SLOT, tracked (and stopped) by the cluster."""
    argv = [sys.executable, str(Path(__file__).resolve()), "_trainer", "--coordinator", cluster.address]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in cluster.client_keys().items()]
    argv += ["--fetch-deadline", str(seconds + 60)]
    proc = Proc("trainer", net.agent_argv(TRAINER_SLOT, argv), cluster.tmp / "trainer.log")
    cluster.procs.append(proc)  # stop_all ends it (SIGTERM to its process group, then SIGKILL)
    return proc


def measure_trainer(net, watch, proc: Proc, seconds: float) -> tuple[float, dict]:
    wait_for(lambda: len(batch_times(proc)) >= 2, 120, "the trainer process's first two batches")
    _, healed, shown = outage(net, TRAINER_SLOT, seconds, watch, trainer=proc)
    # Nothing reaches a partitioned trainer: every batch it prints after the heal came over the healed link.
    first = wait_for(lambda: next((t for t in batch_times(proc) if t > healed), None), 120, "a batch after the heal")
    return first - healed, shown


def trainer_loop(argv: list[str]) -> int:
    """``reconnect.py _trainer``: pull batches and print each one's wall-clock arrival (the ``trainer`` kind)."""
    ap = argparse.ArgumentParser(prog="reconnect.py _trainer")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--curve-secret")
    ap.add_argument("--curve-server-key")
    ap.add_argument("--fetch-deadline", type=float, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from coordinator.client import RolloutClient

    keys = {"curve_secret": args.curve_secret, "curve_server_key": args.curve_server_key}
    kwargs = {k: v for k, v in keys.items() if v}
    # fetch_deadline beyond the outage: the fetch waits for the agents instead of replacing their groups.
    with RolloutClient(
        args.coordinator, timeout=300, retry_interval=0.5, fetch_timeout=3, fetch_deadline=args.fetch_deadline, **kwargs
    ) as client:
        for rollout_id in range(MAX_BATCHES):
            client.generate(rollout_id)
            print(f"batch {rollout_id} {time.time():.6f}", flush=True)
    return 0


def make_net(slots: int) -> NetFault:
    """The harness, built again (bounded) if building it failed: another harness made at the same moment on
    this machine (a test run, say) may have taken the same private /16 between the check and the use."""
    for attempt in range(3):
        try:
            return NetFault.create(agents=slots)
        except NetFaultUnavailable as exc:
            if attempt == 2:
                raise
            print(f"  harness not built ({exc}); building it again", file=sys.stderr, flush=True)
            time.sleep(2)
    raise AssertionError("unreachable")


def run(kind: str, seconds: float, tmp: Path) -> tuple[float, dict]:
    """One fleet, one outage of ``kind``: (seconds from the heal to being back, what else the run showed)."""
    with make_net(len(AGENTS) + (kind == "trainer")) as net:
        cluster = fleet(net, tmp)
        try:
            watch = cluster.client(attach=False, timeout=10)
            registered = len(REGISTERED.findall(cluster.agents["a0"].text()))
            if kind == "trainer":
                back, shown = measure_trainer(net, watch, start_trainer(net, cluster, seconds), seconds)
            else:
                # fetch_deadline beyond the outage: the fetch waits for a0 instead of replacing its groups.
                trainer = cluster.client(timeout=300, fetch_timeout=3, fetch_deadline=seconds + 60)
                puller = Puller(trainer)
                try:
                    if kind == "agent":
                        back, shown = measure_agent(net, cluster, watch, puller, seconds)
                    else:
                        back, shown = measure_payload(net, watch, puller, seconds)
                finally:
                    puller.stop()
                if puller.error is not None:
                    raise RuntimeError(f"the trainer failed: {puller.error!r}")
            texts = [cluster.agents[name].text() for name in AGENTS]
            notes = {
                "a0_registrations": len(REGISTERED.findall(texts[0])) - registered,
                **shown,
                "refused": sum(len(REFUSED.findall(t)) for t in texts),
            }
            return back, notes
        finally:
            leaks = cluster.stop_all()
            if leaks:
                print(f"  leaks after the run: {leaks}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    if sys.argv[1:2] == ["_trainer"]:
        return trainer_loop(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outages", type=float, nargs="+", default=[1, 6, 15, 40])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--keep-logs", type=Path, help="write each run's logs under this directory (default: a temp dir)")
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"reconnect bench: {why}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="rf-reconnect-") as tmp:
        tmp = args.keep_logs or tmp
        for seconds in args.outages:
            for kind in args.kinds:
                got, failed = [], 0
                for rep in range(args.reps):
                    try:
                        back, notes = run(kind, seconds, Path(tmp) / f"{kind}-{seconds:g}-{rep}")
                    except (AssertionError, RuntimeError) as exc:  # not back in time, or a process died: counted
                        failed += 1
                        print(f"  {kind} {seconds:g}s rep {rep}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                    got.append(back)
                    print(f"  {kind} {seconds:g}s rep {rep}: {back:.2f}s {notes}", flush=True)
                rows.append((kind, seconds, got, failed))
    print()
    print("| link | outage s | runs | p50 s | p99 s | max s | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, seconds, got, failed in rows:
        if not got:
            print(f"| {kind} | {seconds:g} | 0 | - | - | - | {failed} |")
            continue
        med = statistics.median(got)
        print(f"| {kind} | {seconds:g} | {len(got)} | {med:.2f} | {pct(got, 0.99):.2f} | {max(got):.2f} | {failed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
