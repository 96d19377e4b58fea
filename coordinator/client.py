"""The trainer API: pull batches, pause/resume, checkpoint.

    from coordinator.client import RolloutClient

    with RolloutClient("tcp://coordinator:5555") as client:
        for step in range(100):
            batch = client.generate(step)
            tensors = batch.to_tensors()      # torch, padded
            print(batch.metrics["rollout/reward_mean"])

``generate(rollout_id)`` asks the coordinator for the batch of that id (a
list of references), then fetches the payloads from the agents that hold
them, in parallel. Asked twice for the same id, it returns the same groups.

Every request is safe to resend: the client resends a request that got no
answer (e.g. while the coordinator restarts) and re-attaches transparently
when the coordinator no longer knows its session. If another trainer
attached meanwhile, calls raise ``Fenced`` instead.

``RolloutClient(addr, expect={...})`` attaches only to a fleet whose rollout
configuration has those values (``StateError`` listing the fields otherwise).
``evaluate(name)`` runs one pass over an evaluation dataset and returns its metrics (mean
reward, pass@k, response length, truncated ratio).
Weight updates (docs/weights.md): ``update_weights_from_disk(path, version)``
and ``update_weights(named_tensors, version, backend=..., bucket_bytes=...)``
(this process is rank 0 of the engines' update group; coordinator/client_weights.py)
return once every engine serves ``version``; ``weight_version()`` reads it.

Every call returns a frozen record, never a bare dict (coordinator/client_results.py, coordinator/client_stats.py):
``pause`` a ``PauseResult``, ``resume`` a ``ResumeResult``, ``set_mixture`` a ``MixtureResult``, ``evaluate``
``EvalMetrics``, the weight calls a ``WeightUpdateResult``, ``stats`` a ``FleetStats``; ``state_dict`` the
checkpoint payload, a plain dict of JSON data (``RolloutState``).

``RolloutClient(addr, record="DIR")`` also writes every batch it returns to ``DIR/rollout-<id>.parquet``
on a thread (coordinator/recorder.py); ``coordinator replay --from DIR`` serves them again to this same
API, with no fleet (docs/guides/record-and-replay.md).

CurveZMQ (docs/operate/keys.md): ``RolloutClient(addr, curve_secret="trainer.key_secret",
curve_server_key="coordinator.key")`` connects with this trainer's key pair to the coordinator
holding that public key, and to the agents' payload endpoints with the keys their addresses carry.

``AsyncRolloutClient`` (coordinator/client_async.py) is the same API for asyncio code; ``RolloutClient``
runs one on a private event-loop thread. Their methods cannot drift apart: tests/unit/test_client_parity.py
compares their names, parameters, defaults and return annotations.
"""

from __future__ import annotations

import asyncio
import threading

from common.errors import Closed
from coordinator.batch import RolloutBatch
from coordinator.client_async import AsyncRolloutClient
from coordinator.client_results import (
    EvalMetrics,
    MixtureResult,
    PauseResult,
    ResumeResult,
    RolloutState,
    WeightUpdateResult,
)
from coordinator.client_stats import FleetStats
from coordinator.client_weights import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT
from coordinator.endpoint import FetchFailed

CoordinatorStats = FleetStats
"""Another name of ``FleetStats``, what ``stats()`` returns (the coordinator's status as the trainer reads it)."""

__all__ = [
    "AsyncRolloutClient",
    "CoordinatorStats",
    "EvalMetrics",
    "FetchFailed",
    "FleetStats",
    "MixtureResult",
    "PauseResult",
    "ResumeResult",
    "RolloutBatch",
    "RolloutClient",
    "RolloutState",
    "WeightUpdateResult",
]


class RolloutClient:
    """Blocking twin of ``AsyncRolloutClient``: the same methods, parameters, defaults and records
    (tests/unit/test_client_parity.py keeps them so)."""

    def __init__(self, address: str, **kwargs):
        self._async = AsyncRolloutClient(address, **kwargs)  # a bad address fails here, before any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-client", daemon=True)
        self._thread.start()
        try:
            self._run(self._async.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise Closed("client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def config(self) -> dict:
        return self._async.config

    @property
    def session(self) -> int:
        return self._async.session

    @property
    def rank(self) -> int:
        return self._async.rank

    @property
    def world_size(self) -> int:
        return self._async.world_size

    def generate(self, rollout_id: int, prefetch: int | None = None, deadline: float | None = None) -> RolloutBatch:
        return self._run(self._async.generate(rollout_id, prefetch, deadline))

    def pause(self, drain: bool = True, abort: bool = False) -> PauseResult:
        return self._run(self._async.pause(drain, abort))

    def resume(self) -> ResumeResult:
        return self._run(self._async.resume())

    def set_mixture(self, weights: dict[str, float]) -> MixtureResult:
        return self._run(self._async.set_mixture(weights))

    def state_dict(self) -> RolloutState:
        return self._run(self._async.state_dict())

    def load_state_dict(self, state: RolloutState) -> None:
        self._run(self._async.load_state_dict(state))

    def evaluate(self, name: str) -> EvalMetrics:
        return self._run(self._async.evaluate(name))

    def stats(self) -> FleetStats:
        return self._run(self._async.stats())

    def update_weights_from_disk(
        self, path: str, version: int, *, timeout: float = DEFAULT_TIMEOUT, group=None
    ) -> WeightUpdateResult:
        return self._run(self._async.update_weights_from_disk(path, version, timeout=timeout, group=group))

    def update_weights(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool | None = None,
        group=None,
    ) -> WeightUpdateResult:
        return self._run(
            self._async.update_weights(
                named_tensors,
                version,
                backend=backend,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                verify=verify,
                group=group,
            )
        )

    def catch_up(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = True,
        group=None,
    ) -> WeightUpdateResult:
        return self._run(
            self._async.catch_up(
                named_tensors,
                version,
                backend=backend,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                verify=verify,
                group=group,
            )
        )

    def weight_version(self) -> int:
        return self._run(self._async.weight_version())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
