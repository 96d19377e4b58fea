"""The engines as the weights executor sees them (docs/weights.md): what each holds, and the verbs that
move one in or out of the pool. Shared by the disk path (agent/weight_disk.py), the broadcast path
(agent/weight_broadcast.py) and the executor (agent/weights.py).

Kept per engine: the version it reports (``versions``), whether it is up but not on the fleet's
weights (``stale``), whether the open update paused it or sent it weights (``paused``, ``touched``),
whether it was sent down as hung (``lost``, until prepared again), the trainer's group it joined
(``group``), a group it did not leave (``held``) and the weight-update session we opened on it
(``sessions``).

``fleet()`` is the weights every engine must hold: the agent core's ``current`` (agent/weight_state.py,
the only record of it), or the weights the running step reached (``land``) until its
``WeightsStepDone`` hands them to the core, so that an engine restarting meanwhile is brought to them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.engine_client import parse_version
from agent.events import EngineVersion, WeightsRecord
from agent.supervisor import EngineSupervisor
from agent.weight_calls import EngineCalls
from common.engine_info import EngineState
from common.errors import EngineError

log = logging.getLogger("rollfleet.agent.weights")


class WeightEngines:
    def __init__(
        self,
        supervisor: EngineSupervisor,
        calls: EngineCalls,
        dispatch: Callable[[object], None],
        fleet: Callable[[], WeightsRecord],
    ):
        self.supervisor = supervisor
        self.calls = calls
        self._dispatch = dispatch
        self._fleet = fleet
        self.landed: WeightsRecord | None = None  # the running step's weights, until the core has them
        self.versions: dict[str, int | None] = {}
        self.stale: set[str] = set()  # up, but not on the fleet's weights (partial, or behind)
        self.paused: dict[str, str] = {}  # engines the open update paused
        self.touched: set[str] = set()  # engines the open update sent weights to
        self.lost: set[str] = set()  # engines sent down as hung, until they are prepared again
        self.group: dict[str, str] = {}  # engines in the trainer's update group: name -> url
        self.held: dict[str, str] = {}  # engines that did not leave a failed group: name -> group name
        self.sessions: dict[str, str] = {}  # engines with a weight-update session we opened: name -> url
        self._step_restarts: dict[str, int] = {}  # each engine's relaunches when the running step began

    def fleet(self) -> WeightsRecord:
        """The weights every engine must hold (the module docstring says which)."""
        return self.landed if self.landed is not None else self._fleet()

    def land(self, record: WeightsRecord) -> WeightsRecord:
        """The running step reached ``record``: engines are brought to it from now on."""
        self.landed = record
        return record

    def step_begins(self) -> None:
        self.calls.hung.clear()
        self._step_restarts = self.supervisor.restarts()

    def restarted(self, name: str) -> None:
        """The engine (re)started: a new process holds no group, no session, and is no longer going down."""
        self.group.pop(name, None)
        self.held.pop(name, None)
        self.sessions.pop(name, None)
        self.lost.discard(name)
        self.stale.discard(name)

    def set_version(self, name: str, version: int | None) -> None:
        if self.versions.get(name, -1) != version:
            self.versions[name] = version
            self._dispatch(EngineVersion(name, version, self.supervisor.tp(name)))

    def set_serving(self, name: str, serving: bool) -> None:
        (self.stale.discard if serving else self.stale.add)(name)
        self.supervisor.mark(name, EngineState.HEALTHY if serving else EngineState.STALE)

    async def verify(self, name: str, url: str, version: int) -> None:
        """``/model_info`` must say ``str(version)``; EngineError naming the engine otherwise."""
        info = await self.calls.bounded(url, "/model_info", self.calls.client.model_info(url))
        label = info.get("weight_version")
        self.set_version(name, parse_version(label))
        if label != str(version):
            raise EngineError(f"{url} reports weight version {label!r} after the update, expected {str(version)!r}")

    async def continue_paused(self, *, deadline: float | None = None) -> dict[str, str]:
        """Every engine the open update paused continues; ``{name: error}`` of those that did not."""
        paused, self.paused = self.paused, {}
        return await self.calls.each(paused, lambda name, url: self.calls.unpause(url), deadline=deadline)

    async def drop_lost(self, errors: dict[str, str], update_id: int, doing: str) -> set[str]:
        """Take the engines whose process exited, or that were found hung, out of ``errors``: losing an engine
        leaves it out of an update, it does not fail it (the restart brings it to the recorded version). A hung
        one is sent down now (restarted, or for a ``url`` engine probed until it answers, then continued)."""
        names = list(errors)
        dead = await asyncio.gather(*(self.supervisor.died(n) for n in names))
        gone = {n for n, d in zip(names, dead, strict=True) if d}
        restarts = self.supervisor.restarts()
        # Killed and relaunched already within the step: its process is alive again, but it is not the one the
        # step called (its error was a reset connection, not a refusal).
        gone |= {n for n in names if restarts.get(n, 0) != self._step_restarts.get(n, 0)}
        hung, self.calls.hung = self.calls.hung, {}
        for name in names:
            if name in hung and name not in gone:
                gone.add(name)
                self.lose(name, hung[name])
        for name in gone:
            why = errors.pop(name)
            log.warning("engine %s lost %s for weight update %#x: left out: %s", name, doing, update_id, why)
            self.touched.discard(name)
            self.group.pop(name, None)
            self.sessions.pop(name, None)  # a dead process holds none
            self.stale.add(name)
        return gone

    def lose(self, name: str, why: str) -> None:
        """A hung engine goes down (the supervisor restarts it, or probes a ``url`` one) and, once it answers
        again, is continued: it never stays paused by us."""
        url = self.supervisor.urls().get(name)
        self.lost.add(name)
        self.supervisor.fail(name, f"hung in a weight update: {why}")
        if url is not None:
            self.calls.continue_later(name, url)
