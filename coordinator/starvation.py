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

A filter that drops every group (a rollout setting that makes every reward
equal, e.g. ``--max-new-tokens`` so small that every sample is truncated) is
the same stall by another road: the prompts are filtered, legitimately, by
the filter's verdict, and the dataset burns through while ``generate()``
waits. ``Starvation`` counts the drops in a row too (a kept group, a receipt,
ends the streak). At ``after`` of them it logs a WARNING with the drop counts
by reason, once per streak; at ``drop_after`` (default: the dataset's size,
a whole data epoch) the rollout is starved with a reason carrying those
counts, e.g. ``the filter dropped every group of the last 20000 (none kept):
zero_std_0=20000``. The dropped prompts stay filtered: that was the
filter's verdict on them.

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

    def __init__(self, after: int, drop_after: int | None = None):
        for name, value in (("starve_after", after), ("starve_after_drops", drop_after)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.after = after
        self.drop_after = drop_after
        """Filter drops in a row after which the rollout is starved; None: never."""
        self.reason: str | None = None
        """Why the rollout is starved; None while it is not."""
        self.answered: set[tuple[bytes, int]] = set()
        """``(peer, req)`` of the generate calls told so: a resend of one is told again, not taken for
        a new call (which would clear the state)."""
        self._filtered: dict[Prompt, str] = {}  # filtered for their failures during the streak
        self._failed: set[Prompt] = set()  # failed during the streak
        self._details: Counter[str] = Counter()
        self._streak = 0
        self._drops: Counter[str] = Counter()  # drop reasons of the current streak of drops
        self._drop_streak = 0

    @property
    def starved(self) -> bool:
        return self.reason is not None

    def ok(self) -> None:
        """A group went through reward and filter: the streak is over, and its filtered prompts
        stay filtered (the rollout works for other prompts, so they failed on their own account)."""
        self._reset()

    def kept(self) -> None:
        """A group was kept (a receipt): any streak of filter drops is over."""
        self._drops.clear()
        self._drop_streak = 0

    def dropped(self, reason: str) -> bool:
        """The filter dropped a group (``reason``); True when this drop starves the rollout."""
        if self.starved:
            return False
        self._drop_streak += 1
        self._drops[reason] += 1
        if self._drop_streak == self.after:
            log.warning(
                "the filter dropped every group of the last %d (none kept): %s; generate() waits for groups that "
                "pass it (check --dynamic-filter against the rollout settings)",
                self._drop_streak,
                self._drop_counts(),
            )
        if self.drop_after is None or self._drop_streak < self.drop_after:
            return False
        self.reason = f"the filter dropped every group of the last {self._drop_streak} (none kept): "
        self.reason += self._drop_counts()
        log.error("rollout starved, admission stopped until the next generate(): %s", self.reason)
        self.kept()
        return True

    def _drop_counts(self) -> str:
        return ", ".join(f"{reason}={n}" for reason, n in self._drops.most_common())

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
        self.kept()

    def _reset(self) -> None:
        self._filtered.clear()
        self._failed.clear()
        self._details.clear()
        self._streak = 0
