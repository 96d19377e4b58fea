"""ZeroMQ sockets with the options every rollfleet endpoint needs.

Why each option (see the facts in the design notes):
- ``LINGER=0``: closing never hangs on unsent messages; loss is repaired by
  leases and idempotent resends, not by the transport.
- ``ROUTER_MANDATORY=1``: a ROUTER send to a gone peer raises instead of
  being silently dropped, so the caller knows.
- ``ROUTER_HANDOVER=1``: a restarted agent reusing its routing id takes over
  the old connection instead of being ignored.
- ``MAXMSGSIZE`` above the application limit: oversized messages reach the
  decoder and get a clear error reply instead of a silent disconnect.
- ZMTP heartbeats clean up dead TCP peers; membership uses app heartbeats.
- Connecting sockets (agents, trainers) come back within about a second of a
  silent partition healing, however long it lasted: a connection that heard
  nothing for ``DEALER_HEARTBEAT_TIMEOUT_MS`` after a ZMTP PING is dropped and
  redialled (TCP's retransmit backoff would otherwise stretch an outage of N
  seconds into up to N more of silence after the heal), and each dial gives up
  after ``CONNECT_TIMEOUT_MS`` (a SYN dropped without a word would otherwise be
  retried by the kernel at 1, 2, 4 ... 32 s) and is retried after at most
  ``RECONNECT_IVL_MAX_MS``. A handshake cut off half-way (CurveZMQ's too) is
  given up after ``HANDSHAKE_IVL_MS``. Messages sent meanwhile wait in the
  socket's queue and leave on the new connection; the protocol deduplicates
  resends (a resent Register gets the same session).
- ``curve``: a ROUTER given a key pair is a CURVE server (its ZAP handler is
  common/zap.py), a DEALER given client keys a CURVE client (common/curve.py);
  the options are set before bind/connect, the others stay the same.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from urllib.parse import urlparse

import zmq
import zmq.asyncio

from common.curve import ClientKeys, KeyPair, make_client, make_server
from common.errors import ConfigError
from common.protocol import DEFAULT_MAX_MESSAGE_BYTES

CONNECT_TIMEOUT_MS = 500
"""A TCP connect not answered in this long is abandoned and dialled again (one SYN per attempt)."""
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 500
"""Redial backoff: 100 ms doubling to 500 ms (plus libzmq's jitter of up to RECONNECT_IVL_MS), so a
healed link is dialled within CONNECT_TIMEOUT_MS + RECONNECT_IVL_MAX_MS + 100 ms (1.1 s); a fleet of
1000 agents redialling a coordinator that is down costs ~2000 SYNs/s, nothing to a kernel."""
DEALER_HEARTBEAT_IVL_MS = 500
DEALER_HEARTBEAT_TIMEOUT_MS = 2000
"""A connecting socket that hears nothing (no PONG, no data) for 2 s after a PING redials."""
HANDSHAKE_IVL_MS = 3000
"""A ZMTP/CurveZMQ handshake not done in this long drops the connection (libzmq's default is 30 s)."""
LISTEN_BACKLOG = 4096
"""Connections a bound socket's kernel queue holds before accept (libzmq's default is 100). A fleet reconnecting
at once, after a coordinator restart, overflows 100: the kernel drops the rest's SYNs and each waits out a
redial. The kernel caps it at ``net.core.somaxconn`` (4096 by default since Linux 5.4)."""


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)


def router(
    ctx: zmq.asyncio.Context,
    bind: str,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    prefer_port: int | None = None,
    curve: KeyPair | None = None,
    use_fd: int | None = None,
) -> tuple[zmq.asyncio.Socket, str]:
    """Bind a ROUTER; returns the socket and its resolved endpoint (port 0 resolved).

    With port 0, ``prefer_port`` is tried first (a restarted agent takes its old
    port back, so peers' connections to it simply reconnect), then any port.
    An endpoint that cannot be bound (port in use, an address not on this
    machine) is a ConfigError naming it; the socket is closed.

    ``use_fd``: accept on this already listening socket instead of opening one
    (``ZMQ_USE_FD``; ``bind`` must name its address): the gateways of
    coordinator/gateway.py share the coordinator's public socket this way.
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        _common(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes * 2 + 4096)
        sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if curve is not None:
            make_server(sock, curve)
        if use_fd is not None:
            sock.setsockopt(zmq.USE_FD, use_fd)
        endpoint = _bind(sock, bind, prefer_port)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError(f"cannot bind {bind}: {zmq.strerror(exc.errno)}") from None
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, endpoint


def core_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The coordinator core's ROUTER for its gateways (a private ``ipc://`` endpoint): their batches may be
    of any size and are never dropped at a high-water mark (the gateways are the core's own processes)."""
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _bind(sock: zmq.Socket, bind: str, prefer_port: int | None) -> str:
    if bind.startswith("tcp://") and bind.rsplit(":", 1)[-1] in ("0", "*"):
        host = bind.rsplit(":", 1)[0]
        if prefer_port:
            try:
                sock.bind(f"{host}:{prefer_port}")
                return f"{host}:{prefer_port}"
            except zmq.ZMQError:
                pass
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(bind)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def dealer(
    ctx: zmq.asyncio.Context,
    connect: str,
    *,
    identity: bytes | None = None,
    curve: ClientKeys | None = None,
    server_public: bytes | None = None,
    before_connect: Callable[[zmq.asyncio.Socket], None] | None = None,
) -> zmq.asyncio.Socket:
    """Connect a DEALER; with ``curve``, as a CURVE client of ``server_public`` (default: the coordinator's key).

    Redials a silent or dead connection within about a second of the network healing (module docstring).

    ``before_connect(sock)`` runs before the connect: a socket monitor attached there sees the
    first handshake's events too (one attached after may miss a refusal that came at once).
    """
    sock = ctx.socket(zmq.DEALER)
    _common(sock)
    if curve is not None:
        make_client(sock, curve, server_public)
    if identity:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, DEALER_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, DEALER_HEARTBEAT_TIMEOUT_MS)
    if before_connect is not None:
        before_connect(sock)
    sock.connect(connect)
    return sock


