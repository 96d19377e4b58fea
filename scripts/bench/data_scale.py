#!/usr/bin/env python
"""Scale of data: ``coordinator serve`` on a 10-million-row dataset, its start-up time and memory.

For each dataset size (``--rows`` and the smaller ``--small-rows``, to show what grows with the
dataset) the bench

1. writes a JSONL dataset of the sim's arithmetic prompts with labels (``{"prompt": "What is
   a + b?", "label": c, "id": i}``), cached under ``<tmp>/rollfleet-data-scale/`` and reused;
2. starts a real ``coordinator serve`` on it (a fresh data dir, the LMDB ledger synced,
   ``--shuffle-seed`` set, groups of ``--group`` samples, batches of ``--batch-groups``,
   ``--dynamic-filter none``) and measures **startup_s**: from spawning the process to its
   first answer to a status request (dataset loaded and validated, ledger opened, frontier
   built); then **rss_start_mb**, its RSS at that moment;
3. drives ``--batches`` trainer batches through it: one ``harness.loadgen`` worker process
   simulating ``--agents`` agents that speak the real protocol (receipts at once, no local
   dataset, so every Grant carries rows the coordinator reads from the file), and one trainer
   process pulling batches with ``AsyncRolloutClient.generate`` minus the payload fetch
   (payloads never touch the coordinator); prints **first_batch_s** (spawn to the first
   batch) and **rss_after_batches_mb** with the peak (VmHWM);
4. stops it and starts it again on the same data dir: **restart_s** and **rss_restart_mb**
   (the ledger's resume: cursors and records restored, the shuffle order recomputed).

One JSON line per metric, like the other benches (``"bench": "data_scale"``).

    python scripts/bench/data_scale.py --quick     # 1M and 100k rows, 100 batches; < 1 minute
    python scripts/bench/data_scale.py             # 10M and 1M rows, 1,000 batches
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from benchlib import Procs, coordinator_endpoint, refs_client, venv_script, wait_until  # noqa: E402

BENCH = "data_scale"
READY_TIMEOUT = 300.0


def progress(msg: str) -> None:
    print(f"[data_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MiB."""
    out = status_mb(pid)
    return out.get("VmRSS", 0.0), out.get("VmHWM", 0.0)


