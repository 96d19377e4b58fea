#!/usr/bin/env python
"""W1's two floors, each a client process whose own CPU per sample is measured (``w1_overhead.py`` runs them).

bare
    A bare aiohttp client: ``concurrency`` workers per engine, one ``/generate`` at a time each,
    the agent's request shape (256 input ids, the coordinator's sampling params,
    ``return_logprob``), each body read whole and not decoded. The floor of any client.
agent
    The agent's hot path with none of rollfleet's machinery: ``concurrency / 8`` groups per
    engine, each 8 concurrent ``/generate`` calls of the same shape; every body orjson-decoded,
    its token ids and logprobs taken out of ``meta_info.output_token_logprobs``, the group
    msgpack-encoded with packed arrays (the payload format), and committed to a plain LMDB
    environment with ``sync`` on, with a small receipt record beside it in the same
    transaction. One writer thread takes every group queued meanwhile into one transaction, so
    a busy floor pays one commit for many groups, as the agent's store does. No leases, no
    coordinator, no supervisor, no retries, no filter, no payload serving.

Each prints one JSON line on stdout: samples, wall and CPU seconds over the window after
``warmup`` samples, the engines' CPU and the machine's busy CPU over the same window.

    python scripts/bench/w1_floors.py bare|agent --urls URL,URL --warmup N --measured N [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
from array import array
from operator import itemgetter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

from benchlib import busy_cpu_seconds, cpu_seconds  # noqa: E402
from w1_overhead import GROUP, make_prompt, sampling_params  # noqa: E402


class Window:
    """Marks taken when the ``warmup``-th and the ``warmup + measured``-th samples are done."""

    def __init__(self, warmup: int, measured: int, engine_pids: list[int]):
        self.warmup, self.target, self.engine_pids = warmup, warmup + measured, engine_pids
        self.done = 0
        self.marks: dict[str, tuple] = {}
        self.finished = asyncio.Event()

    def count(self, n: int = 1) -> None:
        before, self.done = self.done, self.done + n
        if before < self.warmup <= self.done:
            self._mark("start")
        if before < self.target <= self.done:
            self._mark("end")
            self.finished.set()

    def _mark(self, name: str) -> None:
        marks = (time.monotonic(), time.process_time(), self.done, cpu_seconds(self.engine_pids), busy_cpu_seconds())
        self.marks[name] = marks

    def result(self, **extra) -> dict:
        (t0, c0, n0, e0, m0), (t1, c1, n1, e1, m1) = self.marks["start"], self.marks["end"]
        return {
            "samples": n1 - n0,
            "wall_s": t1 - t0,
            "cpu_s": c1 - c0,
            "engine_cpu_s": e1 - e0,
            "machine_busy_s": m1 - m0,
            **extra,
        }


def _session():
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, connect=10))


def _body(input_ids: list[int], params: dict, rid: str) -> bytes:
    import orjson

    return orjson.dumps({"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid})


async def bare_client(urls: list[str], concurrency: int, window: Window) -> dict:
    from common.tokenizer import ByteTokenizer

    input_ids, params = ByteTokenizer().encode(make_prompt(0)[0]), sampling_params()
    state = {"bytes": 0, "errors": 0}
    counter = iter(range(1 << 62))
    async with _session() as session:

        async def worker(url: str) -> None:
            while not window.finished.is_set():
                body = _body(input_ids, params, f"floor-{next(counter):016x}-000-0000")
                async with session.post(url + "/generate", data=body, headers=JSON) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        state["errors"] += 1
                        if state["errors"] > 10:
                            raise RuntimeError(f"floor: {url} answered HTTP {resp.status}: {raw[:200]!r}")
                        continue
                state["bytes"] += len(raw)
                window.count()

        await asyncio.gather(*(worker(u) for u in urls for _ in range(concurrency)))
    return window.result(**state)


JSON = {"Content-Type": "application/json"}
_first, _second = itemgetter(0), itemgetter(1)


class Committer:
    """One thread writing every queued (key, payload, receipt) in one LMDB transaction, sync on."""

    def __init__(self, path: str):
        import lmdb

        os.makedirs(path, exist_ok=True)
        self.env = lmdb.open(path, map_size=8 << 30, max_dbs=2, sync=True)
        self.groups = self.env.open_db(b"groups")
        self.outbox = self.env.open_db(b"outbox")
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.transactions = 0
        self.thread = threading.Thread(target=self._run, name="floor-writer", daemon=True)
        self.thread.start()

    def commit(self, loop, key: bytes, payload: bytes, receipt: bytes) -> asyncio.Future:
        fut = loop.create_future()
        self.queue.put((key, payload, receipt, fut))
        return fut

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            if batch[0] is None:
                return
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            batch = [b for b in batch if b is not None]
            with self.env.begin(write=True) as txn:
                for key, payload, receipt, _ in batch:
                    txn.put(key, payload, db=self.groups)
                    txn.put(key, receipt, db=self.outbox)
            self.transactions += 1
            for *_, fut in batch:
                fut.get_loop().call_soon_threadsafe(_resolve, fut)
            if stop:
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.env.close()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def agent_floor(urls: list[str], concurrency: int, window: Window, data_dir: str) -> dict:
    import msgpack
    import orjson

    from common.tokenizer import ByteTokenizer

    input_ids, params = ByteTokenizer().encode(make_prompt(0)[0]), sampling_params()
    prompt_bytes = array("i", input_ids).tobytes()
    loop = asyncio.get_running_loop()
    store = Committer(data_dir)
    counter = iter(range(1 << 62))
    state = {"errors": 0}
    try:
        async with _session() as session:

            async def one(url: str, rid: str) -> dict:
                async with session.post(url + "/generate", data=_body(input_ids, params, rid), headers=JSON) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        state["errors"] += 1
                        raise RuntimeError(f"agent floor: {url} answered HTTP {resp.status}: {raw[:200]!r}")
                out = orjson.loads(raw)
                triples = out["meta_info"]["output_token_logprobs"]
                tokens, logprobs = list(map(_second, triples)), list(map(_first, triples))
                return {
                    "p": prompt_bytes,
                    "r": array("i", tokens).tobytes(),
                    "lp": array("d", logprobs).tobytes(),
                    "m": bytes([1]) * len(tokens),
                    "rw": 0.0,
                    "s": (out["meta_info"].get("finish_reason") or {}).get("type", ""),
                    "wv": out["meta_info"].get("weight_version", ""),
                    "wvs": [],
                    "t": out.get("text", ""),
                    "md": {},
                }

            async def group_worker(url: str) -> None:
                while not window.finished.is_set():
                    g = next(counter)
                    samples = await asyncio.gather(*(one(url, f"floor-{g:016x}-{i:03d}-0000") for i in range(GROUP)))
                    payload = msgpack.packb({"i": g, "e": 0, "rid": 0, "l": None, "md": {}, "ss": samples})
                    receipt = msgpack.packb({"i": g, "e": 0, "n": GROUP, "bytes": len(payload)})
                    await store.commit(loop, b"%016x" % g, payload, receipt)
                    window.count(GROUP)

            await asyncio.gather(*(group_worker(u) for u in urls for _ in range(concurrency // GROUP)))
    finally:
        store.close()
    return window.result(transactions=store.transactions, **state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("bare", "agent"))
    ap.add_argument("--urls", required=True)
    ap.add_argument("--concurrency", type=int, required=True, help="requests in flight per engine")
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--measured", type=int, required=True)
    ap.add_argument("--engine-pids", default="")
    ap.add_argument("--dir", default=None, help="the agent floor's LMDB directory")
    args = ap.parse_args(argv)
    window = Window(args.warmup, args.measured, [int(x) for x in args.engine_pids.split(",") if x])
    urls = args.urls.split(",")
    if args.kind == "bare":
        result = asyncio.run(bare_client(urls, args.concurrency, window))
    else:
        result = asyncio.run(agent_floor(urls, args.concurrency, window, args.dir))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
