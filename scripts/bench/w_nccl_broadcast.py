"""Weight broadcast over NCCL: the trainer on one GPU, an hf engine on another.

What it runs (issue 28), one sitting, JSON lines on stdout and progress on stderr:

1. **Floor.** Two new processes form a plain ``torch.distributed`` group of the same backend, rank 0
   on the trainer's device and rank 1 on the engine's. Rank 0 broadcasts the tensors of each size
   (the model's first parameters up to that size, same shapes and dtypes); rank 1 receives each into
   a new tensor. The window closes when both ranks have every byte (a CUDA synchronize, then a
   barrier). The first repetition is warm-up.
2. **The fleet.** ``coordinator serve`` and one ``agent join --engine hf`` whose engine runs on the
   engine GPU (``CUDA_VISIBLE_DEVICES`` and ``--device cuda``). This process is the trainer: it holds
   the same model (``agent make-model``) on its GPU. For each of ``--steps`` steps it takes a batch,
   checks that the samples' logprobs equal its own recompute (fp32: under 1e-3), nudges every
   parameter, pushes them with ``update_weights(..., backend)`` and checks that the engine's
   ``weight_digest`` equals its own.
3. **Latency.** ``update_weights`` of each size's tensors, ``--reps`` times: median against the floor.
4. **Bucket sweep.** The largest size at each ``--bucket-mb``.
5. **An engine SIGKILLed before an update.** With engines left the update succeeds without the dead one;
   with none (this run has one engine, as two GPUs allow) the coordinator refuses it at once, naming why,
   and releases the lock. Either way the restarted engine is brought to the fleet's version by
   ``catch_up`` over the same backend (a new group with a new engine process), then takes a push and
   serves the trainer's logprobs.

    python scripts/bench/w_nccl_broadcast.py                   # two GPUs, NCCL, a ~1 GiB model
    python scripts/bench/w_nccl_broadcast.py --cpu --quick     # the same run on CPU over gloo

NVLink multicast stays off here and in every child process (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``) unless the caller set them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.errors import WeightUpdateError  # noqa: E402
from coordinator.client import WeightUpdateResult  # noqa: E402
from harness.chaos_check import NO_ENGINE_UP  # noqa: E402
from harness.chaos_evidence import serving_engines  # noqa: E402
from harness.cluster import Cluster, free_port  # noqa: E402
from harness.polling import wait_for  # noqa: E402
from scripts.bench.benchlib import end_floor, floor_times, progress, run_ranks  # noqa: E402

BENCH = "nccl_broadcast"
MB = 1 << 20
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# About 1 GiB of float32 parameters (253 M); --quick and --cpu use the tiny preset.
LARGE_MODEL = ["--hidden-size", "2048", "--layers", "5", "--heads", "16", "--intermediate-size", "5504"]
LOGPROB_TOLERANCE = 1e-3


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def prefix_of(named: list[tuple[str, object]], size_mb: int) -> list[tuple[str, object]]:
    """The first tensors of ``named`` up to ``size_mb`` (at least one; all of them if they are smaller)."""
    out, total = [], 0
    for name, tensor in named:
        if out and total + tensor.numel() * tensor.element_size() > size_mb * MB:
            break
        out.append((name, tensor))
        total += tensor.numel() * tensor.element_size()
    return out


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


# --------------------------------------------------------------------------- floor


def floor_rank(args) -> int:
    """One rank of the floor group; rank 0 prints ``{size_mb: [seconds per repetition]}`` as JSON."""
    import torch
    import torch.distributed as dist

    device = args.trainer_device if args.floor_rank == 0 else args.engine_device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        args.backend,
        init_method=f"tcp://127.0.0.1:{args.floor_port}",
        rank=args.floor_rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    specs = json.loads(Path(args.floor_specs).read_text())
    out = {}
    for size_mb, tensors in specs.items():
        dtypes = [getattr(torch, d) for _, d in tensors]
        sent = (
            [torch.full(shape, 0.5, dtype=dt, device=device) for (shape, _), dt in zip(tensors, dtypes, strict=True)]
            if args.floor_rank == 0
            else None
        )
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        out[size_mb] = floor_times(
            args.reps,
            lambda: (
                sent[i] if sent is not None else torch.empty(shape, dtype=dt, device=device)
                for i, ((shape, _), dt) in enumerate(zip(tensors, dtypes, strict=True))
            ),
            sync,
        )
    return end_floor(out, args.floor_rank)


def run_floor(workdir: Path, named, sizes: list[int], args) -> dict[int, list[float]]:
    specs = {
        str(size): [(list(t.shape), str(t.dtype).removeprefix("torch.")) for _, t in prefix_of(named, size)]
        for size in sizes
    }
    spec_file = workdir / "floor-specs.json"
    spec_file.write_text(json.dumps(specs))
    port = free_port()
    argvs = []
    for rank in (0, 1):
        argv = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--floor-rank", str(rank)]
        argv += ["--floor-port", str(port), "--floor-specs", str(spec_file), "--reps", str(args.reps)]
        argvs.append(argv + ["--backend", args.backend, "--trainer-device", args.trainer_device,
                             "--engine-device", args.engine_device])  # fmt: skip
    return {int(k): v for k, v in json.loads(run_ranks(workdir, argvs)).items()}


# --------------------------------------------------------------------------- the fleet


def model_info(cluster: Cluster, agent: str) -> dict:
    """The ``/model_info`` of the agent's healthy engine; {} if it has none."""
    urls = [url for key, url in serving_engines(cluster.status()).items() if key.startswith(f"{agent}/")]
    if not urls:
        return {}
    with urllib.request.urlopen(f"{urls[0]}/model_info", timeout=30) as resp:
        return json.loads(resp.read())


