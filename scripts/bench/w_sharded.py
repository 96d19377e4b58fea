#!/usr/bin/env python3
"""Sharded trainers (issue 41): per-rank fetches, packed micro-batches, pushes from every rank, each against a floor.

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
push
    An FSDP2 weight push from W = 1, 2, 4 trainer processes (one ``gloo`` group each, loopback). Every rank
    builds the same model, a stack of ``nn.Linear(1024, 1024)`` of ``--push-mb`` MB of float32 parameters,
    wrapped with ``fully_shard`` (each layer, then the whole model); ranks hold 1/W of each parameter.
    - ``floor`` first (no fleet running): W trainer ranks and 4 receiver ranks in ONE plain gloo group. Per
      repetition, bucket by bucket (``--bucket-mb``, the rule and order of ``update_weights``' plan), every
      trainer rank gathers each parameter (``full_tensor()``) and trainer rank 0 ``dist.broadcast``s it to the
      4 receivers (a group of rank 0 and them), which allocate and receive; a barrier after the last bucket.
      ``floor_push_s``: rank 0's time from the barrier before to the barrier after.
    - ``push``: ``coordinator serve`` + 2 agents x 2 sim engines on loopback; every rank calls
      ``RolloutClient(rank=R, world_size=W, run=<this launch>).update_weights(model.named_parameters(),
      version, backend="gloo")`` (the same bytes, the same buckets). ``push_s``: rank 0's wall time of the call
      (it returns once every engine serves the version), after a barrier. Each launch's first push forms the
      engines' group: reported apart (``first_push_s``; the run's very first also loads torch in the sims).
      Versions count up across launches. Outside the timed windows the ranks nudge every parameter before each
      push, and after a launch's last push every engine's weight digest must be the full model's.
      At W = 1 (``world_size=1``: the one-process path, which does not take DTensors) the rank passes
      ``p.full_tensor()`` instead, gathered inside the window.
    Reported per W: the medians over ``--reps`` (after one warm-up) and ``ratio_to_floor`` (push / floor).

    python scripts/bench/w_sharded.py --quick      # 4 batches of 16 groups, a 16 MB push; W = 1, 2
    python scripts/bench/w_sharded.py              # 8 batches of 32 groups, a 64 MB push; W = 1, 2, 4
    python scripts/bench/w_sharded.py --quick --part push

Output: one JSON object per line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from coordinator.client_weights import DEFAULT_BUCKET_BYTES  # noqa: E402
from harness.chaos_evidence import serving_engines  # noqa: E402
from harness.cluster import Cluster, free_port  # noqa: E402
from harness.polling import wait_for  # noqa: E402
from scripts.bench.benchlib import run_ranks  # noqa: E402

BENCH = "sharded"
SIM = "--token-latency-ms 0.2 --output-len-median {median}"
MB = 1 << 20
HIDDEN = 1024  # the push model's layers: nn.Linear(HIDDEN, HIDDEN), about 4 MB each
RECEIVERS = 4  # 2 agents x 2 sim engines


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


# ---------------------------------------------------------------------- push: one rank (a subprocess)


def push_layers(push_mb: float) -> int:
    """How many ``nn.Linear(HIDDEN, HIDDEN)`` make ``push_mb`` MB of float32 parameters (weights and biases)."""
    return max(1, round(push_mb * MB / ((HIDDEN * HIDDEN + HIDDEN) * 4)))


def push_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the push model's parameters, in ``named_parameters()`` order."""
    return [
        (f"{i}.{kind}", shape)
        for i in range(layers)
        for kind, shape in (("weight", (HIDDEN, HIDDEN)), ("bias", (HIDDEN,)))
    ]


