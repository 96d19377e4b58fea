"""A gateway: one child process of ``coordinator serve --gateways K`` that holds agents' and trainers'
connections and relays their messages to the core in batches.

Every gateway accepts on the same listening socket, which the serving process opened on the public
``--bind`` address and handed down (its file descriptor, through ZeroMQ's ``ZMQ_USE_FD``): the
kernel gives each new connection to whichever gateway accepts it first, so peers connect to the one
address they always used and never learn that gateways exist. A gateway that dies takes its
connections with it; their peers redial (common/transport.py) and land on another gateway or on its
restarted successor, while connections waiting to be accepted stay queued on the socket, which the
serving process keeps open.

Towards the core a gateway is a DEALER on a private ``ipc://`` endpoint (a directory only the
coordinator's user can enter), named by ``prefix``: two bytes of gateway number and two of
incarnation, so a restarted gateway's peers never take the place of its predecessor's. What it
relays, as ``[kind, payload]`` frames:

- ``b"m"`` (to the core): msgpack of ``[[peer, frames, user], ...]``, every message its ROUTER had
  waiting (up to ``BATCH_MESSAGES`` or ``BATCH_BYTES``), in arrival order; ``frames`` are the
  message's frames after the routing id, untouched (the core decodes and validates them, so a
  malformed or oversized message is answered exactly as without gateways), ``user`` the CurveZMQ
  User-Id (the sender's public key) or None;
- ``b"m"`` (from the core): msgpack of ``[[peer, frame], ...]``, sent on to each peer in order;
and, on a socket of their own (a PUSH to the serving process's ``stats`` endpoint, read by its supervisor
and never queued behind a backlog of messages, so a busy core does not take a live gateway for a hung one):
``[prefix, msgpack of its counters and peers]`` every ``STATS_INTERVAL``, for the status page and metrics.

So the core pays its socket reads, writes and wake-ups per batch, not per message. The relay keeps
each peer's order both ways (one connection, one DEALER, one ROUTER). A message lost with a gateway
is lost like one on a dropped connection, which the protocol already repairs (agents resend
receipts and reconcile leases by heartbeat; trainers resend requests).

The gateway exits when the serving process does (``PR_SET_PDEATHSIG``, and its parent pid checked
every poll) and on SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time

import msgpack
import zmq

from common.gc_tuning import quiet_gc
from common.logs import add_log_flags, setup_logging

log = logging.getLogger("rollfleet.gateway")

BATCH_MESSAGES = 1024
"""Most messages in one batch to the core."""
BATCH_BYTES = 8 << 20
"""A batch to the core closes once its frames reach this many bytes."""
PEER_WINDOW = 5.0
"""A peer counts in the gateway's ``peers`` while it was heard from within this many seconds."""
STATS_INTERVAL = 1.0
"""Seconds between the gateway's statistics messages to the supervisor (coordinator/gateways.py)."""
MESSAGES = b"m"


def prefix_of(index: int, incarnation: int) -> bytes:
    """The routing id of gateway ``index``'s ``incarnation``: the first four bytes of every peer id it relays."""
    return index.to_bytes(2, "big") + (incarnation & 0xFFFF).to_bytes(2, "big")


