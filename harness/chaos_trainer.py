"""A trainer process for the chaos suite: pulls batches, logs what it consumed, checkpoints, pushes weights.

Run as its own process so the chaos driver can SIGKILL it. It appends one
JSON line per consumed batch to ``--consumed`` (fsynced before the next
pull), and every ``--checkpoint-every`` batches pauses with drain, takes
``state_dict()``, writes it atomically to ``--checkpoint`` and resumes. With
``--resume`` it loads that checkpoint first and continues after it.

Every ``--weights-every`` batches it pushes a weight update, alternating a disk
update (a ``model.safetensors`` it writes under ``--weights-dir``, one directory
per version, replaced atomically) and a gloo broadcast of a few small tensors.
The version is always above the fleet's (``weight_version()``, read before each
update), so versions rise strictly across trainer restarts. An update may fail
under chaos (an agent, engine or the coordinator killed meanwhile): that is
allowed, the next one is tried ``--weights-every`` batches later. Each update is
bounded (``--update-timeout`` is the coordinator's deadline and the process
group's; the whole call gets three times that), so a failure never hangs the
trainer. One JSON line per attempt goes to ``--weights-log`` (fsynced):
``kind``, ``version``, ``ok``, the engines' versions or the error.

After a broadcast, an engine that restarts (or a node that joins) is stale: out of
the pool until an update reaches it. Before each ``generate`` the trainer looks at
``stats().weights.behind`` and, when engines are behind a broadcast version,
brings just them to it with ``catch_up`` (the tensors are a function of the version,
so a resumed trainer sends the same ones), logged with kind ``catch_up``. Once every
engine is stale no batch can come: while a ``generate`` waits, the trainer looks at
the fleet every ``--rescue-after`` seconds and, if no engine serves but some are
stale and no update runs, catches them up (or, after a disk update, pushes a new
disk update; recorded with ``"rescue": true``), as a trainer must.

Each record carries ``t0`` and ``t1`` (wall-clock seconds, ``time.time()``) so the
driver can tell which faults fell inside a failed update, and ``retried`` when the
client retried the broadcast once after an engine was lost in it.

Without torch there is nothing to broadcast with and no weights file to write:
every update is then a disk update of an empty checkpoint directory (it changes
the label only), and the trainer says so at start.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import struct
import time
from pathlib import Path

from common.errors import NoCapacity, RolloutError
from coordinator.client import AsyncRolloutClient
from harness.chaos_check import batch_record
from harness.chaos_eval import NAME as EVAL_NAME

ACCURACY = 0.5
"""``sim.accuracy`` of every update: the sim's default, so rewards and filtering stay as without updates."""
BUCKET_BYTES = 4096
"""Small buckets: a broadcast of the tensors below takes three, each a point where chaos can strike."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--batches", type=int, required=True, help="stop after this rollout id")
    ap.add_argument("--consumed", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--fetch-timeout",
        type=float,
        default=5.0,
        help="give up on a silent node this soon and ask the coordinator again (a lost node's "
        "groups are replaced once it is retired)",
    )
    ap.add_argument("--weights-every", type=int, default=0, help="push a weight update every K batches (0: never)")
    ap.add_argument("--weights-dir", default=None, help="where disk checkpoints are written (one dir per version)")
    ap.add_argument("--weights-log", default=None, help="one JSON line per update attempt")
    ap.add_argument("--update-timeout", type=float, default=15.0, help="a weight update's deadline, in seconds")
    ap.add_argument(
        "--rescue-after",
        type=float,
        default=2.0,
        help="while a generate waits this long, push a disk update if every engine is stale (0: never)",
    )
    ap.add_argument("--evaluate-every", type=int, default=0, help="run client.evaluate every K batches (0: never)")
    ap.add_argument("--eval-name", default=EVAL_NAME, help="the evaluation dataset evaluate() runs")
    ap.add_argument("--eval-log", default=None, help="one JSON line per evaluate() call: its metrics or its error")
    args = ap.parse_args(argv)
    if args.evaluate_every and not args.eval_log:
        ap.error("--evaluate-every needs --eval-log")
    if args.weights_every and not (args.weights_dir and args.weights_log):
        ap.error("--weights-every needs --weights-dir and --weights-log")
    return args


def weights(version: int) -> dict[str, tuple[list[int], list[float]]]:
    """What an update of ``version`` carries, as ``name -> (shape, values)`` (float32): ``sim.accuracy`` and two
    tensors that make its digest its own."""
    return {
        "sim.accuracy": ([1], [ACCURACY]),
        "layer.0.weight": ([32, 32], [float(version)] * 32 * 32),
        "layer.0.bias": ([32], [-float(version)] * 32),
    }


def tensors(version: int) -> dict:
    """``weights(version)`` as torch tensors, for a broadcast."""
    import torch

    return {name: torch.tensor(values).reshape(shape) for name, (shape, values) in weights(version).items()}


def safetensors_bytes(named: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """The safetensors encoding of float32 tensors: header length (u64 LE), JSON header, raw data. Written by hand
    because ``safetensors.torch.save_file`` needs numpy, which the sim does not."""
    header, blobs, offset = {}, [], 0
    for name, (shape, values) in named.items():
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def write_checkpoint(root: Path, version: int, with_torch: bool) -> Path:
    """``root/v<version>``: a ``model.safetensors`` of ``weights(version)``, or empty without torch (the engines
    could not read it). The file is replaced atomically: a trainer that resumes and writes the same version again
    never tears a file an engine may be reading (its content is a function of the version)."""
    path = root / f"v{version}"
    path.mkdir(parents=True, exist_ok=True)
    if with_torch:
        tmp = path / f"model.safetensors.{os.getpid()}.tmp"
        tmp.write_bytes(safetensors_bytes(weights(version)))
        os.replace(tmp, path / "model.safetensors")
    return path


def rescue_from_disk(client, root: Path, weights_log: Path, with_torch: bool) -> int:
    """A disk update above every version pushed so far (sync ``client``), appended to ``weights_log`` like a
    trainer's push; the version. For a harness that finds every engine stale once the trainer is gone."""
    with open(weights_log) as f:
        pushed = [r["version"] for r in map(json.loads, f) if r.get("ok")]
    version = max([client.weight_version(), *pushed]) + 1
    result = client.update_weights_from_disk(str(write_checkpoint(root, version, with_torch)), version, timeout=60)
    with open(weights_log, "a") as log:
        record = {"run": "harness", "pid": os.getpid(), "rid": -1, "kind": "disk", "rescue": True, "ok": True}
        append(log, {**record, "version": result.version, "engines": result.engines, "seconds": 0.0})
    return result.version