def status_mb(pid: int) -> dict[str, float]:
    """The memory lines of /proc/PID/status in MiB: RssAnon is the heap; RssFile counts mapped file
    pages such as the ledger's LMDB map, which the kernel can drop."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


# --------------------------------------------------------------------------- dataset


def dataset_path(rows: int) -> Path:
    """The cached dataset of ``rows`` rows, written on first use (about 2 s per million rows)."""
    cache = Path(tempfile.gettempdir()) / "rollfleet-data-scale"
    cache.mkdir(exist_ok=True)
    path = cache / f"arith-{rows}.jsonl"
    if path.exists():
        return path
    t0 = time.monotonic()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    step = 200_000
    with open(tmp, "w") as f:
        for lo in range(0, rows, step):
            f.write(
                "".join(
                    f'{{"prompt": "What is {i % 997} + {i % 89}?", "label": {i % 997 + i % 89}, "id": {i}}}\n'
                    for i in range(lo, min(rows, lo + step))
                )
            )
    os.replace(tmp, path)
    progress(f"wrote {path} ({rows} rows, {path.stat().st_size >> 20} MiB) in {time.monotonic() - t0:.1f}s")
    return path


# --------------------------------------------------------------------------- child roles


def run_load_worker(spec: str) -> None:
    from harness.loadgen import LoadConfig, LoadWorker

    res = LoadWorker(LoadConfig(**json.loads(spec))).run()
    print(json.dumps({k: v for k, v in res.__dict__.items() if not isinstance(v, list)}), flush=True)


def run_trainer(spec: str) -> None:
    """Pull ``batches`` batches; print a line after the first and after the last."""
    import asyncio

    cfg = json.loads(spec)

    RefsClient = refs_client()

    async def main() -> None:
        async with RefsClient(cfg["coordinator"], retry_interval=5.0) as client:
            for rollout_id in range(cfg["batches"]):
                batch = await client.generate(rollout_id)
                if len(batch.groups) != cfg["batch_groups"]:
                    raise RuntimeError(f"batch {rollout_id} has {len(batch.groups)} groups")
                if rollout_id == 0:
                    print(json.dumps({"first_batch_at": time.time()}), flush=True)
                if cfg["checkpoint_every"] and (rollout_id + 1) % cfg["checkpoint_every"] == 0:
                    # As a trainer saving a checkpoint: the coordinator drops the batches behind the
                    # previous one (it keeps the batches since, to deliver them again on a resume).
                    await client.pause(drain=True)
                    await client.state_dict()
                    await client.resume()
                if rollout_id + 1 == cfg["batches"] // 2:
                    print(json.dumps({"half_at": time.time()}), flush=True)
            print(json.dumps({"done_at": time.time(), "batches": cfg["batches"]}), flush=True)

    asyncio.run(main())


# --------------------------------------------------------------------------- one size


def start_coordinator(procs: Procs, name: str, dataset: Path, data_dir: Path, args):
    argv = [venv_script("coordinator"), "serve", "--dataset", str(dataset), "--data-dir", str(data_dir)]
    argv += ["--bind", "tcp://127.0.0.1:0", "--rollout-batch-size", str(args.batch_groups)]
    argv += ["--n-samples-per-prompt", str(args.group), "--dynamic-filter", "none", "--prefetch", "-1"]
    argv += ["--shuffle-seed", "1", "--log-level", "WARNING"]
    t0 = time.monotonic()
    coord = procs.start(name, argv)

    address = wait_until(lambda: coordinator_endpoint(coord), READY_TIMEOUT, name, interval=0.02, check=procs.check)
    from coordinator.client import RolloutClient

    with RolloutClient(address, timeout=READY_TIMEOUT, attach=False) as client:
        client.stats()
    return coord, address, time.monotonic() - t0


def measure(rows: int, args, workdir: Path) -> dict:
    dataset = dataset_path(rows)
    procs = Procs(workdir)
    data_dir = workdir / f"coordinator-{rows}"
    out = {"rows": rows, "dataset_mib": round(dataset.stat().st_size / 2**20, 1)}
    try:
        coord, address, out["startup_s"] = start_coordinator(procs, f"coordinator-{rows}", dataset, data_dir, args)
        out["rss_start_mb"], out["rss_start_peak_mb"] = rss_mb(coord.pid)
        out["rss_anon_start_mb"] = status_mb(coord.pid)["RssAnon"]
        progress(f"{rows} rows: answered after {out['startup_s']:.2f}s, RSS {out['rss_start_mb']:.0f} MiB")
        far = time.time() + 3600
        spec = {
            "coordinator": address,
            "agents": args.agents,
            "capacity_groups": args.capacity_groups,
            "n_samples": args.group,
            "start_at": time.time(),
            "end_at": far,
            "stop_at": far,
        }
        load = procs.start(f"load-{rows}", [sys.executable, __file__, "--load-worker", json.dumps(spec)], cwd=str(ROOT))
        trainer_spec = {
            "coordinator": address,
            "batches": args.batches,
            "batch_groups": args.batch_groups,
            "checkpoint_every": args.checkpoint_every,
        }
        trainer = procs.start(
            f"trainer-{rows}", [sys.executable, __file__, "--trainer-worker", json.dumps(trainer_spec)], cwd=str(ROOT)
        )
        t_agents = time.time()

        def alive():
            coord.check_alive()
            load.check_alive()

        def trainer_line(key):
            for line in trainer.log_text().splitlines():
                if line.startswith("{") and key in line:
                    return json.loads(line)
            return None

        first = wait_until(lambda: trainer_line("first_batch_at"), READY_TIMEOUT, "first batch", check=alive)
        out["first_batch_s"] = first["first_batch_at"] - t_agents
        wait_until(lambda: trainer_line("half_at"), 3600, f"{args.batches // 2} batches", interval=0.01, check=alive)
        rss_half, _ = rss_mb(coord.pid)
        anon_half = status_mb(coord.pid)["RssAnon"]
        done = wait_until(lambda: trainer_line("done_at"), 3600, f"{args.batches} batches", interval=0.01, check=alive)
        out["batches_per_s"] = (args.batches - 1) / max(1e-9, done["done_at"] - first["first_batch_at"])
        out["rss_after_batches_mb"], out["rss_peak_mb"] = rss_mb(coord.pid)
        mem = status_mb(coord.pid)
        out["rss_anon_after_batches_mb"], out["rss_file_after_batches_mb"] = mem["RssAnon"], mem["RssFile"]
        # Growth over the second half only: the first batches also warm allocator pools and buffers.
        out["rss_growth_kb_per_1000_batches"] = (
            (out["rss_after_batches_mb"] - rss_half) * 1024 / (args.batches - args.batches // 2) * 1000
        )
        out["rss_anon_growth_kb_per_1000_batches"] = (
            (out["rss_anon_after_batches_mb"] - anon_half) * 1024 / (args.batches - args.batches // 2) * 1000
        )
        progress(
            f"{rows} rows: {args.batches} batches at {out['batches_per_s']:.0f}/s, "
            f"RSS {out['rss_after_batches_mb']:.0f} MiB (peak {out['rss_peak_mb']:.0f}), "
            f"+{out['rss_growth_kb_per_1000_batches']:.0f} KiB per 1,000 batches over the second half "
            f"(heap +{out['rss_anon_growth_kb_per_1000_batches']:.0f}; "
            f"file-backed {out['rss_file_after_batches_mb']:.0f} MiB)"
        )
        procs.stop()
        coord, address, out["restart_s"] = start_coordinator(procs, f"restart-{rows}", dataset, data_dir, args)
        out["rss_restart_mb"], _ = rss_mb(coord.pid)
        out["rss_anon_restart_mb"] = status_mb(coord.pid)["RssAnon"]
        progress(f"{rows} rows: restarted in {out['restart_s']:.2f}s, RSS {out['rss_restart_mb']:.0f} MiB")
    finally:
        procs.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- load scan alone


def scan_scaling(rows: int, workers: list[int]) -> None:
    """``Dataset`` load time of ``rows`` rows validated by 1, 2, 4, ... worker processes (no index)."""
    import common.dataset as dataset_module

    path = dataset_path(rows)
    for w in workers:
        dataset_module._scan_workers = lambda size, w=w: w
        t0 = time.monotonic()
        with dataset_module.Dataset(path) as ds:
            seconds = time.monotonic() - t0
            spans = len(ds._span_rows)
        emit("load_s", round(seconds, 3), "s", rows=rows, workers=w, spans=spans, cpus=len(os.sched_getaffinity(0)))
        progress(f"{rows} rows, {w} worker(s): loaded in {seconds:.2f}s")


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000, help="the large dataset")
    ap.add_argument("--small-rows", type=int, default=1_000_000, help="the smaller dataset, to compare (0: skip)")
    ap.add_argument("--batches", type=int, default=1000, help="trainer batches driven through each coordinator")
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--group", type=int, default=1, help="samples per group")
    ap.add_argument("--agents", type=int, default=4, help="simulated agents (one load-generator process)")
    ap.add_argument("--capacity-groups", type=int, default=8, help="groups in flight per agent")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        help="batches between the trainer's checkpoints (pause, state_dict, resume); 0: never, and the "
        "coordinator keeps every batch so that a resume can deliver it again",
    )
    ap.add_argument("--quick", action="store_true", help="1M and 100k rows, 100 batches")
    ap.add_argument(
        "--scan-workers",
        default="",
        help="only time the dataset load of --rows rows with these worker counts, e.g. 1,2,4,8 (no coordinator)",
    )
    ap.add_argument("--load-worker", help=argparse.SUPPRESS)
    ap.add_argument("--trainer-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_worker:
        run_load_worker(args.load_worker)
        return 0
    if args.trainer_worker:
        run_trainer(args.trainer_worker)
        return 0
    if args.quick:
        args.rows, args.small_rows, args.batches = 1_000_000, 100_000, 100
    if args.scan_workers:
        scan_scaling(args.rows, [int(w) for w in args.scan_workers.split(",")])
        return 0
    sizes = [r for r in (args.small_rows, args.rows) if r > 0]
    mode = {"batches": args.batches, "batch_groups": args.batch_groups, "group": args.group, "quick": args.quick}
    mode["checkpoint_every"] = args.checkpoint_every
    with tempfile.TemporaryDirectory(prefix="rollfleet-data-scale-") as tmp:
        for rows in sizes:
            row = measure(rows, args, Path(tmp))
            for metric, unit in (
                ("startup_s", "s"),
                ("rss_start_mb", "MiB"),
                ("first_batch_s", "s"),
                ("rss_after_batches_mb", "MiB"),
                ("rss_growth_kb_per_1000_batches", "KiB"),
                ("restart_s", "s"),
                ("rss_restart_mb", "MiB"),
            ):
                emit(metric, round(row[metric], 3), unit, **mode, **{k: v for k, v in row.items() if k != metric})
    return 0


if __name__ == "__main__":
    sys.exit(main())
