#!/usr/bin/env python3
"""Weight-update latency (issue 7): a broadcast or a disk update, from the trainer's call to every engine serving.

Two measurements per tensor-set size, never at the same time:

floor
    Five fresh processes on this machine form a plain ``torch.distributed`` gloo group
    (``init_process_group``, TCP rendezvous on loopback). Rank 0 broadcasts the same tensors
    (same names, shapes, dtypes, order) to the 4 receiving ranks, which allocate each tensor and
    receive into it; a barrier after the last tensor marks that every receiver has it all.
    ``floor_broadcast_s`` is rank 0's time from the first broadcast to the end of that barrier.
    For the disk path, ``floor_read_s`` is one read of every byte of the checkpoint's
    ``model.safetensors`` into memory, page cache warm (the engines read it warm too).
rollfleet
    ``coordinator serve`` + 2 agents x 2 sim engines on loopback (``harness.cluster``); this
    process is the trainer. ``update_s`` is the wall time of ``client.update_weights(tensors,
    version, backend="gloo", bucket_bytes=...)``, which returns once every engine reports the
    new version (docs/weights.md, step 5); the bench then checks each engine's ``/model_info``
    (version and weight digest) outside the timed window. The first broadcast also forms the
    update group and is reported apart (``first_update_s``), not in the median.
    ``disk_update_s`` is ``client.update_weights_from_disk(dir, version)`` of a directory holding
    a ``model.safetensors`` of the same tensors: every engine pauses, loads it and continues.

Each figure is the median over ``--reps`` repetitions; ``ratio_to_floor`` is rollfleet divided by
its floor (1.0 would mean rollfleet adds nothing to moving the bytes). Output: one JSON object per
line on stdout; progress on stderr.

    python scripts/bench/w_weight_update.py --quick     # 10 MB, 3 repetitions
    python scripts/bench/w_weight_update.py             # 10 MB and 100 MB, 5 repetitions
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import struct
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.chaos_evidence import serving_engines  # noqa: E402
from harness.cluster import Cluster, free_port  # noqa: E402
from harness.polling import wait_for  # noqa: E402
from scripts.bench.benchlib import end_floor, floor_times, run_ranks  # noqa: E402

BENCH = "weight_update"
AGENTS = 2
ENGINES_PER_AGENT = 2
RECEIVERS = AGENTS * ENGINES_PER_AGENT
TENSOR_BYTES = 4 << 20  # each tensor of a set is at most 4 MiB of float32, like a mid-sized layer
MB = 1 << 20


def progress(msg: str) -> None:
    print(f"[w-weights {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def tensor_shapes(size_mb: int) -> list[tuple[str, int]]:
    """``(name, numel)`` of float32 tensors adding up to ``size_mb`` MiB, 4 MiB each at most."""
    total, out, i = size_mb * MB, [], 0
    while total > 0:
        nbytes = min(TENSOR_BYTES, total)
        out.append((f"layers.{i}.weight", nbytes // 4))
        total -= nbytes
        i += 1
    return out


def make_tensors(size_mb: int, fill: float) -> dict:
    import torch

    return {
        name: torch.full((numel,), fill + i, dtype=torch.float32)
        for i, (name, numel) in enumerate(tensor_shapes(size_mb))
    }


def write_safetensors(path: Path, tensors: dict) -> None:
    """A ``model.safetensors`` written by hand (the format is a JSON header and raw bytes; the
    ``safetensors`` package's writer needs numpy, which the venv need not have)."""
    import ctypes

    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))


def read_checkpoint(path: Path) -> int:
    """Read every byte of ``path`` once into memory (the floor of a disk update: the bytes must be read)."""
    size = path.stat().st_size
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return got


# --------------------------------------------------------------------------- floor


