"""The ZAP handler of a CURVE server: pyzmq's asyncio authenticator with an allow list of public keys.

``KeyGate(ctx, allowed, what)`` binds the context's ZAP endpoint and answers each CURVE handshake
on the event loop: a key in the allow list passes, any other is refused. A refused peer never
reaches the socket: libzmq closes its connection before any message is delivered, so the core
never sees it. Each refusal is logged at WARNING with the key's fingerprint (the first 8 Z85
characters) and the peer's address; a peer that keeps retrying is logged again at most once a
minute, with the count since.

The allow list can be replaced while running (``allow``): the agent's payload endpoint learns the
trainers' keys from the coordinator's Welcome and accepts nobody before that.

Invariant: the sockets this gate serves set ``ZAP_ENFORCE_DOMAIN`` (common/curve.py), so a
handshake that comes before ``start`` or after ``stop`` fails rather than passes.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.thread import ThreadAuthenticator

from common.curve import ZAP_DOMAIN, fingerprint

log = logging.getLogger("rollfleet.zap")

REPEAT_LOG_SECONDS = 60.0
"""A key refused again is logged at most this often (a refused client retries every few seconds)."""

MAX_TRACKED = 4096
"""Refused keys remembered for the repeat limit; beyond this the memory starts over (bounded)."""


class _PeerAddress:
    """Remembers the peer address of the request being answered (ZAP, RFC 27: frame 3), for the log."""

    peer_address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.peer_address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)


class _Authenticator(_PeerAddress, AsyncioAuthenticator):
    pass


class _ThreadedAuthenticator(_PeerAddress, ThreadAuthenticator):
    pass


class KeyGate:
    def __init__(self, ctx: zmq.Context, allowed: dict[bytes, str], what: str, *, threaded: bool = False):
        """``allowed``: public key (Z85 bytes) -> the name logged for it; ``what``: the endpoint, for the log;
        ``threaded``: answer on a thread of its own (for a process with no event loop, a gateway's)."""
        self.what = what
        self._allowed = dict(allowed)
        self._refused: dict[bytes, list] = {}  # key -> [count since last logged, last logged at]
        self.refusals = 0
        kind = _ThreadedAuthenticator if threaded else _Authenticator
        self._auth = kind(ctx, log=logging.getLogger("rollfleet.zap.pyzmq"))
        self._auth.configure_curve_callback(ZAP_DOMAIN, self)
        self._started = False

    def start(self) -> None:
        """Bind the ZAP endpoint and answer on the running loop."""
        if not self._started:
            self._auth.start()
            self._started = True

    def stop(self) -> None:
        if self._started:
            self._auth.stop()
            self._started = False

    def allow(self, allowed: dict[bytes, str]) -> None:
        """Replace the allow list; connections already made are kept."""
        if set(allowed) != set(self._allowed):
            log.info("%s: %d allowed key(s): %s", self.what, len(allowed), sorted(allowed.values()))
        self._allowed = dict(allowed)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials provider hook: True lets the peer in."""
        if key in self._allowed:
            return True
        self.refusals += 1
        now = time.monotonic()
        seen = self._refused.get(key)
        if seen is None:
            if len(self._refused) >= MAX_TRACKED:
                self._refused.clear()
            self._refused[key] = [0, now]
            log.warning(
                "%s: refused a CurveZMQ peer from %s with unknown key %s... (not in the allow list)",
                self.what,
                self._auth.peer_address or "?",
                fingerprint(key),
            )
            return False
        seen[0] += 1
        if now - seen[1] >= REPEAT_LOG_SECONDS:
            log.warning(
                "%s: refused unknown key %s... %d more time(s) (last from %s)",
                self.what,
                fingerprint(key),
                seen[0],
                self._auth.peer_address or "?",
            )
            seen[0], seen[1] = 0, now
        return False
