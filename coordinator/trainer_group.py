"""The trainer's own process group in a sharded weight update (coordinator/sharded_weights.py): the plan
every rank agrees on, the gathers bucket by bucket, and the channel rank 0 steers the other ranks through.

**Plan.** Every rank says what it passes (name, DTensor or not, dtype, global shape, the ranks of a DTensor's
mesh, and its own argument errors) in one ``all_gather_object``; every rank then computes the same plan from
the same lists (``make_plan``, no torch), or raises the same ``PlanError``. A name's *holders* are the ranks
that pass it; its *owner* is rank 0 when it holds it, else the lowest holder. The order is rank 0's names,
then each later rank's new ones; buckets group that order up to ``bucket_bytes`` of full tensors.

**Gather** (``gather``, one bucket): for each entry in plan order, every holder of a DTensor runs
``full_tensor()`` (a collective over its mesh); an owner other than rank 0 sends the full tensor to rank 0
(``send``/``recv`` over the trainer's group). Rank 0 ends with the bucket's full tensors; every other rank
drops what it gathered. Every rank runs its share of the operations in one global order, so none waits on
another that is elsewhere (the first operation not yet done has every participant at it).

**Channel.** Rank 0 talks to the others with ``broadcast_object_list`` over the trainer's group (or, when
that group cannot carry CPU tensors, a gloo group made once beside it). Every collective runs on the
channel's one worker thread (a daemon), so they keep their order, the event loop keeps serving, and a
caller waits a bounded time: a collective that raises (gloo raises at once when a peer's process is gone)
or outlives its bound marks the channel broken, for good (a thread may still sit in a collective on that
group), and raises ``GroupBroken``. While rank 0 works alone (the coordinator, the engines) it sends a
*beat* every ``BEAT`` seconds, so a rank waiting for word never mistakes a long step for a silent rank 0,
and rank 0 learns at once when another rank is gone.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import WeightUpdateError

BEAT = 1.0
"""Seconds between rank 0's beats to the ranks waiting for its word."""
BEAT_MSG = ("beat",)


class GroupBroken(WeightUpdateError):
    """The trainer's process group failed during a sharded update: a rank died (its collectives raised), or
    one outlived the update's timeout. Never retried; the group is not used for updates again."""

    def __init__(self, message: str):
        super().__init__(message, code="weights")


