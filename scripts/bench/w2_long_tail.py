#!/usr/bin/env python3
"""W2 — long tail and utilisation, as the benchmark brief defines it, with the staleness bound at 0, 1 and 4.

Every configuration runs on a fresh loopback cluster (``harness.cluster``): ``coordinator serve``
and 2 agents with one sim engine each. The engines have ``--slots`` slots (32), a per-token time,
and output lengths lognormal with median 512, sigma 1.0, capped at 8192 (``--max-new-tokens
8192``). Each agent keeps ``--overcommit`` (4) times as many samples in flight as its engine has
slots (``agent join --concurrency``); the rest wait in the engine's queue, as they do on SGLang,
and take a slot the moment one frees. With as many samples as slots, a group would hold its 8
slots until its longest sample ends, and utilisation could not pass ``tail_bound`` (about 0.33).
The coordinator's ``--prefetch`` is what the agents can hold (so its bound never idles a slot
while the trainer waits). This process is the trainer: per step it calls ``generate(step)``,
touches every sample, "trains" for a fixed time (a sleep), then pushes a weight update (a
small disk checkpoint by default, or a small gloo broadcast) and goes on to the next step.

Configurations, one after the other in the same run:

- ``floor``: unbounded staleness and no weight updates (the best the fleet can do here);
- ``covered``: the same, with the trainer's step 1.5x the floor's time per batch, so the
  prefetch covers the step: its trainer wait should be about 0 (and its utilisation about 1/1.5,
  the trainer being the bottleneck);
- ``eta=0``, ``eta=1``, ``eta=4``: ``--max-staleness`` 0, 1, 4 and an update after every step.

Per configuration, over the steady-state window (from the end of the warm-up batch to the end of
the last batch):

- ``slot_utilisation``: busy slot-seconds / available slot-seconds; the bench polls every
  engine's ``/v1/loads`` (``num_running_reqs`` / ``max_running_requests``) every 20 ms;
- ``token_utilisation``: response tokens delivered to the trainer / what the slots could have
  decoded at the per-token time (useful work only: tokens of filtered or re-generated samples
  are not counted);
- ``all_slots_idle_share``: the share of polls that found no slot running anywhere (an update's pause);
- ``trainer_wait_s_per_step``: mean time inside ``generate()``;
- ``group_latency_p50_s`` / ``p99``: the groups' ``gen_seconds`` (first request to last response);
- ``staleness_mean`` / ``staleness_max`` / ``admission_stall_s`` (per step) from the batch metrics;
- ``samples_per_s`` delivered to the trainer.

Each bounded configuration is also reported as ratios against the floor (``*_ratio_to_floor``).
``tail_bound`` (context) is what the long tail allows with ``--overcommit 1``: a group holds its 8
slots until its longest sample ends, so utilisation cannot pass mean length / mean longest-of-8.
Output: one JSON object per line on stdout (a ``summary`` line last), progress and a table on stderr.

    python scripts/bench/w2_long_tail.py --quick     # 0.5 ms/token, 5 steps per configuration
    python scripts/bench/w2_long_tail.py             # 1 ms/token, 12 steps per configuration
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.cluster import Cluster  # noqa: E402
from harness.polling import wait_for  # noqa: E402

BENCH = "W2"
GROUP = 8
AGENTS = 2
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 512, 1.0, 8192
POLL_S = 0.02


def progress(msg: str) -> None:
    print(f"[w2 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def tail_bound(groups: int = 20000) -> float:
    """Mean sample length / mean of the longest of a group's 8 (Monte Carlo, the brief's distribution).

    A group holds its 8 slots until its longest sample ends, so with every slot leased and no other
    loss, slot utilisation cannot exceed this (about 0.33 for sigma 1.0).
    """
    import math
    import random

    rng = random.Random(0)
    draw = lambda: min(OUTPUT_MAX, math.exp(math.log(OUTPUT_MEDIAN) + rng.gauss(0.0, OUTPUT_SIGMA)))  # noqa: E731
    total = longest = 0.0
    for _ in range(groups):
        lengths = [draw() for _ in range(GROUP)]
        total += sum(lengths) / GROUP
        longest += max(lengths)
    return total / longest


# --------------------------------------------------------------------------- engines


def engine_urls(cluster: Cluster) -> list[str]:
    status = cluster.status()
    return [
        e["url"]
        for entry in status["agents"].values()
        if entry["status"] == "alive"
        for e in entry["engines"]
        if e.get("state") == "healthy"
    ]


class LoadPoller:
    """Samples every engine's ``/v1/loads`` every ``POLL_S`` in a thread: (time, running, slots)."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="w2-load-poller", daemon=True)

    def __enter__(self) -> LoadPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            running = slots = 0
            for url in self.urls:
                try:
                    with urllib.request.urlopen(f"{url}/v1/loads", timeout=2) as resp:
                        load = json.loads(resp.read())["loads"][0]
                except OSError:  # an engine paused for an update may answer late; count it as unknown
                    continue
                running += load["num_running_reqs"]
                slots += load["max_running_requests"]
            if slots:
                self.samples.append((time.monotonic(), running, slots))
            self._stop.wait(POLL_S)

    def stopped(self, t0: float, t1: float) -> float:
        """The share of polls in ``[t0, t1]`` that found no slot of any engine running (an update's pause)."""
        window = [r for t, r, _ in self.samples if t0 <= t <= t1]
        return sum(r == 0 for r in window) / len(window) if window else 0.0

    def utilisation(self, t0: float, t1: float) -> float:
        window = [(r, s) for t, r, s in self.samples if t0 <= t <= t1]
        return sum(r for r, _ in window) / sum(s for _, s in window) if window else 0.0


