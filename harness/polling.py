"""The one way tests wait: poll a predicate until it holds, with a deadline, never a bare sleep.

``wait_for`` polls from synchronous code (tests driving real processes); ``wait_for_async`` polls
from a coroutine (tests of in-process servers), yielding to the event loop between polls. Both
return the predicate's first truthy value and raise ``AssertionError`` naming what was awaited,
with the last exception the predicate raised, when the deadline passes. A predicate may raise
while the thing it polls is not up yet; that counts as "not yet". A predicate that knows the
wait can never succeed (the process it waits on died) raises ``WaitAborted`` to fail at once.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


class WaitAborted(AssertionError):
    """Raised by a predicate: what is awaited can no longer happen; stop waiting now."""


def _timed_out(timeout: float, what: str, last_exc: BaseException | None) -> AssertionError:
    detail = f" (last error: {type(last_exc).__name__}: {last_exc})" if last_exc else ""
    return AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except WaitAborted:
            raise
        except Exception as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, last_exc)
        time.sleep(interval)


async def wait_for_async(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Like ``wait_for``; ``predicate`` may be a plain function or return an awaitable."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
        except WaitAborted:
            raise
        except Exception as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, last_exc)
        await asyncio.sleep(interval)
