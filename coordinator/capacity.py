"""Why no batch can come until something changes: no engine left to generate on.

Pure, read from membership and the weight updates: every agent is gone (all retired), or every
engine that may serve is behind the fleet's weights with no update running to bring it back
(``all_stale``). Waiting batches (coordinator/batches.py) and evaluation passes are answered with the
reason instead of waiting forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine_info import EngineState
from common.weight_step import WeightKind
from coordinator.membership import RETIRED

if TYPE_CHECKING:
    from coordinator.faces import WeightsFace
    from coordinator.membership import Membership

ALL_STALE = (
    "every engine is behind the fleet's weights (stale after a restart): push a weight update "
    "(catch_up to the current version, update_weights or update_weights_from_disk) to bring them back"
)
ALL_PARTIAL = (
    "every engine is out of the pool holding part of a failed weight update ({why}): push a weight update "
    "(catch_up to the current version, update_weights or update_weights_from_disk) to bring them back"
)


class Capacity:
    """Whether any engine is left to generate on."""

    def __init__(self, membership: Membership, weights: WeightsFace):
        self._membership = membership
        self._weights = weights

    def why_none(self) -> str | None:
        """Why no engine can generate anything until something changes (every agent gone, every engine stale);
        None while one may."""
        if self._membership.all_gone():
            return "no agent with a live engine is left to generate on (all retired)"
        if self.all_stale():
            partial = self._weights.partial
            return ALL_PARTIAL.format(why=partial) if partial else ALL_STALE
        return None

    def all_stale(self) -> bool:
        """Every engine that may serve is behind the fleet's weights, and no update runs to bring it back.

        After a broadcast, only a weight update returns a stale engine to the pool (docs/weights.md,
        failure during an update), and no update starts while the trainer waits in ``generate``. A healthy or
        starting engine of an agent that may still speak (alive, or dead but not retired) keeps the wait going.
        """
        weights, membership = self._weights, self._membership
        if weights.locked or weights.log.kind == WeightKind.DISK:
            return False  # after a disk update, agents reload stale engines from the recorded path themselves
        if membership.find("serving", _may_serve) is not None:
            return False
        states = {e.state for r in membership.agents.values() if r.status != RETIRED for e in r.engines}
        return EngineState.STALE in states and not any(s.may_serve for s in states)


def _may_serve(rec) -> bool:
    """A not-retired agent with an engine that is healthy or starting."""
    return rec.status != RETIRED and any(e.state.may_serve for e in rec.engines)
