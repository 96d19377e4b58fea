"""The agent's data plane: trainers fetch group payloads straight from the node.

A ZeroMQ ROUTER answers ``Fetch`` with a ``Payloads`` header frame followed
by the stored bytes of each found group, unmodified (no re-encoding). The
coordinator never carries payloads, so it is never a bandwidth bottleneck.
Bad requests get an ``Error`` reply; the server keeps serving. Every fetch
runs as a task of the server's own task group: cancelling ``serve`` ends them.

With CurveZMQ keys (``curve``: the agent's own pair) the ROUTER is a CURVE server and a
``KeyGate`` admits only the trainers' public keys, which the coordinator hands over in its
Welcome (``allow_trainers``); before the first Welcome nobody is admitted, and a refused peer
never reaches ``serve``. The agent's public key travels in its payload address.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from common import protocol as p
from common.curve import KeyPair
from common.errors import ProtocolError
from common.transport import router, send_nowait

log = logging.getLogger("rollfleet.agent.payload")

MAX_KEYS_PER_FETCH = 4096


class PayloadServer:
    def __init__(self, ctx: zmq.asyncio.Context, store, bind: str, *, curve: KeyPair | None = None):
        self.store = store
        self.gate = None
        if curve is not None:
            from common.zap import KeyGate

            self.gate = KeyGate(ctx, {}, "payload endpoint")
        # The same port across restarts of this data dir: trainers fetching from
        # the node reconnect by themselves instead of waiting for a new address.
        saved = store.meta_get("payload_port")
        self.sock, self.endpoint = router(ctx, bind, prefer_port=int(saved) if saved else None, curve=curve)
        store.meta_put("payload_port", self.endpoint.rsplit(":", 1)[1])
        self.served = 0

    def allow_trainers(self, keys: list[str]) -> None:
        """The trainers' public keys (Z85 text, from the Welcome) become the allow list."""
        if self.gate is not None:
            self.gate.allow({k.encode("ascii", "replace"): f"trainer {k[:8]}" for k in keys})

    async def serve(self) -> None:
        """Answer fetches until cancelled; each fetch is a task of its own, owned here."""
        if self.gate is not None:
            self.gate.start()
        async with asyncio.TaskGroup() as tg:
            while True:
                frames = await self.sock.recv_multipart(copy=True)
                if len(frames) < 2:
                    continue
                peer, frame = frames[0], frames[-1]
                try:
                    msg = p.decode(frame)
                    if not isinstance(msg, p.Fetch):
                        raise ProtocolError(f"the payload endpoint serves 'fetch' only, not {msg.TYPE!r}")
                    if len(msg.keys) > MAX_KEYS_PER_FETCH:
                        raise ProtocolError(f"fetch of {len(msg.keys)} keys exceeds {MAX_KEYS_PER_FETCH}")
                except ProtocolError as exc:
                    self._send(peer, [p.encode(p.Error("bad_request", str(exc), p.peek_req(frame)))])
                    continue
                tg.create_task(self._answer(peer, msg), name=f"fetch-{msg.req}")

    async def _answer(self, peer: bytes, msg: p.Fetch) -> None:
        try:
            values = await self.store.get_many(msg.keys)
        except Exception as exc:
            # One failed read fails this fetch, not the endpoint: no reply, the trainer resends.
            log.error("reading %d group(s) for a trainer's fetch failed: %s", len(msg.keys), exc)
            return
        found, missing, frames = [], [], []
        for key, value in zip(msg.keys, values, strict=True):
            if value is None:
                missing.append(key)
            else:
                found.append(key)
                frames.append(value)
        self.served += len(found)
        if log.isEnabledFor(logging.DEBUG):  # one line per fetch: --log-level DEBUG only
            size = sum(len(f) for f in frames)
            log.debug("served %d group(s), %d bytes, to %s", len(found), size, msg.requester or "a trainer")
        self._send(peer, [p.encode(p.Payloads(msg.req, found, missing)), *frames])

    def _send(self, peer: bytes, frames: list[bytes]) -> None:
        # Peer gone (ROUTER_MANDATORY) or at its HWM: the trainer resends its fetch.
        send_nowait(self.sock, [peer, *frames], _reply_failed, copy=len(frames) < 3)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.stop()
        self.sock.close(linger=0)


def _reply_failed(exc: BaseException) -> None:
    log.warning("payload reply to a trainer failed: %s", exc)
