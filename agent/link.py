"""The agent's connection to the coordinator: one DEALER socket, reopened at every reconnect.

The link is mechanics only; what to say and when is the core's
(agent/session.py). Its loop:

1. open a fresh socket, read the store's stored keys and unacknowledged
   receipts (one transaction, off the event loop) and dispatch ``Connected``:
   the core answers with the Register to send;
2. deliver every frame as ``MessageReceived`` (undecodable ones too: any
   frame is a sign of life) and a ``Tick`` whenever the core's
   ``next_tick_at`` is reached (Register resend, heartbeat, receipt resend,
   the silence TTL), whatever the message rate;
3. when the core ends the session (``Reconnect``: fenced or silence past the
   TTL), wait a randomised backoff and go to 1; ``CloseLink`` (the agent is
   stopping) ends the loop, ``Exit`` (refused for good) raises ``AgentExit``.

With CurveZMQ keys the socket is a CURVE client and a monitor watches its handshakes: a
coordinator that refuses this agent's key is logged at ERROR (the key's fingerprint and what to
fix) once per connection; the link keeps retrying, as it does for an unreachable coordinator.

Sends never block: a full queue drops the message and says so; the protocol
repairs it (receipt resend, heartbeat lease lists, lease expiry).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import random
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from agent.events import CloseLink, Connected, Exit, MessageReceived, Reconnect, Tick
from agent.session import AgentSession
from agent.store import GroupStore
from common import faults
from common import protocol as p
from common.curve import ClientKeys, fingerprint
from common.errors import ProtocolError, RolloutError
from common.transport import dealer, send_nowait

log = logging.getLogger("rollfleet.agent")

_MONITORS = itertools.count()

FIRST_BACKOFF = 0.2
MAX_BACKOFF = 10.0


class AgentExit(RolloutError):
    """The agent cannot continue (e.g. the coordinator refused it)."""


class CoordinatorLink:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        agent_id: str,
        store: GroupStore,
        session: AgentSession,
        dispatch: Callable[[object], None],
        curve: ClientKeys | None = None,
    ):
        self.address = address
        self._curve = curve
        self._monitor = None
        self._ctx = ctx
        self._agent_id = agent_id
        self._store = store
        self._session = session
        self._dispatch = dispatch
        self.sock: zmq.asyncio.Socket | None = None
        self._ending: Reconnect | CloseLink | Exit | None = None

    def send(self, msg: p.Message) -> None:
        if self.sock is None:
            return
        if faults.INJECTED is not None:  # tests only: receipts lost in flight, a one-way partition
            for m in faults.INJECTED.agent_outgoing(msg):
                send_nowait(self.sock, [p.encode(m)], functools.partial(_send_failed, m.TYPE))
            return
        send_nowait(self.sock, [p.encode(msg)], functools.partial(_send_failed, msg.TYPE))

    def end(self, why: Reconnect | CloseLink | Exit) -> None:
        """The core ended the session: the loop acts on it once the current event is handled."""
        self._ending = why

    async def run(self) -> None:
        backoff = FIRST_BACKOFF
        while True:
            self._open()
            stored, unacked = await asyncio.to_thread(self._store.snapshot)
            self._dispatch(Connected(tuple(stored), tuple(unacked)))
            registered = await self._serve()
            ending, self._ending = self._ending, None
            if isinstance(ending, Exit):
                raise AgentExit(ending.reason)
            if isinstance(ending, CloseLink):
                log.info("agent %s: coordinator link lost while shutting down: %s", self._agent_id, ending.reason)
                return
            log.warning("agent %s: reconnecting to the coordinator: %s", self._agent_id, ending.reason)
            if registered:
                backoff = FIRST_BACKOFF
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, MAX_BACKOFF)

    def close(self, linger_ms: int) -> None:
        self._close_monitor()
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _open(self) -> None:
        if self.sock is not None:
            self._close_monitor()
            self.sock.close(linger=0)
        if faults.INJECTED is not None:
            faults.INJECTED.link_reopened()
        identity = f"agent:{self._agent_id}".encode()

        def watch(sock) -> None:
            # Before the connect, so the first handshake's refusal is seen too. A plain PAIR on the
            # same context: polled without awaiting, from the serve loop. A fresh name per socket:
            # the previous monitor's inproc endpoint is released asynchronously.
            address = f"inproc://rollfleet-link-monitor-{id(self)}-{next(_MONITORS)}"
            sock.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._monitor = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PAIR)
            self._monitor.connect(address)
            self._refusal_logged = False

        self.sock = dealer(
            self._ctx, self.address, identity=identity, curve=self._curve, before_connect=watch if self._curve else None
        )

    def _check_monitor(self) -> None:
        """Log a refused key once per connection (the link retries regardless)."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if not self._refusal_logged:
                self._refusal_logged = True
                log.error(
                    "agent %s: the coordinator at %s refused this agent's CurveZMQ key %s... (ZAP status %s): "
                    "add its public key to the coordinator's --curve-dir agents/ and restart the coordinator",
                    self._agent_id,
                    self.address,
                    fingerprint(self._curve.pair.public),
                    event["value"],
                )

    async def _serve(self) -> bool:
        """Until the core ends the session; True if it was registered meanwhile."""
        session, sock = self._session, self.sock
        welcomes = session.welcomes
        while self._ending is None:
            if time.monotonic() >= session.next_tick_at:
                self._dispatch(Tick(self._store.count()))
                if self._ending is not None:
                    break
            wait_ms = max(1.0, (session.next_tick_at - time.monotonic()) * 1000)
            if self._monitor is not None:
                self._check_monitor()
            if await sock.poll(wait_ms):
                self._dispatch(MessageReceived(self._decode(await sock.recv())))
        return session.welcomes > welcomes

    def _decode(self, frame: bytes) -> p.Message | None:
        try:
            return p.decode(frame)
        except ProtocolError as exc:
            log.error("bad message from the coordinator: %s", exc)
            return None


def _send_failed(kind: str, exc: BaseException) -> None:
    if isinstance(exc, zmq.Again):
        log.warning("send queue to the coordinator is full; %s dropped (repaired by resend/lease expiry)", kind)
    else:
        log.warning("sending %s to the coordinator failed: %s", kind, exc)
