#!/usr/bin/env python3
"""What recording costs a trainer (issue 25): ``RolloutClient(record=DIR)`` against the same client without it.

``coordinator serve`` + 2 agents x 1 sim engine on loopback (``harness.cluster``: instant engines, fixed
output length, no filter); this process is the trainer and pulls batches in phases that alternate
``off`` (no ``record``) and ``on`` (``record=DIR``, a fresh client each phase), never at the same time.

Per batch, in each phase:

``fetch_s``
    the batch's own fetch time, ``rollout/fetch_seconds``: its payloads from the agents, decoded. The
    floor the recorder's work is held against: both handle the same bytes once.
``record_s``, ``record_cpu_s``
    the recorder thread's wall time and CPU time for the batch (``Recorder.statistics()``, per file
    written): unpack, Arrow table, Parquet, fsync, rename. Off the trainer's critical path; the wall
    time less the CPU time is waiting for the disk.
``enqueue_us``
    what recording adds to ``generate`` itself: the ``batch_nowait`` call that queues the payloads.
``generate_s``
    ``generate``'s wall time, the trainer's view (mostly waiting for the fleet), on and off.
``trainer_cpu_s``
    this process's CPU per batch (the writer thread's included when on).

Ratios, each against its floor from the same run: ``record_to_fetch`` (record_s / fetch_s),
``record_cpu_to_fetch``,
``generate_on_to_off`` and ``trainer_cpu_on_to_off``. Output: one JSON object per line on stdout; progress
on stderr.

    python scripts/bench/record_cost.py --quick     # 32 groups x 8 samples x 256 tokens, 2 x 6 batches a mode
    python scripts/bench/record_cost.py             # 64 x 8 x 512, 2 x 12 batches a mode
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.cluster import Cluster  # noqa: E402

BENCH = "record_cost"


def progress(msg: str) -> None:
    print(f"[record-cost {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def pull(cluster: Cluster, first: int, n: int, record: str | None) -> dict:
    """Batches ``first .. first + n - 1`` with one client; per-batch figures."""
    client = cluster.client(record=record) if record else cluster.client()
    enqueue: list[float] = []
    recorder = client._async._recorder
    if recorder is not None:  # time the one call recording adds to generate()
        queued = recorder.batch_nowait

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return queued(*args)
            finally:
                enqueue.append(time.perf_counter() - t0)

        recorder.batch_nowait = timed
    client.generate(first)  # warm-up: a fresh client's first batch also connects to the agents
    gen, fetch = [], []
    cpu0 = time.process_time()
    for rollout_id in range(first + 1, first + n + 1):
        t0 = time.perf_counter()
        batch = client.generate(rollout_id)
        gen.append(time.perf_counter() - t0)
        fetch.append(batch.metrics["rollout/fetch_seconds"])
        for s in batch.samples:  # the trainer touches what it trains on
            _ = (s.response_tokens[-1], s.response_logprobs[-1], s.reward)
    close0 = time.perf_counter()
    client.close()  # with a recorder: whatever is still queued is written here
    cpu = time.process_time() - cpu0
    out = {"generate_s": gen, "fetch_s": fetch, "cpu_s": cpu / n, "close_s": time.perf_counter() - close0}
    if recorder is not None:
        st = recorder.statistics()
        out.update(
            record_s=st.write_seconds / max(1, st.written),
            record_cpu_s=st.write_cpu_seconds / max(1, st.written),
            written=st.written,
            enqueue_s=enqueue[1:],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="off/on phase pairs")
    args = ap.parse_args()
    groups, n, tokens, per_phase = (32, 8, 256, 6) if args.quick else (64, 8, 512, 12)
    work = Path(tempfile.mkdtemp(prefix="rollfleet-record-cost-"))
    progress(f"work dir {work}: batches of {groups} groups x {n} samples x {tokens} tokens")
    cluster = Cluster(
        work / "cluster",
        rows=groups * per_phase * (args.rounds * 2 + 2) * 2,
        rollout_batch_size=groups,
        n_samples_per_prompt=n,
        max_new_tokens=tokens,
        dynamic_filter="none",
    )
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        cluster.start_coordinator()
        sim = f"--output-len-dist fixed --output-len-median {tokens}"
        for name in ("a1", "a2"):
            cluster.start_agent(name, concurrency=256, sim_args=sim)
        rollout_id = 0
        for r in range(args.rounds):
            for mode in ("off", "on"):
                record = str(work / f"records-{r}") if mode == "on" else None
                res = pull(cluster, rollout_id, per_phase, record)
                rollout_id += per_phase + 1
                results[mode].append(res)
                progress(
                    f"round {r} {mode}: generate {statistics.median(res['generate_s']):.3f}s, "
                    f"fetch {statistics.median(res['fetch_s']):.4f}s"
                    + (f", record {res['record_s']:.4f}s" if mode == "on" else "")
                )
        sizes = [os.path.getsize(p) for p in (work / "records-0").glob("rollout-*.parquet")]
    finally:
        leaks = cluster.stop_all()
        if leaks:
            progress(f"left behind: {leaks}")
    ctx = {"groups": groups, "samples": groups * n, "tokens": tokens, "batches": per_phase * args.rounds}

    def med(mode: str, key: str) -> float:
        return statistics.median(x for res in results[mode] for x in res[key])

    fetch_on = med("on", "fetch_s")
    record_s = statistics.median(res["record_s"] for res in results["on"])
    record_cpu = statistics.median(res["record_cpu_s"] for res in results["on"])
    cpu = {m: statistics.median(res["cpu_s"] for res in results[m]) for m in results}
    emit("fetch_s_per_batch", round(fetch_on, 5), "s", off=round(med("off", "fetch_s"), 5), **ctx)
    emit("record_s_per_batch", round(record_s, 5), "s", **ctx)
    emit("record_cpu_s_per_batch", round(record_cpu, 5), "s", **ctx)
    emit("record_to_fetch", round(record_s / fetch_on, 3), "ratio", **ctx)
    emit("record_cpu_to_fetch", round(record_cpu / fetch_on, 3), "ratio", **ctx)
    emit("enqueue_us_per_batch", round(med("on", "enqueue_s") * 1e6, 1), "us", **ctx)
    emit("generate_s_per_batch", round(med("on", "generate_s"), 4), "s", off=round(med("off", "generate_s"), 4), **ctx)
    emit("generate_on_to_off", round(med("on", "generate_s") / med("off", "generate_s"), 3), "ratio", **ctx)
    emit("trainer_cpu_s_per_batch", round(cpu["on"], 4), "s", off=round(cpu["off"], 4), **ctx)
    emit("trainer_cpu_on_to_off", round(cpu["on"] / cpu["off"], 3), "ratio", **ctx)
    emit("file_bytes_per_batch", int(statistics.median(sizes)), "bytes", **ctx)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
