"""The engine vocabulary on the wire: ``EngineState`` and the ``EngineInfo`` record.

Part of the protocol: ``common.protocol`` re-exports both, and the messages that carry engines
(``Register``, ``Capacity``, the agent's ``Heartbeat``) declare ``list[EngineInfo]``, so an entry with
an unknown state or a mistyped field is refused at decoding, naming it. The agent's supervisor
(agent/supervisor.py) moves each engine through these states; the coordinator keeps each agent's
last report in its membership (coordinator/membership.py) and shows it in the status unchanged:
the states' values are the strings the status JSON and the metrics always had.
"""

from __future__ import annotations

import enum

from common.wire import Record, record


class EngineState(enum.StrEnum):
    """Where an engine is in its supervisor's life cycle (agent/supervisor.py keeps the transitions)."""

    STARTING = "starting"
    """Launched, no readiness outcome yet."""
    HEALTHY = "healthy"
    """Up, on the fleet's weights: in the pool."""
    STALE = "stale"
    """Up, but behind the fleet's weights: out of the pool, still health-checked (a weight update brings it back)."""
    DOWN = "down"
    """Broken: being restarted (a launched engine) or probed (a ``url`` engine)."""
    RETIRED = "retired"
    """Given up on (its restart budget spent, or it refuses the API key): never touched again."""

    @property
    def up(self) -> bool:
        """Answers its health checks: ``healthy`` or ``stale`` (the engines a broadcast group may hold)."""
        return self in _UP

    @property
    def may_serve(self) -> bool:
        """Serves, or may once its start ends: ``healthy`` or ``starting``."""
        return self in _MAY_SERVE

    @property
    def gone(self) -> bool:
        """Not running: ``down`` or ``retired`` (requests in flight on it will not come back)."""
        return self in _GONE


_UP = frozenset({EngineState.HEALTHY, EngineState.STALE})
_MAY_SERVE = frozenset({EngineState.HEALTHY, EngineState.STARTING})
_GONE = frozenset({EngineState.DOWN, EngineState.RETIRED})


@record
class EngineInfo(Record):
    """One engine of an agent, as the agent reports it (its ``Register``, ``Capacity`` and heartbeats)."""

    name: str
    """The engine's name on its agent (``e0``, ``e1``, ...)."""
    state: EngineState
    """Where its supervisor has it now."""
    url: str = ""
    """Its current URL ("" before it ever came up)."""
    in_flight: int = 0
    """Samples sent to it and not answered yet."""
    tp: int = 1
    """Its tensor-parallel size: the ranks it takes in a weight-update group."""
    version: int | None = None
    """The weight version it serves (None: unknown)."""

    @property
    def serving(self) -> bool:
        """In its agent's pool: ``healthy``."""
        return self.state is EngineState.HEALTHY

    def to_dict(self) -> dict:
        """Its status-JSON entry: the map agents reported before protocol 10, keys in that order."""
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state.value,
            "in_flight": self.in_flight,
            "tp": self.tp,
            "version": self.version,
        }
