#!/usr/bin/env python
"""W3 — control-plane scale: one coordinator, N simulated agents, a trainer pulling batches.

Processes, all started here and stopped on exit:

coordinator
    ``coordinator serve`` on a fresh data dir, a real LMDB ledger with sync on (``--no-sync``
    runs it without fsync, to report beside, never instead), groups of 8, batch
    ``--batch-groups``, ``--prefetch``, ``--dynamic-filter none``.
load workers
    ``--workers`` processes of ``harness.loadgen.LoadWorker``, the N agents split between them.
    Each simulated agent has its own DEALER socket, routing id and session, registers, sends
    heartbeats (with its leases) and capacity messages, and answers each granted lease with a
    receipt (or a filtered report / release at ``--filtered-rate`` / ``--release-rate``) after
    ``--gen-ms``.
trainer
    One process pulling batches in a loop exactly as ``RolloutClient.generate`` talks to the
    coordinator: ``Generate(rollout_id)``, then ``Consumed(rollout_id)``, through
    ``AsyncRolloutClient`` itself. The one thing it skips is fetching the payloads from the
    agents, which never touches the coordinator (simulated agents store none).

Every process measures the same wall-clock window (after a warm-up in which the agents
register and the first batches flow). Per N the bench prints:

- ``receipts_per_s``: receipts sent by the agents in the window, per second; every one is
  acknowledged only after the ledger commit (``acks_per_s`` says how many came back);
- ``coordinator_cpu_us_per_receipt``: the coordinator's user+sys CPU in the window per receipt;
- ``grant_rtt_p50_ms`` / ``_p99_ms``: from the message that frees an agent's slot (receipt,
  filtered, release) to the Grant that refills it;
- ``receipt_ack_p50_ms`` / ``_p99_ms``: Receipt sent to ReceiptAck received;
- ``coordinator_rss_mb`` (and ``_peak``) at the end of the window;
- ``loadgen_cpu_busy``: the load workers' CPU as a fraction of their cores in the window (near
  1.0 per worker means the load generator, not the coordinator, is the bottleneck), and
  ``coordinator_cpu_busy`` (near 1.0: the coordinator's one core is saturated).

    python scripts/bench/w3_control_plane.py --quick        # N = 10, 100, 1000; < 1 minute on 2 cores
    python scripts/bench/w3_control_plane.py --agents 1000 --seconds 20 --workers 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from benchlib import CLK_TCK, Procs, children_of, coordinator_endpoint, proc_stat, refs_client, venv_script, wait_until  # noqa: E402

BENCH = "W3"
GROUP = 8
READY_TIMEOUT = 60.0


def progress(msg: str) -> None:
    print(f"[w3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out.get("VmRSS", 0.0), out.get("VmHWM", 0.0)


def cpu_s(pid: int) -> float:
    st = proc_stat(pid)
    return st[1] / CLK_TCK if st else 0.0


# --------------------------------------------------------------------------- child roles


def run_load_worker(spec: str) -> None:
    from harness.loadgen import LoadConfig, LoadWorker

    res = LoadWorker(LoadConfig(**json.loads(spec))).run()
    print(json.dumps(res.__dict__), flush=True)


def run_trainer(spec: str) -> None:
    """Pull batches until ``stop_at``; count those finished inside the window."""
    cfg = json.loads(spec)

    RefsClient = refs_client()

    async def main() -> dict:
        out = {"batches": 0, "groups": 0, "cpu_s": 0.0, "wait_s": []}
        keys = (
            {"curve_secret": cfg["curve_secret"], "curve_server_key": cfg["curve_server_key"]}
            if cfg.get("curve_secret")
            else {}
        )
        async with RefsClient(cfg["coordinator"], retry_interval=5.0, **keys) as client:
            rollout_id = 0
            cpu0 = None
            while time.time() < cfg["stop_at"]:
                t0 = time.monotonic()
                try:
                    async with asyncio.timeout(max(0.1, cfg["stop_at"] - time.time())):
                        batch = await client.generate(rollout_id)
                except TimeoutError:
                    break  # the agents stopped
                if len(batch.groups) != cfg["batch_groups"]:
                    raise RuntimeError(f"batch {rollout_id} has {len(batch.groups)} groups")
                now = time.time()
                if cfg["start_at"] <= now < cfg["end_at"]:
                    if cpu0 is None:
                        cpu0 = time.process_time()
                    out["batches"] += 1
                    out["groups"] += len(batch.groups)
                    out["wait_s"].append(time.monotonic() - t0)
                elif now >= cfg["end_at"] and cpu0 is not None and not out["cpu_s"]:
                    out["cpu_s"] = time.process_time() - cpu0
                rollout_id += 1
        return out

    print(json.dumps(asyncio.run(main())), flush=True)


# --------------------------------------------------------------------------- one N


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i % 997} + {i % 89}?", "label": i % 997 + i % 89}))
            f.write("\n")


def agents_alive(address: str, curve: dict) -> int:
    """How many agents the coordinator counts alive now (its Stats answer); -1 if it does not answer."""
    from common.errors import RolloutError
    from coordinator.client import RolloutClient

    try:
        with RolloutClient(address, timeout=10, attach=False, **curve) as client:
            return sum(a.status == "alive" for a in client.stats().agents.values())
    except RolloutError:
        return -1


def measure(
    n_agents: int, rate: float, args, workdir: Path, dataset: Path, fingerprint: str, rows: int, gateways: int = 0
) -> dict:
    """One coordinator, N agents offering ``rate`` outcomes/s (0: as fast as grants come), one window."""
    procs = Procs(workdir)
    tag = f"g{gateways}-n{n_agents}-{'ceiling' if not rate else f'rate{rate:.0f}'}"
    try:
        coord_argv = [venv_script("coordinator")]
        if args.profile_cprofile:
            coord_argv = [sys.executable, "-m", "cProfile", "-o", str(Path(args.profile_cprofile) / f"{tag}.prof")]
            coord_argv += ["-m", "coordinator.cli"]
        coord_argv += [
            "serve",
            "--dataset",
            str(dataset),
            "--data-dir",
            str(workdir / f"coordinator-{tag}"),
            "--bind",
            "tcp://127.0.0.1:0",
            "--rollout-batch-size",
            str(args.batch_groups),
            "--n-samples-per-prompt",
            str(GROUP),
            "--dynamic-filter",
            "none",
            "--prefetch",
            str(args.prefetch),
            "--log-level",
            "WARNING",
            "--gateways",
            str(gateways),
            "--heartbeat-interval",
            str(args.heartbeat_interval),
            "--agent-ttl",
            str(5 * args.heartbeat_interval),
            "--retire-after",
            str(max(60.0, 12 * args.heartbeat_interval)),
        ]
        if args.no_sync:
            coord_argv.append("--no-sync")
        agent_keys, trainer_keys = {}, {}
        if args.curve:
            from common.keygen import write_fleet

            curve_dir = workdir / f"curve-{tag}"
            write_fleet(curve_dir, ["sim"], ["trainer"])
            coord_argv += ["--curve-dir", str(curve_dir)]
            server = str(curve_dir / "coordinator.key")
            agent_keys = {"curve_secret": str(curve_dir / "secrets" / "sim.key_secret"), "curve_server_key": server}
            trainer_keys = {
                "curve_secret": str(curve_dir / "secrets" / "trainer.key_secret"),
                "curve_server_key": server,
            }
        coord = procs.start(f"coordinator-{tag}", coord_argv)

        address = wait_until(lambda: coordinator_endpoint(coord), READY_TIMEOUT, "coordinator", check=procs.check)
        gateway_pids = wait_until(
            lambda: (lambda kids: (kids,) if len(kids) >= gateways else None)(children_of(coord.pid)),
            READY_TIMEOUT,
            "gateways",
            check=procs.check,
        )[0]
        workers = args.workers or max(1, min(os.cpu_count() - 2, math.ceil(n_agents / 125)))
        workers = min(workers, n_agents)
        now = time.time()
        start_at = now + args.warmup
        end_at = start_at + args.seconds
        stop_at = end_at + 1.0
        progress(
            f"N={n_agents} {'ceiling' if not rate else f'at {rate:.0f}/s'}: coordinator pid {coord.pid} at {address}; "
            f"{workers} load worker(s); window {args.seconds:.0f}s after {args.warmup:.0f}s warm-up"
        )
        trainer = procs.start(
            f"trainer-{tag}",
            [
                sys.executable,
                os.path.abspath(__file__),
                "--trainer-worker",
                json.dumps(
                    {
                        "coordinator": address,
                        "batch_groups": args.batch_groups,
                        "start_at": start_at,
                        "end_at": end_at,
                        "stop_at": stop_at,
                        **trainer_keys,
                    }
                ),
            ],
            cwd=str(ROOT),
        )
        loads = []
        base, extra = divmod(n_agents, workers)
        first = 0
        for w in range(workers):
            count = base + (w < extra)
            spec = {
                "coordinator": address,
                "agents": count,
                "first_agent": first,
                "capacity_groups": max(1, math.ceil(args.in_flight / n_agents)),
                "n_samples": GROUP,
                "gen_ms": args.gen_ms,
                "filtered_rate": args.filtered_rate,
                "release_rate": args.release_rate,
                "rate": rate / workers,
                "capacity_interval": args.capacity_interval,
                "dataset_fingerprint": "" if args.rows else fingerprint,
                "dataset_size": -1 if args.rows else rows,
                "start_at": start_at,
                "end_at": end_at,
                "stop_at": stop_at,
                "seed": w,
                **agent_keys,
            }
            first += count
            loads.append(
                procs.start(
                    f"load-{tag}-{w}",
                    [sys.executable, os.path.abspath(__file__), "--load-worker", json.dumps(spec)],
                    cwd=str(ROOT),
                )
            )
        # The coordinator's CPU over the same window, read from /proc at its edges.
        time.sleep(max(0.0, start_at - time.time()))
        if args.py_spy:
            spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(coord.pid), "--nonblocking"]
            spy += ["--threads", "-r", "200", "-d", str(int(args.seconds)), "-f", "raw"]
            spy_proc = procs.start(f"py-spy-{tag}", spy + ["-o", str(Path(args.py_spy) / f"{tag}.txt")])
            procs.items.remove(spy_proc)  # it ends by itself with the window (-d): not a failure for check()
        c0, g0, t0 = cpu_s(coord.pid), sum(map(cpu_s, gateway_pids)), time.monotonic()
        time.sleep(max(0.0, end_at - time.time()))
        c1, g1, t1 = cpu_s(coord.pid), sum(map(cpu_s, gateway_pids)), time.monotonic()
        procs.check()  # before the trainer's stop_at: every process was alive through the window
        rss, peak = rss_mb(coord.pid)
        alive = agents_alive(address, trainer_keys)
        # The same gateways as the CPU figure (one restarted meanwhile has exited).
        gateway_rss = sum(rss_mb(pid)[0] for pid in gateway_pids if proc_stat(pid))
        for line in coord.log_text().splitlines():
            if "gateway" in line and ("WARNING" in line or "ERROR" in line or "Traceback" in line):
                progress(f"coordinator: {line}")
        if args.py_spy:
            spy_proc.popen.wait(timeout=30)
        results = []
        for load in loads:
            rc = load.popen.wait(timeout=60)
            if rc != 0:
                raise RuntimeError(f"{load.name} failed (exit {rc}):\n{load.log_text()[-3000:]}")
            results.append(json.loads(load.log_text().strip().splitlines()[-1]))
        rc = trainer.popen.wait(timeout=60)
        if rc != 0:
            raise RuntimeError(f"trainer failed (exit {rc}):\n{trainer.log_text()[-3000:]}")
        tr = json.loads(trainer.log_text().strip().splitlines()[-1])
    finally:
        procs.stop()
    window = t1 - t0
    total = {k: sum(r[k] for r in results) for k in ("outcomes", "receipts", "filtered", "released", "acks")}
    total.update({k: sum(r[k] for r in results) for k in ("refused", "errors", "fences", "grants", "leases")})
    rtt = [x for r in results for x in r["grant_rtt"]]
    ack = [x for r in results for x in r["ack_latency"]]
    beats = [x for r in results for x in r["beat_gaps"]]
    core_cpu, gateway_cpu = c1 - c0, g1 - g0
    coord_cpu = core_cpu + gateway_cpu
    load_cpu = sum(r["cpu_s"] for r in results)
    receipts = total["receipts"]
    row = {
        "n_agents": n_agents,
        "gateways": gateways,
        "offered_rate": rate,
        "receipts_per_s": receipts / window,
        "acks_per_s": total["acks"] / window,
        "outcomes_per_s": total["outcomes"] / window,
        "delivered_groups_per_s": tr["groups"] / window,
        "coordinator_cpu_us_per_receipt": coord_cpu / receipts * 1e6 if receipts else float("nan"),
        "coordinator_cpu_us_per_message": coord_cpu / max(1, total["outcomes"]) * 1e6,
        "coordinator_cpu_busy": coord_cpu / window,
        "core_cpu_us_per_receipt": core_cpu / receipts * 1e6 if receipts else float("nan"),
        "core_cpu_busy": core_cpu / window,
        "gateway_cpu_busy": gateway_cpu / window,
        "gateway_rss_mb": gateway_rss,
        "grant_rtt_p50_ms": percentile(rtt, 0.5) * 1e3,
        "grant_rtt_p99_ms": percentile(rtt, 0.99) * 1e3,
        "receipt_ack_p50_ms": percentile(ack, 0.5) * 1e3,
        "receipt_ack_p99_ms": percentile(ack, 0.99) * 1e3,
        "heartbeat_gap_p50_ms": percentile(beats, 0.5) * 1e3,
        "heartbeat_gap_p99_ms": percentile(beats, 0.99) * 1e3,
        "heartbeat_lag_p99_ms": (percentile(beats, 0.99) - args.heartbeat_interval / 2) * 1e3,
        "coordinator_rss_mb": rss + gateway_rss,
        "core_rss_mb": rss,
        "coordinator_rss_peak_mb": peak,
        "loadgen_workers": len(results),
        "loadgen_cpu_busy": load_cpu / window,
        "loadgen_cpu_busy_per_worker": load_cpu / window / len(results),
        "trainer_cpu_busy": tr["cpu_s"] / window,
        "trainer_batches": tr["batches"],
        "leases_per_grant": total["leases"] / total["grants"] if total["grants"] else 0.0,
        "refused": total["refused"],
        "errors": total["errors"],
        "fences": total["fences"],
        "agents_alive_at_end": alive,
        "window_s": window,
    }
    errors = [e for r in results for e in r["error_samples"]]
    if errors:
        progress(f"N={n_agents}: coordinator errors, e.g. {errors[:3]}")
    return row


# --------------------------------------------------------------------------- main


def report(n: int, phase: str, row: dict, mode: dict) -> None:
    """The ceiling phase gives throughput and CPU; the latency phase, at a rate under it, the latencies."""
    metrics = [("receipts_per_s", "1/s"), ("coordinator_cpu_us_per_receipt", "us"), ("coordinator_rss_mb", "MiB")]
    if phase == "latency":
        metrics += [(f"{k}_{q}_ms", "ms") for k in ("grant_rtt", "receipt_ack") for q in ("p50", "p99")]
    for metric, unit in metrics:
        extra = {k: v for k, v in row.items() if k != metric}
        emit(metric, round(row[metric], 3), unit, phase=phase, **mode, **extra)
    progress(
        f"gateways={row['gateways']} N={n} {phase}: "
        f"{row['receipts_per_s']:.0f} receipts/s, {row['coordinator_cpu_us_per_receipt']:.0f} us CPU "
        f"each, grant rtt p50/p99 {row['grant_rtt_p50_ms']:.1f}/{row['grant_rtt_p99_ms']:.1f} ms, ack "
        f"p50/p99 {row['receipt_ack_p50_ms']:.1f}/{row['receipt_ack_p99_ms']:.1f} ms, rss "
        f"{row['coordinator_rss_mb']:.0f} MiB, heartbeat gap p99 {row['heartbeat_gap_p99_ms']:.0f} ms, agents alive "
        f"{row['agents_alive_at_end']}/{n}, fences {row['fences']}, core busy {row['core_cpu_busy']:.2f}, "
        f"gateways busy {row['gateway_cpu_busy']:.2f}, "
        f"load {row['loadgen_cpu_busy_per_worker']:.2f}/worker x {row['loadgen_workers']}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short windows (< 1 minute for N = 10, 100, 1000)")
    ap.add_argument("--agents", default="10,100,1000", help="comma-separated N values")
    ap.add_argument("--seconds", type=float, default=None, help="measured window per phase (default 10, quick 3)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the window (default 5, quick 3)")
    ap.add_argument("--workers", type=int, default=0, help="load worker processes (default: by N and cores)")
    ap.add_argument(
        "--in-flight",
        type=int,
        default=4096,
        help="groups the fleet can hold at once, split over the N agents (so only N changes between rows)",
    )
    ap.add_argument("--gen-ms", type=float, default=0.0, help="mean generation time of a group (0: instant)")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="outcomes/s offered in the latency phase (default: half the ceiling the first phase measured)",
    )
    ap.add_argument("--filtered-rate", type=float, default=0.05, help="fraction of groups reported filtered")
    ap.add_argument("--release-rate", type=float, default=0.01, help="fraction of leases released unfinished")
    ap.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="the coordinator's --heartbeat-interval; --agent-ttl is 5 times it, as by default (1 s, TTL 5 s)",
    )
    ap.add_argument("--capacity-interval", type=float, default=10.0, help="seconds between Capacity messages")
    ap.add_argument("--batch-groups", type=int, default=1024, help="groups per trainer batch")
    ap.add_argument(
        "--prefetch", type=int, default=None, help="the coordinator's --prefetch (default: --in-flight + 2 batches)"
    )
    ap.add_argument("--rows", action="store_true", help="agents without a dataset replica: grants carry rows")
    ap.add_argument("--dataset-rows", type=int, default=200_000)
    ap.add_argument("--no-sync", action="store_true", help="ledger without fsync (report beside, never instead)")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="CurveZMQ on: every connection encrypted and authenticated (keys written per run)",
    )
    ap.add_argument(
        "--gateways",
        default="0",
        help="comma-separated coordinator serve --gateways values, each measured at every N (default 0)",
    )
    ap.add_argument("--profile-cprofile", metavar="DIR", help="run the coordinator under cProfile into DIR/nN.prof")
    ap.add_argument(
        "--py-spy", metavar="DIR", help="sample the coordinator over the window with py-spy into DIR/nN.txt (collapsed)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory with its logs")
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_worker:
        run_load_worker(args.load_worker)
        return 0
    if args.trainer_worker:
        run_trainer(args.trainer_worker)
        return 0
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.prefetch = args.in_flight + 2 * args.batch_groups if args.prefetch is None else args.prefetch
    args.warmup = args.warmup or (3.0 if args.quick else 5.0)
    from common.dataset import Dataset

    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-w3-"))
    dataset = workdir / "prompts.jsonl"
    write_dataset(dataset, args.dataset_rows)
    fingerprint = Dataset(str(dataset)).fingerprint
    mode = {
        "sync": not args.no_sync,
        "batch_groups": args.batch_groups,
        "prefetch": args.prefetch,
        "in_flight": args.in_flight,
        "gen_ms": args.gen_ms,
        "rows_in_grants": args.rows,
        "profiled": bool(args.profile_cprofile or args.py_spy),
        "curve": args.curve,
    }
    rows = []
    try:
        for g in [int(x) for x in args.gateways.split(",")]:
            for n in [int(x) for x in args.agents.split(",")]:
                ceiling = measure(n, 0.0, args, workdir, dataset, fingerprint, args.dataset_rows, g)
                report(n, "ceiling", ceiling, mode)
                rate = args.rate or round(ceiling["outcomes_per_s"] * 0.5, -2)
                rated = measure(n, rate, args, workdir, dataset, fingerprint, args.dataset_rows, g)
                report(n, "latency", rated, mode)
                rows.append((g, n, ceiling, rated))
    finally:
        if args.keep:
            progress(f"kept {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    summary = {}
    for g, n, ceiling, rated in rows:
        summary[f"g{g}/{n}"] = {
            "receipts_per_s": round(ceiling["receipts_per_s"]),
            "cpu_us_per_receipt": round(ceiling["coordinator_cpu_us_per_receipt"], 1),
            "latency_at_receipts_per_s": round(rated["receipts_per_s"]),
            "grant_rtt_p50_ms": round(rated["grant_rtt_p50_ms"], 2),
            "grant_rtt_p99_ms": round(rated["grant_rtt_p99_ms"], 2),
            "receipt_ack_p50_ms": round(rated["receipt_ack_p50_ms"], 2),
            "receipt_ack_p99_ms": round(rated["receipt_ack_p99_ms"], 2),
            "rss_mb": round(max(ceiling["coordinator_rss_mb"], rated["coordinator_rss_mb"]), 1),
            "core_cpu_busy": round(ceiling["core_cpu_busy"], 2),
            "heartbeat_lag_p99_ms": round(rated["heartbeat_lag_p99_ms"], 1),
            "agents_alive_at_end": rated["agents_alive_at_end"],
            "gateway_cpu_busy": round(ceiling["gateway_cpu_busy"], 2),
            "coordinator_cpu_busy": round(ceiling["coordinator_cpu_busy"], 2),
            "loadgen_cpu_busy_per_worker": round(ceiling["loadgen_cpu_busy_per_worker"], 2),
        }
    emit("summary", summary, "table", **mode)
    progress("gateways/N  receipts/s  us/receipt | at receipts/s  grant p50/p99 ms  ack p50/p99 ms | rss MiB"
             " | core, gateways busy")  # fmt: skip
    for n, r in summary.items():
        progress(
            f"{n:>10}  {r['receipts_per_s']:>10}  {r['cpu_us_per_receipt']:>10} | {r['latency_at_receipts_per_s']:>13}"
            f"  {r['grant_rtt_p50_ms']:>7.1f}/{r['grant_rtt_p99_ms']:<7.1f}  {r['receipt_ack_p50_ms']:>6.1f}/"
            f"{r['receipt_ack_p99_ms']:<6.1f} | {r['rss_mb']:>6.0f} | {r['core_cpu_busy']:.2f}, "
            f"{r['gateway_cpu_busy']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