def floor_rank(args) -> int:
    """One rank of the floor group; rank 0 prints ``{size_mb: [seconds per rep]}`` as JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.floor_port}",
        rank=args.floor_rank,
        world_size=RECEIVERS + 1,
        timeout=timedelta(seconds=120),
    )
    out = {}
    for size_mb in args.sizes:
        shapes = tensor_shapes(size_mb)
        sent = make_tensors(size_mb, 1.0) if args.floor_rank == 0 else None
        out[size_mb] = floor_times(
            args.reps,
            lambda: (
                sent[name] if sent is not None else torch.empty(numel, dtype=torch.float32) for name, numel in shapes
            ),
        )
    return end_floor(out, args.floor_rank)


def run_floor(workdir: Path, sizes: list[int], reps: int) -> dict[int, list[float]]:
    port = free_port()
    argvs = [
        [
            sys.executable,
            "-W",
            "ignore",
            os.path.abspath(__file__),
            "--floor-rank",
            str(rank),
            "--floor-port",
            str(port),
            "--sizes",
            ",".join(map(str, sizes)),
            "--reps",
            str(reps),
        ]  # fmt: skip
        for rank in range(RECEIVERS + 1)
    ]
    return {int(k): v for k, v in json.loads(run_ranks(workdir, argvs, timeout=600)).items()}


# --------------------------------------------------------------------------- rollfleet


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=10) as resp:
        return json.loads(resp.read())


def check_engines(cluster: Cluster, version: int, digest: str | None) -> None:
    """Every engine serves ``version`` (and holds ``digest``); waits briefly for health to catch up."""

    def ok():
        urls = serving_engines(cluster.status())
        if len(urls) != RECEIVERS:
            return False
        for url in urls.values():
            info = model_info(url)
            if info["weight_version"] != str(version) or (digest and info["weight_digest"] != digest):
                raise AssertionError(
                    f"{url}: {info['weight_version']}/{info['weight_digest']}, expected {version}/{digest}"
                )
        return True

    wait_for(ok, 30, f"every engine serving version {version}")


def run_rollfleet(workdir: Path, sizes: list[int], reps: int, bucket_bytes: int, disk: bool) -> dict:
    from common.weights_digest import weights_digest

    cluster = Cluster(workdir / "cluster", rows=2000, rollout_batch_size=8, n_samples_per_prompt=4, max_new_tokens=64)
    out = {"broadcast": {}, "disk": {}, "first": None}
    try:
        cluster.start_coordinator("--no-sync")
        for i in range(AGENTS):
            cluster.start_agent(f"agent-{i}", "--no-sync", engines=ENGINES_PER_AGENT, concurrency=32)
        wait_for(lambda: len(serving_engines(cluster.status())) == RECEIVERS, 60, f"{RECEIVERS} healthy engines")
        progress(f"cluster ready: coordinator {cluster.address}, {AGENTS} agents x {ENGINES_PER_AGENT} sim engines")
        version = 0
        with cluster.client(timeout=300) as client:
            for size_mb in sizes:
                times = []
                for _ in range(reps + (1 if out["first"] is None else 0)):
                    version += 1
                    tensors = make_tensors(size_mb, float(version))
                    t0 = time.perf_counter()
                    result = client.update_weights(
                        tensors, version, backend="gloo", bucket_bytes=bucket_bytes, timeout=300
                    )
                    dt = time.perf_counter() - t0
                    if set(result.engines.values()) != {version} or len(result.engines) != RECEIVERS:
                        raise AssertionError(f"update {version}: engines answered {result.engines}")
                    check_engines(cluster, version, weights_digest(tensors.items()))
                    if out["first"] is None:
                        out["first"] = (size_mb, dt)
                        progress(f"broadcast {size_mb} MiB, first (forms the group): {dt:.3f}s")
                        continue
                    times.append(dt)
                    progress(f"broadcast {size_mb} MiB, rep {len(times)}: {dt:.3f}s")
                out["broadcast"][size_mb] = times
                if not disk:
                    continue
                ckpt = workdir / f"ckpt-{size_mb}"
                ckpt.mkdir()
                write_safetensors(ckpt / "model.safetensors", make_tensors(size_mb, -1.0))
                read_checkpoint(ckpt / "model.safetensors")  # page cache warm for both sides
                disk_times, read_times = [], []
                for rep in range(reps):
                    version += 1
                    t0 = time.perf_counter()
                    result = client.update_weights_from_disk(str(ckpt), version, timeout=300)
                    disk_times.append(time.perf_counter() - t0)
                    if set(result.engines.values()) != {version} or len(result.engines) != RECEIVERS:
                        raise AssertionError(f"disk update {version}: engines answered {result.engines}")
                    check_engines(cluster, version, None)
                    t0 = time.perf_counter()
                    read_checkpoint(ckpt / "model.safetensors")
                    read_times.append(time.perf_counter() - t0)
                    progress(f"disk {size_mb} MiB, rep {rep}: {disk_times[-1]:.3f}s (one read: {read_times[-1]:.3f}s)")
                out["disk"][size_mb] = (disk_times, read_times)
                shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        leaks = cluster.stop_all()
        if leaks:
            progress(f"cluster teardown found leaks: {leaks}")
    return out


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 MiB only, 3 repetitions (under a minute)")
    ap.add_argument("--sizes", default=None, help="tensor-set sizes in MiB, comma-separated (default 10,100)")
    ap.add_argument("--reps", type=int, default=None, help="measured repetitions per size (default 5, --quick 3)")
    ap.add_argument("--bucket-mb", type=int, default=32, help="bucket_bytes of update_weights, in MiB (default 32)")
    ap.add_argument("--no-disk", action="store_true", help="skip the disk updates")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    ap.add_argument("--floor-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floor-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in (args.sizes or ("10" if args.quick else "10,100")).split(",") if x]
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    if args.floor_rank is not None:
        return floor_rank(args)

    def on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-wu-"))
    started = time.monotonic()
    progress(
        f"workdir {workdir}; sizes {args.sizes} MiB, {args.reps} reps, bucket {args.bucket_mb} MiB, "
        f"{RECEIVERS} receiving engines"
    )
    try:
        progress(f"floor: plain gloo broadcast, rank 0 -> {RECEIVERS} ranks in separate processes")
        floor = run_floor(workdir, args.sizes, args.reps)
        for size_mb, times in floor.items():
            progress(f"floor {size_mb} MiB: median {median(times):.3f}s over {times}")
        rf = run_rollfleet(workdir, args.sizes, args.reps, args.bucket_mb * MB, not args.no_disk)
    finally:
        if args.keep:
            progress(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    common = {"quick": args.quick, "reps": args.reps, "receivers": RECEIVERS, "bucket_mb": args.bucket_mb}
    first_mb, first_s = rf["first"]
    emit("first_update_s", round(first_s, 4), "s", size_mb=first_mb, note="forms the update group", **common)
    for size_mb in args.sizes:
        up, fl = median(rf["broadcast"][size_mb]), median(floor[size_mb])
        emit(
            "update_s",
            round(up, 4),
            "s",
            size_mb=size_mb,
            samples=[round(x, 4) for x in rf["broadcast"][size_mb]],
            mb_per_s=round(size_mb / up, 1),
            **common,
        )
        emit(
            "floor_broadcast_s",
            round(fl, 4),
            "s",
            size_mb=size_mb,
            samples=[round(x, 4) for x in floor[size_mb]],
            mb_per_s=round(size_mb / fl, 1),
            **common,
        )
        emit("ratio_to_floor", round(up / fl, 2), "ratio", size_mb=size_mb, path="broadcast", **common)
        if size_mb in rf["disk"]:
            disk_times, read_times = rf["disk"][size_mb]
            dk, rd = median(disk_times), median(read_times)
            emit(
                "disk_update_s", round(dk, 4), "s", size_mb=size_mb, samples=[round(x, 4) for x in disk_times], **common
            )
            emit(
                "floor_read_s",
                round(rd, 4),
                "s",
                size_mb=size_mb,
                samples=[round(x, 4) for x in read_times],
                mb_per_s=round(size_mb / rd, 1),
                **common,
            )
            emit("disk_ratio_to_floor", round(dk / rd, 2), "ratio", size_mb=size_mb, path="disk", **common)
    summary = {
        f"{k}_{s}mb": round(median(v[s]) if k == "update" else median(v[s][0]), 4)
        for k, v in (("update", rf["broadcast"]), ("disk", rf["disk"]))
        for s in v
    }
    summary.update({f"ratio_{s}mb": round(median(rf["broadcast"][s]) / median(floor[s]), 2) for s in args.sizes})
    summary.update(
        {f"disk_ratio_{s}mb": round(median(rf["disk"][s][0]) / median(rf["disk"][s][1]), 2) for s in rf["disk"]}
    )
    emit("summary", summary, "mixed", elapsed_s=round(time.monotonic() - started, 1), **common)
    progress(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
