"""``coordinator replay``'s I/O shell: one ZeroMQ ROUTER in front of ``ReplayCore`` (coordinator/replay_core.py).

A replay serves one trainer on a laptop, so the shell is a plain blocking loop: poll the socket,
decode, hand the message to the core, send its replies (payload frames after a ``Payloads``), with
no event loop, no threads and no clock. Reading a recorded file blocks only this loop, which has
nothing else to do meanwhile. Trainers connect to ``--bind``; their payload fetches come to the same
socket (the replay is every group's payload address). A frame that cannot be decoded is answered
with an ``Error`` naming the problem, and the loop keeps serving.
"""

from __future__ import annotations

import logging
import random
import socket
import threading

import zmq

from common import protocol as p
from common.errors import ProtocolError
from common.transport import router, send_nowait
from coordinator.recorded_run import RecordedRun
from coordinator.replay_core import ReplayCore

log = logging.getLogger("rollfleet.replay")

POLL_MS = 100
"""How often the loop looks at its stop flag while no message comes."""


def advertised(endpoint: str) -> str:
    """``endpoint`` with a wildcard host replaced by this host's name (the address trainers fetch from)."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(f"//{wildcard}:", f"//{socket.getfqdn()}:")
    return endpoint


class ReplayServer:
    def __init__(self, directory: str, bind: str, *, max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES):
        self.run = RecordedRun(directory)
        self.max_message_bytes = max_message_bytes
        self.ctx = zmq.Context()
        try:
            self.sock, self.endpoint = router(self.ctx, bind, max_bytes=max_message_bytes)
        except BaseException:
            self.ctx.term()
            raise
        self.core = ReplayCore(self.run, advertised(self.endpoint), lambda: random.getrandbits(48) | 1)
        self.errors_sent = 0

    def _send(self, peer: bytes, msg: p.Message, frames: list[bytes]) -> None:
        send_nowait(
            self.sock,
            [peer, p.encode(msg), *frames],
            lambda exc: log.debug("send %s to %r failed: %s", msg.TYPE, peer, exc),
        )

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            if frames:
                self._send(frames[0], p.Error("malformed", f"expected one message frame, got {len(frames) - 1}"), [])
            return
        peer, frame = frames
        try:
            msg = p.decode(frame, max_bytes=self.max_message_bytes)
        except ProtocolError as exc:
            self.errors_sent += 1
            log.warning("rejected message from %r: %s", peer[:40], exc)
            self._send(peer, p.Error("malformed", str(exc), p.peek_req(frame)), [])
            return
        try:
            replies = self.core.handle(msg)
        except Exception as exc:
            log.exception("internal error handling a %r message", msg.TYPE)
            replies = [(p.Error("internal", f"internal replay error: {exc}", getattr(msg, "req", 0)), [])]
        for reply, payloads in replies:
            self._send(peer, reply, payloads)

    def serve(self, stop: threading.Event) -> None:
        """Answer trainers until ``stop`` is set."""
        while not stop.is_set():
            if not self.sock.poll(POLL_MS, zmq.POLLIN):
                continue
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_frames(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
