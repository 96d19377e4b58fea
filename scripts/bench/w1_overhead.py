#!/usr/bin/env python
"""W1 — orchestration overhead (the ceiling), as the benchmark brief defines it.

Three measurements in one run, never at the same time (2 shared cores):

floor
    Two freshly started sim engines (instant mode, 512 fixed output tokens),
    driven by a bare aiohttp client in its own process: 256 concurrent
    ``/generate`` requests per engine, each the shape the agent sends (256
    input ids, the coordinator's sampling params, ``return_logprob``), each
    body read whole and not decoded. Its throughput and its own CPU per sample
    are the floor.
agent floor
    The agent's hot path alone on two fresh engines of the same flags
    (``w1_floors.py agent``): groups of 8 calls, orjson decode, msgpack encode
    and an LMDB sync commit, none of rollfleet's machinery. The agents' CPU
    per sample is compared with its CPU per sample.
rollfleet
    ``coordinator serve`` + 2 x ``agent join`` (1 sim engine each, identical
    sim flags, ``--concurrency 256`` = 32 groups of 8 in flight per agent),
    batch 64 groups, ``--dynamic-filter none``; this process is the trainer:
    it pulls batches with ``RolloutClient.generate`` and touches the token
    ids, logprobs and reward of every sample. The first batch is warm-up.

Throughput is samples delivered per second of wall time in the measured
window. CPU is user+sys from ``/proc/<pid>/stat`` of the coordinator and agent
processes (not their sim engine children, which are reported separately for
context) plus this process's own CPU (``time.process_time``) over the same
window; the floor client's CPU is measured the same way over its window.

Output: one JSON object per line on stdout; progress on stderr.

    python scripts/bench/w1_overhead.py --quick      # < 1 minute on 2 cores
    python scripts/bench/w1_overhead.py              # 30 measured batches
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (  # noqa: E402
    Proc,
    Procs,
    busy_cpu_seconds,
    children_of,
    coordinator_endpoint,
    cpu_seconds,
    venv_script,
    wait_until,
)

BENCH = "W1"
GROUP = 8
PROMPT_LEN = 256
OUTPUT_LEN = 512
BATCH_GROUPS = 64
AGENTS = 2
CONCURRENCY = 256  # samples per engine = 32 groups x 8
SIM_ARGS = ["--output-len-dist", "fixed", "--output-len-median", str(OUTPUT_LEN), "--token-latency-ms", "0"]
READY_TIMEOUT = 60.0


def progress(msg: str) -> None:
    print(f"[w1 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


# --------------------------------------------------------------------------- payload shape


def make_prompt(i: int) -> tuple[str, int]:
    """A 256-byte ASCII arithmetic question (the byte tokenizer: 1 byte = 1 token)."""
    a, b = 100 + (i * 37) % 900, 10 + (i * 11) % 90
    head = f"Question {i}: what is {a} + {b}? Think step by step and put the final answer in \\boxed{{}}. "
    filler = "Here is some context that pads the prompt to its benchmark length. "
    text = head + (filler * (PROMPT_LEN // len(filler) + 1))
    text = text[: PROMPT_LEN - len(f" {a} + {b} =")] + f" {a} + {b} ="
    assert len(text.encode("ascii")) == PROMPT_LEN
    return text, a + b


def sampling_params() -> dict:
    """What the coordinator sends: its config's sampling params (one source of truth)."""
    from common.config import RolloutConfig

    return RolloutConfig(max_new_tokens=OUTPUT_LEN, n_samples_per_prompt=GROUP).sampling_params()


# --------------------------------------------------------------------------- floor


