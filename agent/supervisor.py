"""The node agent's engine supervisor: health-check engines, restart broken ones.

The agent's request path asks which engines are usable (:meth:`EngineSupervisor.healthy`) and
reports broken connections (:meth:`EngineSupervisor.report_failure`).  Plans and the restart
budget come from :mod:`agent.engine_plan`, children from :mod:`agent.engine_process`; health
probes go through the agent's one :class:`~agent.engine_client.EngineClient`.

Invariants
----------
* Every engine is in exactly one state: ``starting`` (only before its first readiness
  outcome), ``healthy``, ``stale`` (up, but not on the fleet's weights: out of the pool, still
  health-checked), ``down`` (broken, being restarted or probed) or ``retired`` (given up on,
  never touched again).  ``on_change(name, state)`` is called on every transition into
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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.engine_client import EngineClient
from agent.engine_plan import (
    EngineLayout,
    EngineSpec,
    RestartBudget,
    check_positive,
    check_specs,
    layout_from_server_info,
    planned_layout,
    reprobe_delay,
)
from agent.engine_process import KILL_GRACE, EngineProcess, wait_ready
from agent.task_owner import TaskOwner
from common.errors import Closed, EngineError, EngineRejected, EngineStartError, EngineUnavailable, StateError

__all__ = ["EngineSupervisor"]

log = logging.getLogger("rollfleet.agent.supervisor")

STATES = ("starting", "healthy", "stale", "down", "retired")

KEY_HINT = "pass the engines' key with --engine-api-key KEY (or ROLLFLEET_ENGINE_API_KEY in the agent's environment)"


@dataclass(eq=False)
class _Engine:
    spec: EngineSpec
    log_path: Path
    budget: RestartBudget
    state: str = "starting"
    url: str | None = None
    proc: EngineProcess | None = None
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    report: str | None = None
    error: str | None = None
    forced: bool = False  # check at once, whatever the interval
    hung: str | None = None  # found hung by a caller (fail()): down at once, health checks paused or not
    layout: EngineLayout | None = None  # from its /server_info once it answered healthy (None: planned)
    info: dict = dataclasses.field(default_factory=dict)  # that /server_info answer ({}: none)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.exited


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
        on_change: Callable[[str, str], None] | None = None,
        client: EngineClient | None = None,
        prepare: Callable[[str, str], Awaitable[str]] | None = None,
        api_key: str = "",
    ):
        specs = list(specs)
        check_specs(specs)
        check_positive(start_timeout=start_timeout, health_interval=health_interval, health_timeout=health_timeout)
        self._log_dir = Path(log_dir)
        self._start_timeout = float(start_timeout)
        self._health_interval = float(health_interval)
        self._health_timeout = float(health_timeout)
        self._on_change = on_change
        self.prepare = prepare
        self._engines: dict[str, _Engine] = {
            s.name: _Engine(
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
        self._paused = False
        self._pause_epoch = 0

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
            task = self._tasks.spawn(self._engine_main(eng), name=f"engine-{eng.name}")
            # A task cancelled before it ever ran skips _engine_main's finally.
            task.add_done_callback(lambda _t, settled=eng.settled: settled.set())
        await asyncio.gather(*(eng.settled.wait() for eng in self._engines.values()))
        if self._stopping:
            raise Closed("the engine supervisor was stopped during start()")
        if self._failure is not None:
            raise self._failure
        if not any(eng.state == "healthy" for eng in self._engines.values()):
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
            await asyncio.gather(*(self._kill(e, grace=timeout) for e in self._engines.values()))
            for eng in self._engines.values():
                if eng.state != "retired":
                    eng.state = "down"
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
        if eng.state not in ("healthy", "stale") or self._stopping:
            return
        eng.hung = reason
        eng.wake.set()

    def report_failure(self, name: str, reason: str) -> None:
        """The request path saw a connection error on ``name``: check it now."""
        eng = self._engines[name]
        if eng.state != "healthy" or self._stopping:
            return
        log.info("engine %s: failure reported (%s), checking it", name, reason)
        eng.report = reason
        eng.wake.set()

    def pause_health_checks(self) -> None:
        """Stop health probes (e.g. during a weight update).  Idempotent."""
        self._paused = True
        self._pause_epoch += 1

    def resume_health_checks(self, *, force: bool = False) -> None:
        """Resume health probes; overdue or reported checks (every one, with ``force``) run at once.  Idempotent."""
        for eng in self._engines.values():
            eng.forced = eng.forced or force
            if force:
                eng.wake.set()
        if not self._paused:
            return
        self._paused = False
        self._pause_epoch += 1
        for eng in self._engines.values():
            eng.wake.set()

    def healthy(self) -> list[EngineSpec]:
        """Engines usable now, in plan order, as copies carrying their current url."""
        if self._stopping:
            return []
        return [
            dataclasses.replace(e.spec, url=e.url, gpu_ids=list(e.spec.gpu_ids))
            for e in self._engines.values()
            if e.state == "healthy"
        ]

    def urls(self, *states: str) -> dict[str, str]:
        """``{name: current url}`` of the engines in ``states`` (default: healthy or stale), in plan order."""
        states = states or ("healthy", "stale")
        if self._stopping:
            return {}
        return {e.name: e.url for e in self._engines.values() if e.state in states and e.url}

    def alive(self, name: str) -> bool:
        """Whether the engine's process is running (a ``url`` engine: whether it is not known down)."""
        eng = self._engines[name]
        if eng.spec.kind == "url":
            return eng.state in ("healthy", "stale")
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

    def mark(self, name: str, state: str) -> bool:
        """Move a ``healthy`` or ``stale`` engine to ``state`` (one of the two); False if it is in neither."""
        eng = self._engines[name]
        if state not in ("healthy", "stale") or eng.state not in ("healthy", "stale") or self._stopping:
            return False
        self._set_state(eng, state)
        return True

    def state(self, name: str) -> str:
        """``starting``, ``healthy``, ``stale``, ``down`` or ``retired``; KeyError for unknown names."""
        return self._engines[name].state

    def restarts(self) -> dict[str, int]:
        return {name: eng.budget.total for name, eng in self._engines.items()}  # relaunches since the start

    def all_retired(self) -> bool:
        """True once every engine is retired: nothing here will ever generate again."""
        return all(e.state == "retired" for e in self._engines.values())

    def pids(self) -> dict[str, int]:
        """Pids of the live child processes (also their process group ids)."""
        return {e.name: e.proc.pid for e in self._engines.values() if e.proc is not None and e.proc.alive}

    # ------------------------------------------------------------- internals

    def _task_failed(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        if self._run_wake is not None:
            self._run_wake.set()

    def _set_state(self, eng: _Engine, state: str) -> None:
        if eng.state == state:
            return
        eng.state = state
        self._notify(eng, state)

    def _notify(self, eng: _Engine, state: str) -> None:
        if self._on_change is not None:
            try:
                self._on_change(eng.name, state)
            except Exception:
                log.exception("on_change(%r, %r) callback failed", eng.name, state)

    def _went_down(self, eng: _Engine) -> None:
        # A failure reported before the engine went down was about the old process: the
        # restarted one must not answer it (it may be stale, not healthy).
        eng.report = None
        self._set_state(eng, "down")

    def _retire(self, eng: _Engine, why: str) -> None:
        eng.error = why
        log.error("engine %s retired, it will not be restarted: %s", eng.name, why)
        self._set_state(eng, "retired")

    async def _engine_main(self, eng: _Engine) -> None:
        try:
            if eng.spec.kind == "url":
                await self._run_url(eng)
            else:
                await self._run_process(eng)
        finally:
            eng.settled.set()  # also when cancelled or crashed: start() must not wait forever

    async def _run_process(self, eng: _Engine) -> None:
        try:
            await self._launch_and_wait(eng)
        except EngineStartError as e:
            await self._kill(eng)
            self._retire(eng, str(e))
            return
        if not await self._enter(eng):
            return
        eng.settled.set()
        log.info("engine %s %s at %s (pid %d)", eng.name, eng.state, eng.url, eng.proc.pid)
        while True:
            reason = await self._watch(eng)
            log.warning("engine %s down: %s (log: %s)", eng.name, reason, eng.log_path)
            eng.error = reason
            self._went_down(eng)
            await self._kill(eng)
            if not await self._restart(eng) or not await self._enter(eng):
                return
            log.info("engine %s %s again at %s (pid %d)", eng.name, eng.state, eng.url, eng.proc.pid)

    async def _restart(self, eng: _Engine) -> bool:
        """Relaunch ``eng`` within its restart budget: True once healthy, False once retired."""
        budget = eng.budget
        while True:
            delay = budget.next_delay(time.monotonic())
            if delay is None:
                self._retire(
                    eng,
                    f"{budget.recent(time.monotonic())} restart(s) within the last "
                    f"{budget.window:g}s already (max_restarts={budget.max_restarts}); "
                    f"last failure: {eng.error}; log: {eng.log_path}",
                )
                return False
            log.info("engine %s: restarting in %.1fs", eng.name, delay)
            await asyncio.sleep(delay)
            budget.record(time.monotonic())
            try:
                await self._launch_and_wait(eng)
            except EngineStartError as e:
                eng.error = str(e)
                log.warning("engine %s: restart failed: %s", eng.name, e)
                await self._kill(eng)
                continue
            return True

    async def _run_url(self, eng: _Engine) -> None:
        try:
            await self._wait_ready(eng, time.monotonic() + self._start_timeout)
        except EngineStartError as e:
            eng.error = str(e)
            log.error("%s; it will be probed until it answers", e)
            self._set_state(eng, "down")
            eng.settled.set()
            await self._probe_until_up(eng)
        if not await self._enter(eng):
            return
        eng.settled.set()
        log.info("engine %s %s at %s", eng.name, eng.state, eng.url)
        while True:
            reason = await self._watch(eng)
            eng.error = reason
            log.warning("engine %s down: %s", eng.name, reason)
            self._went_down(eng)
            await self._probe_until_up(eng)
            if not await self._enter(eng):
                return
            log.info("engine %s %s again at %s", eng.name, eng.state, eng.url)

    async def _enter(self, eng: _Engine) -> bool:
        """A (re)started engine answered healthy: read its layout, then enter the state ``prepare`` says.

        False if it was retired instead: it refuses ``/server_info`` for want of the API key.
        """
        try:
            await self._read_layout(eng)
        except EngineRejected as exc:
            await self._kill(eng)
            self._retire(eng, f"engine {eng.name}: {exc}")
            return False
        self._set_state(eng, await self._prepared(eng))
        return True

    async def _read_layout(self, eng: _Engine) -> None:
        """``eng.layout`` from its ``/server_info``; the planned one, with a warning, if it does not answer.

        Raises EngineRejected (401/403) for an engine that wants an API key it was not given."""
        assert self._client is not None and eng.url is not None
        planned = planned_layout(eng.spec)
        eng.info = {}
        try:
            info = await self._client.server_info(eng.url)
        except EngineRejected as exc:
            if exc.status in (401, 403):
                why = "refuses the key given" if self.api_key else "wants an API key (the server runs with --api-key)"
                raise EngineRejected(f"{exc}: the engine {why}; {KEY_HINT}", status=exc.status) from None
            info, why = None, str(exc)
        except EngineError as exc:
            info, why = None, str(exc)
        if info is None:
            log.warning("engine %s: no /server_info (%s); taking tp_size=%d, dp_size=1", eng.name, why, planned.tp_size)
            eng.layout = planned
            return
        eng.info = info
        eng.layout = layout_from_server_info(info, planned)
        if eng.spec.kind == "sglang" and eng.layout.tp_size != planned.tp_size:
            log.warning("engine %s: /server_info says tp_size=%d, launched on %d GPU(s)",
                        eng.name, eng.layout.tp_size, planned.tp_size)  # fmt: skip
        if eng.layout != dataclasses.replace(planned, from_server=True):
            log.info("engine %s: %s", eng.name, eng.layout)

    async def _prepared(self, eng: _Engine) -> str:
        """The state a (re)started engine enters: ``prepare`` brings it to the fleet's weights first."""
        if self.prepare is None:
            return "healthy"
        assert eng.url is not None
        return await self.prepare(eng.name, eng.url)

    async def _probe_until_up(self, eng: _Engine) -> None:
        assert eng.url is not None
        attempt = 0
        while True:
            await asyncio.sleep(reprobe_delay(attempt, self._health_interval))
            attempt += 1
            if self._paused:
                continue
            epoch = self._pause_epoch
            ok, _ = await self._probe(eng.url, self._health_timeout)
            if ok and epoch == self._pause_epoch:
                return

    async def _launch_and_wait(self, eng: _Engine) -> None:
        deadline = time.monotonic() + self._start_timeout
        eng.url = eng.spec.url if eng.spec.kind != "sim" else None
        eng.proc = await EngineProcess.launch(eng.spec, eng.log_path, on_exit=eng.wake.set)
        log.info("engine %s launched (pid %d), log %s", eng.name, eng.proc.pid, eng.log_path)
        await self._wait_ready(eng, deadline)

    async def _wait_ready(self, eng: _Engine, deadline: float) -> None:
        """Until ``eng`` answers healthy (and its URL is known); EngineStartError otherwise."""
        eng.url = await wait_ready(
            eng.name,
            eng.url,
            eng.proc,
            self._probe,
            deadline=deadline,
            start_timeout=self._start_timeout,
            health_timeout=self._health_timeout,
        )

    async def _watch(self, eng: _Engine) -> str:
        """Return (a reason) when the healthy engine ``eng`` is found broken."""
        next_check = time.monotonic() + self._health_interval
        while True:
            if eng.exited:
                return f"process exited with {eng.proc.describe_exit()}"
            if eng.hung is not None:
                why, eng.hung = eng.hung, None
                return why
            now = time.monotonic()
            if not self._paused and (eng.report is not None or eng.forced or now >= next_check):
                reported, eng.report, eng.forced = eng.report, None, False
                epoch = self._pause_epoch
                assert eng.url is not None
                ok, detail = await self._probe(eng.url, self._health_timeout)
                next_check = time.monotonic() + self._health_interval
                if eng.exited:
                    continue
                if self._paused or epoch != self._pause_epoch:
                    continue  # overlapped a pause: the answer means nothing
                if not ok:
                    why = f"health check failed: {detail}"
                    if reported:
                        why += f" (after a reported failure: {reported})"
                    return why
                if reported and eng.state == "healthy":
                    log.info("engine %s passed its health check after a reported failure (%s)", eng.name, reported)
                    # The reporter may have stopped using it meanwhile: say it is fine. A stale
                    # engine stays out of the pool: it answers health checks on the wrong weights.
                    self._notify(eng, "healthy")
                continue
            eng.wake.clear()
            timeout = None if self._paused else max(0.0, next_check - now)
            try:
                async with asyncio.timeout(timeout):
                    await eng.wake.wait()
            except TimeoutError:
                pass

    async def _probe(self, url: str, timeout: float) -> tuple[bool, str]:
        """One GET /health_generate through the shared client: (healthy, what happened)."""
        assert self._client is not None
        try:
            await self._client.health(url, timeout=timeout)
        except EngineUnavailable as e:
            return False, str(e)
        return True, "HTTP 200"

    async def _kill(self, eng: _Engine, grace: float = KILL_GRACE) -> None:
        """Kill the engine's process group (SIGTERM, SIGKILL after ``grace``) and forget it."""
        proc = eng.proc
        if proc is None:
            return
        await proc.kill(grace)
        if eng.proc is proc:
            eng.proc = None
