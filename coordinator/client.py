"""The trainer API: pull batches, pause/resume, checkpoint.

    from coordinator.client import RolloutClient

    with RolloutClient("tcp://coordinator:5555") as client:
        for step in range(100):
            batch = client.generate(step)
            tensors = batch.to_tensors()      # torch, padded
            print(batch.metrics["rollout/reward_mean"])

``generate(rollout_id)`` asks the coordinator for the batch of that id (a
list of references), then fetches the payloads from the agents that hold
them, in parallel. Asked twice for the same id, it returns the same groups.

Every request is safe to resend: the client resends a request that got no
answer (e.g. while the coordinator restarts) and re-attaches transparently
when the coordinator no longer knows its session. If another trainer
attached meanwhile, calls raise ``Fenced`` instead.

``AsyncRolloutClient`` is the same API for asyncio code; ``RolloutClient``
runs one on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from common import protocol as p
from common.errors import Closed, Fenced, NoCapacity, ProtocolError, RemoteError, RolloutError, Starved, StateError
from common.transport import dealer, validate_endpoint
from common.types import Group
from coordinator.records import GroupRef

log = logging.getLogger("rollfleet.client")

FETCH_CHUNK = 64


@dataclass
class RolloutBatch:
    rollout_id: int
    groups: list[Group]
    metrics: dict = field(default_factory=dict)

    @property
    def samples(self):
        return [s for g in self.groups for s in g.samples]

    def to_tensors(self, pad_token_id: int = 0) -> dict:
        """Padded torch tensors, one row per sample (prompt + response, right-padded).

        Keys: ``tokens``, ``attention_mask``, ``loss_mask`` (response tokens the
        loss sees), ``rollout_logprobs`` (aligned with ``tokens``; 0 on prompt
        and padding), ``rewards``, ``prompt_lengths``, ``response_lengths``,
        ``group_index`` (dataset index of each row).
        """
        try:
            import torch
        except ImportError as exc:
            raise RolloutError("to_tensors() needs torch: pip install 'rollfleet[torch]'") from exc
        samples = self.samples
        width = max((len(s.prompt_tokens) + len(s.response_tokens) for s in samples), default=0)
        n = len(samples)
        tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        loss_mask = torch.zeros((n, width), dtype=torch.float32)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        for row, s in enumerate(samples):
            lp, lr = len(s.prompt_tokens), len(s.response_tokens)
            tokens[row, :lp] = torch.tensor(s.prompt_tokens, dtype=torch.long)
            if lr:
                tokens[row, lp : lp + lr] = torch.tensor(s.response_tokens, dtype=torch.long)
                loss_mask[row, lp : lp + lr] = torch.tensor(s.loss_mask, dtype=torch.float32)
                logprobs[row, lp : lp + lr] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            attention[row, : lp + lr] = 1
        return {
            "tokens": tokens,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
            "prompt_lengths": torch.tensor([len(s.prompt_tokens) for s in samples], dtype=torch.long),
            "response_lengths": torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.long),
            "group_index": torch.tensor([g.index for g in self.groups for _ in g.samples], dtype=torch.long),
        }


# Refusals of a call that is not allowed now (a checkpoint not drained, refused or never delivered).
_STATE_CODES = ("not_drained", "bad_state", "bad_request", "resumed")


def _raise_remote(err: p.Error) -> None:
    if err.code == "fenced":
        raise Fenced(err.message, code=err.code)
    if err.code == "no_capacity":
        raise NoCapacity(err.message, code=err.code)
    if err.code == "starved":
        raise Starved(err.message, code=err.code)
    if err.code in _STATE_CODES:
        exc = StateError(err.message)
        exc.code = err.code
        raise exc
    raise RemoteError(f"[{err.code}] {err.message}", code=err.code)


class _Endpoint:
    """One DEALER socket with request/reply correlation by ``req``."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str):
        self.address = address
        self.sock = dealer(ctx, address)
        self.waiting: dict[int, asyncio.Future] = {}
        self.task = asyncio.create_task(self._recv(), name=f"recv-{name}")

    async def _recv(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = p.decode(frames[0])
            except ProtocolError as exc:
                log.error("undecodable reply from %s: %s", self.address, exc)
                continue
            fut = self.waiting.get(getattr(msg, "req", 0))
            if fut is not None and not fut.done():
                fut.set_result((msg, frames[1:]))

    async def request(self, make, *, retry_interval: float, timeout: float | None, what: str):
        """Send ``make(req)`` and resend it every ``retry_interval`` until a reply arrives."""
        req = next(_REQ)
        frame = p.encode(make(req))
        fut = asyncio.get_running_loop().create_future()
        self.waiting[req] = fut
        started = time.monotonic()
        warned = False
        try:
            while True:
                await self.sock.send(frame)
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), retry_interval)
                except TimeoutError:
                    waited = time.monotonic() - started
                    if timeout is not None and waited > timeout:
                        raise RolloutError(f"{what}: no answer from {self.address} in {timeout:.0f}s") from None
                    if waited > 30 and not warned:
                        warned = True
                        log.warning("%s: still waiting for %s after %.0fs (retrying)", what, self.address, waited)
        finally:
            self.waiting.pop(req, None)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