def send_nowait(
    sock: zmq.asyncio.Socket, frames: list, on_error: Callable[[BaseException], None], *, copy: bool = True
) -> None:
    """Send without waiting; a failure goes to ``on_error``, never unobserved.

    A zmq.asyncio socket reports a failed non-blocking send (``zmq.Again`` at
    the HWM, ``EHOSTUNREACH`` for a gone ROUTER peer) either by raising or
    through the future it returns; both end up in ``on_error``. Callers rely on
    resends and lease reconciliation, not on the transport, for delivery.
    """
    try:
        fut = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
    except zmq.ZMQError as exc:
        on_error(exc)
        return

    def check(f) -> None:
        if not f.cancelled() and f.exception() is not None:
            on_error(f.exception())

    if fut is not None and hasattr(fut, "add_done_callback"):
        fut.add_done_callback(check)


def validate_endpoint(address: str, what: str) -> str:
    """Return ``address`` if it is ``tcp://HOST:PORT`` (or ipc://), else raise ConfigError naming ``what``.

    ZeroMQ takes a malformed address without complaint on connect and then never
    connects, so every address from a user goes through here first.
    """
    if not isinstance(address, str):
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {address!r}")
    if address.startswith("ipc://") or address.startswith("inproc://"):
        return address
    try:
        parsed = urlparse(address)
        port = parsed.port
    except ValueError:
        port = None
        parsed = None
    if parsed is None or parsed.scheme != "tcp" or not parsed.hostname or port is None:
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {address!r}")
    return address


def advertised_host(coordinator: str) -> str:
    """The local address peers can reach us at: the one used to route to the coordinator."""
    host = urlparse(coordinator).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def stop_on_signals(loop, stop) -> None:
    """Set the asyncio event ``stop`` on SIGTERM or SIGINT (orderly shutdown)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests run servers in-process)
            pass
