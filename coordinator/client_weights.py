"""The trainer's side of weight updates (docs/weights.md): rank 0 of the update group.

``WeightSender`` runs inside ``AsyncRolloutClient``, which hands it the one way it reaches the coordinator: a
``Request`` (coordinator/client_session.py), the client's session-bound request. A disk update is one request.
A broadcast:

1. pick ``master_address`` (the trainer's address as the coordinator's host sees it: 127.0.0.1
   when the coordinator is on loopback, else the local address of a UDP socket connected to the
   coordinator's host) and a free ``master_port``; send ``UpdateWeights(kind="distributed")``;
2. if the answer says ``init``, destroy the old group and form the new one as rank 0
   (``common/weight_group.py``: the layout SGLang's engines expect; a plain
   ``init_process_group`` would never meet them);
3. per bucket (tensors grouped up to ``bucket_bytes`` in iteration order): ``WeightBucket``,
   wait for its ``Ok``, then ``broadcast(src=0)`` each tensor in order;
4. ``FinishWeights``, answered once every engine serves the version.

While the call runs it sends ``WeightsAlive`` every heartbeat interval (at most 0.25 s apart): a
trainer silent past the coordinator's TTL (SIGKILLed inside a broadcast) has its update aborted and
the lock released. The answer says when the coordinator aborted the update this call works on (an
agent reported an engine dead in the rendezvous, a member was lost): the client then closes the
rendezvous store it hosts, so its own join and every engine still waiting in
``/init_weights_update_group`` fail at once, and the one retry starts without waiting out a timeout.

Failures: when this side fails (``torch.distributed`` raises, e.g. gloo's "Connection closed by
peer" once an engine died, or the call is cancelled) the client sends ``AbortWeights`` at once,
so the coordinator releases the lock and admission resumes now, not at the deadline. Whatever
failed, the caller gets ``WeightUpdateError`` (never a raw torch error). An update that failed
with code ``weights`` (an engine lost, a broken link) is retried once, transparently, as a new
update on a new group of the engines confirmed then; the tensors are held by reference for the
call's duration, so a generator of them works too. ``weights_busy``, ``weights_version`` and
``fenced`` are not retried.

Every blocking torch call runs in a worker thread, so the client's event loop keeps serving
(heartbeats, resends). torch is imported only by these calls. Any failure destroys the local
group (its other ends are destroyed by the abort): the next update forms a new one. The group
is kept between updates otherwise, and destroyed by ``close()``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from common import protocol as p
from common import weight_group
from common.errors import RemoteError, RolloutError, StateError, WeightUpdateError
from common.weight_rows import leading_rows, tensor_checksum
from common.weight_step import WeightKind
from coordinator.client_results import WeightUpdateResult

DISK, DISTRIBUTED, CATCH_UP = WeightKind.DISK, WeightKind.DISTRIBUTED, WeightKind.CATCH_UP

if TYPE_CHECKING:
    from coordinator.client_session import Request

log = logging.getLogger("rollfleet.client.weights")

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_TIMEOUT = 300.0
VERIFY_EVERY = 10
"""With ``verify=None`` (the default) the first update of a group is verified, then every tenth."""
VERIFY_ROWS = 4
"""Rows of each sampled tensor a verified update compares on every engine."""
ABORT_DEADLINE = 5.0
"""Seconds the client spends telling the coordinator its side of an update failed."""


def coordinator_host(address: str) -> str:
    """The host of a ``tcp://host:port`` endpoint."""
    host = urlsplit(address).hostname
    if not host:
        raise ValueError(f"coordinator address {address!r} has no host")
    return host