def start_floor_engines(procs: Procs, n: int) -> list[tuple[Proc, str]]:
    from agent.engine_plan import plan_engines

    out = []
    for i, spec in enumerate(plan_engines("sim", count=n, sim_args=SIM_ARGS)):
        proc = procs.start(f"floor-engine-{i}", spec.argv)
        out.append(proc)

    def urls():
        found = []
        for proc in out:
            for line in proc.log_text().splitlines():
                if line.startswith("rollfleet-sim listening on "):
                    found.append(line.split()[-1])
                    break
        return found if len(found) == len(out) else None

    found = wait_until(urls, READY_TIMEOUT, "floor engines", check=procs.check)

    def healthy() -> bool:
        import urllib.request

        for url in found:
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=5) as r:
                    if r.status != 200:
                        return False
            except OSError:
                return False
        return True

    wait_until(healthy, READY_TIMEOUT, "floor engine health", check=procs.check)
    return list(zip(out, found, strict=True))


def run_floor(procs: Procs, kind: str, measured_samples: int, warmup_samples: int) -> dict:
    """One floor (``w1_floors.py``: ``bare`` or ``agent``) on fresh sim engines; its result dict."""
    progress(f"{kind} floor: starting {AGENTS} sim engines ({' '.join(SIM_ARGS)})")
    engines = start_floor_engines(procs, AGENTS)
    urls = [u for _, u in engines]
    engine_pids = [p.pid for p, _ in engines]
    progress(
        f"{kind} floor: {CONCURRENCY} concurrent requests per engine at {', '.join(urls)}; "
        f"{warmup_samples} warm-up + {measured_samples} measured samples"
    )
    argv = [sys.executable, str(Path(__file__).resolve().parent / "w1_floors.py"), kind, "--urls", ",".join(urls)]
    argv += ["--concurrency", str(CONCURRENCY), "--warmup", str(warmup_samples), "--measured", str(measured_samples)]
    argv += ["--engine-pids", ",".join(map(str, engine_pids)), "--dir", str(procs.workdir / f"{kind}-floor-store")]
    worker = procs.start(f"{kind}-floor-client", argv)
    rc = worker.popen.wait()
    if rc != 0:
        raise RuntimeError(f"{kind} floor client failed (exit {rc}):\n{worker.log_text()[-3000:]}")
    procs.items.remove(worker)
    result = json.loads(worker.log_text().strip().splitlines()[-1])
    procs.stop([p for p, _ in engines])
    return result


# --------------------------------------------------------------------------- rollfleet


def write_dataset(path: Path, rows: int) -> None:
    with open(path, "w") as f:
        for i in range(rows):
            prompt, label = make_prompt(i)
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")


def launcher(name: str, module: str, args, tag: str) -> list[str]:
    """The console script, or the same module under cProfile with ``--profile``."""
    if not args.profile:
        return [venv_script(name)]
    return [sys.executable, "-m", "cProfile", "-o", str(Path(args.profile) / f"{tag}.prof"), "-m", module]


def start_cluster(procs: Procs, workdir: Path, args) -> tuple[str, Proc, list[Proc]]:
    rows = (args.batches + 3) * BATCH_GROUPS
    dataset = workdir / "prompts.jsonl"
    write_dataset(dataset, rows)
    sync = ["--no-sync"] if args.no_sync else []
    coord = procs.start(
        "coordinator",
        [
            *launcher("coordinator", "coordinator.cli", args, "coordinator"),
            "serve",
            "--dataset",
            str(dataset),
            "--data-dir",
            str(workdir / "coordinator"),
            "--bind",
            "tcp://127.0.0.1:0",
            "--rollout-batch-size",
            str(BATCH_GROUPS),
            "--n-samples-per-prompt",
            str(GROUP),
            "--max-new-tokens",
            str(OUTPUT_LEN),
            "--dynamic-filter",
            "none",
            "--reward",
            args.reward,
            "--log-level",
            "WARNING",
            *sync,
            *(["--prefetch", str(args.prefetch)] if args.prefetch is not None else []),
            "--gateways",
            str(args.gateways),
        ],
    )

    address = wait_until(lambda: coordinator_endpoint(coord), READY_TIMEOUT, "coordinator", check=procs.check)
    progress(f"coordinator at {address}; starting {AGENTS} agents (1 engine, --concurrency {CONCURRENCY} each)")
    agents = []
    for i in range(AGENTS):
        agents.append(
            procs.start(
                f"agent-{i}",
                [
                    *launcher("agent", "agent.cli", args, f"agent-{i}"),
                    "join",
                    "--coordinator",
                    address,
                    "--data-dir",
                    str(workdir / f"agent-{i}"),
                    "--agent-id",
                    f"w1-agent-{i}",
                    "--engines",
                    "1",
                    "--concurrency",
                    str(CONCURRENCY),
                    "--payload-bind",
                    "tcp://127.0.0.1:0",
                    "--sim-args",
                    " ".join(SIM_ARGS),
                    "--log-level",
                    "WARNING",
                    *sync,
                ],
            )
        )
    return address, coord, agents


