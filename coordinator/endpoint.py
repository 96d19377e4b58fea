"""The trainer client's transport: one DEALER socket per peer, requests correlated by ``req`` and
resent until answered, and the mapping of error replies onto ``common.errors``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time

import zmq
import zmq.asyncio

from common import protocol as p
from common.errors import (
    Fenced,
    NoCapacity,
    ProtocolError,
    RemoteError,
    RolloutError,
    Starved,
    StateError,
    WeightUpdateError,
)
from common.transport import dealer

log = logging.getLogger("rollfleet.client")


# Refusals of a call that is not allowed now (a checkpoint not drained, refused or never delivered).
_STATE_CODES = (
    "not_drained",
    "bad_state",
    "bad_request",
    "resumed",
    "config_mismatch",
    "weights_busy",
    "weights_version",
)


def _raise_remote(err: p.Error) -> None:
    if err.code == "fenced":
        raise Fenced(err.message, code=err.code)
    if err.code == "no_capacity":
        raise NoCapacity(err.message, code=err.code)
    if err.code == "starved":
        raise Starved(err.message, code=err.code)
    if err.code == "weights":
        raise WeightUpdateError(err.message, code=err.code)
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
