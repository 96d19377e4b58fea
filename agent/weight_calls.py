"""Calls to the engines during a weight step (docs/weights.md), each bounded: a hung engine is an engine lost.

A short control call (pause, continue, label, version check) gets ``CALL_DEADLINE``; a long one (a
disk load, a flush waiting for requests, a session end re-packing weights, a read-back) runs as long
as the engine's HTTP front answers ``/model_info`` within ``LIVENESS_TIMEOUT`` every
``LIVENESS_INTERVAL`` seconds. Past either, the call raises ``Hung``; ``each`` runs one call per
engine at once and notes the hung ones in ``hung`` (the executor then sends them down).

An engine we paused is never left paused: a pause that outlived its deadline, or an engine that
hung, is continued in the background (``continue_later``) once it answers. ``paused`` (the
``PausedEngines`` of agent/weight_checks.py) records the engines paused by us, so that per-request
aborts wait for their continue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agent.engine_client import EngineClient
from agent.weight_checks import PausedEngines
from common.errors import EngineError

log = logging.getLogger("rollfleet.agent.weights")

T = TypeVar("T")

STEP_DEADLINE = 600.0
"""Seconds one engine may take for one step (an init waits for the trainer to join)."""

CONFIRM_DEADLINE = 3.0
"""Seconds one engine may take to be confirmed for a group, or to leave a failed one. SGLang 0.5.23's pause
(mode ``abort``) aborts, then re-checks once a second until no request holds its lock: with requests in
flight it answers after one second, sometimes two."""

CALL_DEADLINE = 5.0
"""Seconds a short control call to one engine may take (pause, continue, label, version check): past it the
engine is hung (alive but not answering, e.g. SIGSTOPped), left out of the step and restarted as a dead one."""

LIVENESS_INTERVAL = 2.0
LIVENESS_TIMEOUT = 5.0
"""A long call (a disk load, a flush waiting for requests, a session end re-packing weights, a checksum pass)
may take as long as it needs while the engine answers ``/model_info`` (its HTTP front, not its scheduler)
within ``LIVENESS_TIMEOUT`` every ``LIVENESS_INTERVAL`` seconds; one that does not is hung."""

CONTINUE_DEADLINE = 3600.0
"""Seconds the continue of an engine whose pause outlived its deadline, or that hung, is tried for (once a
second): SGLang's continue queues behind the pause still running there, and a frozen engine is continued
once it thaws, so no engine is ever left paused by us."""


class Hung(EngineError):
    """An engine did not answer a call within its deadline: it is out of the step and goes down."""


class EngineCalls:
    def __init__(self, client: EngineClient, step_deadline: float = STEP_DEADLINE):
        self.client = client
        self.step_deadline = step_deadline
        self.paused = PausedEngines()  # urls paused by us: per-request aborts wait for them
        self.hung: dict[str, str] = {}  # engines found hung since the running step began: name -> why
        self._background: set[asyncio.Task] = set()  # continues sent after a pause that outlived its deadline
        self._resuming: dict[str, asyncio.Task] = {}  # the pending continue of an engine (continue_later)

    async def each(
        self, engines: dict[str, str], fn: Callable[[str, str], Awaitable], *, deadline: float | None = None
    ) -> dict[str, str]:
        """Run ``fn(name, url)`` on every engine at once, each within ``deadline`` (default: the step
        deadline); ``{name: error}``."""
        deadline = self.step_deadline if deadline is None else deadline

        async def one(name: str, url: str) -> tuple[str, str | None]:
            try:
                async with asyncio.timeout(deadline):
                    await fn(name, url)
            except TimeoutError:
                return name, f"no answer from {url} within {deadline:g}s"
            except Hung as exc:
                self.hung[name] = str(exc)
                return name, str(exc)
            except EngineError as exc:
                return name, str(exc) or type(exc).__name__
            return name, None

        results = await asyncio.gather(*(one(name, url) for name, url in engines.items()))
        return {name: why for name, why in results if why is not None}

    async def pause(self, url: str) -> None:
        """Pause in mode ``abort`` (in-flight samples come back partial); per-request aborts wait from now."""
        self.paused.hold(url)
        await self.bounded(url, "/pause_generation", self.client.pause_generation(url, "abort"))

    async def unpause(self, url: str) -> None:
        """``/continue_generation``; per-request aborts go on once it answered."""
        await self.bounded(url, "/continue_generation", self.client.continue_generation(url))
        self.paused.release(url)

    async def bounded(self, url: str, what: str, call: Awaitable[T]) -> T:
        """A short control call: Hung past ``CALL_DEADLINE``."""
        try:
            async with asyncio.timeout(CALL_DEADLINE):
                return await call
        except TimeoutError:
            raise Hung(f"{url}: no answer to {what} within {CALL_DEADLINE:g}s") from None

    async def watched(self, url: str, what: str, call: Awaitable[T]) -> T:
        """A long call: as long as it takes while the engine's front answers (``LIVENESS_*``); Hung otherwise."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=LIVENESS_INTERVAL)
                if done:
                    return task.result()
                try:
                    async with asyncio.timeout(LIVENESS_TIMEOUT):
                        await self.client.model_info(url)
                except (TimeoutError, EngineError) as exc:
                    why = str(exc) or f"no answer within {LIVENESS_TIMEOUT:g}s"
                    raise Hung(f"{url}: {what} unanswered and /model_info too: {why}") from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def continue_later(self, name: str, url: str) -> None:
        """Continue an engine whose pause outlived its deadline, or that hung: the pause goes on on the server (a
        client that gives up does not end it) and a continue queues behind it there; a frozen engine answers
        once it thaws. Tried once a second until it answers, the engine is prepared again (a new process), or
        ``CONTINUE_DEADLINE`` passes."""

        async def resume() -> None:
            end = asyncio.get_running_loop().time() + CONTINUE_DEADLINE
            while True:
                try:
                    await self.unpause(url)
                except EngineError as exc:
                    if asyncio.get_running_loop().time() > end:
                        log.warning("engine %s: gave up continuing it after its late pause: %s", name, exc)
                        return
                    await asyncio.sleep(1.0)
                else:
                    log.info("engine %s continued after a pause that outlived its deadline", name)
                    return

        old = self._resuming.pop(name, None)
        if old is not None:
            old.cancel()
        task = asyncio.ensure_future(resume())
        task.set_name(f"continue-{name}")
        self._resuming[name] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def restarted(self, name: str, moved: bool) -> None:
        """The engine was prepared again (a new process); ``moved``: at another address, where the old one's
        pending continue means nothing."""
        resuming = self._resuming.pop(name, None)
        if resuming is not None and moved:
            resuming.cancel()

    async def close(self) -> None:
        """Cancel the continues still being tried."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
