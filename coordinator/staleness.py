"""Bounded staleness (guarantee 8, docs/weights.md "Staleness"): pure rules, no I/O, no clock.

Each lease records ``start``, the weight updates pushed when it was granted; a ready group keeps
it. For the batch of rollout ``t`` every group must have ``start >= t - ETA`` (``--max-staleness
ETA``; the model is the README's loop: rollout ``t`` is asked for once ``t`` updates were pushed).
Two rules make that hold without discarding any group:

1. Admission: a grant is made only while ``leased + ready + delivered < (updates + ETA + 1) * B``,
   where ``delivered = t_next * B`` counts the groups of the batches before the next one
   (``t_next``, the rollout id the next batch gets) and ``B`` is ``rollout_batch_size``.
2. Assembly, oldest first: batch ``t`` takes ready groups by ``(start, acceptance order)`` and is
   not assembled while a lease with ``start <= t - ETA`` is in flight (that group must join
   batch ``t``, the last one it may join).

Rule 1 bounds the groups with ``start <= t - ETA`` to ``(t + 1) * B``: they fit in batches
``0..t``, and rule 2 puts them there. With ``ETA`` None (the default) neither rule applies and
batches take ready groups in acceptance order, as without weight updates.

The time rule 1 held admission back (demand it refused) is summed per batch as
``rollout/admission_stall_s``, beside ``rollout/staleness_mean`` and ``rollout/staleness_max``
(``t - start`` over the batch's groups).
"""

from __future__ import annotations

from collections.abc import Iterable


class Staleness:
    def __init__(self, eta: int | None, batch_size: int):
        self.eta = eta
        self.batch_size = batch_size
        self._stalled_since: float | None = None
        self._stall_s = 0.0

    @property
    def bounded(self) -> bool:
        return self.eta is not None

    def budget(self, outstanding: int, t_next: int, updates: int) -> int | None:
        """Grants rule 1 allows now (``outstanding``: leased + ready); None when unbounded."""
        if self.eta is None:
            return None
        return (updates + self.eta + 1) * self.batch_size - outstanding - t_next * self.batch_size

    def note_admission(self, wanted: int, allowed: int | None, now: float) -> None:
        """Admission wanted ``wanted`` grants and rule 1 allowed ``allowed``: start or end a stall."""
        stalled = allowed is not None and wanted > 0 and allowed < wanted
        if stalled and self._stalled_since is None:
            self._stalled_since = now
        elif not stalled and self._stalled_since is not None:
            self._stall_s += max(0.0, now - self._stalled_since)
            self._stalled_since = None

    def holds_batch(self, t: int, leased_starts: Iterable[int]) -> bool:
        """Rule 2: batch ``t`` waits while a lease that must join it is still in flight."""
        if self.eta is None:
            return False
        limit = t - self.eta
        return any(start <= limit for start in leased_starts)

    def metrics(self, t: int, starts: list[int], now: float) -> dict[str, float]:
        """The staleness metrics of batch ``t`` (its groups' starts); restarts the stall count."""
        if self._stalled_since is not None:
            self._stall_s += max(0.0, now - self._stalled_since)
            self._stalled_since = now
        stall, self._stall_s = self._stall_s, 0.0
        ages = [max(0, t - s) for s in starts]
        return {
            "rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "rollout/staleness_max": float(max(ages, default=0)),
            "rollout/admission_stall_s": stall,
        }
