"""How the coordinator's loop reads and writes its peers' frames: on its own ROUTER, or through gateways.

``open_peer_io`` gives the server one of two shapes of the same interface, so its turns, sends and
shutdown do not depend on which:

``DirectIO``
    A ROUTER bound on ``--bind`` (a CURVE server with ``KeyGate`` when keys are given). ``read``
    takes one message; ``send`` sends it at once, non-blocking.
``GatewayIO``
    ``--gateways N``: the public address is held by N gateway processes (coordinator/gateways.py,
    coordinator/gateway.py) and this side is a ROUTER on their private endpoint. ``read`` takes one
    gateway's batch, each peer id prefixed with the gateway's; ``send`` queues the frame for that
    gateway, and everything sent in one loop iteration leaves as one batch per gateway.

Either way a read returns ``(peer, frames after the routing id, CurveZMQ User-Id or None)`` entries,
``statistics(now)`` lists the gateways (none for ``DirectIO``), and a failed send (a peer or gateway
gone, a full queue) is logged at debug level: the protocol repairs lost messages, not the transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgpack
import zmq

from common.curve import CoordinatorKeys
from common.transport import core_router, router, send_nowait
from coordinator.gateway import MESSAGES
from coordinator.gateways import GatewayPool

log = logging.getLogger("rollfleet.coordinator")

Entry = tuple[bytes, list, str | None]


class DirectIO:
    def __init__(self, ctx: zmq.Context, bind: str, *, max_bytes: int, curve: CoordinatorKeys | None):
        self.gate = None
        if curve is not None:
            from common.zap import KeyGate

            self.gate = KeyGate(ctx, curve.allowed, "coordinator")
        self.sock, self.endpoint = router(ctx, bind, max_bytes=max_bytes, curve=curve.pair if curve else None)
        self._keyed = curve is not None

    def read(self) -> list[Entry] | None:
        """The next message waiting, or None."""
        try:
            if not self._keyed:
                frames, user = self.sock.recv_multipart(zmq.NOBLOCK), None
            else:  # frames as zmq.Frame: their User-Id is the sender's public key
                raw = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                frames, user = [f.bytes for f in raw], raw[-1].get("User-Id")
        except zmq.Again:
            return None
        return [(frames[0], frames[1:], user)]

    def send(self, peer: bytes, frame: bytes, what: str) -> None:
        """Send ``frame`` (a ``what`` message) to ``peer`` now, non-blocking."""
        try:
            self.sock.send_multipart([peer, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or at its HWM
            log.debug("send %s to %r failed: %s", what, peer, exc)

    def statistics(self, now: float) -> list:
        return []

    def start(self) -> None:
        if self.gate is not None:
            self.gate.start()  # until now every CURVE handshake failed (ZAP enforced): none got through

    async def supervise(self) -> None:
        """Nothing to supervise: no gateways."""

    def close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
        self.sock.close(linger=0)


class GatewayIO:
    def __init__(
        self,
        ctx: zmq.Context,
        bind: str,
        count: int,
        *,
        max_bytes: int,
        curve_dir: str | None,
        log_args,
        after_flush: Callable[[], None],
    ):
        self.gateways = GatewayPool(ctx, count, bind, max_bytes=max_bytes, curve_dir=curve_dir, **log_args)
        self.endpoint = self.gateways.endpoint
        try:
            self.sock = core_router(ctx, self.gateways.core_endpoint)
        except BaseException:
            self.gateways.stop()
            raise
        self._out: dict[bytes, list] = {}  # gateway prefix -> [peer, frame] pairs to send it
        self._flush_soon = False
        self.after_flush = after_flush
        """Called after each flush (the server re-checks its socket: a send may consume the FD's edge)."""

    def read(self) -> list[Entry] | None:
        """The next gateway batch waiting (its peers' ids with the gateway's prefix), or None."""
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(frames) != 3 or frames[1] != MESSAGES:
            log.warning("ignored a malformed batch from gateway %r (%d frames)", frames[0], len(frames))
            return []
        prefix = frames[0]
        return [(prefix + peer, rest, user) for peer, rest, user in msgpack.unpackb(frames[2], raw=False)]

    def send(self, peer: bytes, frame: bytes, what: str) -> None:
        """Queue ``frame`` for ``peer``'s gateway (a failed batch is logged when it leaves)."""
        out = self._out.get(peer[:4])
        if out is None:
            out = self._out[peer[:4]] = []
        out.append((peer[4:], frame))
        if not self._flush_soon:  # everything sent in this loop iteration leaves in one batch per gateway
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        out, self._out = self._out, {}
        for prefix, entries in out.items():
            send_nowait(
                self.sock,
                [prefix, MESSAGES, msgpack.packb(entries, use_bin_type=True)],
                lambda exc, prefix=prefix: log.debug("send to gateway %r failed: %s", prefix, exc),
            )
        self.after_flush()

    def start(self) -> None:
        self.gateways.start()

    def statistics(self, now: float) -> list:
        return self.gateways.statistics(now)

    async def supervise(self) -> None:
        """Supervise the gateways until cancelled; none is started after that (a restart may be pending)."""
        try:
            await self.gateways.supervise()
        finally:
            self.gateways.stopping = True

    def close(self) -> None:
        self.gateways.stop()
        self.sock.close(linger=0)


def open_peer_io(ctx: zmq.Context, settings, after_flush: Callable[[], None]) -> DirectIO | GatewayIO:
    """The server's peer I/O for its ``ServeSettings`` (coordinator/server.py); ``after_flush``: see GatewayIO."""
    s = settings
    if not s.gateways:
        return DirectIO(ctx, s.bind, max_bytes=s.max_message_bytes, curve=s.curve)
    # The gateways hold the public address and the CurveZMQ handshakes; the core listens on a private
    # endpoint for them alone.
    return GatewayIO(
        ctx,
        s.bind,
        s.gateways,
        max_bytes=s.max_message_bytes,
        curve_dir=s.curve_dir if s.curve is not None else None,
        log_args={"log_level": s.log_level, "log_format": s.log_format},
        after_flush=after_flush,
    )
