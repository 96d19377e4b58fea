"""SGLang's distributed weight-update groups, the engine's end: join, receive a bucket, destroy.

As SGLang's ``init_custom_process_group``: every rank of the engine (``--tp-size`` of them, ranks
``rank_offset + i``) meets rank 0, the trainer, through the TCP rendezvous
``tcp://master_address:master_port``, and the group's store keys are prefixed ``group_name`` then
``group_name/`` then ``cpu/``, exactly as a trainer's ``_new_process_group_helper(...,
PrefixStore(group_name, store), group_name=group_name)`` lays them out (SGLang's and slime's recipe,
and :mod:`common.weight_group`, the trainer's end; a plain ``init_process_group`` default group uses
other keys and would never meet the engine). The backend is built directly, not registered with
``torch.distributed``, so several engines and groups can live in one process. ``gloo`` always;
``nccl`` only for an engine whose model is on a CUDA device (the hf engine with ``--device cuda``;
its keys are prefixed ``cuda/`` instead of ``cpu/``, and buckets are received into that GPU's
memory). ``--weight-sync-timeout`` bounds the rendezvous and every collective, so a trainer that
dies mid-broadcast fails the call instead of hanging it: gloo notices the closed connection at
once; NCCL cannot, so its wait blocks until the timeout and then aborts the communicator (the
engine process sets ``TORCH_NCCL_BLOCKING_WAIT=1`` so that NCCL's watchdog never ends it instead).

torch is imported only in worker threads, and only when a group is used. Blocking torch calls run
in threads, one at a time per engine; a call whose HTTP client went away still waits for its thread
(bounded by the timeout) before the next one starts, and its tensors are dropped.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from agent.sim.weights import ACCURACY_KEY, WeightError, import_torch
from common.weight_group import DEFAULT_GROUP_NAME as DEFAULT_GROUP
from common.weight_group import NCCL_WATCHDOG_MARGIN_S


def _required(data: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data or data[key] is None:
        raise WeightError(f"Field required: {key}")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WeightError(f"{key} must be of type {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def parse_bucket(data: dict, torch: Any) -> list[tuple[str, Any, list[int]]]:
    """``(name, torch dtype, shape)`` per tensor of an ``/update_weights_from_distributed`` body."""
    names = _required(data, "names", list)
    dtypes = _required(data, "dtypes", list)
    shapes = _required(data, "shapes", list)
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)} and {len(shapes)}")
    load_format = data.get("load_format")
    if load_format not in (None, "auto"):
        raise WeightError(f"load_format {load_format!r} is not supported by rollfleet-sim (use null)")
    out, seen = [], set()
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not name:
            raise WeightError(f"tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise WeightError(f"tensor {name!r} appears twice in names")
        seen.add(name)
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise WeightError(f"tensor {name!r}: unknown dtype {dtype_name!r} (a torch dtype name without 'torch.')")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise WeightError(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
        if name == ACCURACY_KEY and math.prod(shape) != 1:
            raise WeightError(f"{ACCURACY_KEY} must hold one number, got shape {shape}")
        out.append((name, dtype, shape))
    return out


class _Group:
    """One engine's membership of a group: a backend (gloo or NCCL) per rank of the engine."""

    def __init__(self, backends: list[Any], stores: list[Any], kind: str = "gloo"):
        self.backends = backends
        self.stores = stores  # the rendezvous store clients: kept alive as long as the group
        self.kind = kind  # "gloo" (tensors received in CPU memory) or "nccl" (on the engine's GPU)

    def shutdown(self) -> None:
        for backend in self.backends:
            try:
                # NCCL: abort, which never waits on a peer (the trainer may be the reason for leaving).
                backend.abort() if self.kind == "nccl" else backend.shutdown()
            except Exception:  # gloo may not implement shutdown; dropping the references frees it
                pass
        self.backends, self.stores = [], []


