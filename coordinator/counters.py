"""Event counters the coordinator's core keeps for observation (``/metrics``, the status page).

The core already holds every *level* an operator looks at (agents by status,
leases in flight, prompts per state, weight version); what it does not hold
are *events*: receipts taken, leases granted and how each one ended, groups
dropped by reason, batches assembled and how long the trainer waited for them.
``CoreCounters`` records those as plain integers and floats bumped where the
event happens, one attribute increment each, and is read only when someone
scrapes (``coordinator/observe.py``): nothing is formatted, labelled or locked
on the hot path.

Invariants:
- Monotonic: counters only grow (Prometheus' ``rate()`` needs that). A filter
  drop that starvation takes back (its prompt pending again) stays counted:
  it happened.
- Bounded: per-reason dicts grow with distinct reasons (sanitised, a handful),
  the recent-batch list is capped at ``RECENT_BATCHES``.
- In memory only: a restarted coordinator starts from zero, as Prometheus
  counters may (a reset is what ``rate()`` expects).

Pure: no I/O; times are passed in (``time.monotonic()`` values from the shell).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from common.metrics import sanitize_reason

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the batch latency histogram; a last +Inf bucket is implied."""

RECENT_BATCHES = 120
"""Batches the status page plots (the newest ones)."""

RECENT_KEYS = (
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "rollout/dynamic_filter/dropped_ratio",
    "rollout/truncated_ratio",
    "rollout/staleness_mean",
    "rollout/staleness_max",
)
"""The batch metrics kept for the recent batches (what the page draws)."""


@dataclass(frozen=True, slots=True)
class BatchSample:
    """One assembled batch as the status page shows it."""

    rollout_id: int
    at: float
    """When it was assembled (monotonic seconds)."""
    wait_s: float
    """From the trainer's ``generate`` reaching the coordinator to the batch being recorded."""
    groups: int
    metrics: dict


class CoreCounters:
    def __init__(self) -> None:
        self.receipts_accepted = 0
        self.receipts_refused = 0
        """Receipts refused: a duplicate of a prompt already accounted for, or of a closed epoch."""
        self.leases_granted = 0
        self.registrations = 0
        """Sessions made by a Register (first joins and re-registrations)."""
        self.registers_resent = 0
        """Resent Registers answered with the session already made for them (no new session)."""
        self.lease_ends: dict[str, int] = {}
        """Leases ended, by how: receipt, filtered, released, failed, lost (missing from the agent's
        heartbeat), expired (agent silent past the TTL: its evaluation leases, and every lease under
        ``--max-staleness``; its other leases are held for it), held_released (held for a silent
        agent that was then retired or came back without it), held_reassigned (held, and given to
        another agent because nothing else was pending), reregistered (the agent no longer held it),
        stopped (over-sampled, given back after a Stop), evaluated (an evaluation prompt's result came)."""
        self.drops: dict[str, int] = {}
        """Groups filtered (dynamic filter verdicts and prompts given up after repeated failures), by reason."""
        self.batches = 0
        self.partial_batches = 0
        """Batches made short at a ``generate`` deadline."""
        self.stops_sent = 0
        """Over-sampled leases a Stop was sent for (``coordinator/oversampling.py``)."""
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self._wait_total = 0.0
        self._waiting_since: float | None = None
        self.recent: deque[BatchSample] = deque(maxlen=RECENT_BATCHES)

    def lease_ended(self, reason: str, n: int = 1) -> None:
        if n:
            self.lease_ends[reason] = self.lease_ends.get(reason, 0) + n

    def dropped(self, reason: str) -> None:
        reason = sanitize_reason(reason)
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def batch(self, rollout_id: int, now: float, wait_s: float, groups: int, metrics: dict) -> None:
        """A batch was assembled for a ``generate`` that waited ``wait_s``."""
        self.batches += 1
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, wait_s)] += 1
        self.latency_sum += wait_s
        kept = {k: metrics[k] for k in RECENT_KEYS if k in metrics}
        self.recent.append(BatchSample(rollout_id, now, wait_s, groups, kept))

    def note_waiting(self, waiting: bool, now: float) -> None:
        """Whether a trainer ``generate`` is waiting now: integrates the time one was."""
        if waiting and self._waiting_since is None:
            self._waiting_since = now
        elif not waiting and self._waiting_since is not None:
            self._wait_total += max(0.0, now - self._waiting_since)
            self._waiting_since = None

    def trainer_wait_s(self, now: float) -> float:
        """Seconds, in all, during which at least one ``generate`` waited (the current wait included)."""
        open_s = max(0.0, now - self._waiting_since) if self._waiting_since is not None else 0.0
        return self._wait_total + open_s

    def latency_buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs, Prometheus style, ending with ``+Inf``."""
        out, total = [], 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.latency_counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out
