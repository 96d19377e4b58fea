"""The prompt frontier: where every prompt of every open data epoch stands.

Invariant (guarantee 3, "no prompt forgotten"): each prompt ``(data_epoch,
index)`` is at any moment exactly one of

    PENDING    waiting to be leased (fresh, requeued or orphaned)
    LEASED     an agent generates it
    READY      its group is committed on an agent and recorded in the ledger
    DELIVERED  its group is part of a recorded trainer batch
    FILTERED   the dynamic filter rejected its group (with a reason)

Memory per epoch is one byte per prompt plus a cursor and a requeue, so it
does not grow with row content or run length; the epoch's order is a
``Sequence`` computed per position (``common.dataset.epoch_permutation``),
not a list of indices. Per-state tallies are kept as prompts move, so
``counts()`` (the statistics) costs O(epochs), not a pass over the bytes.

Epochs close in order: the oldest open epoch closes once every prompt is DELIVERED or FILTERED, a newer
epoch is open and the caller agrees (the coordinator waits until every batch
holding its prompts was fetched). A closed epoch is never opened again: its
prompts all count as done, and only ``take`` opens a new (latest + 1) epoch.

Pure: no I/O and no clock; ``now`` is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

PENDING, LEASED, READY, DELIVERED, FILTERED = range(5)
STATE_NAMES = ("pending", "leased", "ready", "delivered", "filtered")


class EpochFrontier:
    def __init__(self, data_epoch: int, order: Sequence[int]):
        self.data_epoch = data_epoch
        self.order = order
        self.state = bytearray(len(order))
        self.tally = [len(order), 0, 0, 0, 0]  # prompts per state, kept as they move (stats read it)
        self.cursor = 0
        self.requeue: deque[int] = deque()
        self.orphans: deque[int] = deque()
        self.orphans_not_before = 0.0

    def take(self, now: float) -> int | None:
        # Due orphans first: they have waited longest.
        if self.orphans and now >= self.orphans_not_before:
            while self.orphans:
                index = self.orphans.popleft()
                if self.state[index] == PENDING:
                    return index
        while self.requeue:
            index = self.requeue.popleft()
            if self.state[index] == PENDING:
                return index
        while self.cursor < len(self.order):
            index = self.order[self.cursor]
            self.cursor += 1
            if self.state[index] == PENDING:
                return index
        return None

    @property
    def exhausted(self) -> bool:
        """No fresh prompts left beyond the cursor (requeued ones may remain)."""
        return self.cursor >= len(self.order)

    def move(self, index: int, state: int) -> None:
        """Every state change goes through here, so ``tally`` stays exact."""
        tally = self.tally
        tally[self.state[index]] -= 1
        tally[state] += 1
        self.state[index] = state

    @property
    def finished(self) -> int:
        """DELIVERED + FILTERED."""
        return self.tally[DELIVERED] + self.tally[FILTERED]

    @property
    def complete(self) -> bool:
        return self.finished == len(self.order)


class Frontier:
    def __init__(self, size: int, order_for_epoch: Callable[[int], Sequence[int]]):
        if size <= 0:
            raise ValueError("dataset is empty")
        self.size = size
        self._order_for_epoch = order_for_epoch
        self.epochs: dict[int, EpochFrontier] = {}
        self.floor = 0  # epochs below it are closed
        self.version = 0
        """Counts the calls that may move a cursor or open or close an epoch (``cursors`` is cached on it)."""
        self._cursors: tuple[int, dict[int, int]] = (-1, {})
        self._open(0)

    def _open(self, data_epoch: int) -> EpochFrontier:
        ep = EpochFrontier(data_epoch, self._order_for_epoch(data_epoch))
        self.epochs[data_epoch] = ep
        self.version += 1
        return ep

    def is_open(self, data_epoch: int) -> bool:
        return data_epoch in self.epochs

    def is_closed(self, data_epoch: int) -> bool:
        return data_epoch < self.floor

    def valid(self, data_epoch, index) -> bool:
        """An (epoch, index) pair of the right types and range, in an open epoch."""
        return (
            isinstance(data_epoch, int)
            and isinstance(index, int)
            and not isinstance(index, bool)
            and 0 <= index < self.size
            and data_epoch in self.epochs
        )

    @property
    def latest(self) -> int:
        return max(self.epochs)

    def take(self, now: float, open_new: bool = True) -> tuple[int, int] | None:
        """Lease the next pending prompt: requeued work of older epochs first; once the open epochs
        have none, the first of a new epoch (unless not ``open_new``)."""
        self.version += 1
        for data_epoch in sorted(self.epochs):
            index = self.epochs[data_epoch].take(now)
            if index is not None:
                self.epochs[data_epoch].move(index, LEASED)
                return data_epoch, index
        latest = self.epochs[self.latest]
        if latest.exhausted and open_new:
            nxt = self._open(latest.data_epoch + 1)
            index = nxt.take(now)
            if index is not None:
                nxt.move(index, LEASED)
                return nxt.data_epoch, index
        return None

    def state_of(self, data_epoch: int, index: int) -> int:
        """The prompt's state; every prompt of a closed epoch counts as DELIVERED."""
        ep = self.epochs.get(data_epoch)
        if ep is None:
            if data_epoch < self.floor:
                return DELIVERED
            raise KeyError(f"data epoch {data_epoch} was never opened")
        return ep.state[index]

    def set(self, data_epoch: int, index: int, state: int) -> None:
        ep = self.epochs[data_epoch]
        if ep.state[index] != state:
            ep.move(index, state)

    def release(self, data_epoch: int, index: int) -> None:
        """A lease ended without a result: the prompt is pending again, first in line."""
        ep = self.epochs.get(data_epoch)
        if ep is None or ep.state[index] != LEASED:
            return
        ep.move(index, PENDING)
        ep.requeue.append(index)

    def reopen(self, data_epoch: int, index: int) -> None:
        """Generate it again: a READY or DELIVERED group's payload is lost for good (node retired), or a
        prompt FILTERED for failures turned out to have failed for everyone (a starved rollout)."""
        ep = self.epochs.get(data_epoch)
        if ep is None or ep.state[index] not in (READY, DELIVERED, FILTERED):
            return
        self.set(data_epoch, index, PENDING)
        ep.requeue.append(index)

    def close_finished(self, may_close: Callable[[int], bool] = lambda e: True) -> list[int]:
        """Close complete epochs, oldest first, while ``may_close`` agrees; returns their numbers."""
        closed = []
        while len(self.epochs) > 1:
            oldest = min(self.epochs)
            if not (self.epochs[oldest].complete and may_close(oldest)):
                break
            del self.epochs[oldest]
            self.version += 1
            self.floor = oldest + 1
            closed.append(oldest)
        return closed

    def restore(
        self, cursors: dict[int, int], records: dict[tuple[int, int], int], now: float, orphan_delay: float
    ) -> None:
        """Rebuild after a coordinator restart.

        ``records`` are the ledger's durable states (READY/DELIVERED/FILTERED).
        Prompts below a persisted cursor with no record were leased when the
        coordinator died; their agents may still be generating them, so they
        wait ``orphan_delay`` before being reissued (agents re-registering in
        the meantime adopt them back).
        """
        self.epochs.clear()
        self.version += 1
        opened = sorted(set(cursors) | {e for e, _ in records} or {0})
        for data_epoch in range(opened[0], opened[-1] + 1):
            self._open(data_epoch)
        self.floor = opened[0]
        for (data_epoch, index), state in records.items():
            self.set(data_epoch, index, state)
        for data_epoch, cursor in cursors.items():
            ep = self.epochs[data_epoch]
            ep.cursor = cursor
            ep.orphans_not_before = now + orphan_delay
            ep.orphans.extend(_pending_below(ep, cursor))

    def adopt(self, data_epoch: int, index: int) -> bool:
        """An agent re-registering still generates this prompt: lease it back if still pending."""
        if not self.valid(data_epoch, index):
            return False
        ep = self.epochs[data_epoch]
        if ep.state[index] != PENDING:
            return False
        self.set(data_epoch, index, LEASED)
        return True

    def cursors(self) -> dict[int, int]:
        """Each open epoch's cursor. The same dict until a cursor may have moved: never change it."""
        if self._cursors[0] != self.version:
            self._cursors = (self.version, {e: ep.cursor for e, ep in self.epochs.items()})
        return self._cursors[1]

    def counts(self) -> dict[str, int]:
        """Prompts per state over the open epochs: O(epochs), read from the tallies, not the state bytes."""
        out = dict.fromkeys(STATE_NAMES, 0)
        for ep in self.epochs.values():
            for i, name in enumerate(STATE_NAMES):
                out[name] += ep.tally[i]
        return out