def push_buckets(shapes: list, bucket_bytes: int) -> list[list]:
    """The buckets ``update_weights`` gathers and sends, in its order (``coordinator/trainer_group.make_plan``'s
    rule on the full tensors' sizes: a new bucket when the next tensor would overflow a non-empty one)."""
    out: list[list] = []
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * 4
        if not out or (size + nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append((name, shape))
        size += nbytes
    return out


def sharded_model(layers: int, mesh=None):
    """The same model on every rank (seeded), each layer then the whole wrapped with FSDP2's ``fully_shard``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def floor_push(args, rank: int, world: int, layers: int, bucket_bytes: int) -> dict:
    """The floor: ranks below ``world - RECEIVERS`` are the FSDP2 trainer, the others receive. Bucket by bucket,
    every trainer rank gathers each parameter and trainer rank 0 broadcasts it to the receivers."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    trainers = world - RECEIVERS
    trainer_group = dist.new_group(list(range(trainers)))  # every rank makes both groups (a collective)
    senders = dist.new_group([0, *range(trainers, world)])  # rank 0 and the receivers, as the engines' group
    plan = push_buckets(push_shapes(layers), bucket_bytes)
    params = {}
    if rank < trainers:
        params = dict(sharded_model(layers, DeviceMesh.from_group(trainer_group, "cpu")).named_parameters())
    times = []
    for _ in range(args.reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for bucket in plan:
            with torch.no_grad():
                if rank < trainers:
                    full = [params[name].full_tensor() for name, _ in bucket]
                else:
                    full = [torch.empty(shape, dtype=torch.float32) for _, shape in bucket]
                if rank == 0 or rank >= trainers:
                    for tensor in full:
                        dist.broadcast(tensor, src=0, group=senders)
            del full
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"times": times[1:], "first": times[0]}


def fleet_push(args, rank: int, world: int, layers: int, bucket_bytes: int) -> dict:
    """rollfleet: every rank pushes its shards with ``update_weights``; versions from ``args.first_version``."""
    import torch
    import torch.distributed as dist

    from common.weights_digest import weights_digest
    from coordinator.client import RolloutClient

    model = sharded_model(layers)
    client = RolloutClient(args.address, rank=rank, world_size=world, run=args.run, timeout=120)
    times, version = [], args.first_version
    try:
        for _ in range(args.reps + 1):
            with torch.no_grad():  # a training step's new weights, outside the window
                for p in model.parameters():
                    p.add_(1.0)
            named = [(n, p.detach()) for n, p in model.named_parameters()]
            dist.barrier()
            t0 = time.perf_counter()
            if world == 1:  # the one-process path takes no DTensors: gathered here (a 1-rank mesh: a local copy)
                with torch.no_grad():
                    named = [(n, p.full_tensor()) for n, p in named]
            result = client.update_weights(named, version, backend="gloo", bucket_bytes=bucket_bytes, timeout=120)
            times.append(time.perf_counter() - t0)
            if len(result.engines) != RECEIVERS or set(result.engines.values()) != {version}:
                raise AssertionError(f"push {version}: engines answered {result.engines}")
            version += 1
        with torch.no_grad():  # every rank gathers (a collective); rank 0 hashes the full model
            full = [(n, p.full_tensor()) for n, p in model.named_parameters()]
        digest = weights_digest(full) if rank == 0 else None
    finally:
        client.close()
    return {"times": times[1:], "first": times[0], "version": version - 1, "digest": digest}


def push_rank_main(args) -> int:
    """One rank of a push launch (``--push-of floor`` or a coordinator's address); rank 0 prints its times."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    layers, bucket_bytes = push_layers(args.push_mb), int(args.bucket_mb * MB)
    if args.push_of == "floor":
        out = floor_push(args, rank, world, layers, bucket_bytes)
    else:
        args.address = args.push_of
        out = fleet_push(args, rank, world, layers, bucket_bytes)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


def run_push(workdir: Path, target: str, world: int, args, first_version: int = 0) -> dict:
    """A launch of ``world`` trainer ranks (plus the floor's receivers when ``target`` is ``floor``)."""
    port = free_port("127.0.0.1")
    ranks = world + (RECEIVERS if target == "floor" else 0)
    argvs = [
        [
            "env",
            *f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} RANK={rank} WORLD_SIZE={ranks}".split(),
            sys.executable,
            "-W",
            "ignore",
            __file__,
            "--push-of",
            target,
            "--push-mb",
            str(args.push_mb),
            "--bucket-mb",
            str(args.bucket_mb),
            "--reps",
            str(args.reps),
            "--first-version",
            str(first_version),
            "--run",
            f"push-{world}-{port}",
        ]
        for rank in range(ranks)
    ]
    return json.loads(run_ranks(workdir, argvs, timeout=600))


def check_engines(cluster: Cluster, version: int, digest: str) -> None:
    """Every engine serves ``version`` with the trainer's full model (``/model_info``'s digest)."""

    def ok() -> bool:
        urls = serving_engines(cluster.status())
        if len(urls) != RECEIVERS:
            return False
        for url in urls.values():
            with urllib.request.urlopen(f"{url}/model_info", timeout=10) as resp:
                info = json.loads(resp.read())
            if info["weight_version"] != str(version) or info["weight_digest"] != digest:
                raise AssertionError(
                    f"{url}: {info['weight_version']}/{info['weight_digest']}, expected {version}/{digest}"
                )
        return True

    wait_for(ok, 30, f"every engine serving version {version}")


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


def push_part(args, workdir: Path) -> None:
    mb = round(push_layers(args.push_mb) * (HIDDEN * HIDDEN + HIDDEN) * 4 / MB, 2)
    common = {"mb": mb, "reps": args.reps, "bucket_mb": args.bucket_mb, "receivers": RECEIVERS}
    floors = {}
    for world in args.worlds:  # first, with no fleet running
        floors[world] = run_push(workdir, "floor", world, args)
        progress(
            f"push floor W={world}: {statistics.median(floors[world]['times']):.3f}s ({mb} MB, {RECEIVERS} receivers)"
        )
    cluster = Cluster(
        workdir / "push-cluster", rows=2000, rollout_batch_size=8, n_samples_per_prompt=4, max_new_tokens=64
    )
    pushes = {}
    try:
        cluster.start_coordinator("--no-sync")
        for name in ("a1", "a2"):
            cluster.start_agent(name, "--no-sync", engines=RECEIVERS // 2, concurrency=32)
        wait_for(lambda: len(serving_engines(cluster.status())) == RECEIVERS, 60, f"{RECEIVERS} healthy engines")
        version = 1  # the fleet takes only a version above its own: counted across every launch
        for world in args.worlds:
            out = run_push(workdir, cluster.address, world, args, version)
            check_engines(cluster, out["version"], out["digest"])
            version = out["version"] + 1
            pushes[world] = out
            progress(
                f"push W={world}: {statistics.median(out['times']):.3f}s (first, forms the group: {out['first']:.3f}s)"
            )
    finally:
        leaks = cluster.stop_all()
        if leaks:
            progress(f"cluster teardown found leaks: {leaks}")
    for world in args.worlds:
        push, floor = statistics.median(pushes[world]["times"]), statistics.median(floors[world]["times"])
        samples = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
        emit(
            "push_s",
            round(push, 4),
            "s",
            world=world,
            samples=samples(pushes[world]["times"]),
            first_push_s=round(pushes[world]["first"], 4),
            mb_per_s=round(mb / push, 1),
            **common,
        )
        emit(
            "floor_push_s",
            round(floor, 4),
            "s",
            world=world,
            samples=samples(floors[world]["times"]),
            mb_per_s=round(mb / floor, 1),
            **common,
        )
        emit("ratio_to_floor", round(push / floor, 2), "x", world=world, **common)


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
    ap.add_argument("--push-mb", type=float, default=None, help="the push model's MB of float32 (64; --quick 16)")
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / MB, help="update_weights' bucket_bytes")
    ap.add_argument("--reps", type=int, default=3, help="timed pushes per W, after one warm-up")
    ap.add_argument("--part", choices=("all", "fetch", "padding", "push"), default="all")
    ap.add_argument("--rank-of", dest="address", help=argparse.SUPPRESS)
    ap.add_argument("--push-of", help=argparse.SUPPRESS)
    ap.add_argument("--first-version", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("sharded", "scatter"), help=argparse.SUPPRESS)
    ap.add_argument("--run", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.push_of:
        return push_rank_main(args)
    if args.address:
        return rank_main(args)
    args.worlds = (1, 2) if args.quick else (1, 2, 4)
    if args.quick:
        args.batches, args.groups, args.response_median = 4, 16, 64
    if args.push_mb is None:
        args.push_mb = 16 if args.quick else 64
    if args.part in ("all", "padding"):
        padding_part(args)
    if args.part in ("all", "fetch"):
        with tempfile.TemporaryDirectory(prefix="w-sharded-") as tmp:
            fetch_part(args, Path(tmp))
    if args.part in ("all", "push"):
        with tempfile.TemporaryDirectory(prefix="w-sharded-push-") as tmp:
            push_part(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
