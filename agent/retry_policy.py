"""How often a group is tried again, and how long it waits, when engines refuse or fail it.

Shared by the agent's two generation paths: one ``/generate`` per sample (``agent/lease_runner.py``)
and a custom generate function's engine handle (``agent/custom_rollout.py``). The bounds keep a prompt
that no engine will take from being retried forever; the busy backoff keeps refused groups from all
coming back at once.
"""

from __future__ import annotations

import random

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