def append(log, record: dict) -> None:
    log.write(json.dumps(record) + "\n")
    log.flush()
    os.fsync(log.fileno())


class Pusher:
    """Pushes weight updates, alternating disk and broadcast; logs each attempt, never raises a failed one."""

    def __init__(self, client: AsyncRolloutClient, args: argparse.Namespace, run: str):
        self.client = client
        self.root = Path(args.weights_dir)
        self.timeout = args.update_timeout
        self.rescue_after = args.rescue_after
        self.run = run
        self.with_torch = importlib.util.find_spec("torch") is not None
        self.last = 0
        """The highest version this process pushed (the fleet's could lag behind it only after a restart)."""
        self.log = open(args.weights_log, "a")  # noqa: SIM115 (closed by close())
        if not self.with_torch:
            print("torch is not installed: weight updates are disk only (no broadcasts)", flush=True)

    def kind(self, n: int) -> str:
        return "distributed" if self.with_torch and n % 2 else "disk"

    async def push(self, rid: int, n: int, rescue: bool = False) -> None:
        kind, version, started = "disk" if rescue else self.kind(n), None, time.monotonic()
        record = {"run": self.run, "pid": os.getpid(), "rid": rid, "kind": kind, "rescue": rescue, "t0": time.time()}
        try:
            async with asyncio.timeout(self.timeout * 3):
                version = max(await self.client.weight_version(), self.last) + 1
                if kind == "disk":
                    path = await asyncio.to_thread(write_checkpoint, self.root, version, self.with_torch)
                    result = await self.client.update_weights_from_disk(str(path), version, timeout=self.timeout)
                else:
                    result = await self.client.update_weights(
                        tensors(version), version, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout=self.timeout
                    )
        except (RolloutError, TimeoutError, OSError, RuntimeError) as exc:
            # RuntimeError: torch.distributed's own errors (a rendezvous or broadcast broken by a killed peer).
            record.update(version=version, ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            print(f"weights {kind} {version} failed after rollout {rid}: {record['error']}", flush=True)
        else:
            self.last = max(self.last, result.version)
            record.update(version=result.version, ok=True, engines=result.engines)
            if result.retried:
                record["retried"] = result.retried[:300]
            print(f"weights {kind} {result.version} after rollout {rid}", flush=True)
        record["seconds"] = round(time.monotonic() - started, 3)
        record["t1"] = time.time()
        await asyncio.to_thread(append, self.log, record)

    async def catch_up(self, rid: int, rescue: bool = False) -> bool:
        """Engines behind the fleet's broadcast version: ``catch_up`` brings just them to it (logged). False when
        there was nothing to do (no engine behind, an update in flight, or the fleet's weights came from disk)."""
        if not self.with_torch:
            return False
        try:
            weights = (await asyncio.wait_for(self.client.stats(), 5)).weights
        except (RolloutError, TimeoutError):
            return False  # the coordinator is restarting: look again later
        if not weights.behind or weights.kind != "distributed" or weights.lock is not None:
            return False
        version, started = weights.version, time.monotonic()
        record = {"run": self.run, "pid": os.getpid(), "rid": rid, "kind": "catch_up", "rescue": rescue}
        record.update(version=version, behind=list(weights.behind), t0=time.time())
        try:
            async with asyncio.timeout(self.timeout * 3):
                result = await self.client.catch_up(
                    tensors(version), version, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout=self.timeout
                )
        except (RolloutError, TimeoutError, OSError, RuntimeError) as exc:
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            print(f"catch_up {version} failed before rollout {rid}: {record['error']}", flush=True)
        else:
            record.update(ok=True, engines=result.engines)
            print(f"catch_up {version} before rollout {rid}: {sorted(result.engines)}", flush=True)
        record["seconds"] = round(time.monotonic() - started, 3)
        record["t1"] = time.time()
        await asyncio.to_thread(append, self.log, record)
        return True

    async def all_stale(self) -> bool:
        """No engine of an alive agent serves, some are stale, and no update runs: only an update brings the fleet
        back."""
        try:
            stats = await asyncio.wait_for(self.client.stats(), 5)
        except (RolloutError, TimeoutError):
            return False  # the coordinator is restarting: look again later
        if stats.weights.lock is not None:
            return False
        states = [e.get("state") for a in stats.agents.values() if a.status == "alive" for e in a.engines]
        return "stale" in states and "healthy" not in states

    async def generate(self, rid: int):
        """``client.generate(rid)``, engines behind caught up first; while it waits, a rescue update whenever every
        engine is stale."""
        await self.catch_up(rid)
        task = asyncio.ensure_future(self.client.generate(rid))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.rescue_after or None)
                if done:
                    try:
                        return task.result()
                    except NoCapacity as exc:  # every engine out of the pool: the coordinator says so
                        if "push a weight update" not in str(exc):
                            raise
                        print(f"rollout {rid}: {exc}: an update to bring them back", flush=True)
                        await self.rescue(rid)
                        task = asyncio.ensure_future(self.client.generate(rid))
                        continue
                if await self.all_stale():
                    print(f"every engine is stale while rollout {rid} waits: an update to bring them back", flush=True)
                    await self.rescue(rid)
        finally:
            task.cancel()

    async def rescue(self, rid: int) -> None:
        """Every engine is out of the pool: catch them up to the fleet's broadcast version, else a disk update."""
        if not await self.catch_up(rid, rescue=True):
            await self.push(rid, 0, rescue=True)

    def close(self) -> None:
        self.log.close()