# Random start: a restarted trainer process must not reuse its predecessor's
# request ids (the coordinator deduplicates a resent Attach on them).
_REQ = itertools.count(random.randrange(1, 1 << 40))


class FetchFailed(RolloutError):
    """Some payloads of a batch could not be fetched from their node (yet)."""

    def __init__(self, message: str, missing: list[str] = ()):
        super().__init__(message)
        self.missing = list(missing)


class AsyncRolloutClient:
    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        timeout: float | None = None,
        retry_interval: float = 2.0,
        fetch_timeout: float = 10.0,
        attach: bool = True,
    ):
        self.address = validate_endpoint(address, "coordinator address")
        self.client_id = client_id or f"trainer-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.fetch_timeout = fetch_timeout
        self._attach_wanted = attach
        self.session = 0
        self.config: dict = {}
        self.consumed = -1
        self._ctx: zmq.asyncio.Context | None = None
        self._coord: _Endpoint | None = None
        self._agents: dict[str, _Endpoint] = {}
        self._closed = False

    async def __aenter__(self) -> AsyncRolloutClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._closed:
            raise Closed("client is closed")
        if self._coord is None:
            self._ctx = zmq.asyncio.Context()
            self._coord = _Endpoint(self._ctx, self.address, "coordinator")
        if self._attach_wanted and not self.session:
            await self._attach()

    async def _attach(self) -> None:
        msg, _ = await self._coord.request(
            lambda req: p.Attach(req, self.client_id),
            retry_interval=self.retry_interval,
            timeout=self.timeout,
            what="attach",
        )
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        self.session = msg.result["session"]
        self.config = msg.result["config"]
        log.info("attached to %s as %s (session %x)", self.address, self.client_id, self.session)

    async def _call(self, make, what: str):
        """A coordinator request that re-attaches once if the coordinator restarted."""
        await self.connect()
        for _ in range(3):
            msg, frames = await self._coord.request(
                lambda req: make(self.session, req), retry_interval=self.retry_interval, timeout=self.timeout, what=what
            )
            if isinstance(msg, p.Error) and msg.code == "unknown_session":
                log.warning("coordinator no longer knows session %x (restarted); attaching again", self.session)
                self.session = 0
                await self._attach()
                continue
            if isinstance(msg, p.Error):
                _raise_remote(msg)
            return msg
        raise RolloutError(f"{what}: could not re-attach to {self.address}")

    async def _request(self, make, what: str) -> dict:
        """A session-bound trainer request (``make(session, req)``); its result."""
        msg = await self._call(make, what)
        return msg.result

    # ---------------------------------------------------------------- API

    async def generate(self, rollout_id: int, prefetch: int | None = None) -> RolloutBatch:
        """The batch for ``rollout_id``: exactly ``rollout_batch_size`` groups.

        Asking for a batch not generated yet resumes a paused rollout (so a
        trainer restarted after dying while paused is not left waiting).
        ``prefetch`` (ready groups kept beyond demand), when given, replaces the
        coordinator's ``--prefetch`` for this and every later call, until another
        ``generate(..., prefetch=N)`` or a coordinator restart; None keeps the current one.

        Raises ``NoCapacity`` when no engine is left anywhere, and ``Starved`` when every
        recent group failed (a reward or filter that raises): its message names the failure,
        and the next call starts over (e.g. once the agents run a fixed reward).
        """
        started = time.monotonic()
        while True:
            refs = await self._call(
                lambda s, req: p.Generate(s, req, rollout_id, -1 if prefetch is None else prefetch),
                f"generate({rollout_id})",
            )
            waited = time.monotonic() - started
            try:
                groups = await self._fetch(refs.groups)
                break
            except FetchFailed as exc:
                # The node holding some payloads is down. It either comes back (its
                # disk survives; the coordinator then has its new address) or is
                # retired, and the coordinator completes the batch with replacements.
                if self.timeout is not None and time.monotonic() - started > self.timeout:
                    raise RolloutError(f"generate({rollout_id}): {exc}") from None
                log.warning("generate(%d): %s; asking the coordinator again", rollout_id, exc)
                missing = exc.missing
                if missing:
                    # The node is up but lost them (wiped disk): the coordinator replaces them.
                    await self._request(lambda s, req, keys=missing: p.Missing(s, req, rollout_id, keys), "missing")
                else:
                    await asyncio.sleep(self.retry_interval)
        # Tell the coordinator the batch is in hand before returning it: from now on
        # its prompts are never generated again, even if their node is lost.
        await self._request(lambda s, req: p.Consumed(s, req, rollout_id), "consumed")
        self.consumed = max(self.consumed, rollout_id)
        metrics = dict(refs.metrics)
        metrics["rollout/wait_seconds"] = waited
        metrics["rollout/fetch_seconds"] = time.monotonic() - started - waited
        return RolloutBatch(rollout_id, groups, metrics)

    async def _fetch(self, wire_refs: list) -> list[Group]:
        refs = [GroupRef.from_wire(item) for item in wire_refs]
        by_address: dict[str, list[str]] = {}
        for ref in refs:
            if not ref.payload_address:
                raise FetchFailed(
                    f"group {ref.key} (dataset index {ref.index}) is on agent {ref.agent_id}, "
                    "which the coordinator does not know now"
                )
            by_address.setdefault(ref.payload_address, []).append(ref.key)
        jobs = []
        for address, keys in by_address.items():
            for i in range(0, len(keys), FETCH_CHUNK):
                jobs.append(self._fetch_chunk(address, keys[i : i + FETCH_CHUNK]))
        payloads: dict[str, bytes] = {}
        for part in await asyncio.gather(*jobs):
            payloads.update(part)
        return [Group.from_wire(payloads[ref.key]) for ref in refs]

    async def _fetch_chunk(self, address: str, keys: list[str]) -> dict[str, bytes]:
        ep = self._agents.get(address)
        if ep is None:
            ep = self._agents[address] = _Endpoint(self._ctx, address, address)
        try:
            msg, frames = await ep.request(
                lambda req: p.Fetch(req, keys),
                retry_interval=max(self.retry_interval, 2.0),
                timeout=self.fetch_timeout,
                what=f"fetch from {address}",
            )
        except RolloutError as exc:
            await ep.close()
            self._agents.pop(address, None)
            raise FetchFailed(str(exc)) from None
        if isinstance(msg, p.Error):
            raise RemoteError(f"agent {address}: [{msg.code}] {msg.message}", code=msg.code)
        if msg.missing:
            raise FetchFailed(
                f"agent {address} no longer holds {len(msg.missing)} group(s), e.g. {msg.missing[:3]}", msg.missing
            )
        return dict(zip(msg.found, (bytes(f) for f in frames), strict=False))

    async def pause(self, drain: bool = True, abort: bool = False) -> dict:
        """Stop admission; with ``drain`` wait until no lease is in flight (results durable).

        The pause is durable: it survives a coordinator restart. It lasts until
        ``resume()`` or a ``generate()`` of a batch not generated yet.
        """
        return await self._request(lambda s, req: p.Pause(s, req, bool(drain), bool(abort)), "pause")

    async def resume(self) -> dict:
        return await self._request(lambda s, req: p.Resume(s, req), "resume")

    async def state_dict(self) -> dict:
        """The consumed frontier, as plain JSON data. Only while paused and drained."""
        return await self._request(lambda s, req: p.StateDict(s, req, self.consumed), "state_dict")

    async def load_state_dict(self, state: dict) -> None:
        """Resume at a checkpoint: batches after it are delivered again, identical."""
        if not isinstance(state, dict):
            raise StateError("not a rollfleet state_dict (format 1)")
        await self._request(lambda s, req: p.LoadStateDict(s, req, state), "load_state_dict")
        self.consumed = state["rollout_id"]

    async def stats(self) -> dict:
        await self.connect()
        msg, _ = await self._coord.request(
            lambda req: p.Stats(req), retry_interval=self.retry_interval, timeout=self.timeout or 30, what="stats"
        )
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        return msg.result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.session and self._coord is not None:
            # Leave the fleet for the next trainer; best effort, a dead coordinator must not block close().
            try:
                await self._coord.request(
                    lambda req: p.Detach(self.session, req), retry_interval=0.5, timeout=1.0, what="detach"
                )
            except RolloutError:
                pass
        for ep in [*self._agents.values(), *([self._coord] if self._coord else [])]:
            await ep.close()
        self._agents.clear()
        if self._ctx is not None:
            self._ctx.term()


class RolloutClient:
    """Blocking twin of ``AsyncRolloutClient`` (runs it on a private loop thread)."""

    def __init__(self, address: str, **kwargs):
        self._async = AsyncRolloutClient(address, **kwargs)  # a bad address fails here, before any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-client", daemon=True)
        self._thread.start()
        try:
            self._run(self._async.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise Closed("client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def config(self) -> dict:
        return self._async.config

    def generate(self, rollout_id: int, prefetch: int | None = None) -> RolloutBatch:
        return self._run(self._async.generate(rollout_id, prefetch))

    def pause(self, drain: bool = True, abort: bool = False) -> dict:
        return self._run(self._async.pause(drain, abort))

    def resume(self) -> dict:
        return self._run(self._async.resume())

    def state_dict(self) -> dict:
        return self._run(self._async.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self._run(self._async.load_state_dict(state))

    def stats(self) -> dict:
        return self._run(self._async.stats())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
