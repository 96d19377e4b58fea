"""The lockstep of sharded weight pushes without a fleet (coordinator/trainer_group.py, coordinator/sharded_weights.py).

``make_plan`` is pure: every rank computes the same buckets from what every rank passes, or the same error. The
channel is run for real: two processes joined by gloo (no coordinator: the clients point at an address nobody
serves, so anything that reached for it would fail them).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.client_weights import buckets
from coordinator.trainer_group import PlanError, make_plan

ROOT = Path(__file__).resolve().parents[2]


def meta(*tensors, error=None) -> dict:
    """A rank's plan entry: ``(name, dtensor, dtype, shape, nbytes, mesh)`` tuples."""
    return {"tensors": list(tensors), "error": error}


def dt(name: str, shape=(4, 4), mesh=(0, 1)) -> tuple:
    return (name, True, "float32", shape, 4 * shape[0] * shape[1], mesh)


def plain(name: str, n: int = 4, dtype="float32") -> tuple:
    return (name, False, dtype, (n,), 4 * n, None)


def test_every_name_has_one_owner_and_a_place_in_one_order():
    """DTensors are gathered by their whole mesh and owned by rank 0; a tensor both ranks pass is rank 0's; one
    only rank 1 passes is rank 1's (sent to rank 0). The order is rank 0's names, then rank 1's new ones."""
    plan = make_plan(
        [
            meta(dt("a"), plain("shared"), dt("b")),
            meta(dt("a"), plain("expert.1"), plain("shared"), dt("b")),
        ],
        bucket_bytes=1 << 20,
    )
    (bucket,) = plan
    assert [(e.name, e.holders, e.owner) for e in bucket] == [
        ("a", (0, 1), 0),
        ("shared", (0, 1), 0),
        ("b", (0, 1), 0),
        ("expert.1", (1,), 1),
    ]


