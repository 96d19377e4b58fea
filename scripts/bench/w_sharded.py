#!/usr/bin/env python3
"""Sharded trainers (issue 41): each rank fetching its own share, against rank 0 fetching and scattering.

Three parts, each with its floor measured in the same run:

fetch
    ``coordinator serve`` + 2 agents x 2 sim engines on loopback (``harness.cluster``) generate ``--batches``
    batches of ``--groups`` groups x ``--samples`` samples (long-tailed responses), first for a trainer of one
    process; they are then asked again, unchanged (a batch is idempotent by rollout id), by trainers of
    W = 1, 2, 4 processes, one ``gloo`` group each (``torch.distributed``, loopback):
    - ``sharded``: every rank calls ``RolloutClient(rank=R, world_size=W).generate(t)`` and fetches its own
      share straight from the agents; a barrier after each batch. Per batch, the wall time from the barrier
      before to the barrier after (every rank holds its share).
    - ``scatter`` (the floor, what a data-parallel trainer does without ranks): rank 0 alone calls
      ``generate(t)`` for the whole batch and sends each rank its groups (``scatter_object_list``, the same
      whole groups); the same window.
    Reported per W: the median seconds per batch, payload MB/s per batch, and ``ratio_to_scatter``
    (sharded / scatter; below 1: faster).
padding
    A long-tailed batch (Pareto response lengths, ``--groups`` x ``--samples``) as ``to_tensors()`` pads it
    (rows x the longest sample) against ``micro_batches(max_tokens)`` packing it: the fraction of padding in
    each, and the packed micro-batches' fill of their token budget. Pure computation, no fleet.

    python scripts/bench/w_sharded.py --quick      # 4 batches of 16 groups, W = 1, 2
    python scripts/bench/w_sharded.py              # 8 batches of 32 groups, W = 1, 2, 4

Output: one JSON object per line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.cluster import Cluster, free_port  # noqa: E402
from scripts.bench.benchlib import run_ranks  # noqa: E402

BENCH = "sharded"
SIM = "--token-latency-ms 0.2 --output-len-median {median}"


def progress(msg: str) -> None:
    print(f"[w-sharded {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


# ---------------------------------------------------------------------- one rank (a subprocess)


def rank_main(args) -> int:
    """One rank of a trainer of ``args.world`` processes, timing ``args.batches`` batches in ``args.mode``."""
    import torch.distributed as dist

    from coordinator.client import RolloutClient

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sharded = args.mode == "sharded"
    client = None
    if sharded or rank == 0:
        client = RolloutClient(
            args.address, rank=rank if sharded else 0, world_size=world if sharded else 1, run=args.run, timeout=120
        )
    times, sizes = [], []
    for t in range(args.batches):
        dist.barrier()
        t0 = time.perf_counter()
        if sharded:
            groups = client.generate(t).groups
        else:
            scattered: list = [None]
            parts = None
            if rank == 0:
                whole = client.generate(t).groups
                parts = [whole[r::world] for r in range(world)]
            dist.scatter_object_list(scattered, parts, src=0)
            groups = scattered[0]
        dist.barrier()
        times.append(time.perf_counter() - t0)
        sizes.append(sum(len(s.prompt_tokens) + len(s.response_tokens) for g in groups for s in g.samples))
    if client is not None:
        client.close()
    totals: list = [None] * world
    dist.all_gather_object(totals, sum(sizes))
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"times": times, "tokens": sum(totals)}), flush=True)
    return 0


def run_trainer(workdir: Path, address: str, mode: str, world: int, batches: int) -> dict:
    port = free_port("127.0.0.1")
    argvs = []
    for rank in range(world):
        env = f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} RANK={rank} WORLD_SIZE={world}"
        argvs.append(
            [
                "env",
                *env.split(),
                sys.executable,
                __file__,
                "--rank-of",
                address,
                "--mode",
                mode,
                "--batches",
                str(batches),
                "--run",
                f"{mode}-{world}-{port}",
            ]
        )
    return json.loads(run_ranks(workdir, argvs, timeout=600))


# ---------------------------------------------------------------------- parts


def fetch_part(args, workdir: Path) -> None:
    cluster = Cluster(
        workdir / "cluster",
        rows=max(400, args.batches * args.groups * 2),
        dynamic_filter="none",
        rollout_batch_size=args.groups,
        n_samples_per_prompt=args.samples,
        max_new_tokens=8 * args.response_median,
    )
    try:
        cluster.start_coordinator()
        for name in ("a1", "a2"):
            cluster.start_agent(name, engines=2, concurrency=64, sim_args=SIM.format(median=args.response_median))
        progress(f"generating {args.batches} batches of {args.groups} groups x {args.samples} samples")
        with cluster.client() as client:
            for t in range(args.batches):
                client.generate(t)
        for world in args.worlds:
            for mode in ("scatter", "sharded"):
                out = run_trainer(workdir, cluster.address, mode, world, args.batches)
                times = out["times"][1:] or out["times"]  # the first batch connects: left out
                per_batch = statistics.median(times)
                mb = out["tokens"] * 4 / args.batches / (1 << 20)  # int32 tokens: a lower bound of the payload
                progress(f"W={world} {mode}: {per_batch * 1e3:.1f} ms per batch")
                emit(f"{mode}_batch_s", round(per_batch, 5), "s", world=world, token_mb_per_s=round(mb / per_batch, 2))
                if mode == "scatter":
                    floor = per_batch
                else:
                    emit("ratio_to_scatter", round(per_batch / floor, 3), "x", world=world)
    finally:
        cluster.stop_all()


def padding_part(args) -> None:
    from common.types import Group, Sample
    from coordinator.batch import RolloutBatch

    rng = random.Random(0)
    groups = []
    for i in range(args.groups):
        samples = []
        for _ in range(args.samples):
            prompt = 64 + rng.randrange(64)
            response = min(8192, int(64 * rng.paretovariate(1.3)))
            samples.append(
                Sample(
                    list(range(prompt)), list(range(response)), [0.0] * response, [1] * response, 0.0, "completed", "0"
                )
            )
        groups.append(Group(index=i, samples=samples))
    batch = RolloutBatch(0, groups, {})
    real = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in batch.samples)
    padded = batch.to_tensors()["tokens"].numel()
    emit("to_tensors_padding_fraction", round(1 - real / padded, 4), "fraction", tokens=real, padded=padded)
    for budget in (4096, 16384):
        micro = batch.micro_batches(budget)
        packed = sum(m["tokens"].numel() for m in micro)
        fill = real / (len(micro) * budget)
        emit(
            "micro_batches_padding_fraction",
            round(1 - real / packed, 4),
            "fraction",
            max_tokens=budget,
            micro_batches=len(micro),
            budget_fill=round(fill, 4),
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 batches of 16 groups, W = 1 and 2")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response-median", type=int, default=512, help="the sim engines' median response tokens")
    ap.add_argument("--part", choices=("all", "fetch", "padding"), default="all")
    ap.add_argument("--rank-of", dest="address", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("sharded", "scatter"), help=argparse.SUPPRESS)
    ap.add_argument("--run", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.address:
        return rank_main(args)
    args.worlds = (1, 2) if args.quick else (1, 2, 4)
    if args.quick:
        args.batches, args.groups, args.response_median = 4, 16, 64
    if args.part in ("all", "padding"):
        padding_part(args)
    if args.part in ("all", "fetch"):
        with tempfile.TemporaryDirectory(prefix="w-sharded-") as tmp:
            fetch_part(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