def _die_with_parent(parent: int) -> None:
    """Ask the kernel for SIGTERM when the serving process exits (Linux); the poll loop checks too."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the prctl
        sys.exit(0)


class Gateway:
    def __init__(
        self,
        *,
        core: str,
        stats: str,
        listen_fd: int,
        bind: str,
        prefix: bytes,
        max_bytes: int,
        curve_dir: str | None = None,
    ):
        from common.transport import router

        self.ctx = zmq.Context()
        self.prefix = prefix
        self.curve = curve_dir is not None
        self.gate, pair = None, None
        if curve_dir is not None:
            from common.curve import CoordinatorKeys
            from common.zap import KeyGate

            keys = CoordinatorKeys.load(curve_dir)
            self.gate = KeyGate(self.ctx, keys.allowed, "coordinator", threaded=True)
            pair = keys.pair
        # The coordinator's own options (common/transport.py), on the socket it shares with the other gateways.
        self.front, _ = router(self.ctx, bind, max_bytes=max_bytes, curve=pair, use_fd=listen_fd)
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.setsockopt(zmq.ROUTING_ID, prefix)
        self.back.setsockopt(zmq.SNDHWM, 0)
        self.back.setsockopt(zmq.RCVHWM, 0)
        self.back.connect(core)
        self.stats_out = self.ctx.socket(zmq.PUSH)
        self.stats_out.setsockopt(zmq.LINGER, 0)
        self.stats_out.setsockopt(zmq.SNDHWM, 10)
        self.stats_out.connect(stats)
        self.peers: dict[bytes, float] = {}  # routing id -> when it last sent something
        self.stats = {
            "pid": os.getpid(),
            "peers": 0,
            "messages_in": 0,
            "messages_out": 0,
            "batches_in": 0,
            "batches_out": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "send_failures": 0,
        }

    def _relay_in(self) -> None:
        """Every message waiting on the ROUTER (up to a batch) as one batch to the core."""
        batch, size, front, peers, now = [], 0, self.front, self.peers, time.monotonic()
        while len(batch) < BATCH_MESSAGES and size < BATCH_BYTES:
            try:
                if self.curve:
                    raw = front.recv_multipart(zmq.NOBLOCK, copy=False)
                    frames, user = [f.bytes for f in raw], raw[-1].get("User-Id")
                else:
                    frames, user = front.recv_multipart(zmq.NOBLOCK), None
            except zmq.Again:
                break
            size += sum(len(f) for f in frames)
            peers[frames[0]] = now
            batch.append([frames[0], frames[1:], user])
        if batch:
            self.back.send_multipart([MESSAGES, msgpack.packb(batch, use_bin_type=True)])
            s = self.stats
            s["messages_in"] += len(batch)
            s["batches_out"] += 1
            s["bytes_in"] += size

    def _relay_out(self) -> None:
        """The batches the core sent (up to ``BATCH_MESSAGES`` of them), each message on to its peer."""
        back, front, s = self.back, self.front, self.stats
        for _ in range(BATCH_MESSAGES):
            try:
                frames = back.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or frames[0] != MESSAGES:
                log.warning("ignored a malformed batch from the core (%d frames)", len(frames))
                continue
            s["batches_in"] += 1
            for peer, frame in msgpack.unpackb(frames[1], raw=False, use_list=False):
                try:
                    front.send_multipart([peer, frame], zmq.NOBLOCK)
                    s["messages_out"] += 1
                    s["bytes_out"] += len(frame)
                except zmq.ZMQError:  # the peer is gone or at its high-water mark: it will resend
                    s["send_failures"] += 1

    def _count_peers(self, now: float) -> None:
        """``peers``: those heard from in the last ``PEER_WINDOW`` seconds (every peer sends at least a
        heartbeat a second). Counted, not watched: a socket monitor's events, in a burst of connections, fill
        its queue and block libzmq's I/O thread, and with it every socket of the process."""
        old = now - PEER_WINDOW
        for peer in [p for p, t in self.peers.items() if t < old]:
            del self.peers[peer]
        self.stats["peers"] = len(self.peers)

    def run(self, parent: int) -> None:
        if self.gate is not None:
            self.gate.start()
        poller = zmq.Poller()
        for sock in (self.front, self.back):
            poller.register(sock, zmq.POLLIN)

        def stop(*_):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        next_stats = 0.0
        try:
            while True:
                ready = dict(poller.poll(int(STATS_INTERVAL * 1000)))
                started = time.monotonic()
                if self.back in ready:
                    self._relay_out()
                if self.front in ready:
                    self._relay_in()
                now = time.monotonic()
                if now - started > STATS_INTERVAL:
                    log.warning("a relay turn took %.1fs", now - started)
                if now >= next_stats:
                    next_stats = now + STATS_INTERVAL
                    self._count_peers(now)
                    if os.getppid() != parent:
                        log.warning("the coordinator (pid %d) is gone; this gateway exits", parent)
                        return
                    try:
                        self.stats_out.send_multipart([self.prefix, msgpack.packb(self.stats)], zmq.NOBLOCK)
                    except zmq.Again:  # ten reports unread: the newest is what counts, and it will come
                        pass
        finally:
            self.close()

    def close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
        self.front.close(linger=0)
        self.back.close(linger=0)
        self.stats_out.close(linger=0)
        self.ctx.term()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coordinator.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", required=True, help="the core's private ipc:// endpoint")
    ap.add_argument("--stats", required=True, help="the serving process's ipc:// endpoint for reports")
    ap.add_argument("--listen-fd", type=int, required=True, help="the listening socket's file descriptor")
    ap.add_argument("--bind", required=True, help="the public endpoint that socket is bound to")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--incarnation", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True, help="the serving process's pid")
    ap.add_argument("--max-message-bytes", type=int, required=True)
    ap.add_argument("--curve-dir", default=None)
    add_log_flags(ap)
    args = ap.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    _die_with_parent(args.parent)
    gateway = Gateway(
        core=args.core,
        stats=args.stats,
        listen_fd=args.listen_fd,
        bind=args.bind,
        prefix=prefix_of(args.index, args.incarnation),
        max_bytes=args.max_message_bytes,
        curve_dir=args.curve_dir,
    )
    log.info("gateway %d (incarnation %d) relaying %s to the core", args.index, args.incarnation, args.bind)
    quiet_gc()
    gateway.run(args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