def test_buckets_follow_the_one_process_rule_on_full_sizes():
    sizes = [64, 64, 200, 8, 8, 8]
    plan = make_plan([meta(*(plain(f"t{i}", n // 4) for i, n in enumerate(sizes)))], bucket_bytes=128)

    class Sized:
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

        def element_size(self):
            return 1

    expected = buckets([(f"t{i}", Sized(n)) for i, n in enumerate(sizes)], 128)
    assert [[e.name for e in b] for b in plan] == [[name for name, _ in b] for b in expected]
    assert len(plan) == 3


@pytest.mark.parametrize(
    "metas, words",
    [
        ([meta(plain("w")), meta(plain("w", dtype="float16"))], ["'w'", "rank 0", "rank 1", "float16"]),
        ([meta(dt("w")), meta(plain("w", 16))], ["'w'", "a DTensor", "a tensor"]),
        ([meta(dt("w")), meta()], ["DTensor 'w'", "ranks [0, 1]", "only ranks [0]"]),
        ([meta(plain("w"), plain("w")), meta()], ["rank 0 passes 'w' twice"]),
        ([meta(plain("w")), meta(error="bucket_bytes must be > 0, got 0")], ["rank 1: bucket_bytes"]),
        ([meta(), meta()], ["no rank passed any"]),
    ],
)
def test_a_plan_that_does_not_hold_is_the_same_error_on_every_rank(metas, words):
    with pytest.raises(PlanError) as err:
        make_plan(metas, 1 << 20)
    for word in words:
        assert word in str(err.value), str(err.value)


WORKER = r"""
import asyncio, json, os, sys, time
import torch, torch.distributed as dist
from common.errors import StateError
from coordinator.client import AsyncRolloutClient
from coordinator.trainer_group import Channel, GroupBroken

rank, port, nobody, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
found = {}


async def main():
    address = f"tcp://127.0.0.1:{nobody}"
    client = AsyncRolloutClient(address, rank=rank, world_size=2, attach=False, timeout=2)
    w = {"w": torch.zeros(4, dtype=torch.float32 if rank == 0 else torch.float16)}
    try:
        await client.update_weights(w, 1, backend="gloo")
    except ValueError as exc:
        found["plan"] = [type(exc).__name__, str(exc)]
    alone = dist.new_group([0])  # every rank makes it; rank 1 is not in it
    try:
        await client.catch_up(w, 1, backend="gloo", group=alone)
    except StateError as exc:
        found["size"] = str(exc)
    await client.close()
    wrong = AsyncRolloutClient(address, rank=1 - rank, world_size=2, attach=False, timeout=2)
    try:
        await wrong.update_weights_from_disk("/nowhere", 1)
    except StateError as exc:
        found["rank"] = str(exc)
    await wrong.close()

    ch = Channel(dist.group.WORLD, rank, 2)
    ch.beat = 0.2
    await ch.open(10)
    if rank == 0:  # works 2 s, beating; then its word
        await ch.lead(asyncio.sleep(2), 10)
        await ch.tell(("done", 7), 10)
    else:  # waits with a bound of 0.5 s, which the beats keep from passing
        started = time.monotonic()
        found["beaten"] = [list(await ch.hear(0.5)), time.monotonic() - started]
    if rank == 0:  # silent 1.5 s: no beat
        await asyncio.sleep(1.5)
        try:
            await ch.tell(("late",), 10)  # ends the other side's orphaned receive, if it is still there
        except GroupBroken:
            pass
    else:
        try:
            await ch.hear(0.5)
        except GroupBroken as exc:
            found["silent"] = str(exc)
        try:
            await ch.hear(0.5)
        except GroupBroken as exc:
            found["after"] = str(exc)


asyncio.run(main())
with open(out, "w") as f:
    json.dump(found, f)
# A broken channel's thread may still sit in a gloo collective (it is never used again): leave without waiting
# for it, as a plain exit would end in C++'s "terminate called without an active exception" (SIGABRT).
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_two_ranks_agree_check_their_group_and_wait_on_beats_not_on_silence(tmp_path):
    """Two gloo ranks: tensors that make no plan raise the same ``ValueError`` on both (before anything is
    asked of the coordinator); a group or rank that is not the client's is a ``StateError``; a rank waiting for
    rank 0's word with a 0.5 s bound gets it after 2 s of rank 0's work (beats every 0.2 s), but a silent rank 0
    breaks the channel at the bound, and a broken channel stays broken."""
    pytest.importorskip("torch")
    (tmp_path / "worker.py").write_text(WORKER)
    port, nobody = free_port(), free_port()
    outs = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "worker.py"), str(r), str(port), str(nobody), str(outs[r])],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=45)
            assert proc.returncode == 0, output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    r0, r1 = (json.loads(p.read_text()) for p in outs)
    assert r0["plan"] == r1["plan"] and r0["plan"][0] == "PlanError", (r0, r1)
    assert "rank 0 passes a tensor float32 [4], rank 1 a tensor float16 [4]" in r0["plan"][1]
    assert "rank 0 of 1 in the trainer's process group" in r0["size"] and "rank -1 of" in r1["size"], (r0, r1)
    assert "client is rank 1 of 2, but this process is rank 0 of 2" in r0["rank"], r0
    assert "client is rank 0 of 2, but this process is rank 1 of 2" in r1["rank"], r1
    word, waited = r1["beaten"]
    assert word == ["done", 7] and waited >= 1.5, r1
    assert "no answer within 0.5s" in r1["silent"] and "waiting for rank 0's word" in r1["silent"], r1
    assert "process group failed" in r1["after"], r1


def test_a_sharded_call_without_torch_distributed_is_a_state_error_naming_init_process_group():
    torch = pytest.importorskip("torch")
    if torch.distributed.is_initialized():
        pytest.skip("this process already joined a torch.distributed group")

    from common.errors import StateError
    from coordinator.client import AsyncRolloutClient

    async def call(name: str):
        client = AsyncRolloutClient(f"tcp://127.0.0.1:{free_port()}", rank=1, world_size=2, attach=False)
        try:
            tensors = {"w": torch.zeros(2)}
            if name == "update_weights_from_disk":
                return await client.update_weights_from_disk("/nowhere", 1)
            return await getattr(client, name)(tensors, 1, backend="gloo")
        finally:
            await client.close()

    for name in ("update_weights", "catch_up", "update_weights_from_disk"):
        with pytest.raises(StateError, match="init_process_group"):
            asyncio.run(call(name))
