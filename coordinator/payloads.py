"""The trainer's data plane: a batch's group payloads, fetched straight from the agents that hold them.

``PayloadFetcher.fetch(refs)`` asks every agent of a batch at once, in chunks of ``FETCH_CHUNK`` keys, over one
DEALER endpoint per agent (kept between batches; CurveZMQ when the agent's address carries its key). What no
agent could give comes back together in one ``FetchFailed``: ``missing`` (an agent that is up no longer holds
them) and ``unreachable`` (an agent that did not answer), so ``generate`` can tell the coordinator about the
first at once and give the second their ``fetch_deadline``.
"""

from __future__ import annotations

import asyncio

import zmq.asyncio

from common import protocol as p
from common.curve import ClientKeys, split_address
from common.errors import ConfigError, RemoteError, RolloutError
from common.types import Group
from coordinator.endpoint import FetchFailed, _Endpoint
from coordinator.records import GroupRef

FETCH_CHUNK = 64


class PayloadFetcher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        curve: ClientKeys | None,
        requester: str,
        retry_interval: float,
        timeout: float,
    ):
        """``requester``: how this process names itself in the agents' debug log; ``timeout``: seconds one fetch
        may take (resent every ``retry_interval`` meanwhile)."""
        self._ctx = ctx
        self.curve = curve
        self.requester = requester
        self.retry_interval = retry_interval
        self.timeout = timeout
        self._agents: dict[str, _Endpoint] = {}

    async def fetch(self, wire_refs: list, raw: list[bytes] | None = None) -> list[Group]:
        """The groups of ``wire_refs``, fetched from their agents; ``raw`` (a list) gets their payload bytes too."""
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
                jobs.append(self._chunk(address, keys[i : i + FETCH_CHUNK]))
        payloads: dict[str, bytes] = {}
        failed: list[FetchFailed] = []
        for part in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(part, FetchFailed):
                failed.append(part)
            elif isinstance(part, BaseException):
                raise part
            else:
                payloads.update(part)
        if failed:  # every node was asked: what one lacks and what another could not answer, together
            missing = [k for f in failed for k in f.missing]
            unreachable = [k for f in failed for k in f.unreachable]
            raise FetchFailed("; ".join(str(f) for f in failed), missing, unreachable)
        if raw is not None:
            raw.extend(payloads[ref.key] for ref in refs)
        return [Group.from_wire(payloads[ref.key]) for ref in refs]

    async def _chunk(self, address: str, keys: list[str]) -> dict[str, bytes]:
        ep = self._agents.get(address)
        if ep is None:
            ep = self._agents[address] = self._endpoint(address)
        try:
            msg, frames = await ep.request(
                lambda req: p.Fetch(req, keys, self.requester),
                retry_interval=self.retry_interval,
                timeout=self.timeout,
                what=f"fetch from {address}",
            )
        except RolloutError as exc:
            await ep.close()
            self._agents.pop(address, None)
            raise FetchFailed(str(exc), unreachable=keys) from None
        if isinstance(msg, p.Error):
            raise RemoteError(f"agent {address}: [{msg.code}] {msg.message}", code=msg.code)
        if msg.missing:
            raise FetchFailed(
                f"agent {address} no longer holds {len(msg.missing)} group(s), e.g. {msg.missing[:3]}", msg.missing
            )
        return dict(zip(msg.found, (bytes(f) for f in frames), strict=False))

    def _endpoint(self, address: str) -> _Endpoint:
        endpoint, server_public = split_address(address)
        if server_public is not None and self.curve is None:
            raise ConfigError(
                f"agent payload endpoint {endpoint} requires CurveZMQ keys: give curve_secret and curve_server_key"
            )
        if server_public is None:
            return _Endpoint(self._ctx, endpoint, endpoint)
        hint = " (CurveZMQ: the agent accepts the trainers' keys once the coordinator has welcomed it)"
        return _Endpoint(self._ctx, endpoint, endpoint, curve=self.curve, server_public=server_public, hint=hint)

    async def close(self) -> None:
        for ep in self._agents.values():
            await ep.close()
        self._agents.clear()
