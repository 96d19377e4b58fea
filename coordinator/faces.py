"""The narrow faces roles see of parts they do not own, where the part is a whole role.

A role is handed, in its constructor, what it owns and what it may ask of others (coordinator/core.py
wires them). Most parts are small records handed as they are (the lease book, membership, the mixture's
frontier, the counters). Where the part is a role of its own, the one taking it sees only the few verbs
named here, so that it neither reaches into the role's state nor imports the role's module:

- ``WeightsFace``: what admission, the trainer sessions and the capacity check ask of the weight
  updates (coordinator/weights.py): the weight log, whether an update holds the lock, and the verbs
  that tell it an agent registered or a trainer left, and that hand it a trainer's request or an
  agent's report once the sender's session was checked (the weight updates see neither role).
- ``PauseFace``: whether the trainer has admission paused (admission puts it in each Welcome).

Types only: nothing here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from common import protocol as p
    from coordinator.effects import Send
    from coordinator.membership import AgentRecord
    from coordinator.records import WeightLog

__all__ = ["PauseFace", "WeightsFace"]


class WeightsFace(Protocol):
    log: WeightLog
    """The fleet's weights as recorded (versions, updates pushed, each update's lease boundary)."""
    partial: str
    """Why engines may hold part of a failed update; "" once an update completes."""

    @property
    def locked(self) -> bool:
        """An update holds the weight lock."""

    def none_current(self, engines: list) -> bool:
        """None of ``engines`` that serve holds the fleet's weights (the agent can start no lease)."""

    def note_engines(self, engines: list) -> list:
        """A registering agent's engines: ledger operations if they report newer weights than the log."""

    def on_register(self, agent_id: str, now: float) -> list[Send]:
        """An agent registered: the update steps it must take part in, behind its Welcome."""

    def trainer_gone(self, session: int, why: str, now: float) -> list:
        """Trainer session ``session`` was replaced or detached: its update, if any, is aborted."""

    def on_request(self, peer: bytes, msg: p.Message, holder: str, now: float) -> list:
        """A weight request of the current trainer session, whose client ``holder`` holds a lock it takes."""

    def on_report(self, rec: AgentRecord, msg: p.WeightsReport, now: float) -> list:
        """A weight step's report from agent ``rec``'s current session."""


class PauseFace(Protocol):
    paused: bool
    """The trainer paused admission (durably)."""