async def evaluate(client: AsyncRolloutClient, args: argparse.Namespace, rid: int, run: str) -> None:
    """One evaluation pass after rollout ``rid``, logged (fsynced) with its metrics; a failure is logged, not raised:
    a trainer killed during it calls again after resuming and joins the same pass."""
    record = {"run": run, "pid": os.getpid(), "rid": rid, "name": args.eval_name}
    started = time.monotonic()
    try:
        record.update(ok=True, metrics=(await client.evaluate(args.eval_name)).to_dict())
    except RolloutError as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    record["seconds"] = round(time.monotonic() - started, 3)
    print(f"evaluate after rollout {rid}: {record.get('metrics') or record.get('error')}", flush=True)
    with open(args.eval_log, "a") as log:
        await asyncio.to_thread(append, log, record)


async def train(args: argparse.Namespace) -> int:
    ckpt = Path(args.checkpoint)
    run = "resumed" if args.resume else "first"
    client = AsyncRolloutClient(args.coordinator, retry_interval=0.5, fetch_timeout=args.fetch_timeout)
    async with client:
        pusher = Pusher(client, args, run) if args.weights_every > 0 else None
        with open(args.consumed, "a") as log:
            start = 0
            if args.resume and ckpt.exists():
                state = json.loads(ckpt.read_text())
                await client.load_state_dict(state)
                start = state["rollout_id"] + 1
                print(f"resumed at rollout {start}", flush=True)
            for rid in range(start, args.batches):
                batch = await (pusher.generate(rid) if pusher is not None else client.generate(rid))
                await asyncio.to_thread(append, log, batch_record(batch, run))
                print(f"consumed {rid}", flush=True)
                if pusher is not None and (rid + 1) % args.weights_every == 0:
                    await pusher.push(rid, (rid + 1) // args.weights_every)
                if args.evaluate_every and (rid + 1) % args.evaluate_every == 0:
                    await evaluate(client, args, rid, run)
                if (rid + 1) % args.checkpoint_every == 0:
                    await client.pause(drain=True)
                    state = await client.state_dict()
                    tmp = ckpt.with_suffix(".tmp")
                    tmp.write_text(json.dumps(state))
                    os.replace(tmp, ckpt)
                    await client.resume()
                    print(f"checkpoint at {rid}", flush=True)
        if pusher is not None:
            pusher.close()
    return 0


def main() -> int:
    return asyncio.run(train(parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
