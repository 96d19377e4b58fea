#!/usr/bin/env python3
"""W4 — durable commit: the agent's group store against a plain file fsynced once per batch.

Store side: ``agent.store.GroupStore`` (the class the agent runs), ``sync=True``, groups of
``--group-mb`` MiB (random bytes, so nothing can be deduplicated or compressed) committed through
``GroupStore.commit`` with their receipts. ``--in-flight`` commits (default 4 x batch) are kept
going at once, as an agent's leases do, and the store takes ``--batch`` of them per transaction
(``max_batch``; the bench reports ``groups_per_transaction`` from ``GroupStore.statistics()``).
A commit counts when ``commit()`` returned, i.e. once durable (a receipt could leave then).
Each round uses a new data dir, so the store, like the floor, grows a new file.

Floor side: the same payload bytes appended to a new plain file with ``os.write`` and one
``os.fsync`` per ``--batch`` groups: the least a durable append of those bytes can cost here.

So "batch" means the same on both sides: ``--batch`` groups per durable flush (one LMDB
transaction, whose commit fdatasyncs the file, its meta page made durable by the next commit's
fdatasync; one fsync of the file). The sides run interleaved, their order rotated, ``--rounds``
times; medians are reported (the disk is shared and noisy), with each side's CPU per MB.

Beside it (never instead), each against the same floor:

- ``alone``: waves of ``--batch`` concurrent commits, each wave waiting for the last, so no
  transaction ever has another queued behind it (its meta page then costs a flush of its own);
- ``steady``: one long-lived store, each round's groups trimmed after it as an agent does once
  trainers fetched them, so commits rewrite freed pages instead of growing a new file;
- ``no_sync``: the store with ``sync=False`` (what ``--no-sync`` buys, never the headline).

Output: one JSON object per line on stdout (``commit_mb_per_s``, ``fsync_floor_mb_per_s``,
``ratio_to_fsync_floor`` ...), a summary on stderr.

    python scripts/bench/w4_durable_commit.py --quick      # 128 MiB per side per round, 15 rounds
    python scripts/bench/w4_durable_commit.py              # 256 MiB per side per round, 21 rounds
"""

from __future__ import annotations

import argparse
import asyncio
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

from agent.store import GroupStore  # noqa: E402

BENCH = "W4"
MB = 1 << 20