def master_address(address: str) -> str:
    """This process's address as seen from the coordinator's host (rank 0's rendezvous address)."""
    host = coordinator_host(address)
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route and its local address
        return s.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """Consecutive tensors grouped up to ``bucket_bytes`` (a larger tensor is a bucket of its own)."""
    out: list[list[tuple[str, Any]]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not out or (size + nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def verify_values(items: list[tuple[str, Any]], rows: int = VERIFY_ROWS) -> dict:
    """``FinishWeights.verify`` for ``items``: of the first, middle and last tensor sent, the first ``rows``
    rows (as floats), read back where the engine has ``/get_weights_by_name``, and the checksum of the
    whole tensor as sent, compared with ``/weights_checker``'s where it does not (docs/weights.md)."""
    picks = sorted({0, len(items) // 2, len(items) - 1})
    values, checksums = {}, {}
    for i in picks:
        name, tensor = items[i]
        values[name] = leading_rows(tensor, rows)
        checksums[name] = tensor_checksum(tensor)
    return {"rows": rows, "values": values, "checksums": checksums}


class WeightSender:
    """Rank 0's side of the weight updates of one client. ``request``: the client's session-bound coordinator
    request (its one way to the coordinator); ``address``: the coordinator's endpoint (the rendezvous address is
    picked against it); ``heartbeat``: the coordinator's heartbeat interval now (it comes with each attach)."""

    def __init__(self, request: Request, address: str, heartbeat: Callable[[], float]):
        self.request = request
        self.address = address
        self.heartbeat = heartbeat
        self.group: Any = None
        self.group_name = ""
        self._store: Any = None  # the rendezvous store of ``group``, hosted by this process for its lifetime
        self._side_store: Any = None  # the rendezvous store of a catch-up's group, for the call
        self._hosting: Any = None  # the store of a group being formed; dropped to abandon the rendezvous
        self._update_id = 0  # the update this call works on: its keep-alive asks whether it was aborted
        self._aborted: dict[int, str] = {}  # update id -> why the coordinator aborted it
        self.version: int | None = None
        self.updates = 0  # broadcasts attempted: every VERIFY_EVERY-th is verified by default

    async def from_disk(self, path: str, version: int, timeout: float) -> WeightUpdateResult:
        result = await self.request(
            lambda s, req: p.UpdateWeights(s, req, int(version), DISK, str(path), timeout=float(timeout)),
            f"update_weights_from_disk({version})",
        )
        self.version = result["version"]
        return WeightUpdateResult.from_wire(result)

    async def broadcast(
        self, named_tensors, version: int, backend: str, bucket_bytes: int, timeout: float, verify: bool | None = None
    ) -> WeightUpdateResult:
        # References to the tensors, not copies, kept for the call's duration: a retry sends them
        # again, also when they came from a generator such as ``model.named_parameters()``.
        items = local_tensors(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        if not items:
            raise ValueError("update_weights needs at least one named tensor")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        check_backend(backend)
        what = f"update_weights({version})"
        beat = self._start_beat(what, f"weights-alive-{version}")
        try:
            try:
                result = await self._attempt(items, int(version), backend, bucket_bytes, float(timeout), what, verify)
                return WeightUpdateResult.from_wire(result)
            except WeightUpdateError as exc:
                if exc.code != "weights":
                    raise
                # An engine lost in the update (or a broken link) failed it: the coordinator aborted it
                # and released the lock. Once more, on a new group of the engines confirmed now.
                log.warning("%s failed, retrying once on a new group: %s", what, exc)
                first = str(exc)
            result = await self._attempt(items, int(version), backend, bucket_bytes, float(timeout), what, verify)
            return WeightUpdateResult.from_wire(result, retried=first)
        finally:
            await self._stop_beat(beat)

    def _start_beat(self, what: str, name: str) -> tuple[asyncio.Task, asyncio.Event]:
        stop = asyncio.Event()
        task = asyncio.ensure_future(self._keep_alive(what, stop))
        task.set_name(name)
        return task, stop

    @staticmethod
    async def _stop_beat(beat: tuple[asyncio.Task, asyncio.Event]) -> None:
        """End the keep-alive: by its flag as well as by cancellation, since ``asyncio.wait_for`` (Python 3.11)
        can swallow a cancellation that lands as its request is answered; the flag ends the loop then."""
        task, stop = beat
        stop.set()
        task.cancel()
        await asyncio.wait([task], timeout=5)
        if not task.done():
            log.warning("the weight-update keep-alive did not stop within 5 s; leaving it to end on its flag")

    async def _keep_alive(self, what: str, stop: asyncio.Event) -> None:
        """``WeightsAlive`` every heartbeat interval (at most 0.25 s) while the call runs: the coordinator
        aborts the update of a trainer silent past its TTL (a trainer SIGKILLed mid-broadcast frees the
        lock that way), and answers whether the update this call works on was aborted (then the
        rendezvous is abandoned at once)."""
        interval = min(self.heartbeat(), 0.25)
        while not stop.is_set():
            await asyncio.sleep(interval)
            if stop.is_set():
                return
            update_id = self._update_id
            try:
                answer = await self.request(
                    lambda s, req, update_id=update_id: p.WeightsAlive(s, req, update_id), f"{what} heartbeat"
                )
            except RolloutError as exc:
                log.debug("%s heartbeat: %s", what, exc)  # the call itself meets the same error
                continue
            if update_id and update_id == self._update_id and answer.get("failed"):
                self._abandon(update_id, str(answer["failed"]))

    def _abandon(self, update_id: int, why: str) -> None:
        """The coordinator aborted ``update_id``: close a rendezvous still forming its group."""
        if update_id in self._aborted:
            return
        self._aborted[update_id] = why
        if self._hosting is not None:
            log.info("weight update %#x was aborted while its group formed; closing the rendezvous: %s", update_id, why)
            self._hosting = None  # the last reference: the store closes, every rank waiting on it fails now

    async def _begin(self, make, address: str, port: int, timeout: float, what: str) -> dict:
        """Send ``UpdateWeights`` with the rendezvous already served at ``address:port``: the engines dial it
        as soon as the coordinator announces the group, and one that finds nothing listening backs off for
        seconds (torch's store client). Kept when the answer says ``init``, closed otherwise."""
        self._hosting = weight_group.host(address, port, timeout)  # held by this object only (see ``_abandon``)
        try:
            begun = await self.request(make, what)
        except BaseException:
            self._hosting = None
            raise
        if not begun.get("init") or not begun.get("world_size"):
            self._hosting = None  # the group is kept (or nothing is behind): no rendezvous
        return begun

    async def _form(self, address: str, port: int, begun: dict, backend: str, timeout: float) -> tuple[Any, Any]:
        """Join the rendezvous ``_begin`` serves as rank 0: ``(group, store)``. Abandoned (``_abandon``) when
        the coordinator aborts the update meanwhile: every rank then fails at once."""
        try:
            group = await asyncio.to_thread(
                weight_group.join,
                address,
                port,
                begun["world_size"],
                backend=backend,
                group_name=begun["group_name"],
                timeout_s=timeout,
            )
        except BaseException:
            self._hosting = None
            raise
        store, self._hosting = self._hosting, None
        if store is None:  # aborted as the group formed: it cannot be used
            await self._drop(group)
            raise WeightUpdateError(self._aborted.get(begun["update_id"], "aborted"), code="weights")
        return group, store

    async def _attempt(
        self, items, version: int, backend: str, bucket_bytes: int, timeout: float, what: str, verify: bool | None
    ) -> dict:
        """One update: a new ``UpdateWeights``, the group, the buckets, ``FinishWeights``."""
        address = master_address(self.address)
        port = free_port(address)
        begun = await self._begin(
            lambda s, req: p.UpdateWeights(s, req, version, DISTRIBUTED, "", address, port, backend, timeout),
            address,
            port,
            timeout,
            what,
        )
        update_id = self._update_id = begun["update_id"]
        try:
            if begun["init"]:
                await self._destroy()
                log.info(
                    "forming weight-update group %s (world size %d) on %s:%d",
                    begun["group_name"],
                    begun["world_size"],
                    address,
                    port,
                )
                self.group, self._store = await self._form(address, port, begun, backend, timeout)
                self.group_name = begun["group_name"]
            elif self.group is None or self.group_name != begun["group_name"]:
                raise WeightUpdateError(
                    f"{what}: the coordinator kept group {begun['group_name']!r}, which this trainer no longer holds",
                    code="weights",
                )
            await self._send(self.group, update_id, items, backend, bucket_bytes, timeout, what)
            self.updates += 1
            checked = verify if verify is not None else (begun["init"] or self.updates % VERIFY_EVERY == 0)
            values = verify_values(items) if checked else {}
            result = await self.request(lambda s, req: p.FinishWeights(s, req, update_id, values), what)
        except (RemoteError, StateError):
            # The coordinator answered with an error: it has ended the update already.
            await asyncio.shield(self._destroy())  # the next update forms a new group
            raise
        except BaseException as exc:
            # This side failed (torch.distributed raised, a link timed out, the call was cancelled):
            # say so at once, so the lock is released now and not at the update's deadline. When the
            # coordinator aborted it first (the rendezvous was closed for that), its reason is the error.
            raise await self._failed(exc, update_id, what, destroy=True) from exc
        finally:
            self._update_id = 0
            self._aborted.pop(update_id, None)
        self.version = result["version"]
        return result

    async def _failed(self, exc: BaseException, update_id: int, what: str, *, destroy: bool) -> BaseException:
        """This side of ``update_id`` failed with ``exc``: the coordinator told (unless it aborted the update
        first), the local group dropped when ``destroy``; the exception to raise."""
        why = f"{type(exc).__name__}: {exc}" if not isinstance(exc, asyncio.CancelledError) else "call cancelled"
        aborted = self._aborted.get(update_id)
        if aborted is None:
            await asyncio.shield(self._give_up(update_id, why, what, destroy=destroy))
        elif destroy:
            await asyncio.shield(self._destroy())
        if not isinstance(exc, Exception):
            return exc  # cancellation and the like go on as they are
        if aborted is not None:
            return WeightUpdateError(f"{what}: {aborted}", code="weights")
        # A broken link (torch.distributed raises RuntimeError or OSError) is worth the one retry on a new group;
        # a mistake in what was passed (a tensor torch cannot send) would only fail the same way again.
        link = isinstance(exc, (RuntimeError, OSError, TimeoutError)) and not isinstance(exc, NotImplementedError)
        return WeightUpdateError(f"{what}: the trainer's side failed: {why}", code="weights" if link else "trainer")

    async def catch_up(
        self, named_tensors, version: int, backend: str, bucket_bytes: int, timeout: float, verify: bool
    ) -> WeightUpdateResult:
        """The fleet's current ``version`` again, to the engines behind it only (restarted or joined after
        a broadcast), in a group of their own that ends with the call; every other engine keeps serving.
        Nothing behind: answered at once, ``named_tensors`` unread."""
        what = f"catch_up({version})"
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        address = master_address(self.address)
        port = free_port(address)
        begun = await self._begin(
            lambda s, req: p.UpdateWeights(s, req, int(version), CATCH_UP, "", address, port, backend, timeout),
            address,
            port,
            timeout,
            what,
        )
        if not begun["world_size"]:
            return WeightUpdateResult.from_wire(nothing_behind(begun, version))
        update_id = self._update_id = begun["update_id"]
        beat = self._start_beat(what, f"weights-alive-catch-up-{version}")
        group = None
        try:
            items = local_tensors(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
            if not items:
                raise ValueError("catch_up needs the named tensors of the current version")
            check_backend(backend)
            log.info("catching up %d engine rank(s) to version %d", begun["world_size"] - 1, version)
            group, self._side_store = await self._form(address, port, begun, backend, timeout)
            await self._send(group, update_id, items, backend, bucket_bytes, timeout, what)
            values = verify_values(items) if verify else {}
            result = await self.request(lambda s, req: p.FinishWeights(s, req, update_id, values), what)
            return WeightUpdateResult.from_wire(result)
        except (RemoteError, StateError):
            raise  # the coordinator ended it already
        except BaseException as exc:
            raise await self._failed(exc, update_id, what, destroy=False) from exc
        finally:
            self._update_id = 0
            self._aborted.pop(update_id, None)
            await self._stop_beat(beat)
            if group is not None:
                await asyncio.shield(self._drop(group))
            self._side_store = None  # its group is gone: the rendezvous closes

    async def _send(
        self, group, update_id: int, items: list, backend: str, bucket_bytes: int, timeout: float, what: str
    ) -> None:
        """Every bucket of ``items``: announced (``WeightBucket``), then broadcast from rank 0 of ``group``.

        Pipelined: bucket k+1 is announced (coordinator -> agents -> engines, which queue it) while
        bucket k is on the wire, so no round trip sits between two broadcasts."""
        planned = [
            (seq, bucket, [_sendable(t, backend) for _, t in bucket])
            for seq, bucket in enumerate(buckets(items, bucket_bytes))
        ]

        def announce(seq: int, bucket: list, tensors: list) -> asyncio.Task:
            return asyncio.ensure_future(
                self.request(
                    lambda s, req: p.WeightBucket(
                        s,
                        req,
                        update_id,
                        seq,
                        [name for name, _ in bucket],
                        [str(t.dtype).removeprefix("torch.") for t in tensors],
                        [list(t.shape) for t in tensors],
                    ),
                    f"{what} bucket {seq}",
                )
            )

        pending = announce(*planned[0])
        try:
            for i, (_, _, tensors) in enumerate(planned):
                await pending
                pending = announce(*planned[i + 1]) if i + 1 < len(planned) else None
                await asyncio.to_thread(weight_group.broadcast, group, tensors, timeout)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    async def _give_up(self, update_id: int, why: str, what: str, *, destroy: bool = True) -> None:
        """Tell the coordinator this trainer's side of ``update_id`` failed, then drop the local group."""
        try:
            async with asyncio.timeout(ABORT_DEADLINE):
                await self.request(lambda s, req: p.AbortWeights(s, req, update_id, why[:2000]), f"{what} abort")
        except (RolloutError, TimeoutError) as exc:
            log.warning("%s: could not report the failure (the update ends at its deadline or TTL): %s", what, exc)
        if destroy:
            await self._destroy()

    async def _destroy(self) -> None:
        group, self.group, self.group_name = self.group, None, ""
        await self._drop(group)
        self._store = None  # after its group: the rendezvous closes

    @staticmethod
    async def _drop(group) -> None:
        if group is not None:
            try:
                await asyncio.to_thread(weight_group.destroy, group)
            except Exception as exc:  # a group broken by a failed collective may refuse to go quietly
                log.warning("destroying the weight-update group: %s", exc)

    async def close(self) -> None:
        await self._destroy()


def nothing_behind(begun: dict, version: int) -> dict:
    """A catch-up's result when no engine is behind (the coordinator's answer to ``UpdateWeights`` said so)."""
    return {"update_id": begun["update_id"], "version": int(version), "engines": {}}


def _sendable(tensor: Any, backend: str) -> Any:
    """A contiguous tensor the backend can send: gloo sends from CPU memory, NCCL from a GPU's (a CPU
    tensor goes to the current CUDA device)."""
    tensor = tensor.detach()
    if backend == "gloo" and tensor.device.type != "cpu":
        tensor = tensor.cpu()
    elif backend == "nccl" and tensor.device.type != "cuda":
        tensor = tensor.cuda()
    return tensor.contiguous()


def local_tensors(named_tensors) -> list[tuple[str, Any]]:
    """``(name, tensor)`` pairs a trainer of one process can send: a DTensor on a mesh of this process alone
    (FSDP2 on one GPU) is its full tensor; one sharded over several processes raises ``ValueError`` (its gather
    is a collective the other processes never join), before the broadcast begins."""
    out = []
    for name, tensor in named_tensors:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and hasattr(tensor, "full_tensor"):
            if mesh.size() > 1:
                raise ValueError(
                    f"{name!r} is a DTensor sharded over {mesh.size()} processes: give every process "
                    "RolloutClient(..., rank=R, world_size=W) and call update_weights on every one of them "
                    "(docs/guides/sharded-trainers.md)"
                )
            tensor = tensor.full_tensor()
        out.append((name, tensor))
    return out


def check_backend(backend: str) -> None:
    """ValueError, before anything is sent, for a backend this trainer cannot use."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' (tensors on GPUs) or 'gloo' (CPU), got {backend!r}")
    if backend == "nccl":
        try:
            import torch
        except ImportError:
            raise ValueError("update_weights needs torch on the trainer (pip install torch)") from None
        if not torch.cuda.is_available():
            raise ValueError(
                f"backend='nccl' needs CUDA on the trainer, and torch {torch.__version__} sees no GPU: "
                "use backend='gloo' to broadcast from CPU memory"
            )