# --------------------------------------------------------------------------- trainer updates


def write_small_checkpoint(path: Path, step: int) -> None:
    """A ``model.safetensors`` of one 4 KiB float32 tensor (written by hand: the format is a header
    and raw bytes, and the safetensors writer would need numpy)."""
    path.mkdir(parents=True, exist_ok=True)
    n = 1024
    header = json.dumps({"policy.weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + struct.pack(f"<{n}f", *([float(step)] * n)))


class Updater:
    """Pushes one small update per step: ``disk`` (a 4 KiB checkpoint) or ``broadcast`` (1 MiB over gloo)."""

    def __init__(self, kind: str, workdir: Path):
        self.kind = kind
        self.workdir = workdir

    def push(self, client, version: int) -> float:
        t0 = time.perf_counter()
        if self.kind == "disk":
            ckpt = self.workdir / f"ckpt-{version}"
            write_small_checkpoint(ckpt, version)
            client.update_weights_from_disk(str(ckpt), version, timeout=120)
        else:
            import torch

            client.update_weights(
                {"policy.weight": torch.full((1 << 18,), float(version))}, version, backend="gloo", timeout=120
            )
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- one configuration


def run_config(
    name: str,
    workdir: Path,
    args,
    max_staleness: int | None,
    update: str | None,
    step_s: float | None = None,
    overrides: dict | None = None,
) -> dict:
    """One configuration on a fresh cluster; ``overrides``: coordinator flags over the defaults (e.g. prefetch)."""
    step_s = args.step_s if step_s is None else step_s
    sim_args = (
        f"--slots {args.slots} --token-latency-ms {args.token_ms} --output-len-dist lognormal "
        f"--output-len-median {OUTPUT_MEDIAN} --output-len-sigma {OUTPUT_SIGMA} --output-len-max {OUTPUT_MAX}"
    )
    config = {
        "rollout_batch_size": args.batch,
        "n_samples_per_prompt": GROUP,
        "max_new_tokens": OUTPUT_MAX,
        "dynamic_filter": "none",
        # Ready-or-leased groups beyond the trainer's demand: by default what the agents can hold,
        # so the coordinator's bound never leaves a slot idle while the trainer waits.
        "prefetch": args.prefetch if args.prefetch is not None else AGENTS * args.slots * args.overcommit // GROUP,
    }
    if max_staleness is not None:
        config["max_staleness"] = max_staleness
    config.update(overrides or {})
    cluster = Cluster(workdir / name, rows=max(2000, (args.steps + 10) * args.batch * 4), **config)
    updater = Updater(update, workdir / name) if update else None
    sync = ["--no-sync"] if args.no_sync else []
    steps = args.steps + 1  # step 0 is warm-up
    waits, updates, gen_s, stall, st_mean, st_max = [], [], [], [], [], []
    samples = tokens = 0
    try:
        cluster.start_coordinator(*sync)
        for i in range(AGENTS):
            cluster.start_agent(
                f"agent-{i}", *sync, engines=1, concurrency=args.slots * args.overcommit, sim_args=sim_args
            )
        urls = wait_for(lambda: (u := engine_urls(cluster)) and len(u) == AGENTS and u, 60, "healthy engines")
        with LoadPoller(urls) as poller, cluster.client(timeout=600) as client:
            for step in range(steps):
                t0 = time.monotonic()
                batch = client.generate(step)
                waited = time.monotonic() - t0
                if step == 0:
                    window_start = time.monotonic()
                else:
                    m = batch.metrics
                    waits.append(waited)
                    gen_s += [g.gen_seconds for g in batch.groups]
                    stall.append(m.get("rollout/admission_stall_s", 0.0))
                    st_mean.append(m.get("rollout/staleness_mean", 0.0))
                    st_max.append(m.get("rollout/staleness_max", 0.0))
                    samples += sum(len(g.samples) for g in batch.groups)
                    tokens += sum(len(s.response_tokens) for g in batch.groups for s in g.samples)
                if step == steps - 1:
                    window_end = time.monotonic()
                progress(
                    f"{name} step {step}{' (warm-up)' if step == 0 else ''}: waited {waited:.2f}s, "
                    f"staleness max {batch.metrics.get('rollout/staleness_max', 0.0):.0f}, "
                    f"stall {batch.metrics.get('rollout/admission_stall_s', 0.0):.2f}s"
                )
                if step == steps - 1:
                    break
                time.sleep(step_s)  # the trainer's fixed step
                if updater is not None:
                    updates.append(updater.push(client, step + 1))
            util = poller.utilisation(window_start, window_end)
            stopped = poller.stopped(window_start, window_end)
    finally:
        leaks = cluster.stop_all()
        if leaks:
            progress(f"{name}: teardown found leaks: {leaks}")
    wall = window_end - window_start
    capacity_tokens = AGENTS * args.slots * wall / (args.token_ms / 1000.0)
    return {
        "config": name,
        "max_staleness": max_staleness,
        "update": update,
        "steps": args.steps,
        "step_s": round(step_s, 3),
        "slot_utilisation": round(util, 3),
        "all_slots_idle_share": round(stopped, 3),
        "token_utilisation": round(tokens / capacity_tokens, 3),
        "trainer_wait_s_per_step": round(mean(waits), 3),
        "group_latency_p50_s": round(quantile(gen_s, 0.5), 3),
        "group_latency_p99_s": round(quantile(gen_s, 0.99), 3),
        "staleness_mean": round(mean(st_mean), 3),
        "staleness_max": max(st_max, default=0.0),
        "admission_stall_s_per_step": round(mean(stall), 3),
        "samples_per_s": round(samples / wall, 1),
        "update_s_mean": round(mean(updates), 3) if updates else None,
        "wall_s": round(wall, 2),
    }


# --------------------------------------------------------------------------- main


COLUMNS = [
    ("config", "config", "{}"),
    ("slot_utilisation", "slot util", "{:.3f}"),
    ("token_utilisation", "token util", "{:.3f}"),
    ("step_s", "step s", "{:.2f}"),
    ("all_slots_idle_share", "all idle", "{:.3f}"),
    ("trainer_wait_s_per_step", "wait/step s", "{:.2f}"),
    ("group_latency_p50_s", "grp p50 s", "{:.2f}"),
    ("group_latency_p99_s", "grp p99 s", "{:.2f}"),
    ("staleness_mean", "stale mean", "{:.2f}"),
    ("staleness_max", "stale max", "{:.0f}"),
    ("admission_stall_s_per_step", "stall/step s", "{:.2f}"),
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("update_s_mean", "update s", "{:.3f}"),
    ("util_ratio_to_floor", "util/floor", "{:.2f}"),
    ("throughput_ratio_to_floor", "tput/floor", "{:.2f}"),
]


def table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.5 ms/token, 5 steps, 0.2 s trainer step (about a minute)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration (default 12, quick 5)")
    ap.add_argument("--token-ms", type=float, default=None, help="sim decode time per token (default 1, quick 0.5)")
    ap.add_argument("--step-s", type=float, default=None, help="the trainer's fixed step time (default 0.5, quick 0.2)")
    ap.add_argument("--batch", type=int, default=8, help="groups per batch (default 8)")
    ap.add_argument("--slots", type=int, default=32, help="each engine's slots (max_running_requests; default 32)")
    ap.add_argument(
        "--overcommit",
        type=int,
        default=4,
        help="the agent's --concurrency as a multiple of the slots (default 4; 1 = no sample waits in the engine)",
    )
    ap.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="the coordinator's --prefetch (default: the agents' capacity in groups)",
    )
    ap.add_argument("--update", choices=("disk", "broadcast"), default="disk", help="the update pushed every step")
    ap.add_argument("--staleness", default="0,1,4", help="bounds to run, comma-separated (default 0,1,4)")
    ap.add_argument("--no-sync", action="store_true", help="coordinator and agents without fsync")
    ap.add_argument(
        "--no-covered", dest="covered", action="store_false", help="skip the run whose trainer step outlasts generation"
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    ap.add_argument(
        "--over-sampling",
        type=float,
        default=None,
        help="also run on-policy (prefetch 0) with --over-sampling 1 and with this factor: the trainer's wait",
    )
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.quick else 12
    if args.token_ms is None:
        args.token_ms = 0.5 if args.quick else 1.0
    if args.step_s is None:
        args.step_s = 0.2 if args.quick else 0.5
    if args.token_ms <= 0:
        ap.error("--token-ms must be > 0 (utilisation needs timed decode)")

    def on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-w2-"))
    started = time.monotonic()
    progress(
        f"workdir {workdir}; {args.steps} steps + 1 warm-up per configuration, batch {args.batch} x {GROUP}, "
        f"{AGENTS} engines x {args.slots} slots, {args.overcommit}x as many samples in flight, "
        f"{args.token_ms} ms/token, trainer step {args.step_s}s, "
        f"update: {args.update}"
    )
    rows = []
    try:
        rows.append(run_config("floor", workdir, args, None, None))
        if args.covered:
            # The trainer slower than generation (its step 1.5x the floor's time per batch): the
            # prefetch then covers the step, and the trainer should not wait at all.
            batch_s = args.batch * GROUP / rows[0]["samples_per_s"]
            rows.append(run_config("covered", workdir, args, None, None, step_s=1.5 * batch_s))
        for eta in [int(x) for x in args.staleness.split(",") if x]:
            rows.append(run_config(f"eta={eta}", workdir, args, eta, args.update))
        if args.over_sampling:
            # On-policy: nothing generated ahead, so each batch waits for its slowest group; over-sampling
            # starts FACTOR x the batch and stops the rest once it is full.
            for factor in (1.0, args.over_sampling):
                on_policy = {"prefetch": 0, "over_sampling": factor}
                rows.append(run_config(f"prefetch0 os={factor:g}", workdir, args, None, None, overrides=on_policy))
    finally:
        if args.keep:
            progress(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    floor = rows[0]
    common = {
        "quick": args.quick,
        "token_ms": args.token_ms,
        "trainer_step_s": args.step_s,
        "batch": args.batch,
        "slots_per_engine": args.slots,
        "in_flight_per_engine": args.slots * args.overcommit,
        "engines": AGENTS,
        "tail_bound": round(tail_bound(), 3),
    }
    for r in rows:
        r["util_ratio_to_floor"] = (
            round(r["slot_utilisation"] / floor["slot_utilisation"], 3) if floor["slot_utilisation"] else None
        )
        r["throughput_ratio_to_floor"] = round(r["samples_per_s"] / floor["samples_per_s"], 3)
        r["wait_ratio_to_floor"] = (
            round(r["trainer_wait_s_per_step"] / floor["trainer_wait_s_per_step"], 3)
            if floor["trainer_wait_s_per_step"]
            else None
        )
        extra = {k: v for k, v in r.items() if k not in ("config", "slot_utilisation")}
        emit("slot_utilisation", r["slot_utilisation"], "ratio", config=r["config"], **extra, **common)
    emit(
        "summary",
        {
            r["config"]: {
                k: r[k]
                for k in (
                    "slot_utilisation",
                    "trainer_wait_s_per_step",
                    "samples_per_s",
                    "staleness_max",
                    "util_ratio_to_floor",
                    "throughput_ratio_to_floor",
                )
            }
            for r in rows
        },
        "mixed",
        elapsed_s=round(time.monotonic() - started, 1),
        **common,
    )
    print(table(rows), file=sys.stderr, flush=True)
    progress(f"tail bound on slot utilisation (mean length / mean longest of {GROUP}): {common['tail_bound']}")
    progress(f"done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