def logprob_gap(model, samples, device: str) -> float:
    """The largest |engine logprob - this model's recompute| over ``samples``."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = list(s.prompt_tokens) + list(s.response_tokens)
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
            n = len(s.prompt_tokens)
            picked = torch.tensor(s.response_tokens, device=device)[:, None]
            ref = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, picked)[:, 0].cpu()
            worst = max(worst, float((ref - torch.tensor(s.response_logprobs)).abs().max()))
    return worst


class Fleet:
    """The cluster, the trainer's model and the checks run after each push."""

    def __init__(self, workdir: Path, model_dir: str, args):
        from agent.hf.model import load_model

        self.args = args
        self.cluster = Cluster(
            workdir / "cluster",
            rollout_batch_size=4,
            n_samples_per_prompt=2,
            max_new_tokens=16,
            dynamic_filter="none",
            max_staleness=0,  # every batch is generated on the weights pushed last: the trainer recomputes them
        )
        self.model, _ = load_model(model_dir, device=args.trainer_device, dtype="float32")
        self.version = 0
        self.rollout_id = 0
        self.model_dir = model_dir

    def start(self) -> None:
        self.cluster.start_coordinator()
        gpu = self.args.engine_device
        if gpu.startswith("cuda"):
            visible = gpu.split(":")[1] if ":" in gpu else "0"
            wrap = lambda argv: ["env", f"CUDA_VISIBLE_DEVICES={visible}", *argv]  # noqa: E731
            hf_args = "--device cuda --dtype float32 --threads 4"
        else:
            wrap, hf_args = None, "--device cpu --dtype float32 --threads 1"
        self.cluster.start_agent(
            "gpu-agent", "--model-path", self.model_dir, f"--hf-args={hf_args}", engine="hf", wrap=wrap
        )
        self.client = self.cluster.client(timeout=600)

    def named(self):
        return list(self.model.named_parameters())

    def push(self, named, *, bucket_mb: int | None = None) -> tuple[float, WeightUpdateResult]:
        self.version += 1
        bucket = (bucket_mb or self.args.bucket_mb) * MB
        t0 = time.perf_counter()
        result = self.client.update_weights(
            named, self.version, backend=self.args.backend, bucket_bytes=bucket, timeout=600
        )
        return time.perf_counter() - t0, result

    def check_batch(self) -> tuple[float, int]:
        """The samples of the next batch generated wholly on the current version (or of up to two more
        batches, when groups begun before the last push filled it) against this model: (largest gap,
        samples compared)."""
        label = str(self.version) if self.version else "default"
        seen: set[str] = set()
        for _ in range(3):
            batch = self.client.generate(self.rollout_id)
            self.rollout_id += 1
            # Only samples generated wholly on the current weights: one caught by the push in flight has an
            # earlier span (partial rollouts), whose logprobs are the earlier weights'.
            samples = [s for s in batch.samples if {str(v) for v, _, _ in s.weight_versions} == {label}]
            seen |= {s.weight_version for s in batch.samples}
            if samples:
                break
        else:
            raise AssertionError(f"three batches held no sample generated on version {label}: {sorted(seen)}")
        gap = logprob_gap(self.model, samples, self.args.trainer_device)
        if gap >= LOGPROB_TOLERANCE:
            raise AssertionError(f"version {label}: engine logprobs differ from the trainer's by {gap:.2e}")
        return gap, len(samples)

    def check_digest(self) -> None:
        from common.weights_digest import weights_digest

        ours = weights_digest((n, p.detach()) for n, p in self.model.named_parameters())
        info = model_info(self.cluster, "gpu-agent")
        if (info.get("weight_version"), info.get("weight_digest")) != (str(self.version), ours):
            raise AssertionError(f"engine holds {info.get('weight_version')}/{info.get('weight_digest')}, "
                                 f"the trainer {self.version}/{ours}")  # fmt: skip

    def nudge(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(0.999)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.cluster.stop_all()


def run(args) -> int:
    import torch

    from agent.hf.model import make_model

    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"--backend nccl needs two GPUs; torch sees {torch.cuda.device_count()} (use --cpu)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-nccl-"))
    progress(f"workdir {workdir}")
    model_dir = str(workdir / "model")
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    overrides = {} if args.quick else dict(zip(fields, map(int, LARGE_MODEL[1::2]), strict=True))
    summary = make_model(model_dir, **overrides)
    progress(f"model: {summary.get('parameters')} parameters")
    fleet = Fleet(workdir, model_dir, args)
    named = fleet.named()
    total_mb = nbytes(named) / MB
    sizes = sorted({min(s, int(total_mb) + 1) for s in args.sizes})
    emit("model_mb", round(total_mb, 1), "MiB", tensors=len(named), backend=args.backend)

    progress(f"floor: bare {args.backend} broadcast of {sizes} MiB, {args.reps} repetitions")
    floor = run_floor(workdir, named, sizes, args)
    results: dict = {}
    try:
        progress("starting the fleet")
        fleet.start()
        gaps = []
        for step in range(args.steps):
            gap, n = fleet.check_batch()
            gaps.append(gap)
            fleet.nudge()
            took, _ = fleet.push(fleet.named())
            fleet.check_digest()
            progress(f"step {step}: {n} samples within {gap:.1e}, push of {total_mb:.0f} MiB took {took:.3f} s")
            emit("step_update_s", round(took, 4), "s", step=step, first=step == 0)
        gap, _ = fleet.check_batch()
        gaps.append(gap)
        emit("logprob_gap_max", max(gaps), "nats", steps=args.steps, tolerance=LOGPROB_TOLERANCE)

        for size in sizes:
            part = prefix_of(fleet.named(), size)
            times = [fleet.push(part, bucket_mb=max(size, args.bucket_mb))[0] for _ in range(args.reps)]
            fleet.check_digest()
            update, bare = statistics.median(times), statistics.median(floor[size])
            ratio = update / bare
            emit("update_s", round(update, 4), "s", size_mb=size, samples=[round(t, 4) for t in times])
            emit("floor_broadcast_s", round(bare, 4), "s", size_mb=size, samples=[round(t, 4) for t in floor[size]])
            emit("ratio_to_floor", round(ratio, 2), "ratio", size_mb=size, target=1.3)
            results[f"ratio_{size}mb"] = round(ratio, 2)

        largest = prefix_of(fleet.named(), sizes[-1])
        for bucket_mb in args.sweep:
            times = [fleet.push(largest, bucket_mb=bucket_mb)[0] for _ in range(max(1, args.reps // 2))]
            results[f"sweep_{bucket_mb}mb"] = round(statistics.median(times), 4)
            emit("sweep_update_s", results[f"sweep_{bucket_mb}mb"], "s", size_mb=sizes[-1], bucket_mb=bucket_mb)
        fleet.check_digest()

        progress("SIGKILL of the engine, then an update")
        victim = fleet.cluster.engine_pids_of("gpu-agent")[0]
        os.kill(victim, signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            took, result = fleet.push(fleet.named())
            emit("update_after_kill_s", round(took, 4), "s", engines=result.engines, retried=result.retried)
            results["update_after_kill_s"] = round(took, 4)
        except WeightUpdateError as exc:
            # With one engine in the fleet there is nobody to receive it: refused at once, lock released.
            if NO_ENGINE_UP not in str(exc):
                raise
            fleet.version -= 1
            emit("update_after_kill_refused_s", round(time.perf_counter() - t0, 4), "s", error=str(exc)[:200])
            results["update_after_kill"] = "refused: no engine up"
        behind = wait_for(lambda: fleet.client.stats().weights.behind, 600, "the killed engine to restart behind")
        t0 = time.perf_counter()
        caught = fleet.client.catch_up(fleet.named(), fleet.version, backend=args.backend, timeout=600)
        emit("catch_up_s", round(time.perf_counter() - t0, 4), "s", engines=caught.engines, behind=behind)
        results["catch_up_s"] = round(time.perf_counter() - t0, 4)
        fleet.check_digest()
        fleet.nudge()
        took, result = fleet.push(fleet.named())
        fleet.check_digest()
        gap, n = fleet.check_batch()
        emit("update_after_restart_s", round(took, 4), "s", engines=result.engines)
        emit("logprob_gap_after_restart", gap, "nats", samples=n)
    finally:
        fleet.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    emit("summary", results, "", backend=args.backend, trainer=args.trainer_device, engine=args.engine_device)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU: trainer and engine on this machine's CPU")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 steps, 2 repetitions")
    ap.add_argument("--sizes", default="100,1024", help="update sizes in MiB, comma-separated (default 100,1024)")
    ap.add_argument("--sweep", default="64,256,1024", help="bucket_bytes of the sweep, MiB (default 64,256,1024)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket_bytes of the steps, MiB (default 512)")
    ap.add_argument("--steps", type=int, default=None, help="train steps with a push each (default 4, --quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per size (default 5, --quick 2)")
    ap.add_argument("--trainer-device", default=None, help="default cuda:0 (cpu with --cpu)")
    ap.add_argument("--engine-device", default=None, help="default cuda:1 (cpu with --cpu)")
    ap.add_argument("--backend", default=None, help="default nccl (gloo with --cpu)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, model)")
    ap.add_argument("--floor-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floor-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--floor-specs", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.backend = args.backend or ("gloo" if args.cpu else "nccl")
    args.trainer_device = args.trainer_device or ("cpu" if args.cpu else "cuda:0")
    args.engine_device = args.engine_device or ("cpu" if args.cpu else "cuda:1")
    args.reps = args.reps or (2 if args.quick else 5)
    if args.floor_rank is not None:
        return floor_rank(args)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 4)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.sweep = [int(s) for s in args.sweep.split(",")]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
