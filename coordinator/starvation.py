"""Starvation: every recent group failed, so no batch can ever be assembled.

A reward or filter that raises on every sample (a bug in user code, a dependency
it lacks on the nodes) makes every group fail. Left alone, each prompt would
fail ``MAX_FAILURES`` times, be filtered, and the next one leased: the dataset
burns through into "filtered" while ``generate()`` waits forever.

``Starvation`` watches group outcomes in the order they arrive:

    ok      a group went through reward and filter (a receipt, or a filter drop)
    error   a group failed (``common.protocol.FAILURE_KINDS``: reward_error,
            filter_error, generation_failed), with a detail naming spec and exception

When the last ``after`` outcomes are all errors the rollout is *starved*:
``reason`` says so and names the dominant failure, e.g. ``every group of the
last 64 failed: reward_error: reward 'my_mod:score' raised RuntimeError: boom``.
The rest is up to the core: admission stops, waiting ``generate`` calls fail
with ``starved`` (``common.errors.Starved`` in the client), and the next
``generate`` clears the state.

Invariants (with ``coordinator/admission.py``, which owns the prompts):
- Failing user code loses no data. A prompt that fails ``MAX_FAILURES`` times
  is filtered (reason: its failure kind), as a prompt that fails on its own
  must not be retried forever; but when the streak it failed in starves the
  rollout, the failure was not the prompt's: every prompt filtered during the
  streak is pending again (ledger record dropped, drop metric taken back), and
  every prompt that failed in it has its attempts forgotten. A fixed reward
  then sees each of them afresh.
- While starved, errors change nothing but the prompt's return to pending: no
  attempt is counted, nothing is filtered, no prompt is leased.
- Bounded: the streak's details and prompts are at most ``after`` entries (the
  streak ends at ``after`` errors); nothing here is persisted, so a restarted
  coordinator starts unstarved (its trainer's next ``generate`` would clear it anyway).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from coordinator.records import Prompt

log = logging.getLogger("rollfleet.coordinator")


def default_starve_after(rollout_batch_size: int) -> int:
    """``--starve-after`` when not given: two batches' worth of groups, and at least 64."""
    return max(64, 2 * rollout_batch_size)


@dataclass(frozen=True, slots=True)
class FreshStart:
    """The prompts of the streak that starved the rollout."""

    filtered: tuple[tuple[Prompt, str], ...]
    """``(prompt, reason)`` of the prompts filtered for their failures during the streak: pending again."""
    failed: tuple[Prompt, ...]
    """Every prompt that failed during the streak: its attempts are forgotten."""


class Starvation:
    """The current streak of failed groups, and the starved state it may lead to."""

    def __init__(self, after: int):
        if not isinstance(after, int) or isinstance(after, bool) or after < 1:
            raise ValueError(f"starve_after must be a positive integer, got {after!r}")
        self.after = after
        self.reason: str | None = None
        """Why the rollout is starved; None while it is not."""
        self.answered: set[tuple[bytes, int]] = set()
        """``(peer, req)`` of the generate calls told so: a resend of one is told again, not taken for
        a new call (which would clear the state)."""
        self._filtered: dict[Prompt, str] = {}  # filtered for their failures during the streak
        self._failed: set[Prompt] = set()  # failed during the streak
        self._details: Counter[str] = Counter()
        self._streak = 0

    @property
    def starved(self) -> bool:
        return self.reason is not None

    def ok(self) -> None:
        """A group went through reward and filter: the streak is over, and its filtered prompts
        stay filtered (the rollout works for other prompts, so they failed on their own account)."""
        self._reset()

    def error(self, prompt: Prompt, kind: str, detail: str) -> FreshStart | None:
        """A group of ``prompt`` failed.

        None while the rollout is not starved by it. When this error starves it:
        the streak's prompts, which get a fresh start.
        """
        if self.starved:
            return None
        self._streak += 1
        self._failed.add(prompt)
        self._details[f"{kind}: {detail}"] += 1
        if self._streak < self.after:
            return None
        (dominant, n), *others = self._details.most_common()
        self.reason = f"every group of the last {self._streak} failed: {dominant}"
        if others:
            self.reason += f" ({n} of them; {len(others)} other failure(s))"
        log.error("rollout starved, admission stopped until the next generate(): %s", self.reason)
        fresh = FreshStart(tuple(sorted(self._filtered.items())), tuple(sorted(self._failed)))
        self._reset()
        return fresh

    def filtered(self, prompt: Prompt, reason: str) -> None:
        """``prompt`` was filtered for its failures during the streak (taken back if it starves)."""
        self._filtered[prompt] = reason

    def clear(self) -> None:
        """A trainer asks again (e.g. agents were restarted with a fixed reward): start over."""
        if self.reason is not None:
            log.info("rollout no longer starved: a trainer asked for a batch again")
        self.reason = None
        self.answered.clear()
        self._reset()

    def _reset(self) -> None:
        self._filtered.clear()
        self._failed.clear()
        self._details.clear()
        self._streak = 0
