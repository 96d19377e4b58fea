"""A task group whose life spans two calls (a service's ``start`` to its ``stop``).

Every task is named and kept; an unexpected exception is logged and handed to ``on_failure``
(for the owner's ``run`` to re-raise); :meth:`TaskOwner.aclose` cancels and awaits them all,
and a cancellation of its own caller propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

__all__ = ["TaskOwner"]

log = logging.getLogger("rollfleet.agent.supervisor")


class TaskOwner:
    """A task group whose life spans two calls, :meth:`EngineSupervisor.start` to ``stop``.

    Every task is named and kept here; an unexpected exception is logged and handed to
    ``on_failure`` (for :meth:`EngineSupervisor.run` to re-raise); :meth:`aclose` cancels
    and awaits them all, and a cancellation of its own caller propagates.
    """

    def __init__(self, on_failure: Callable[[BaseException], None]):
        self._tasks: set[asyncio.Task] = set()
        self._on_failure = on_failure

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine task %s crashed", task.get_name(), exc_info=task.exception())
            self._on_failure(task.exception())

    async def aclose(self) -> None:
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.error("engine task failed: %r", r)
