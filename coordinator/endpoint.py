"""The trainer client's transport: one DEALER socket per peer, requests correlated by ``req`` and
resent until answered, and the mapping of error replies onto ``common.errors``.

With CurveZMQ keys a socket is a CURVE client and a monitor watches its handshakes: a server that
refuses this client's key (ZAP 400) fails the waiting requests at once with an error naming the
key's fingerprint, instead of letting them time out; a handshake that succeeds later (the key was
added) clears it. A server that never answers (a wrong server key fails the handshake without a
word) ends in the usual timeout, whose message says which keys to check."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time

import zmq
import zmq.asyncio

from common import protocol as p
from common.curve import ClientKeys, fingerprint
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

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        name: str,
        *,
        curve: ClientKeys | None = None,
        server_public: bytes | None = None,
        hint: str = "",
    ):
        self.address = address
        self.hint = hint
        """Appended to a timeout's message: which keys to check."""
        monitors = []

        def watch(sock) -> None:
            # Before the connect, so the first handshake's refusal is seen. A name of its own:
            # pyzmq's default names the socket's fd, which a closed socket hands on.
            monitors.append(
                sock.get_monitor_socket(
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                    addr=f"inproc://rollfleet-endpoint-monitor-{next(_MONITORS)}",
                )
            )

        self.sock = dealer(
            ctx, address, curve=curve, server_public=server_public, before_connect=watch if curve else None
        )
        self.waiting: dict[int, asyncio.Future] = {}
        self.refused: str | None = None
        """Why the server refused this client's key; None while it has not (or accepted it since)."""
        self.tasks = [asyncio.create_task(self._recv(), name=f"recv-{name}")]
        if curve is not None:
            self._key = fingerprint(curve.pair.public)
            self.tasks.append(asyncio.create_task(self._watch(monitors[0]), name=f"monitor-{name}"))

    async def _watch(self, mon) -> None:
        from zmq.utils.monitor import parse_monitor_message

        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.refused = None
                    continue
                self.refused = (
                    f"{self.address} refused this client's CurveZMQ key {self._key}... "
                    f"(ZAP status {event['value']}): its public key is not in that server's allow list"
                )
                for fut in self.waiting.values():
                    if not fut.done():
                        fut.set_exception(RolloutError(self.refused))
        finally:
            mon.close(linger=0)

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
                if self.refused:
                    raise RolloutError(f"{what}: {self.refused}")
                try:
                    await self.sock.send(frame, flags=zmq.NOBLOCK)
                except zmq.Again:
                    # No pipe to queue on: libzmq gave up on a connection whose handshake failed
                    # (keys refused or missing). A blocking send would wait forever; this one
                    # counts as a lost attempt and the deadline below still applies.
                    pass
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), retry_interval)
                except TimeoutError:
                    waited = time.monotonic() - started
                    if timeout is not None and waited > timeout:
                        raise RolloutError(
                            f"{what}: no answer from {self.address} in {timeout:.0f}s{self.hint}"
                        ) from None
                    if waited > 30 and not warned:
                        warned = True
                        log.warning(
                            "%s: still waiting for %s after %.0fs (retrying)%s", what, self.address, waited, self.hint
                        )
        finally:
            self.waiting.pop(req, None)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if len(self.tasks) > 1:
            self.sock.disable_monitor()
        self.sock.close(linger=0)


_MONITORS = itertools.count()

# Random start: a restarted trainer process must not reuse its predecessor's
# request ids (the coordinator deduplicates a resent Attach on them).
_REQ = itertools.count(random.randrange(1, 1 << 40))


class FetchFailed(RolloutError):
    """Some payloads of a batch could not be fetched from their node (yet)."""

    def __init__(self, message: str, missing: list[str] = (), unreachable: list[str] = ()):
        super().__init__(message)
        self.missing = list(missing)
        """Keys the node answered it no longer holds."""
        self.unreachable = list(unreachable)
        """Keys on nodes that did not answer within ``fetch_timeout`` (down, or partitioned away)."""
