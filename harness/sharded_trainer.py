"""One rank of a two-rank sharded trainer (FSDP2 over gloo, on CPU), for tests of weight pushes from every rank.

    python -m harness.sharded_trainer ADDRESS RANK WORLD INIT_PORT OUT_DIR SCENARIO [ENGINE_PID]

Every rank joins ``torch.distributed`` (gloo, ``tcp://127.0.0.1:INIT_PORT``), builds ``build_model()`` wrapped
with ``fully_shard`` (its parameters are DTensors, each rank holding half of each), and opens a
``RolloutClient(rank=RANK, world_size=WORLD)``: rank 0 attaches to ADDRESS; the others are given an address
nobody serves (``attach=False``, a 5 s request timeout), so any coordinator request a member made in a weight
call would fail it. What it pushes at version v (``tensors``): the model's DTensors after v steps of
``step()``, ``sim.accuracy`` (a plain tensor every rank passes) and ``expert.R.weight`` (one only rank R passes).
``reference(v, world)`` is the same, unsharded: what every engine must hold after the push.

Each call's outcome goes to ``OUT_DIR/rank<R>.json`` (a list of ``{"step", "result" | "error", "kind", "at"}``,
``at`` from ``time.time()``) and a line to stdout. Scenarios:

- ``push``: ``update_weights`` of version 1 (verified, several buckets), then waits for ``OUT_DIR/go-2`` (the test
  checks the engines), writes the full model to ``OUT_DIR/ckpt2/weights.pt`` and pushes it with
  ``update_weights_from_disk``, then a ``catch_up`` with nothing behind, then ``update_weights`` of version 2
  again (refused: ``StateError`` on every rank);
- ``retry``: rank 0 SIGKILLs ENGINE_PID just before it broadcasts the first bucket of version 1 (gathered; the
  engine is in the group then), so the push costs one retry; then, once ``OUT_DIR/go-2`` says an engine is
  behind the fleet, ``catch_up`` twice (it, then nothing behind);
- ``kill-member``: rank 1 stops before gathering bucket 1 of version 1 (prints ``stalled``); the test kills it;
- ``kill-leader``: rank 0 stops inside its broadcast of bucket 1 (prints ``stalled``); the test kills it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import weight_group
from coordinator import trainer_group
from coordinator.client import RolloutClient, WeightUpdateResult

TIMEOUT = 30.0
BUCKET_BYTES = 4 << 10  # several buckets for a model of ~17 KiB


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8)
    )


def step(model: torch.nn.Module) -> None:
    """One "training step": the same float operations on a sharded and an unsharded model give the same bits."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(1.0)


def plain(version: int, world: int) -> tuple[dict, dict]:
    """``(every rank's, {rank: only that rank's})`` plain tensors at ``version``."""
    shared = {"sim.accuracy": torch.tensor([0.5])}
    owned = {
        r: {f"expert.{r}.weight": torch.arange(96, dtype=torch.float32).reshape(12, 8) * (r + 1) + version}
        for r in range(world)
    }
    return shared, owned


def reference(version: int, world: int) -> dict:
    """What every engine holds after a push of ``version``: the unsharded model after ``version`` steps, and the
    plain tensors."""
    model = build_model()
    for _ in range(version):
        step(model)
    shared, owned = plain(version, world)
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    out.update(shared)
    for tensors in owned.values():
        out.update(tensors)
    return out


def tensors(model: torch.nn.Module, version: int, rank: int, world: int) -> list:
    shared, owned = plain(version, world)
    return [*model.named_parameters(), *shared.items(), *owned[rank].items()]


class Log:
    def __init__(self, out: Path, rank: int):
        self.path = out / f"rank{rank}.json"
        self.rank = rank
        self.records: list[dict] = []

    def call(self, name: str, fn) -> WeightUpdateResult | None:
        started = time.time()
        try:
            result = fn()
        except Exception as exc:
            record = {"step": name, "error": str(exc), "kind": type(exc).__name__}
            result = None
        else:
            record = {"step": name, "result": result.to_dict()}
        record.update(at=time.time(), took=time.time() - started)
        self.records.append(record)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records))
        os.replace(tmp, self.path)
        print(f"rank {self.rank} {name}: {json.dumps(record)}", flush=True)
        return result


def wait_file(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never came")
        time.sleep(0.05)


def stall(what: str) -> None:
    print(f"stalled {what}", flush=True)
    threading.Event().wait()  # until killed


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def nobody_listens() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(address: str, rank: int, world: int, port: int, out: Path, scenario: str, engine_pid: int = 0) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    step(model)  # version 1
    log = Log(out, rank)

    if scenario == "retry" and rank == 0:
        real, calls = weight_group.broadcast, []

        def killing(group, sent, timeout_s=None):
            calls.append(1)
            if len(calls) == 1:  # the group holds the engine now: it dies before the first bucket reaches it
                os.kill(engine_pid, signal.SIGKILL)
                while not gone(engine_pid):
                    time.sleep(0.01)
                print(f"killed engine {engine_pid}", flush=True)
            return real(group, sent, timeout_s)

        weight_group.broadcast = killing
    if scenario == "kill-member" and rank == 1:
        real_gather, buckets = trainer_group.gather, []

        def stalling_gather(bucket, *args):
            buckets.append(1)
            if len(buckets) == 2:
                stall("before gathering bucket 1")
            return real_gather(bucket, *args)

        trainer_group.gather = stalling_gather
    if scenario == "kill-leader" and rank == 0:
        real_broadcast, sends = weight_group.broadcast, []

        def stalling_broadcast(group, sent, timeout_s=None):
            sends.append(1)
            if len(sends) == 2:
                stall("inside the broadcast of bucket 1")
            return real_broadcast(group, sent, timeout_s)

        weight_group.broadcast = stalling_broadcast

    if rank:
        address = f"tcp://127.0.0.1:{nobody_listens()}"
    client = RolloutClient(
        address, rank=rank, world_size=world, attach=rank == 0, timeout=60 if rank == 0 else 5, retry_interval=0.5
    )
    try:
        push = lambda v, **kw: client.update_weights(  # noqa: E731
            tensors(model, v, rank, world), v, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT, **kw
        )
        log.call("broadcast-1", lambda: push(1, verify=True))
        if scenario == "push":
            wait_file(out / "go-2")
            step(model)
            full = {name: p.full_tensor().detach().contiguous() for name, p in model.named_parameters()}
            if rank == 0:
                shared, owned = plain(2, world)
                full.update(shared)
                for part in owned.values():
                    full.update(part)
                (out / "ckpt2").mkdir()
                torch.save(full, out / "ckpt2" / "weights.pt")
            log.call("disk-2", lambda: client.update_weights_from_disk(str(out / "ckpt2"), 2, timeout=TIMEOUT))
            log.call("catch-up-none", lambda: client.catch_up(tensors(model, 2, rank, world), 2, backend="gloo"))
            log.call("broadcast-2-again", lambda: push(2))
        elif scenario == "retry":
            wait_file(out / "go-2")  # the test has an engine behind the fleet
            catch = lambda: client.catch_up(  # noqa: E731
                tensors(model, 1, rank, world), 1, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT
            )
            log.call("catch-up-1", catch)
            log.call("catch-up-none", catch)
    finally:
        client.close()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4]), argv[5], *(int(x) for x in argv[6:]))
