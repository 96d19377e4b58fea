"""What the coordinator's pure core asks its I/O shell to do.

    Send(to, msg)        to an agent id (str) or a raw ZeroMQ peer (bytes)
    Persist(ops, then)   write ``ops`` (``coordinator.records`` ledger
                         operations) in one durable transaction, and only
                         after it commits send ``then``

The shell delivers the messages for one destination in the order the core
produced them: a ``Send`` waits behind an earlier ``Persist.then`` message to
the same destination.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import protocol as p
from coordinator.records import LedgerOp


@dataclass(frozen=True, slots=True)
class Send:
    to: str | bytes
    """An agent id (str) or a ZeroMQ peer id (bytes)."""
    msg: p.Message
    with_rows: bool = False
    """A ``Grant`` whose leases still lack their dataset rows: the shell reads each lease's row
    (``prompt``, ``label``, ``metadata``) off the event loop and adds it before sending."""


@dataclass(slots=True)
class Persist:
    ops: list[LedgerOp]
    then: list[Send] = field(default_factory=list)
