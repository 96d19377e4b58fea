"""Bounded staleness (guarantee 8, docs/weights.md "Staleness"): pure rules, no I/O, no clock.

Each lease records ``start``, the weight updates pushed when it was granted; a ready group keeps
it. For the batch of rollout ``t`` every group must have ``start >= t - ETA`` (``--max-staleness
ETA``; the model is the README's loop: rollout ``t`` is asked for once ``t`` updates were pushed).
Two rules make that hold without discarding any group:

1. Admission: a grant is made only while ``leased + ready + delivered < (updates + ETA + 1) * B``,
   where ``delivered = t_next * B`` counts the groups of the batches before the next one
   (``t_next``, the rollout id the next batch gets) and ``B`` is ``rollout_batch_size``. Of a
   mixture, by shares: each dataset may have leased or ready no more than its shares of batches
   ``t_next..updates + ETA`` (``TrainingSource.allowance``), so every batch the bound admits can
   be made of the groups it admits. Spent on whichever dataset lacked most for the waiting batches
   and the prefetch, the budget bought a mix those batches could not be made of (ready 7/2/1 for a
   batch of 5/3/2), and nothing more was leased until a push the trainer could only make after the
   batch (issue 39).
2. Assembly, oldest first: batch ``t`` takes ready groups by ``(start, acceptance order)`` and is
   not assembled while, for the start ``s`` of some lease in flight, fewer than ``B`` ready groups
   have ``start <= s`` and more than ``(s + ETA - t) * B`` leases with ``start <= s`` are in
   flight. Taking a younger group then would leave those leases more groups than batches
   ``t+1..s+ETA``, the last they may join, can hold. For ``s = t - ETA`` that is any such lease:
   it must join batch ``t``.

Why it holds. Write ``U(s)`` for the groups leased or ready with ``start <= s``, ``L(s)`` and
``R(s)`` for its leased and ready parts. Before batch ``t`` is assembled, ``U(s) <= (s + ETA + 1 -
t) * B`` for every ``s``:

- Rule 1 keeps it: a grant at ``updates = u`` has ``start = u`` and leaves ``leased + ready <= (u +
  ETA + 1 - t) * B``, which bounds ``U(s)`` for every ``s >= u``; ``U(s)`` for ``s < u`` is
  untouched. A release or a filter verdict only lowers ``U``.
- Rule 2 carries it to batch ``t + 1``: for every ``s``, batch ``t`` either takes ``B`` groups with
  ``start <= s`` (``R(s) >= B``, oldest first) or all of them, leaving ``U(s) = L(s) <= (s + ETA -
  t) * B``.

With ``s = t - ETA - 1`` the bound is 0: no group older than ``t - ETA`` is left for batch ``t``.
Of a mixture the same argument runs per dataset: rule 1 by shares bounds ``U(s)`` of each by its
shares of batches ``t..s+ETA``, and rule 2 holds batch ``t`` on each dataset's leases and ready
groups against its share of ``t`` (``Batches._held``); on the whole batch it let batch ``t`` take a
younger group of one dataset while older ones of it were in flight.
Rule 2 only ever waits on leases in flight: once they land, ``R(s) = U(s)`` and the bound above
ends the hold; a lease granted meanwhile has ``start = updates``, the newest, and rule 1 keeps it
from starting a hold. Without the second condition (the first version of rule 2 waited only for
``start <= t - ETA``) an early batch could take younger groups while old ones were in flight and
leave more old groups than the last batch they may join holds: W2's eta=4 run had a group of
``start`` 0 in batch 5.

A batch past the bound waits for a push. Rule 1 admits groups for rollouts up to ``updates + ETA``
only, so ``generate(t)`` for a later ``t`` (a trainer that asks for batch ``t+2`` before pushing
update ``t+1`` at ``ETA = 1``) gets nothing leased until the push; it waits, and
``update_wait`` says why (``statistics()["waiting_for_update"]``, ``coordinator status``). It is
not an error: a trainer may push from another thread, or another rank may be pushing right then.

With ``ETA`` None (the default) neither rule applies and batches take ready groups in acceptance
order, as without weight updates.

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

    def last_admitted(self, updates: int) -> int | None:
        """The last rollout id rule 1 admits groups for after ``updates`` pushes; None when unbounded."""
        return None if self.eta is None else updates + self.eta

    def update_wait(self, t: int, updates: int, lacking: list[str], budget: int, in_flight: int) -> str | None:
        """Why batch ``t`` cannot be completed before a weight update is pushed, or None if it can.

        ``lacking``: the datasets (``""`` for the one of a plain ``--dataset``) whose ready groups and leases in
        flight together fall short of their share of batch ``t``; ``budget``: rule 1's (``budget``); ``in_flight``:
        bounded leases in flight. The batch waits for a push when some dataset lacks groups and rule 1 admits none
        until one: ``t`` is past the last rollout the bound admits groups for, or the budget is spent (on groups
        of other datasets, for later batches: after a partial batch or ``set_mixture``) with no lease left whose
        drop could free it.
        """
        if self.eta is None or not lacking or budget > 0:
            return None
        last = updates + self.eta
        short = f" ({', '.join(lacking)} lack their share)" if any(lacking) else ""
        if t > last:
            more = t - last
            return (
                f"rollout {t} waits for {more} more weight update(s): with --max-staleness {self.eta} its groups may "
                f"start only on weights of update {t - self.eta} or later, and {updates} update(s) were pushed"
                f"{short}; push an update (update_weights*) to go on"
            )
        if in_flight:
            return None
        return (
            f"rollout {t} waits for a weight update: --max-staleness {self.eta} admits no more groups before update "
            f"{updates + 1}, its budget held by groups ready for later rollouts{short}; push an update to go on"
        )

    def note_admission(self, wanted: int, allowed: int | None, now: float) -> None:
        """Admission wanted ``wanted`` grants and rule 1 allowed ``allowed``: start or end a stall."""
        stalled = allowed is not None and wanted > 0 and allowed < wanted
        if stalled and self._stalled_since is None:
            self._stalled_since = now
        elif not stalled and self._stalled_since is not None:
            self._stall_s += max(0.0, now - self._stalled_since)
            self._stalled_since = None

    def holds_batch(
        self,
        t: int,
        leased_starts: Iterable[int],
        ready_starts: Iterable[int],
        size: int | None = None,
    ) -> bool:
        """Rule 2: batch ``t`` waits while taking a younger group would strand a lease in flight.

        That is: for the start ``s`` of some lease, fewer than ``B`` ready groups have ``start <= s``
        (the batch would take a younger one) and more than ``(s + ETA - t) * B`` leases have
        ``start <= s`` (more than batches ``t+1..s+ETA`` can hold). It only waits on leases in
        flight, so it ends once they land or are released.

        Of one dataset of a mixture (``size``: its share of batch ``t``, for ``B``): the same rule on that
        dataset's leases and ready groups alone, since batch ``t`` takes its share of each dataset oldest first.
        Batches ``t+1..s+ETA`` then hold ``(s + ETA - t) * size`` of it: exact while the weights stay, an
        estimate across a ``set_mixture`` change.
        """
        if self.eta is None:
            return False
        leased = sorted(leased_starts)
        ready = sorted(ready_starts)
        size = self.batch_size if size is None else size
        r = 0
        for i, s in enumerate(leased):
            if i + 1 < len(leased) and leased[i + 1] == s:
                continue  # count every lease with this start first
            while r < len(ready) and ready[r] <= s:
                r += 1
            if r >= size:
                return False  # the batch takes B groups with start <= s, and so for every later s
            if i + 1 > (s + self.eta - t) * size:
                return True
        return False

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
