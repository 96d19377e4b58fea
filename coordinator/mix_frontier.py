"""The training frontier of a mixture: one ``Frontier`` per training source, behind one set of keys.

Each source runs through its own data epochs (a small source opens its next epoch while a large one
is still in its first), exactly once per ``(source, data_epoch, index)``. Callers name a prompt
``(key, index)`` with ``key = epoch_key(source, data_epoch)`` (common/mixture.py), so the ledger,
receipts and batches keep their ``(data_epoch, index)`` shape; with one source the keys are its epochs.

Pure, like ``coordinator/frontier.py``, whose invariants hold per source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.mixture import epoch_key, split_key
from coordinator.frontier import LEASED, READY, STATE_NAMES, EpochFrontier, Frontier


class MixFrontier:
    def __init__(self, sizes: list[int], order_for: Callable[[int, int, int], Sequence[int]]):
        """``order_for(source, size, data_epoch)``: the source's prompt order in that epoch."""
        self.parts = [Frontier(size, lambda e, s=s, n=size: order_for(s, n, e)) for s, size in enumerate(sizes)]
        self._keys: dict[int, tuple[Frontier, int]] = {}  # key -> (its part, its epoch), for keys seen valid
        self._cursors: tuple[int, dict[int, int]] = (-1, {})

    # ---------------------------------------------------------------- keys

    def _part(self, key) -> tuple[Frontier | None, int]:
        if type(key) is int:  # not a bool, whose True would find key 1
            hit = self._keys.get(key)
            if hit is not None:
                return hit
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            return None, -1
        s, e = split_key(key)
        if s >= len(self.parts):
            return None, -1
        if len(self._keys) > 4096:  # keys are (source, epoch) pairs: a few per source, unless a peer makes some up
            self._keys.clear()
        self._keys[key] = hit = (self.parts[s], e)
        return hit

    def source_of(self, key: int) -> int:
        return split_key(key)[0]

    @property
    def epochs(self) -> dict[int, EpochFrontier]:
        """Every open epoch of every source, by key."""
        return {epoch_key(s, e): ep for s, part in enumerate(self.parts) for e, ep in part.epochs.items()}

    # ---------------------------------------------------------------- the frontier's interface

    def is_open(self, key) -> bool:
        part, e = self._part(key)
        return part is not None and part.is_open(e)

    def is_closed(self, key) -> bool:
        part, e = self._part(key)
        return part is not None and part.is_closed(e)

    def valid(self, key, index) -> bool:
        part, e = self._part(key)
        return part is not None and part.valid(e, index)

    def take(self, now: float, open_new: bool = True, source: int = 0) -> tuple[int, int] | None:
        """The next prompt of ``source`` (``Frontier.take``), as ``(key, index)``."""
        taken = self.parts[source].take(now, open_new)
        return None if taken is None else (epoch_key(source, taken[0]), taken[1])

    def state_of(self, key: int, index: int) -> int:
        part, e = self._part(key)
        if part is None:
            raise KeyError(f"data epoch key {key} names no training source")
        return part.state_of(e, index)

    def set(self, key: int, index: int, state: int) -> None:
        part, e = self._part(key)
        part.set(e, index, state)

    def release(self, key: int, index: int) -> None:
        part, e = self._part(key)
        if part is not None:
            part.release(e, index)

    def reopen(self, key: int, index: int) -> None:
        part, e = self._part(key)
        if part is not None:
            part.reopen(e, index)

    def adopt(self, key, index) -> bool:
        part, e = self._part(key)
        return part is not None and part.adopt(e, index)

    def close_finished(self, may_close: Callable[[int], bool] = lambda k: True) -> list[int]:
        closed = []
        for s, part in enumerate(self.parts):
            closed += [epoch_key(s, e) for e in part.close_finished(lambda e, s=s: may_close(epoch_key(s, e)))]
        return closed

    def restore(
        self, cursors: dict[int, int], records: dict[tuple[int, int], int], now: float, orphan_delay: float
    ) -> None:
        by_source: list[tuple[dict, dict]] = [({}, {}) for _ in self.parts]
        for key, cursor in cursors.items():
            s, e = split_key(key)
            if s < len(self.parts):
                by_source[s][0][e] = cursor
        for (key, index), state in records.items():
            s, e = split_key(key)
            if s < len(self.parts):
                by_source[s][1][(e, index)] = state
        for part, (c, r) in zip(self.parts, by_source, strict=True):
            if c or r:
                part.restore(c, r, now, orphan_delay)

    def cursors(self) -> dict[int, int]:
        """Every cursor by key; the same dict until one may have moved (never change it)."""
        version = sum(part.version for part in self.parts)
        if self._cursors[0] != version:
            out = {epoch_key(s, e): c for s, part in enumerate(self.parts) for e, c in part.cursors().items()}
            self._cursors = (version, out)
        return self._cursors[1]

    def counts(self, source: int | None = None) -> dict[str, int]:
        """Prompts per state over the open epochs, of one source or all."""
        parts = self.parts if source is None else [self.parts[source]]
        out = dict.fromkeys(STATE_NAMES, 0)
        for part in parts:
            for name, n in part.counts().items():
                out[name] += n
        return out

    def outstanding(self, source: int) -> int:
        """Prompts of ``source`` leased or ready (from the tallies: O(open epochs))."""
        return sum(ep.tally[LEASED] + ep.tally[READY] for ep in self.parts[source].epochs.values())