def wait_cluster_ready(procs: Procs, address: str) -> None:
    from coordinator.client import RolloutClient

    with RolloutClient(address, attach=False, timeout=10) as probe:

        def ready():
            agents = probe.stats().agents
            # The coordinator counts capacity in groups.
            live = [a for a in agents.values() if a.status == "alive" and a.capacity >= CONCURRENCY // GROUP]
            return len(live) == AGENTS

        wait_until(ready, READY_TIMEOUT, "agents registered with healthy engines", interval=0.2, check=procs.check)


def materialise(batch) -> tuple[int, int, float]:
    """Touch every sample's token ids, logprobs and reward, as a trainer would."""
    if len(batch.groups) != BATCH_GROUPS:
        raise RuntimeError(f"batch {batch.rollout_id} has {len(batch.groups)} groups, expected {BATCH_GROUPS}")
    samples = tokens = 0
    checksum = 0.0
    for g in batch.groups:
        if len(g.samples) != GROUP:
            raise RuntimeError(f"group {g.index} has {len(g.samples)} samples, expected {GROUP}")
        for s in g.samples:
            toks, lps = s.response_tokens, s.response_logprobs
            if len(toks) != len(lps) or len(s.prompt_tokens) != PROMPT_LEN:
                raise RuntimeError(
                    f"group {g.index}: {len(s.prompt_tokens)} prompt / {len(toks)} tokens / {len(lps)} logprobs"
                )
            tokens += len(toks)
            checksum += toks[-1] + lps[-1] + s.reward if toks else s.reward
            samples += 1
    return samples, tokens, checksum


def run_rollfleet(procs: Procs, workdir: Path, args) -> dict:
    from coordinator.client import RolloutClient

    address, coord, agents = start_cluster(procs, workdir, args)
    wait_cluster_ready(procs, address)
    # The coordinator's gateways are part of it: their CPU counts as the coordinator's.
    gateway_pids = wait_until(
        lambda: (lambda kids: (kids,) if len(kids) >= args.gateways else None)(children_of(coord.pid)), 30, "gateways"
    )[0]
    orch_pids = [coord.pid, *gateway_pids] + [a.pid for a in agents]
    engine_pids = [c for a in agents for c in children_of(a.pid)]
    progress(
        f"cluster ready (coordinator pid {coord.pid}, agents {[a.pid for a in agents]}, engines {engine_pids}); "
        f"1 warm-up + {args.batches} measured batches of {BATCH_GROUPS} groups x {GROUP} samples"
    )
    per_batch, waits, gen_means = [], [], []
    with RolloutClient(address, timeout=120) as client:
        t_prev = time.monotonic()
        batch = client.generate(0)
        materialise(batch)
        progress(f"warm-up batch 0 in {time.monotonic() - t_prev:.2f}s")
        # Measured window starts here: everything below is steady state.
        t0, trainer0 = time.monotonic(), time.process_time()
        orch0, engine0, machine0 = cpu_seconds(orch_pids), cpu_seconds(engine_pids), busy_cpu_seconds()
        by_proc0 = {pid: cpu_seconds([pid]) for pid in orch_pids}
        gateways0 = cpu_seconds(gateway_pids)
        samples = tokens = 0
        t_prev = t0
        for rid in range(1, args.batches + 1):
            batch = client.generate(rid)
            n, t, _ = materialise(batch)
            samples += n
            tokens += t
            now = time.monotonic()
            per_batch.append(now - t_prev)
            waits.append(batch.metrics.get("rollout/wait_seconds", 0.0))
            gen_means.append(batch.metrics.get("rollout/gen_seconds_mean", 0.0))
            progress(
                f"batch {rid}: {now - t_prev:.2f}s ({n / (now - t_prev):.0f} samples/s, "
                f"wait {waits[-1]:.2f}s, fetch {batch.metrics.get('rollout/fetch_seconds', 0.0):.3f}s)"
            )
            t_prev = now
            procs.check()
        wall = time.monotonic() - t0
        trainer_cpu = time.process_time() - trainer0
        orch_cpu = cpu_seconds(orch_pids) - orch0
        engine_cpu = cpu_seconds(engine_pids) - engine0
        machine_busy = busy_cpu_seconds() - machine0
        by_proc = {
            name: cpu_seconds([pid]) - by_proc0[pid]
            for name, pid in [("coordinator", coord.pid)] + [(a.name, a.pid) for a in agents]
        }
        by_proc["coordinator"] += cpu_seconds(gateway_pids) - gateways0
    procs.stop()
    return {
        "samples": samples,
        "tokens": tokens,
        "wall_s": wall,
        "trainer_cpu_s": trainer_cpu,
        "orch_cpu_s": orch_cpu,
        "engine_cpu_s": engine_cpu,
        "machine_busy_s": machine_busy,
        "by_proc_cpu_s": by_proc,
        "batch_s": per_batch,
        "wait_s": waits,
        "gen_s_mean": sum(gen_means) / len(gen_means),
    }


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 measured batches (about 10 s on 2 cores)")
    ap.add_argument(
        "--batches", type=int, default=None, help="measured batches after 1 warm-up (default 30, --quick 8)"
    )
    ap.add_argument("--no-sync", action="store_true", help="pass --no-sync to coordinator and agents (durability off)")
    ap.add_argument("--reward", default="math", help="coordinator --reward (default math)")
    ap.add_argument(
        "--prefetch", type=int, default=None, help="coordinator --prefetch (default: its default, one batch)"
    )
    ap.add_argument(
        "--floor", choices=("before", "after"), default="before", help="run the floor before or after rollfleet"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, stores)")
    ap.add_argument(
        "--gateways", type=int, default=0, help="coordinator serve --gateways (their CPU counts as the coordinator's)"
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="run coordinator and agents under cProfile, writing DIR/<process>.prof "
        "(whole process lifetime, main thread only; CPU figures are then inflated)",
    )
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if args.batches is None:
        args.batches = 8 if args.quick else 30
    if args.batches < 1:
        ap.error("--batches must be >= 1")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)
    batch_samples = BATCH_GROUPS * GROUP
    measured_samples = args.batches * batch_samples
    # The floor is fast: give it at least 16 batches' worth so its window is seconds, not ticks.
    floor_samples = max(measured_samples, 16 * batch_samples)

    # SIGTERM must unwind through the finally below, or the cluster would outlive us;
    # a second one must not interrupt that cleanup.
    def on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-w1-"))
    procs = Procs(workdir)
    progress(
        f"workdir {workdir}; {'quick' if args.quick else 'full'} run, durability {'off' if args.no_sync else 'on'}"
    )
    started = time.monotonic()
    try:
        if args.floor == "before":
            floor = run_floor(procs, "bare", floor_samples, batch_samples)
            agent_floor = run_floor(procs, "agent", floor_samples, batch_samples)
            rf = run_rollfleet(procs, workdir, args)
        else:
            rf = run_rollfleet(procs, workdir, args)
            floor = run_floor(procs, "bare", floor_samples, batch_samples)
            agent_floor = run_floor(procs, "agent", floor_samples, batch_samples)
    finally:
        procs.stop()
        if args.keep:
            progress(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    common = {"quick": args.quick, "sync": not args.no_sync, "batches": args.batches, "prefetch": args.prefetch}
    if args.profile:
        common["profiled"] = True
    floor_sps = floor["samples"] / floor["wall_s"]
    floor_cpu_us = floor["cpu_s"] / floor["samples"] * 1e6
    sps = rf["samples"] / rf["wall_s"]
    orch_cpu_us = (rf["orch_cpu_s"] + rf["trainer_cpu_s"]) / rf["samples"] * 1e6
    split = {k: round(v / rf["samples"] * 1e6, 1) for k, v in rf["by_proc_cpu_s"].items()}
    split["trainer"] = round(rf["trainer_cpu_s"] / rf["samples"] * 1e6, 1)
    # Little's law: every group holds one of the 2 x 32 lease slots from grant to receipt.
    lease_s = AGENTS * (CONCURRENCY // GROUP) / (sps / GROUP)
    emit(
        "samples_per_s",
        round(sps, 1),
        "samples/s",
        samples=rf["samples"],
        wall_s=round(rf["wall_s"], 3),
        group_gen_s_mean=round(rf["gen_s_mean"], 4),
        lease_s_littles_law=round(lease_s, 4),
        machine_busy_cores=round(rf["machine_busy_s"] / rf["wall_s"], 2),
        cores=os.cpu_count(),
        tokens_per_s=round(rf["tokens"] / rf["wall_s"], 0),
        batch_s=[round(x, 3) for x in rf["batch_s"]],
        trainer_wait_s=[round(x, 3) for x in rf["wait_s"]],
        **common,
    )
    emit(
        "floor_samples_per_s",
        round(floor_sps, 1),
        "samples/s",
        samples=floor["samples"],
        wall_s=round(floor["wall_s"], 3),
        mb_per_s=round(floor["bytes"] / floor["wall_s"] / 1e6, 1),
        errors=floor["errors"],
        machine_busy_cores=round(floor["machine_busy_s"] / floor["wall_s"], 2),
        cores=os.cpu_count(),
        **common,
    )
    emit("ratio_to_floor", round(sps / floor_sps, 3), "ratio", **common)
    emit(
        "orchestration_cpu_us_per_sample",
        round(orch_cpu_us, 1),
        "us/sample",
        by_process=split,
        engine_cpu_us_per_sample=round(rf["engine_cpu_s"] / rf["samples"] * 1e6, 1),
        **common,
    )
    emit(
        "floor_cpu_us_per_sample",
        round(floor_cpu_us, 1),
        "us/sample",
        engine_cpu_us_per_sample=round(floor["engine_cpu_s"] / floor["samples"] * 1e6, 1),
        **common,
    )
    emit("cpu_ratio_to_floor", round(orch_cpu_us / floor_cpu_us, 2), "ratio", target=1.5, **common)
    # The agents' CPU per sample they generated (each makes about half) against the agent hot-path floor.
    agents_us = sum(v for k, v in split.items() if k.startswith("agent-"))
    agent_floor_us = agent_floor["cpu_s"] / agent_floor["samples"] * 1e6
    emit(
        "agent_floor_cpu_us_per_sample",
        round(agent_floor_us, 1),
        "us/sample",
        samples_per_s=round(agent_floor["samples"] / agent_floor["wall_s"], 1),
        transactions=agent_floor["transactions"],
        engine_cpu_us_per_sample=round(agent_floor["engine_cpu_s"] / agent_floor["samples"] * 1e6, 1),
        **common,
    )
    emit("agent_cpu_us_per_sample", round(agents_us, 1), "us/sample", **common)
    emit("agent_cpu_ratio_to_floor", round(agents_us / agent_floor_us, 2), "ratio", target=1.1, **common)
    emit("coordinator_cpu_us_per_sample", split["coordinator"], "us/sample", target=15, **common)
    emit("trainer_cpu_us_per_sample", split["trainer"], "us/sample", target=30, **common)
    progress(
        f"orchestration {orch_cpu_us:.0f} us/sample = {orch_cpu_us / floor_cpu_us:.2f} x the bare client "
        f"({floor_cpu_us:.0f}; target 1.5); agents {agents_us:.0f} = {agents_us / agent_floor_us:.2f} x the agent "
        f"floor ({agent_floor_us:.0f}; target 1.1); coordinator {split['coordinator']:.0f} (target 15); "
        f"trainer {split['trainer']:.0f} (target 30)"
    )
    progress(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
