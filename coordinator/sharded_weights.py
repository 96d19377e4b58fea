"""Weight updates from every rank of a sharded trainer (``client.world_size > 1``; docs/weights.md, "Sharded
trainers: weight pushes").

``update_weights``, ``catch_up`` and ``update_weights_from_disk`` are called on every rank with that rank's
view of the model (FSDP2 DTensors, plain tensors, or both). Rank 0 alone talks to the coordinator and the
engines, exactly as a one-process trainer does (``WeightSender``); the other ranks only run the collectives
of the trainer's own process group (``torch.distributed``'s default group, or ``group=``) and wait for rank
0's word at fixed points (coordinator/trainer_group.py has the plan, the gathers and the channel).

One broadcast, on every rank: the plan (``all_gather_object`` of what each rank passes; every rank computes
the same buckets, or raises the same ``ValueError`` before anything starts), then per attempt:

    rank 0: begin (UpdateWeights, the engines' group) -> "next"
    all:    gather bucket 0 (full_tensor / send to rank 0)     rank 0: announce + broadcast it -> "next"
    ...     gather bucket n-1                                  rank 0: broadcast it, FinishWeights
    rank 0: "done" with its result | "retry" (code weights, first attempt) | "fail" with its error

Every other rank waits for each word in ``hear`` and acts on it: "next" gathers the next bucket, "retry"
starts the attempt again (so a retry is one on every rank), "done" returns rank 0's result, "fail" raises
rank 0's error (same type, message and code). Rank 0 holds one bucket of full tensors at a time and computes
the verification values (first, middle, last tensor) from them as it sends them. A catch-up is the same,
its plan made at its first "next" (nothing behind: "done" at once, nothing read or gathered), never retried;
a disk update is rank 0's one request, then "done" or "fail".

When the trainer's group fails (a rank SIGKILLed: gloo raises at once on every peer; a collective outliving
the update's timeout) every surviving rank raises ``GroupBroken`` (a ``WeightUpdateError``) naming what it
was doing, and rank 0 aborts the update at the coordinator at once (``AbortWeights``), so the lock is free.
A dead rank 0 is the coordinator's to notice (its ``WeightsAlive`` stop; the lock goes at the TTL).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from common import errors, weight_group
from common import protocol as p
from common.errors import RemoteError, StateError, WeightUpdateError
from common.weight_rows import leading_rows, tensor_checksum
from common.weight_step import WeightKind
from coordinator.client_results import WeightUpdateResult
from coordinator.client_weights import (
    VERIFY_EVERY,
    VERIFY_ROWS,
    _sendable,
    check_backend,
    free_port,
    master_address,
    nothing_behind,
)
from coordinator.trainer_group import (
    Channel,
    GroupBroken,
    PlanError,
    cuda_device,
    describe,
    make_plan,
    wire_device,
)

DISTRIBUTED, CATCH_UP = WeightKind.DISTRIBUTED, WeightKind.CATCH_UP

if TYPE_CHECKING:
    from coordinator.client_weights import WeightSender

log = logging.getLogger("rollfleet.client.weights")

TELL_DEADLINE = 10.0
"""Seconds rank 0 spends telling the other ranks that its call failed."""
_RAISABLE = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "StateError": StateError,
    "Fenced": errors.Fenced,
    "RemoteError": RemoteError,
    "WeightUpdateError": WeightUpdateError,
    "GroupBroken": WeightUpdateError,
    "PlanError": PlanError,
    "ConfigError": errors.ConfigError,
}


def failure(exc: BaseException) -> tuple:
    """Rank 0's error as a word for the other ranks."""
    if not isinstance(exc, Exception):
        return ("fail", "WeightUpdateError", "rank 0's call was cancelled", "weights")
    return ("fail", type(exc).__name__, str(exc), getattr(exc, "code", None))