class WeightGroups:
    """The engine's weight-update groups by name: join, receive a bucket by broadcast, destroy."""

    def __init__(self, *, timeout_s: float, tp_size: int = 1, device: str = "cpu", engine: str = "rollfleet-sim"):
        self.timeout_s = timeout_s
        self.tp_size = tp_size
        self.device = device  # where received tensors live: "cpu", or "cuda"/"cuda:N" for NCCL groups
        self.engine = engine  # for error messages
        self._groups: dict[str, _Group] = {}
        self._busy = asyncio.Lock()
        # One thread per rank: every rank of a tp>1 engine must enter the rendezvous and the collective at once.
        self._pool = ThreadPoolExecutor(max_workers=max(2, tp_size), thread_name_prefix="sim-weights")

    @property
    def names(self) -> list[str]:
        return sorted(self._groups)

    async def _blocking(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run each ``(fn, *args)`` in its own thread; results or exceptions, in order.

        If the caller is cancelled, it still waits for the threads (each bounded by the timeout),
        so the next operation never overlaps a running one.
        """
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, *call) for call in calls]
        gathered = asyncio.gather(*futures, return_exceptions=True)
        try:
            return await asyncio.shield(gathered)
        except asyncio.CancelledError:
            await asyncio.wait([gathered])
            raise

    async def _torch(self) -> Any:
        (torch,) = await self._blocking([(import_torch,)])
        if isinstance(torch, BaseException):
            raise torch
        return torch

    async def init(self, data: dict) -> str:
        """Join the group the body describes; returns SGLang's success message once every rank joined."""
        address = _required(data, "master_address", str)
        port = _required(data, "master_port", int)
        rank_offset = _required(data, "rank_offset", int)
        world_size = _required(data, "world_size", int)
        group_name = data.get("group_name") or DEFAULT_GROUP
        backend = data.get("backend") or "nccl"
        if not isinstance(group_name, str):
            raise WeightError(f"group_name must be a string, got {group_name!r}")
        self.check_backend(backend)
        if not 0 < port < 65536:
            raise WeightError(f"master_port must be in 1..65535, got {port}")
        if rank_offset < 1 or rank_offset + self.tp_size > world_size:
            raise WeightError(
                f"ranks {rank_offset}..{rank_offset + self.tp_size - 1} do not fit a group of world_size "
                f"{world_size} whose rank 0 is the trainer"
            )
        async with self._busy:
            if group_name in self._groups:
                raise WeightError(
                    "Failed to initialize custom process group: The specified group name has already been "
                    "created, please use a different group name."
                )
            torch = await self._torch()
            ranks = range(rank_offset, rank_offset + self.tp_size)
            init_method = f"tcp://{address}:{port}"
            results = await self._blocking(
                [(self._join, torch, init_method, rank, world_size, group_name, backend) for rank in ranks]
            )
            failures = [r for r in results if isinstance(r, BaseException)]
            joined = [r for r in results if not isinstance(r, BaseException)]
            if failures:
                _Group([b for b, _ in joined], [s for _, s in joined], backend).shutdown()
                raise WeightError(f"Failed to initialize custom process group: {failures[0]}.")
            self._groups[group_name] = _Group([b for b, _ in joined], [s for _, s in joined], backend)
        return "Succeeded to initialize custom process group."

    def check_backend(self, backend: Any) -> None:
        """WeightError unless this engine can join a group of ``backend``."""
        if backend == "gloo" or (backend == "nccl" and self.device.startswith("cuda")):
            return
        if backend == "nccl" and self.engine == "rollfleet-sim":
            raise WeightError(f"backend 'nccl' is not available in {self.engine} (CPU only): use 'gloo'")
        if backend == "nccl":
            raise WeightError(
                f"backend 'nccl' needs the model on a CUDA device, and this {self.engine} engine runs on "
                f"{self.device}: use 'gloo', or start the engine with --device cuda"
            )
        raise WeightError(f"backend {backend!r} is not available in {self.engine}: use 'gloo' or 'nccl'")

    def _join(
        self, torch: Any, init_method: str, rank: int, world_size: int, group_name: str, backend_name: str
    ) -> tuple[Any, Any]:
        from torch.distributed import PrefixStore, rendezvous

        timeout = timedelta(seconds=self.timeout_s)
        store, _, _ = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        # The keys of SGLang's init_custom_process_group: PrefixStore(group_name), then the helper's
        # "group_name/", then the device's "cpu/" (gloo) or "cuda/" (nccl).
        prefix = "cuda/" if backend_name == "nccl" else "cpu/"
        prefixed = PrefixStore(prefix, PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
        if backend_name == "nccl":
            backend = self._nccl(torch, prefixed, rank, world_size, group_name, timeout)
        else:
            from torch._C._distributed_c10d import ProcessGroupGloo

            backend = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        backend._set_sequence_number_for_group()
        return backend, store

    def _nccl(self, torch: Any, store: Any, rank: int, world_size: int, group_name: str, timeout: timedelta) -> Any:
        """An NCCL backend on this engine's GPU, with the options a trainer's ``_new_process_group_helper`` uses.
        Its communicator forms at the first broadcast (NCCL's unique id travels through ``store``)."""
        from torch._C._distributed_c10d import ProcessGroupNCCL

        torch.cuda.set_device(torch.device(self.device))
        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        # The watchdog's limit, past the waits' own (``timeout``), which raise and abort first.
        options._timeout = timeout + timedelta(seconds=NCCL_WATCHDOG_MARGIN_S)
        options.group_name = group_name
        options.global_ranks_in_group = list(range(world_size))
        return ProcessGroupNCCL(store, rank, world_size, options)

    async def receive(self, data: dict) -> dict[str, Any]:
        """Receive one bucket by ``broadcast(src=0)`` in ``names`` order; the tensors by name."""
        group_name = data.get("group_name") or DEFAULT_GROUP
        self.require(group_name)
        torch = await self._torch()
        specs = parse_bucket(data, torch)
        async with self._busy:
            self.require(group_name)  # it may have been destroyed while this call waited
            group = self._groups[group_name]
            device = self.device if group.kind == "nccl" else "cpu"
            results = await self._blocking(
                [(self._broadcast, torch, backend, specs, device) for backend in group.backends]
            )
        for result in results:
            if isinstance(result, BaseException):
                raise WeightError(
                    f"Failed to update parameter online: {result}. The full weights of the ModelRunner are "
                    "partially updated. Please discard the whole weights."
                )
        return results[0]

    def _broadcast(
        self, torch: Any, backend: Any, specs: list[tuple[str, Any, list[int]]], device: str = "cpu"
    ) -> dict[str, Any]:
        from torch._C._distributed_c10d import BroadcastOptions

        timeout = timedelta(seconds=self.timeout_s)
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = timeout
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        received, works = {}, []
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            works.append(backend.broadcast([tensor], options))
            received[name] = tensor
        for work in works:
            work.wait(timeout)
        return received

    def require(self, group_name: str) -> None:
        if group_name not in self._groups:
            raise WeightError(
                f"Group {group_name} not in {sorted(self._groups)}. Please call `init_weights_update_group` first."
            )

    async def destroy(self, data: dict) -> str:
        group_name = data.get("group_name") or DEFAULT_GROUP
        async with self._busy:
            group = self._groups.pop(group_name, None)
            if group is None:
                raise WeightError("The group to be destroyed does not exist.")
            group.shutdown()
        return "Succeeded to destroy custom process group."

    def close(self) -> None:
        """Leave every group and stop the threads (engine shutdown); a running collective ends by its timeout."""
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