def _pending_below(ep: EpochFrontier, cursor: int) -> list[int]:
    """The PENDING prompts at positions below ``cursor``, in position order.

    Write-ahead leases put every prompt the ledger has a record of below the persisted cursor,
    so exactly ``cursor - (recorded prompts)`` of the positions below it are pending. The search
    runs from the cursor down and stops when it has them all: prompts in flight at a crash are
    mostly the last ones leased, so a restart looks at a few positions past the fleet's
    in-flight count, not at the whole epoch. (At worst, a prompt leased at the epoch's start and
    never finished, it reads every position below the cursor: about 1 us each when shuffled.)
    File order (``range``) needs no order lookups: a scan of the state bytes for PENDING.
    """
    state = ep.state
    missing = cursor - (len(state) - ep.tally[PENDING])
    if missing <= 0:
        return []
    order = ep.order
    if isinstance(order, range) and order == range(len(state)):
        found = []
        pos = state.find(PENDING, 0, cursor)
        while pos >= 0 and len(found) < missing:
            found.append(pos)
            pos = state.find(PENDING, pos + 1, cursor)
        return found
    found = []
    for pos in range(cursor - 1, -1, -1):
        index = order[pos]
        if state[index] == PENDING:
            found.append(index)
            if len(found) == missing:
                break
    found.reverse()
    return found