def rebuild(msg: tuple) -> Exception:
    """The error rank 0 raised, from its word: the same type (a rollfleet or argument error), message and code."""
    _, kind, message, code = msg
    cls = _RAISABLE.get(kind)
    if cls is None:
        return WeightUpdateError(f"{kind}: {message}", code="weights")
    if issubclass(cls, RemoteError):
        return cls(message, code=code or "weights")
    exc = cls(message)
    if code is not None:
        exc.code = code
    return exc


def _items(named_tensors) -> list:
    return list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)


class ShardedWeights:
    """The sharded side of ``AsyncRolloutClient``'s weight calls, on rank ``rank`` of ``world_size``; rank 0 drives
    ``sender`` (its ``WeightSender``), which reaches the coordinator through the ``request`` it was handed."""

    def __init__(self, sender: WeightSender, rank: int, world_size: int):
        self.sender = sender
        self.rank = rank
        self.world_size = world_size
        self._channels: list[Channel] = []

    # ------------------------------------------------------------------ the trainer's group

    async def _channel(self, group: Any, timeout: float, what: str) -> Channel:
        """The channel of the trainer's ``group`` (default: the default group), checked against this client's
        rank and world size; made (a collective) at the first call. The other ranks wait for word after it."""
        try:
            import torch.distributed as dist
        except ImportError:
            raise StateError(f"{what}: world_size > 1 needs torch.distributed on the trainer") from None
        if not (dist.is_available() and dist.is_initialized()):
            raise StateError(
                f"{what}: this client has world_size={self.world_size}, so every rank calls it inside the "
                "trainer's torch.distributed group: call torch.distributed.init_process_group first (or pass group=)"
            )
        group = dist.group.WORLD if group is None else group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != self.world_size or rank != self.rank:
            raise StateError(
                f"{what}: the client is rank {self.rank} of {self.world_size}, but this process is "
                f"rank {rank} of {size} in the trainer's process group: they must be the same"
            )
        for ch in self._channels:
            if ch.group is group:
                ch.check()  # a group that failed once is not used again (a collective may still hang in it)
                break
        else:
            ch = Channel(group, rank, size)
            self._channels.append(ch)
            await ch.open(timeout)
        ch.owed = True
        return ch

    async def _plan(self, ch: Channel, items: list, bucket_bytes: int, error: str | None, timeout: float) -> list:
        """Every rank's tensors and argument errors exchanged; the same buckets (or PlanError) on every rank."""
        import torch.distributed as dist

        if error is None and bucket_bytes <= 0:
            error = f"bucket_bytes must be > 0, got {bucket_bytes}"
        tensors, bad = describe(items, {dist.get_global_rank(ch.group, r): r for r in range(ch.size)})
        ch.device = wire_device(ch.group, items)
        ch.cuda = cuda_device(items, ch.device)
        metas = await ch.exchange(
            {"tensors": tensors, "error": error or bad, "bucket_bytes": bucket_bytes}, timeout, "agreeing on the plan"
        )
        return make_plan(metas, metas[0]["bucket_bytes"])  # rank 0's bucket size, whatever the others passed

    # ------------------------------------------------------------------ the calls

    async def from_disk(self, path: str, version: int, timeout: float, group: Any) -> WeightUpdateResult:
        what = f"update_weights_from_disk({version})"
        ch = await self._channel(group, timeout, what)
        if ch.rank:
            return WeightUpdateResult.from_wire(await self._follow(ch, None, (), 0, timeout, what))
        try:
            result = await ch.lead(self.sender.from_disk(path, version, timeout), timeout)
        except BaseException as exc:
            await self._tell_failure(ch, exc)
            raise
        return WeightUpdateResult.from_wire(await self._done(ch, result.raw, timeout, what))

    async def broadcast(
        self, named_tensors, version, backend, bucket_bytes, timeout, verify, group
    ) -> WeightUpdateResult:
        what = f"update_weights({version})"
        items = _items(named_tensors)  # references, kept for the call (a retry gathers them again)
        ch = await self._channel(group, timeout, what)
        ch.owed = False  # the others are in the plan's exchange, then wait for word
        plan = await self._plan(ch, items, bucket_bytes, self._backend_error(ch, backend), float(timeout))
        ch.owed = True
        if ch.rank:
            return WeightUpdateResult.from_wire(await self._follow(ch, plan, items, bucket_bytes, timeout, what))
        beat = self.sender._start_beat(what, f"weights-alive-{version}")
        try:
            first = None
            for attempt in (0, 1):
                try:
                    result = await self._lead_attempt(
                        ch, plan, dict(items), int(version), backend, timeout, verify, what
                    )
                except GroupBroken:
                    raise
                except WeightUpdateError as exc:
                    if exc.code == "weights" and attempt == 0:
                        log.warning("%s failed, retrying once on a new group (every rank): %s", what, exc)
                        first = str(exc)
                        await ch.tell(("retry", first), timeout)
                        continue
                    await self._tell_failure(ch, exc)
                    raise
                except BaseException as exc:
                    await self._tell_failure(ch, exc)
                    raise
                if first is not None:
                    result = {**result, "retried": first}
                return WeightUpdateResult.from_wire(await self._done(ch, result, timeout, what))
        finally:
            await self.sender._stop_beat(beat)
        raise AssertionError("unreachable")

    async def catch_up(
        self, named_tensors, version, backend, bucket_bytes, timeout, verify, group
    ) -> WeightUpdateResult:
        what = f"catch_up({version})"
        ch = await self._channel(group, timeout, what)
        if ch.rank:
            result = await self._follow(ch, None, named_tensors, bucket_bytes, timeout, what)
            return WeightUpdateResult.from_wire(result)
        try:
            result = await self._lead_catch_up(ch, named_tensors, int(version), backend, bucket_bytes, timeout, verify)
        except BaseException as exc:
            await self._tell_failure(ch, exc)
            raise
        return WeightUpdateResult.from_wire(result)

    # ------------------------------------------------------------------ the other ranks

    async def _follow(self, ch, plan, named_tensors, bucket_bytes, timeout, what) -> dict:
        """Ranks above 0: act on rank 0's word until it says "done" (its result: the coordinator's answer, "retried"
        added when rank 0 retried) or "fail" (its error).
        ``plan`` None: a catch-up's, made at its first "next" (``named_tensors`` read only then)."""
        k = 0
        items = named_tensors if isinstance(named_tensors, list) else None
        try:
            while True:
                msg = await ch.hear(timeout)
                if msg[0] == "next":
                    if plan is None:
                        items = _items(named_tensors)
                        plan = await self._plan(ch, items, bucket_bytes, None, timeout)
                    await ch.gather(plan[k], dict(items), timeout, f"gathering bucket {k}")
                    k += 1
                elif msg[0] == "retry":
                    log.info("%s: rank 0 retries once: %s", what, msg[1])
                    k = 0
                elif msg[0] == "done":
                    return msg[1]
                elif msg[0] == "fail":
                    raise rebuild(msg)
                else:
                    raise GroupBroken(f"unexpected word from rank 0: {msg!r}")
        except GroupBroken as exc:
            raise GroupBroken(f"{what} on rank {ch.rank}: {exc}") from exc

    # ------------------------------------------------------------------ rank 0

    def _backend_error(self, ch: Channel, backend: str) -> str | None:
        if ch.rank:
            return None
        try:
            check_backend(backend)
        except ValueError as exc:
            return str(exc)
        return None

    async def _lead_attempt(self, ch, plan, mine, version, backend, timeout, verify, what) -> dict:
        """One attempt of a broadcast, rank 0's side (``WeightSender._attempt`` with the gathers in it)."""
        s = self.sender
        address = master_address(s.address)
        port = free_port(address)
        begun = await ch.lead(
            s._begin(
                lambda ss, req: p.UpdateWeights(ss, req, version, DISTRIBUTED, "", address, port, backend, timeout),
                address,
                port,
                timeout,
                what,
            ),
            timeout,
        )
        update_id = s._update_id = begun["update_id"]
        try:
            ch.check()
            if begun["init"]:
                await s._destroy()
                s.group, s._store = await ch.lead(s._form(address, port, begun, backend, timeout), timeout)
                s.group_name = begun["group_name"]
            elif s.group is None or s.group_name != begun["group_name"]:
                raise WeightUpdateError(
                    f"{what}: the coordinator kept group {begun['group_name']!r}, which this trainer no longer holds",
                    code="weights",
                )
            checked = verify if verify is not None else (begun["init"] or (s.updates + 1) % VERIFY_EVERY == 0)
            values = await self._push(ch, plan, mine, s.group, update_id, backend, timeout, what, checked)
            s.updates += 1
            finish = s.request(lambda ss, req: p.FinishWeights(ss, req, update_id, values), what)
            result = await ch.lead(finish, timeout)
        except GroupBroken as exc:
            raise await self._broken(exc, update_id, what, destroy=True) from exc
        except (RemoteError, StateError):
            await asyncio.shield(s._destroy())  # the coordinator ended the update already
            raise
        except BaseException as exc:
            raise await s._failed(exc, update_id, what, destroy=True) from exc
        finally:
            s._update_id = 0
            s._aborted.pop(update_id, None)
        s.version = result["version"]
        return result

    async def _lead_catch_up(self, ch, named_tensors, version, backend, bucket_bytes, timeout, verify) -> dict:
        s = self.sender
        what = f"catch_up({version})"
        address = master_address(s.address)
        port = free_port(address)
        begun = await ch.lead(
            s._begin(
                lambda ss, req: p.UpdateWeights(ss, req, version, CATCH_UP, "", address, port, backend, timeout),
                address,
                port,
                timeout,
                what,
            ),
            timeout,
        )
        if not begun["world_size"]:  # nothing behind: every rank returns, nothing read or gathered
            return await self._done(ch, nothing_behind(begun, version), timeout, what)
        items = _items(named_tensors)
        update_id = s._update_id = begun["update_id"]
        beat = s._start_beat(what, f"weights-alive-catch-up-{version}")
        group = None
        try:
            ch.check()
            log.info("catching up %d engine rank(s) to version %d", begun["world_size"] - 1, version)
            group, s._side_store = await ch.lead(s._form(address, port, begun, backend, timeout), timeout)
            plan = self._lazy_plan(ch, items, bucket_bytes, self._backend_error(ch, backend), timeout)
            values = await self._push(ch, plan, dict(items), group, update_id, backend, timeout, what, verify)
            finish = s.request(lambda ss, req: p.FinishWeights(ss, req, update_id, values), what)
            result = await ch.lead(finish, timeout)
        except GroupBroken as exc:
            raise await self._broken(exc, update_id, what, destroy=False) from exc
        except (RemoteError, StateError):
            raise  # the coordinator ended it already
        except PlanError as exc:
            await asyncio.shield(s._give_up(update_id, f"PlanError: {exc}", what, destroy=False))
            raise  # the same error every other rank raises
        except BaseException as exc:
            raise await s._failed(exc, update_id, what, destroy=False) from exc
        finally:
            s._update_id = 0
            s._aborted.pop(update_id, None)
            await s._stop_beat(beat)
            if group is not None:
                await asyncio.shield(s._drop(group))
            s._side_store = None
        return await self._done(ch, result, timeout, what)

    def _lazy_plan(self, ch, items, bucket_bytes, error, timeout):
        async def plan() -> list:
            return await self._plan(ch, items, bucket_bytes, error, timeout)

        return plan

    async def _push(self, ch, plan, mine, group, update_id, backend, timeout, what, checked) -> dict:
        """Every bucket: "next" to the other ranks, the gather, then ``WeightBucket`` and the broadcast to the
        engines (bucket k+1 announced while bucket k is on the wire). The verification values (first, middle
        and last tensor: ``client_weights.verify_values``) come from the full tensors while rank 0 holds them.
        ``plan``: the buckets, or a coroutine function making them at the first "next" (a catch-up's)."""
        s = self.sender

        def announce(seq: int) -> asyncio.Future:
            entries = plan[seq]
            return asyncio.ensure_future(
                s.request(
                    lambda ss, req: p.WeightBucket(
                        ss,
                        req,
                        update_id,
                        seq,
                        [e.name for e in entries],
                        [e.dtype for e in entries],
                        [list(e.shape) for e in entries],
                    ),
                    f"{what} bucket {seq}",
                )
            )

        verify = {"rows": VERIFY_ROWS, "values": {}, "checksums": {}}
        picks: set[str] = set()
        pending: asyncio.Future | None = None
        k = 0
        try:
            while not isinstance(plan, list) or k < len(plan):
                await ch.tell(("next",), timeout)
                if not isinstance(plan, list):
                    plan = await plan()
                if k == 0:
                    flat = [e.name for bucket in plan for e in bucket]
                    picks = {flat[i] for i in (0, len(flat) // 2, len(flat) - 1)} if checked else set()
                    pending = announce(0)
                full = await ch.gather(plan[k], mine, timeout, f"gathering bucket {k}")
                after = (lambda seq=k + 1: announce(seq)) if k + 1 < len(plan) else None
                sending = self._send_bucket(full, pending, after, picks, verify, group, backend, timeout)
                pending = None  # awaited (or cancelled) by ``sending`` from here on
                pending = await ch.lead(sending, timeout)
                ch.check()
                del full
                k += 1
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
        return verify if checked else {}

    @staticmethod
    async def _send_bucket(full, announced, after, picks, verify, group, backend, timeout) -> asyncio.Future | None:
        """One gathered bucket to the engines once its announcement is answered, the next one announced (by
        ``after``) while it is on the wire; the verification values of the sampled tensors in it. Returns the
        next announcement."""
        try:
            await announced
        except BaseException:
            announced.cancel()
            raise
        following = after() if after is not None else None
        try:
            for name, tensor in full:
                if name in picks:
                    verify["values"][name] = await asyncio.to_thread(leading_rows, tensor, VERIFY_ROWS)
                    verify["checksums"][name] = await asyncio.to_thread(tensor_checksum, tensor)
            tensors = [_sendable(t, backend) for _, t in full]
            await asyncio.to_thread(weight_group.broadcast, group, tensors, timeout)
        except BaseException:
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            raise
        return following

    async def _broken(self, exc: GroupBroken, update_id: int, what: str, *, destroy: bool) -> GroupBroken:
        """Rank 0: the trainer's group failed inside ``update_id``: the coordinator told at once (lock freed)."""
        s = self.sender
        if update_id not in s._aborted:
            await asyncio.shield(s._give_up(update_id, f"{what}: {exc}", what, destroy=destroy))
        elif destroy:
            await asyncio.shield(s._destroy())
        return GroupBroken(f"{what} on rank 0: {exc}")

    async def _tell_failure(self, ch: Channel, exc: BaseException) -> None:
        """Rank 0's error to the other ranks where they wait for its word (not when the group itself failed)."""
        if isinstance(exc, GroupBroken) or ch.broken is not None:
            return
        try:
            await asyncio.shield(ch.tell_if_owed(failure(exc), TELL_DEADLINE))
        except (GroupBroken, asyncio.CancelledError) as err:
            log.warning("could not tell the other ranks that rank 0's call failed: %s", err)

    async def _done(self, ch: Channel, result: dict, timeout: float, what: str) -> dict:
        """Rank 0's result to every rank. The update is the fleet's by now: a rank lost at this point is logged,
        not raised (the next collective on the group tells the trainer)."""
        try:
            await ch.tell(("done", result), timeout)
        except GroupBroken as exc:
            log.warning("%s succeeded, but telling the other ranks failed: %s", what, exc)
        return result

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
