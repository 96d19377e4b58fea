"""The receipts the coordinator has not answered yet, and when each was last sent. Pure.

Mirrors the store's outbox (agent/store.py) for sending: the store keeps a
receipt durable until its ack, this table decides when to say it (again).

Invariants:
- A receipt leaves the table only when the coordinator answered it (a
  ReceiptAck, or an ack in the Welcome); it is never dropped unanswered.
- ``sent_at`` is the time it was last sent under the current session, None
  if not yet: a Welcome sends every receipt it did not answer, and a receipt
  unanswered for a TTL after it was sent is sent again (a lost ack). The
  coordinator dedupes a resent receipt by its key.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.events import PendingReceipt


@dataclass(slots=True)
class OutboxEntry:
    receipt: PendingReceipt
    sent_at: float | None = None


class Outbox:
    def __init__(self):
        self._entries: dict[str, OutboxEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def recover(self, receipt: PendingReceipt) -> None:
        """A receipt read back from the store (a new one, or one already known here)."""
        self._entries.setdefault(receipt.key, OutboxEntry(receipt))

    def add(self, receipt: PendingReceipt, sent_at: float | None) -> None:
        """A group was just committed; its receipt was sent at ``sent_at`` (None: no session to send it)."""
        self._entries[receipt.key] = OutboxEntry(receipt, sent_at)

    def answer(self, key: str) -> None:
        self._entries.pop(key, None)

    def send_all(self, now: float) -> list[PendingReceipt]:
        """Every receipt, marked sent at ``now`` (a new session: none was sent under it)."""
        for entry in self._entries.values():
            entry.sent_at = now
        return [entry.receipt for entry in self._entries.values()]

    def due(self, now: float, ttl: float) -> list[PendingReceipt]:
        """Receipts sent more than ``ttl`` ago and still unanswered, marked sent again at ``now``."""
        out = []
        for entry in self._entries.values():
            if entry.sent_at is not None and now - entry.sent_at > ttl:
                entry.sent_at = now
                out.append(entry.receipt)
        return out
