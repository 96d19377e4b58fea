"""How often a group is tried again, and how long it waits, when engines refuse or fail it.

Shared by the agent's two generation paths: one ``/generate`` per sample (``agent/lease_runner.py``)
and a custom generate function's engine handle (``agent/custom_rollout.py``). The bounds keep a prompt
that no engine will take from being retried forever; the busy backoff keeps refused groups from all
coming back at once.
"""

from __future__ import annotations

import asyncio
import logging
import random

from agent.engine_client import EngineRejected, EngineUnavailable
from agent.events import EngineFailed, EngineWanted, GenerationEnded

log = logging.getLogger("rollfleet.agent")

RETRY_DELAY = 0.1
"""Seconds between an engine failing under a group and the group asking for another engine."""

MAX_REJECTED = 3
"""Tries of a group whose requests an engine refuses (HTTP 4xx) before its prompt fails."""

MAX_ENGINE_FAILURES = 5
"""Engine failures (connection refused, 5xx) under one group before its prompt fails."""

BUSY_BACKOFF = (0.2, 5.0)
"""Seconds before samples an engine was too busy for are asked for again: first wait, longest wait."""


def busy_backoff(rounds: int) -> float:
    """The wait after the ``rounds``-th busy answer in a row: doubling, capped, with jitter so refused
    groups do not all come back at once."""
    first, longest = BUSY_BACKOFF
    return min(longest, first * 2 ** max(0, rounds - 1)) * random.uniform(0.5, 1.0)


class GroupRetries:
    """One group's retry budget, spent by either generation path: each call counts one refusal or one
    engine failure, raises the prompt's failure once its bound is reached, and otherwise asks the
    agent's core (through ``runner``) for the assignment to try next."""

    def __init__(self, runner):
        self.runner = runner
        self.rejected = 0
        self.failures = 0

    async def engine_refused(self, exc: EngineRejected, what: str = ""):
        """The engine refused a request (4xx): the group starts over, at most ``MAX_REJECTED`` tries in all."""
        self.rejected += 1
        if self.rejected >= MAX_REJECTED:
            raise EngineRejected(f"refused {self.rejected} times, last: {exc}", status=exc.status)
        log.warning("lease %x: %s; starting the group over (try %d/%d)", self.runner.lease, what or exc,
                    self.rejected + 1, MAX_REJECTED)  # fmt: skip
        return await self.runner._ask(GenerationEnded(self.runner.lease, aborted=True))

    async def engine_failed(self, failure: BaseException):
        """The engine failed under the group: reported, and the group goes to the engine the core assigns
        next after ``RETRY_DELAY``, at most ``MAX_ENGINE_FAILURES`` times."""
        self.failures += 1
        self.runner._dispatch(EngineFailed(self.runner.lease, str(failure)))
        if self.failures >= MAX_ENGINE_FAILURES:
            raise EngineUnavailable(f"engines failed {self.failures} times under this group, last: {failure}")
        await asyncio.sleep(RETRY_DELAY)
        return await self.runner._ask(EngineWanted(self.runner.lease))