def progress(msg: str) -> None:
    print(f"[w4 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def payloads(n: int, size: int) -> list[bytes]:
    """``n`` distinct payloads of ``size`` bytes (distinct so no layer can share pages between them)."""
    block = os.urandom(size + n)
    return [block[i : i + size] for i in range(n)]


def receipt(key: str, i: int) -> dict:
    """A receipt shaped like the agent's (agent/events.py PendingReceipt.to_dict)."""
    return {
        "lease": i,
        "data_epoch": 0,
        "index": i,
        "key": key,
        "n_samples": 8,
        "stats": {"n_samples": 8, "response_tokens": 4096, "reward_sum": 1.0, "gen_seconds": 1.0},
    }


# --------------------------------------------------------------------------- the two sides


def floor_run(path: Path, data: list[bytes], batch: int) -> float:
    """Append every payload to a new plain file, one fsync per ``batch``; returns seconds."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for start in range(0, len(data), batch):
            for payload in data[start : start + batch]:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


async def store_waves(store: GroupStore, data: list[bytes], batch: int, tag: str) -> float:
    """Commit the payloads ``batch`` at a time (each wave waits for its commits); returns seconds."""
    t0 = time.perf_counter()
    for start in range(0, len(data), batch):
        wave = [(f"{tag}:{i}:1", i) for i in range(start, min(start + batch, len(data)))]
        await asyncio.gather(*(store.commit(k, data[i], receipt(k, i)) for k, i in wave))
    return time.perf_counter() - t0


async def store_stream(store: GroupStore, data: list[bytes], in_flight: int, tag: str) -> float:
    """Keep ``in_flight`` commits going until every payload is committed; returns seconds."""
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < len(data):
            i, nxt = nxt, nxt + 1
            key = f"{tag}:{i}:1"
            await store.commit(key, data[i], receipt(key, i))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return time.perf_counter() - t0


def store_run(workdir: Path, data: list[bytes], *, sync: bool, batch: int, stream: int = 0) -> tuple[float, dict]:
    """One fresh store (a new data dir), every payload committed; returns (seconds, statistics).

    ``stream`` > 0: that many commits kept in flight, the store taking ``batch`` per transaction;
    otherwise waves of ``batch`` commits, each wave alone in the store.
    """
    store = GroupStore(workdir, agent_id="w4", sync=sync, max_batch=batch)
    try:
        before = store.statistics()

        async def go() -> float:
            if stream:
                return await store_stream(store, data, stream, "s")
            return await store_waves(store, data, batch, "w")

        seconds = asyncio.run(go())
        after = store.statistics()
        stats = {"transactions": after.transactions - before.transactions, "groups": after.groups - before.groups}
        stats["groups_per_transaction"] = round(stats["groups"] / max(1, stats["transactions"]), 2)
        return seconds, stats
    finally:
        store.close()
        shutil.rmtree(workdir, ignore_errors=True)


def steady_run(store: GroupStore, data: list[bytes], tag: str) -> float:
    """Commit every payload into a long-lived store, then trim them, as an agent does once trainers
    fetched them (so the next run rewrites freed pages); returns the seconds of the commits."""

    async def go() -> float:
        seconds = await store_stream(store, data, 4 * store.max_batch, tag)
        await store.trim([f"{tag}:{i}:1" for i in range(len(data))])
        await store.drain()
        return seconds

    return asyncio.run(go())


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 MiB per side per round, 15 rounds (well under a minute)")
    ap.add_argument("--group-mb", type=float, default=1.0, help="group payload size in MiB (default 1)")
    ap.add_argument("--batch", type=int, default=8, help="groups per transaction / per fsync (default 8)")
    ap.add_argument("--mb", type=int, default=None, help="MiB written per side per round (default 256, quick 128)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 21, quick 15)")
    ap.add_argument(
        "--in-flight", type=int, default=None, help="commits in flight in the store run (default 4 x batch)"
    )
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary dir; use the agent's disk)")
    args = ap.parse_args(argv)
    if args.mb is None:
        args.mb = 128 if args.quick else 256
    if args.rounds is None:
        args.rounds = 15 if args.quick else 21
    if args.in_flight is None:
        args.in_flight = 4 * args.batch
    size = int(args.group_mb * MB)
    n = max(args.batch, int(args.mb * MB // size))
    data = payloads(n, size)
    total_mb = n * size / MB
    root = Path(tempfile.mkdtemp(prefix="rollfleet-w4-", dir=args.dir))
    started = time.monotonic()
    progress(
        f"{root}: {n} groups of {size / MB:.2f} MiB per side per round, {args.batch} groups per transaction/fsync, "
        f"{args.in_flight} commits in flight, {args.rounds} rounds"
    )
    sides = ["floor", "store", "alone", "nosync", "steady"]
    secs: dict[str, list[float]] = {side: [] for side in sides}
    cpu = dict.fromkeys(sides, 0.0)
    stats: dict[str, dict] = {}
    steady = GroupStore(root / "steady", agent_id="w4", sync=True, max_batch=args.batch)
    try:
        steady_run(steady, data, "warm")
        for r in range(args.rounds):
            # Rotate the order, so no side always follows another's writeback.
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                os.sync()  # start each side with no one's dirty pages (earlier sides', other tenants') pending
                cpu0 = time.process_time()
                if side == "floor":
                    secs[side].append(floor_run(root / f"floor-{r}.bin", data, args.batch))
                    (root / f"floor-{r}.bin").unlink()
                elif side == "steady":
                    secs[side].append(steady_run(steady, data, f"r{r}"))
                else:
                    seconds, stats[side] = store_run(
                        root / f"{side}-{r}",
                        data,
                        sync=side != "nosync",
                        batch=args.batch,
                        stream=0 if side == "alone" else args.in_flight,
                    )
                    secs[side].append(seconds)
                cpu[side] += time.process_time() - cpu0
            progress(f"round {r}: " + ", ".join(f"{side} {total_mb / secs[side][-1]:.0f} MB/s" for side in sides))
    finally:
        steady.close()
        shutil.rmtree(root, ignore_errors=True)

    def rate(side: str) -> float:
        return round(total_mb / statistics.median(secs[side]), 1)

    def ratio(side: str) -> float:
        return round(statistics.median(f / s for f, s in zip(secs["floor"], secs[side], strict=True)), 3)

    cpu_ms = {side: round(1000 * c / (total_mb * args.rounds), 3) for side, c in cpu.items()}
    common = {
        "quick": args.quick,
        "group_mb": round(size / MB, 3),
        "groups_per_fsync": args.batch,
        "mb_per_round": round(total_mb, 1),
        "rounds": args.rounds,
    }
    store = {"in_flight": args.in_flight, "cpu_ms_per_mb": cpu_ms["store"], **stats["store"], **common}
    emit("commit_mb_per_s", rate("store"), "MB/s", sync=True, **store)
    emit("fsync_floor_mb_per_s", rate("floor"), "MB/s", cpu_ms_per_mb=cpu_ms["floor"], **common)
    per_round = [round(f / s, 3) for f, s in zip(secs["floor"], secs["store"], strict=True)]
    emit("ratio_to_fsync_floor", ratio("store"), "ratio", per_round=per_round, target=0.8, **common)
    alone = {"cpu_ms_per_mb": cpu_ms["alone"], **stats["alone"], **common}
    emit("commit_mb_per_s_alone", rate("alone"), "MB/s", sync=True, ratio_to_fsync_floor=ratio("alone"), **alone)
    emit(
        "commit_mb_per_s_steady",
        rate("steady"),
        "MB/s",
        sync=True,
        ratio_to_fsync_floor=ratio("steady"),
        cpu_ms_per_mb=cpu_ms["steady"],
        **common,
    )
    emit("commit_mb_per_s_no_sync", rate("nosync"), "MB/s", sync=False, in_flight=args.in_flight, **common)
    progress(
        f"store {rate('store')} MB/s ({stats['store']['groups_per_transaction']} groups/txn), floor {rate('floor')} "
        f"MB/s, ratio {ratio('store')} (target 0.8); one wave at a time {rate('alone')} MB/s, ratio {ratio('alone')}; "
        f"long-lived store {rate('steady')} MB/s, ratio {ratio('steady')}; no-sync {rate('nosync')} MB/s; "
        f"CPU ms/MB store {cpu_ms['store']} floor {cpu_ms['floor']}; "
        f"{time.monotonic() - started:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
