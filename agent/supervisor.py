"""The node agent's engine supervisor: health-check engines, restart broken ones.

The agent's request path asks which engines are usable (:meth:`EngineSupervisor.healthy`) and
reports broken connections (:meth:`EngineSupervisor.report_failure`).  Plans and the restart
budget come from :mod:`agent.engine_plan`, children from :mod:`agent.engine_process`; health
probes go through the agent's one :class:`~agent.engine_client.EngineClient`.  Each engine's own
life (launch, readiness, layout, weights, health watch, restart or probe) runs in its task,
:class:`~agent.engine_lifecycle.EngineLifecycle`; this module is the node's face of them: start
and stop, the queries, failure reports and the pause of health checks.

Invariants
----------
* Every engine is in exactly one :class:`~common.engine_info.EngineState`: ``starting`` (only
  before its first readiness outcome), ``healthy``, ``stale`` (up, but not on the fleet's
  weights: out of the pool, still health-checked), ``down`` (broken, being restarted or probed)
  or ``retired`` (given up on, never touched again).  ``on_change(name, state)`` is called on every transition into
  ``healthy``, ``stale``, ``down`` and ``retired``; a ``healthy`` verdict after a reported
  failure is repeated only while the engine is ``healthy``, and a report does not outlive the
  process it was about.
* :meth:`healthy` lists an engine exactly while its state is ``healthy``, with its *current*
  URL.  A (re)started engine has its launch-time weights: before it is ``healthy`` the
  ``prepare(name, url)`` hook (agent/weights.py) brings it to the fleet's version and says
  whether it is ``healthy`` or ``stale``; :meth:`mark` moves it between the two later.
* Readiness is an event, not a sleep (:func:`~agent.engine_process.wait_ready`): a child that
  exits during start fails at once with its exit code and log tail.
* An engine whose *first* start fails (exit, or not healthy within ``start_timeout``) is
  retired; :meth:`start` raises :class:`~common.errors.EngineStartError` only when no engine
  became healthy (a ``url`` engine not up yet is marked ``down`` and probed).
* A healthy engine goes ``down`` when its process exits or a health check fails (non-200 or
  no answer within ``health_timeout``).  Its process group is killed and it is restarted as
  :class:`~agent.engine_plan.RestartBudget` allows (0.5 s doubling, capped at 30 s; more than
  ``max_restarts`` within ``restart_window`` seconds retires it).  A down ``url`` engine is
  probed with backoff until it answers; it is never retired.
* Structured concurrency: one task per engine, named ``engine-<name>``, owned by the
  supervisor's task owner; :meth:`stop` cancels and awaits them, then kills every process
  group.  Cancellation is always re-raised.  All timing uses ``time.monotonic()``.
* Once an engine answers healthy, and before ``prepare``, its ``/server_info`` (fallback
  ``/get_server_info``) gives its parallel layout (:meth:`layout`, :meth:`tp`, :meth:`dp`), read
  again at every (re)start: a ``url`` engine may come back as another server. An engine that does
  not answer it keeps the planned layout (tp 1 but for ``sglang`` engines) with a warning; one
  that refuses it for want of the API key (HTTP 401/403) is retired with an error naming
  ``--engine-api-key``: no retry can fix a missing key.
* Health checks can be paused around weight updates (a paused SGLang server fails
  ``/health_generate``); results of checks that overlapped a pause are discarded.
  Process-exit detection keeps running while paused; resuming with ``force`` checks every
  engine at once.

All methods must be called from the event loop thread that ran :meth:`start`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from agent.engine_client import EngineClient
from agent.engine_lifecycle import EngineLifecycle, HealthGate, SupervisedEngine, Timing, kill
from agent.engine_plan import EngineLayout, EngineSpec, RestartBudget, check_positive, check_specs, planned_layout
from agent.task_owner import TaskOwner
from common.engine_info import EngineState
from common.errors import Closed, EngineStartError, StateError

__all__ = ["EngineSupervisor"]

log = logging.getLogger("rollfleet.agent.supervisor")


class EngineSupervisor:
    """Launches, health-checks and restarts the engines of one node.

    ``client`` is the agent's engine client, shared so that health probes and
    requests use one session; without one the supervisor makes its own at
    :meth:`start` and closes it at :meth:`stop` (a client passed in is left open).

    Usage::

        sup = EngineSupervisor(plan_engines("sim", count=2), log_dir=Path("logs"))  # agent.engine_plan
        try:
            await sup.start()          # raises EngineStartError if none came up
            await sup.run()            # until stop(); engines are watched from start()
        finally:
            await sup.stop()
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        log_dir: Path,
        start_timeout: float = 600.0,
        health_interval: float = 5.0,
        health_timeout: float = 20.0,
        max_restarts: int = 3,
        restart_window: float = 600.0,
        on_change: Callable[[str, EngineState], None] | None = None,
        client: EngineClient | None = None,
        prepare: Callable[[str, str], Awaitable[EngineState | str]] | None = None,
        api_key: str = "",
    ):
        specs = list(specs)
        check_specs(specs)
        check_positive(start_timeout=start_timeout, health_interval=health_interval, health_timeout=health_timeout)
        self._log_dir = Path(log_dir)
        self._timing = Timing(float(start_timeout), float(health_interval), float(health_timeout))
        self._on_change = on_change
        self.prepare = prepare
        self._engines: dict[str, SupervisedEngine] = {
            s.name: SupervisedEngine(
                spec=s, log_path=self._log_dir / f"{s.name}.log", budget=RestartBudget(max_restarts, restart_window)
            )
            for s in specs
        }
        self.api_key = api_key
        """``--engine-api-key``: the supervisor's own client sends it (a client passed in must carry it already)."""
        self._client = client
        self._own_client = client is None
        self._tasks: TaskOwner | None = None
        self._started = False
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._run_wake: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._gate = HealthGate()

    # ---------------------------------------------------------------- public

    async def start(self) -> None:
        """Launch every engine and wait (in parallel) for each one's first outcome.

        Engines that fail to start are retired (``url`` engines: marked down
        and probed).  Raises EngineStartError, after cleaning up, only if no
        engine at all became healthy.
        """
        if self._stopping:
            raise Closed("the engine supervisor was stopped")
        if self._started:
            raise StateError("EngineSupervisor.start() was already called")
        self._started = True
        self._stopped = asyncio.Event()
        self._run_wake = asyncio.Event()
        self._log_dir.mkdir(parents=True, exist_ok=True)
        if self._client is None:
            self._client = EngineClient(api_key=self.api_key)
        self._tasks = TaskOwner(self._task_failed)
        for eng in self._engines.values():
            eng.url = eng.spec.url if eng.spec.kind != "sim" else None
            life = EngineLifecycle(
                eng,
                timing=self._timing,
                gate=self._gate,
                client=self._client,
                set_state=self._set_state,
                notify=self._notify,
                prepare=self._prepared,
                api_key=self.api_key,
            )
            task = self._tasks.spawn(life.run(), name=f"engine-{eng.name}")
            # A task cancelled before it ever ran skips _engine_main's finally.
            task.add_done_callback(lambda _t, settled=eng.settled: settled.set())
        await asyncio.gather(*(eng.settled.wait() for eng in self._engines.values()))
        if self._stopping:
            raise Closed("the engine supervisor was stopped during start()")
        if self._failure is not None:
            raise self._failure
        if not any(eng.state is EngineState.HEALTHY for eng in self._engines.values()):
            errors = "\n".join(
                f"- {eng.error or f'engine {eng.name!r} is {eng.state}'}" for eng in self._engines.values()
            )
            await self.stop()
            raise EngineStartError(f"no engine became healthy:\n{errors}")
        log.info("engines up: %s", ", ".join(f"{e.name}={e.state}" for e in self._engines.values()))

    async def run(self) -> None:
        """Supervise until :meth:`stop`.

        Engines are already watched from :meth:`start` on; this is the
        supervisor's lifetime for the agent's task group.  It re-raises an
        unexpected failure of an engine task (a bug), after logging it.
        """
        if not self._started:
            raise StateError("EngineSupervisor.run() before start()")
        assert self._run_wake is not None
        while not self._stopping:
            if self._failure is not None:
                raise self._failure
            self._run_wake.clear()
            await self._run_wake.wait()
        if self._failure is not None:
            raise self._failure

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel the engine tasks, then SIGTERM every process group and SIGKILL
        it after ``timeout`` seconds.  Idempotent; concurrent calls wait for
        the first.  No on_change callbacks are made; every engine that is not
        retired reads as ``down`` afterwards."""
        if self._stopping:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._stopping = True
        if self._stopped is None:  # never started
            return
        assert self._run_wake is not None and self._tasks is not None
        self._run_wake.set()
        try:
            await self._tasks.aclose()
            await asyncio.gather(*(kill(e, grace=timeout) for e in self._engines.values()))
            for eng in self._engines.values():
                if eng.state is not EngineState.RETIRED:
                    eng.state = EngineState.DOWN
        finally:
            for eng in self._engines.values():
                if eng.proc is not None:  # only if this stop() was itself cancelled midway
                    eng.proc.kill_now()
            self._stopped.set()
            if self._own_client and self._client is not None:
                await self._client.close()
        log.info("engine supervisor stopped")

    def fail(self, name: str, reason: str) -> None:
        """``name`` was found hung (no answer to a call within its deadline): it goes down now, whatever its state
        and paused health checks, and is restarted (``url``: probed until it answers) as a dead one is."""
        eng = self._engines[name]
        if not eng.state.up or self._stopping:
            return
        eng.hung = reason
        eng.wake.set()

    def report_failure(self, name: str, reason: str) -> None:
        """The request path saw a connection error on ``name``: check it now."""
        eng = self._engines[name]
        if eng.state is not EngineState.HEALTHY or self._stopping:
            return
        log.info("engine %s: failure reported (%s), checking it", name, reason)
        eng.report = reason
        eng.wake.set()

    def pause_health_checks(self) -> None:
        """Stop health probes (e.g. during a weight update).  Idempotent."""
        self._gate.pause()

    def resume_health_checks(self, *, force: bool = False) -> None:
        """Resume health probes; overdue or reported checks (every one, with ``force``) run at once.  Idempotent."""
        for eng in self._engines.values():
            eng.forced = eng.forced or force
            if force:
                eng.wake.set()
        if not self._gate.resume():
            return
        for eng in self._engines.values():
            eng.wake.set()

    def healthy(self) -> list[EngineSpec]:
        """Engines usable now, in plan order, as copies carrying their current url."""
        if self._stopping:
            return []
        return [
            dataclasses.replace(e.spec, url=e.url, gpu_ids=list(e.spec.gpu_ids))
            for e in self._engines.values()
            if e.state is EngineState.HEALTHY
        ]

    def urls(self, *states: EngineState | str) -> dict[str, str]:
        """``{name: current url}`` of the engines in ``states`` (default: up, healthy or stale), in plan order."""
        if self._stopping:
            return {}
        wanted = {EngineState(s) for s in states} if states else {s for s in EngineState if s.up}
        return {e.name: e.url for e in self._engines.values() if e.state in wanted and e.url}

    def alive(self, name: str) -> bool:
        """Whether the engine's process is running (a ``url`` engine: whether it is not known down)."""
        eng = self._engines[name]
        if eng.spec.kind == "url":
            return eng.state.up
        return eng.proc is not None and not eng.proc.exited

    async def died(self, name: str, within: float = 1.0) -> bool:
        """Whether the engine's process has exited, waiting up to ``within`` seconds for the exit to be
        reported (an HTTP call to a killed engine can fail before the child watcher reaps it)."""
        eng = self._engines[name]
        if eng.spec.kind == "url" or eng.proc is None:
            return not self.alive(name)
        return await eng.proc.wait_exited(within)

    def layout(self, name: str) -> EngineLayout:
        """The engine's parallel layout: from its ``/server_info`` once it answered one, else as planned."""
        eng = self._engines[name]
        return eng.layout if eng.layout is not None else planned_layout(eng.spec)

    def server_info(self, name: str) -> dict:
        """The engine's last ``/server_info`` answer, read when it last came up ({} if it gave none)."""
        return self._engines[name].info

    def tp(self, name: str) -> int:
        """The engine's tensor-parallel size (the ranks it takes in a weight-update group): its
        ``/server_info`` ``tp_size``; before that, or if it never said, its GPUs (1 for sim, hf, url)."""
        return self.layout(name).tp_size

    def dp(self, name: str) -> int:
        """The engine's data-parallel size (``/server_info`` ``dp_size``; 1 when it does not say)."""
        return self.layout(name).dp_size

    def mark(self, name: str, state: EngineState | str) -> bool:
        """Move a ``healthy`` or ``stale`` engine to ``state`` (one of the two); False if it is in neither."""
        eng = self._engines[name]
        state = EngineState(state)
        if not state.up or not eng.state.up or self._stopping:
            return False
        self._set_state(eng, state)
        return True

    def state(self, name: str) -> EngineState:
        """The engine's state; KeyError for unknown names."""
        return self._engines[name].state

    def restarts(self) -> dict[str, int]:
        return {name: eng.budget.total for name, eng in self._engines.items()}  # relaunches since the start

    def all_retired(self) -> bool:
        """True once every engine is retired: nothing here will ever generate again."""
        return all(e.state is EngineState.RETIRED for e in self._engines.values())

    def pids(self) -> dict[str, int]:
        """Pids of the live child processes (also their process group ids)."""
        return {e.name: e.proc.pid for e in self._engines.values() if e.proc is not None and e.proc.alive}

    # ------------------------------------------------------------- internals

    def _task_failed(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        if self._run_wake is not None:
            self._run_wake.set()

    def _set_state(self, eng: SupervisedEngine, state: EngineState) -> None:
        if eng.state is state:
            return
        eng.state = state
        self._notify(eng, state)

    def _notify(self, eng: SupervisedEngine, state: EngineState) -> None:
        if self._on_change is not None:
            try:
                self._on_change(eng.name, state)
            except Exception:
                log.exception("on_change(%r, %r) callback failed", eng.name, state)

    async def _prepared(self, eng: SupervisedEngine) -> EngineState:
        """The state a (re)started engine enters: ``prepare`` brings it to the fleet's weights first."""
        if self.prepare is None:
            return EngineState.HEALTHY
        assert eng.url is not None
        return EngineState(await self.prepare(eng.name, eng.url))