class PlanError(ValueError):
    """The ranks' tensors do not make one plan (raised alike on every rank)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtensor: bool
    dtype: str  # torch's name without "torch."
    shape: tuple[int, ...]
    nbytes: int
    holders: tuple[int, ...]
    owner: int


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def describe(items: list, global_ranks: dict[int, int]) -> tuple[list, str | None]:
    """This rank's entries for the plan: ``(name, dtensor, dtype, shape, nbytes, mesh group ranks)``, and the
    first thing wrong with them (None when nothing is). ``global_ranks``: global rank -> group rank."""
    dtensor_type = _dtensor_type()
    out = []
    for name, t in items:
        if not isinstance(name, str) or not hasattr(t, "numel") or not hasattr(t, "element_size"):
            return out, f"{name!r} is not a (name, tensor) pair of a str and a torch tensor"
        shape, nbytes = tuple(int(x) for x in t.shape), int(t.numel()) * int(t.element_size())
        mesh = None
        if dtensor_type is not None and isinstance(t, dtensor_type):
            ranks = [int(r) for r in t.device_mesh.mesh.flatten().tolist()]
            outside = [r for r in ranks if r not in global_ranks]
            if outside:
                return out, f"DTensor {name!r} has a mesh with ranks {outside} outside the trainer's group"
            mesh = tuple(sorted(global_ranks[r] for r in ranks))
        out.append((name, mesh is not None, dtype_name(t.dtype), shape, nbytes, mesh))
    return out, None


def make_plan(metas: list[dict], bucket_bytes: int) -> list[list[Entry]]:
    """The buckets every rank gathers, from every rank's ``{"tensors": describe(...)[0], "error": ...}``
    (``metas[r]`` is rank r's); ``PlanError`` when they disagree."""
    for r, meta in enumerate(metas):
        if meta["error"]:
            raise PlanError(f"rank {r}: {meta['error']}")
    order: list[str] = []
    first: dict[str, tuple] = {}
    holders: dict[str, list[int]] = {}
    for r, meta in enumerate(metas):
        mine: set[str] = set()
        for name, dtensor, dtype, shape, nbytes, mesh in meta["tensors"]:
            if name in mine:
                raise PlanError(f"rank {r} passes {name!r} twice")
            mine.add(name)
            seen = (dtensor, dtype, tuple(shape), nbytes, mesh)
            if name not in first:
                order.append(name)
                first[name], holders[name] = seen, [r]
                continue
            if seen[:4] != first[name][:4]:
                r0 = holders[name][0]
                raise PlanError(
                    f"{name!r}: rank {r0} passes {_what(first[name])}, rank {r} {_what(seen)}: "
                    "every rank passing a name must pass the same tensor (a DTensor of it, or a copy)"
                )
            holders[name].append(r)
    if not order:
        raise PlanError("update_weights needs at least one named tensor (no rank passed any)")
    entries = []
    for name in order:
        dtensor, dtype, shape, nbytes, mesh = first[name]
        who = tuple(holders[name])
        if dtensor and set(mesh) != set(who):
            raise PlanError(
                f"DTensor {name!r} lives on the mesh of ranks {list(mesh)}, but only ranks {list(who)} pass it: "
                "every rank of its mesh must (gathering it is a collective)"
            )
        entries.append(Entry(name, dtensor, dtype, shape, nbytes, who, 0 if 0 in who else who[0]))
    out: list[list[Entry]] = []
    size = 0
    for entry in entries:  # coordinator/client_weights.buckets' rule, on the full tensors' sizes
        if not out or (size + entry.nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry.nbytes
    return out


def _what(seen: tuple) -> str:
    dtensor, dtype, shape, _, _ = seen
    return f"{'a DTensor' if dtensor else 'a tensor'} {dtype} {list(shape)}"


def gather(bucket: list[Entry], mine: dict, rank: int, group: Any, device: Any) -> list[tuple[str, Any]]:
    """One bucket's full tensors on rank 0 (``[]`` elsewhere): this rank's share of the collectives, in plan
    order. ``device``: where tensors travel between ranks over ``group``. Blocking."""
    import torch
    import torch.distributed as dist

    out = []
    with torch.no_grad():
        for e in bucket:
            t = mine.get(e.name)
            full = None
            if t is not None:
                full = (t.full_tensor() if e.dtensor else t).detach()
            if e.owner == 0:
                if rank == 0:
                    out.append((e.name, full))
            elif rank == e.owner:
                dist.send(full.to(device).contiguous(), dst=_global(group, 0), group=group)
            elif rank == 0:
                buf = torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device)
                dist.recv(buf, src=_global(group, e.owner), group=group)
                out.append((e.name, buf))
            del full
    return out


def _global(group: Any, group_rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank)


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.5
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def wire_device(group: Any, items: list) -> Any:
    """Where tensors travel between the trainer's ranks: the CPU on a group gloo serves, else this rank's GPU
    (the group's bound device, else its first CUDA tensor's, else the current one)."""
    import torch

    if "gloo" in backend_of(group):
        return torch.device("cpu")
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    for _, t in items:
        if getattr(t, "device", None) is not None and t.device.type == "cuda":
            return t.device
    return torch.device("cuda", torch.cuda.current_device())


def cuda_device(items: list, wire: Any) -> Any:
    """This rank's GPU: its first CUDA tensor's device, else the wire's when that is a GPU; None on CPU."""
    for _, t in items:
        if getattr(t, "device", None) is not None and t.device.type == "cuda":
            return t.device
    return wire if wire.type == "cuda" else None


def backend_of(group: Any) -> str:
    import torch.distributed as dist

    getter = getattr(dist, "get_backend_config", None) or dist.get_backend
    return str(getter(group))


class Channel:
    """Rank 0's word to the other ranks of one trainer group, and every collective of a sharded update, on one
    worker thread with bounded waits. ``owed``: the other ranks wait for rank 0's next message (not a beat)."""

    def __init__(self, group: Any, rank: int, size: int):
        self.group = group
        self.rank = rank
        self.size = size
        self.device: Any = None  # where tensors travel between ranks (``wire_device``), set by each plan
        self.cuda: Any = None  # this rank's GPU (its first CUDA tensor's), current on the worker thread
        self.ctl: Any = None
        self.broken: GroupBroken | None = None
        self.owed = True
        self.beat = BEAT
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="rollfleet-trainer-group", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                if self.cuda is not None:
                    import torch

                    torch.cuda.set_device(self.cuda)  # the current device is per thread
                result, error = fn(), None
            except BaseException as exc:  # handed to the waiting caller
                result, error = None, exc
            done(result, error)

    async def run(self, fn: Callable[[], Any], bound: float, what: str) -> Any:
        """``fn()`` on the worker thread, after every job queued before it; GroupBroken (and the channel broken
        for good) when it raises or outlives ``bound`` seconds."""
        self.check()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_exception(error) if error is not None else fut.set_result(result)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is gone (the client closed)
                pass

        self._jobs.put((fn, done))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), bound)
        except TimeoutError:
            raise self._break(f"{what}: no answer within {bound:g}s") from None
        except (asyncio.CancelledError, GroupBroken):
            raise
        except BaseException as exc:
            raise self._break(f"{what}: {type(exc).__name__}: {exc}") from exc

    def _break(self, why: str) -> GroupBroken:
        error = GroupBroken(f"the trainer's process group failed: {why}")
        if self.broken is None:
            self.broken = error
        return error

    def check(self) -> None:
        if self.broken is not None:
            raise GroupBroken(str(self.broken))

    async def open(self, bound: float) -> None:
        """The control group: the trainer's own when gloo serves it (CPU objects), else a gloo group of the
        same ranks, made once (a collective of the group's ranks)."""

        def make() -> Any:
            import torch.distributed as dist

            if "gloo" in backend_of(self.group):
                return self.group
            ranks = dist.get_process_group_ranks(self.group)
            if ranks == list(range(dist.get_world_size())):
                return dist.new_group(backend="gloo")
            return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)

        self.ctl = await self.run(make, bound, "forming a gloo group beside the trainer's for the update's word")

    def _src(self) -> int:
        return _global(self.ctl, 0)

    async def tell(self, msg: tuple, bound: float) -> None:
        """Rank 0: ``msg`` to every other rank (a beat leaves ``owed`` as it is)."""

        def send() -> None:
            import torch.distributed as dist

            dist.broadcast_object_list([msg], src=self._src(), group=self.ctl)
            if msg != BEAT_MSG:
                self.owed = msg[0] == "retry"  # after a retry they wait for the next attempt's word

        await self.run(send, bound, f"telling the other ranks {msg[0]!r}")

    async def tell_if_owed(self, msg: tuple, bound: float) -> None:
        """Rank 0: ``msg``, if the other ranks wait for a message once every job queued before it is done."""
        if self.broken is not None:
            return

        def send() -> None:
            import torch.distributed as dist

            if self.owed:
                dist.broadcast_object_list([msg], src=self._src(), group=self.ctl)
                self.owed = msg[0] == "retry"

        await self.run(send, bound, f"telling the other ranks {msg[0]!r}")

    async def hear(self, bound: float) -> tuple:
        """Another rank: rank 0's next message, beats skipped; GroupBroken when rank 0 is silent ``bound`` s (at
        least two beats' time)."""
        bound = max(bound, 2 * self.beat)

        def recv() -> tuple:
            import torch.distributed as dist

            box = [None]
            dist.broadcast_object_list(box, src=self._src(), group=self.ctl)
            return box[0]

        while True:
            msg = await self.run(recv, bound, "waiting for rank 0's word")
            if msg != BEAT_MSG:
                return msg

    async def lead(self, aw: Any, bound: float) -> Any:
        """Rank 0: await ``aw`` (its own work while the others wait for its word), beating them meanwhile. A
        beat that fails breaks the channel; ``aw`` is still awaited (the caller learns what to undo) and
        ``check()`` raises afterwards."""
        task = asyncio.ensure_future(aw)
        try:
            while not task.done():
                await asyncio.wait([task], timeout=self.beat)
                if not task.done() and self.broken is None:
                    try:
                        await self.tell(BEAT_MSG, bound)
                    except GroupBroken:
                        pass  # check() raises it once ``aw`` is done
        except asyncio.CancelledError:
            task.cancel()
            raise
        return task.result()

    async def exchange(self, obj: Any, bound: float, what: str) -> list:
        """Every rank's ``obj`` (``all_gather_object``), in group-rank order."""

        def gather_all() -> list:
            import torch.distributed as dist

            out: list = [None] * self.size
            dist.all_gather_object(out, obj, group=self.ctl)
            return out

        return await self.run(gather_all, bound, what)

    async def gather(self, bucket: list[Entry], mine: dict, bound: float, what: str) -> list:
        def job() -> list:
            out = gather(bucket, mine, self.rank, self.group, self.device)
            self.owed = True
            return out

        return await self.run(job, bound, what)

    def close(self) -> None:
        self._jobs.put(None)
