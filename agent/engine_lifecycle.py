"""The life of one supervised engine: launch, readiness, layout, weights, health watch, restart or probe.

:class:`EngineLifecycle` is the body of one engine's task (``engine-<name>``, owned by the
:class:`~agent.supervisor.EngineSupervisor`). It works on its own :class:`SupervisedEngine` record and
uses the supervisor through a narrow face handed to its constructor: ``set_state`` (every transition,
which the supervisor reports through its ``on_change``), ``notify`` (a verdict repeated without a
transition), ``prepare`` (bring a (re)started engine to the fleet's weights, answering ``healthy`` or
``stale``) and the :class:`HealthGate` the supervisor pauses around weight updates.

The life cycle (the supervisor's docstring states the invariants):

    launched engine:  launch -> wait_ready -> layout -> prepare -> watch --broken--> down -> kill
                         ^                                                               |
                         +------------- restart within the RestartBudget, else retired --+
    url engine:       wait_ready (else down, probed until it answers) -> layout -> prepare -> watch
                      --broken--> down -> probe until it answers -> layout -> ...   (never retired)

An engine that refuses ``/server_info`` for want of the API key is retired at ``layout``; a launched
engine whose *first* start fails is retired at once. A restart that cannot write the engine's log (a full disk)
is charged to no budget and tried again every ``LOG_SPACE_RETRY`` seconds until space is back. Cancellation is
always re-raised; all timing uses ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agent.engine_client import EngineClient
from agent.engine_plan import (
    EngineLayout,
    EngineSpec,
    RestartBudget,
    layout_from_server_info,
    planned_layout,
    reprobe_delay,
)
from agent.engine_process import KILL_GRACE, EngineProcess, wait_ready
from common.engine_info import EngineState
from common.errors import EngineError, EngineLogUnwritable, EngineRejected, EngineStartError, EngineUnavailable

log = logging.getLogger("rollfleet.agent.supervisor")

LOG_SPACE_RETRY = 2.0
"""Seconds between restarts of an engine whose log cannot be written (a full disk), charged to no budget."""
LOG_SPACE_WARN_EVERY = 60.0
"""The same unwritable-log failure is warned about at most this often while it lasts."""
KEY_HINT = "pass the engines' key with --engine-api-key KEY (or ROLLFLEET_ENGINE_API_KEY in the agent's environment)"


@dataclass(eq=False)
class SupervisedEngine:
    """One engine of the node and everything its supervisor knows of it."""

    spec: EngineSpec
    log_path: Path
    budget: RestartBudget
    state: EngineState = EngineState.STARTING
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


class HealthGate:
    """Whether health probes run now. ``epoch`` moves at every pause and resume: a probe whose epoch changed
    while it ran overlapped a pause, and its answer means nothing (a paused SGLang fails ``/health_generate``)."""

    def __init__(self):
        self.paused = False
        self.epoch = 0

    def pause(self) -> None:
        self.paused = True
        self.epoch += 1

    def resume(self) -> bool:
        """Probes run again; False if they were not paused."""
        if not self.paused:
            return False
        self.paused = False
        self.epoch += 1
        return True


@dataclass(frozen=True)
class Timing:
    """The supervisor's bounds (seconds)."""

    start_timeout: float
    """An engine has this long to answer healthy after its launch."""
    health_interval: float
    """Between health checks."""
    health_timeout: float
    """A health probe without an answer within this is a failed one (the engine counts as hung)."""


async def kill(eng: SupervisedEngine, grace: float = KILL_GRACE) -> None:
    """Kill the engine's process group (SIGTERM, SIGKILL after ``grace``) and forget it."""
    proc = eng.proc
    if proc is None:
        return
    await proc.kill(grace)
    if eng.proc is proc:
        eng.proc = None


class EngineLifecycle:
    def __init__(
        self,
        eng: SupervisedEngine,
        *,
        timing: Timing,
        gate: HealthGate,
        client: EngineClient,
        set_state: Callable[[SupervisedEngine, EngineState], None],
        notify: Callable[[SupervisedEngine, EngineState], None],
        prepare: Callable[[SupervisedEngine], Awaitable[EngineState]],
        api_key: str = "",
    ):
        self.eng = eng
        self._timing = timing
        self._gate = gate
        self._client = client
        self._set_state = set_state
        self._notify = notify
        self._prepare = prepare
        self._api_key = api_key
        self._log_warned = -LOG_SPACE_WARN_EVERY  # when the last unwritable-log warning went out

    async def run(self) -> None:
        eng = self.eng
        try:
            if eng.spec.kind == "url":
                await self._run_url()
            else:
                await self._run_process()
        finally:
            eng.settled.set()  # also when cancelled or crashed: start() must not wait forever

    # ---------------------------------------------------------------- transitions

    def _went_down(self) -> None:
        # A failure reported before the engine went down was about the old process: the
        # restarted one must not answer it (it may be stale, not healthy).
        self.eng.report = None
        self._set_state(self.eng, EngineState.DOWN)

    def _retire(self, why: str) -> None:
        self.eng.error = why
        log.error("engine %s retired, it will not be restarted: %s", self.eng.name, why)
        self._set_state(self.eng, EngineState.RETIRED)

    # ---------------------------------------------------------------- launched engines

    async def _run_process(self) -> None:
        eng = self.eng
        try:
            await self._launch_and_wait()
        except EngineStartError as e:
            await kill(eng)
            self._retire(str(e))
            return
        if not await self._enter():
            return
        eng.settled.set()
        log.info("engine %s %s at %s (pid %d)", eng.name, eng.state, eng.url, eng.proc.pid)
        while True:
            reason = await self._watch()
            log.warning("engine %s down: %s (log: %s)", eng.name, reason, eng.log_path)
            eng.error = reason
            self._went_down()
            await kill(eng)
            if not await self._restart() or not await self._enter():
                return
            log.info("engine %s %s again at %s (pid %d)", eng.name, eng.state, eng.url, eng.proc.pid)

    async def _restart(self) -> bool:
        """Relaunch the engine within its restart budget: True once healthy, False once retired."""
        eng = self.eng
        budget = eng.budget
        while True:
            delay = budget.next_delay(time.monotonic())
            if delay is None:
                self._retire(
                    f"{budget.recent(time.monotonic())} restart(s) within the last "
                    f"{budget.window:g}s already (max_restarts={budget.max_restarts}); "
                    f"last failure: {eng.error}; log: {eng.log_path}",
                )
                return False
            log.info("engine %s: restarting in %.1fs", eng.name, delay)
            await asyncio.sleep(delay)
            budget.record(time.monotonic())
            try:
                await self._launch_and_wait()
            except EngineLogUnwritable as e:
                # The disk under its log is full (or read-only): no engine started, so no restart is charged (a disk
                # full for a while must not retire the engine); tried again every few seconds until space is back.
                budget.refund()
                now = time.monotonic()
                if str(e) != eng.error or now - self._log_warned > LOG_SPACE_WARN_EVERY:
                    log.warning("engine %s: restart failed, retrying until space is back: %s", eng.name, e)
                    self._log_warned = now
                eng.error = str(e)
                await kill(eng)
                await asyncio.sleep(LOG_SPACE_RETRY)
                continue
            except EngineStartError as e:
                eng.error = str(e)
                log.warning("engine %s: restart failed: %s", eng.name, e)
                await kill(eng)
                continue
            return True

    async def _launch_and_wait(self) -> None:
        eng = self.eng
        deadline = time.monotonic() + self._timing.start_timeout
        eng.url = eng.spec.url if eng.spec.kind != "sim" else None
        eng.proc = await EngineProcess.launch(eng.spec, eng.log_path, on_exit=eng.wake.set)
        log.info("engine %s launched (pid %d), log %s", eng.name, eng.proc.pid, eng.log_path)
        await self._wait_ready(deadline)

    # ---------------------------------------------------------------- url engines

    async def _run_url(self) -> None:
        eng = self.eng
        try:
            await self._wait_ready(time.monotonic() + self._timing.start_timeout)
        except EngineStartError as e:
            eng.error = str(e)
            log.error("%s; it will be probed until it answers", e)
            self._set_state(eng, EngineState.DOWN)
            eng.settled.set()
            await self._probe_until_up()
        if not await self._enter():
            return
        eng.settled.set()
        log.info("engine %s %s at %s", eng.name, eng.state, eng.url)
        while True:
            reason = await self._watch()
            eng.error = reason
            log.warning("engine %s down: %s", eng.name, reason)
            self._went_down()
            await self._probe_until_up()
            if not await self._enter():
                return
            log.info("engine %s %s again at %s", eng.name, eng.state, eng.url)

    async def _probe_until_up(self) -> None:
        url = self.eng.url
        assert url is not None
        attempt = 0
        while True:
            await asyncio.sleep(reprobe_delay(attempt, self._timing.health_interval))
            attempt += 1
            if self._gate.paused:
                continue
            epoch = self._gate.epoch
            ok, _ = await self._probe(url, self._timing.health_timeout)
            if ok and epoch == self._gate.epoch:
                return

    # ---------------------------------------------------------------- up

    async def _wait_ready(self, deadline: float) -> None:
        """Until the engine answers healthy (and its URL is known); EngineStartError otherwise."""
        eng = self.eng
        eng.url = await wait_ready(
            eng.name,
            eng.url,
            eng.proc,
            self._probe,
            deadline=deadline,
            start_timeout=self._timing.start_timeout,
            health_timeout=self._timing.health_timeout,
        )

    async def _enter(self) -> bool:
        """A (re)started engine answered healthy: read its layout, then enter the state ``prepare`` says.

        False if it was retired instead: it refuses ``/server_info`` for want of the API key.
        """
        try:
            await self._read_layout()
        except EngineRejected as exc:
            await kill(self.eng)
            self._retire(f"engine {self.eng.name}: {exc}")
            return False
        self._set_state(self.eng, await self._prepare(self.eng))
        return True

    async def _read_layout(self) -> None:
        """The engine's layout from its ``/server_info``; the planned one, with a warning, if it does not answer.

        Raises EngineRejected (401/403) for an engine that wants an API key it was not given."""
        eng = self.eng
        assert eng.url is not None
        planned = planned_layout(eng.spec)
        eng.info = {}
        try:
            info = await self._client.server_info(eng.url)
        except EngineRejected as exc:
            if exc.status in (401, 403):
                why = "refuses the key given" if self._api_key else "wants an API key (the server runs with --api-key)"
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

    async def _watch(self) -> str:
        """Return (a reason) when the healthy engine is found broken."""
        eng, gate = self.eng, self._gate
        next_check = time.monotonic() + self._timing.health_interval
        while True:
            if eng.exited:
                return f"process exited with {eng.proc.describe_exit()}"
            if eng.hung is not None:
                why, eng.hung = eng.hung, None
                return why
            now = time.monotonic()
            if not gate.paused and (eng.report is not None or eng.forced or now >= next_check):
                reported, eng.report, eng.forced = eng.report, None, False
                epoch = gate.epoch
                assert eng.url is not None
                ok, detail = await self._probe(eng.url, self._timing.health_timeout)
                next_check = time.monotonic() + self._timing.health_interval
                if eng.exited:
                    continue
                if gate.paused or epoch != gate.epoch:
                    continue  # overlapped a pause: the answer means nothing
                if not ok:
                    why = f"health check failed: {detail}"
                    if reported:
                        why += f" (after a reported failure: {reported})"
                    return why
                if reported and eng.state is EngineState.HEALTHY:
                    log.info("engine %s passed its health check after a reported failure (%s)", eng.name, reported)
                    # The reporter may have stopped using it meanwhile: say it is fine. A stale
                    # engine stays out of the pool: it answers health checks on the wrong weights.
                    self._notify(eng, EngineState.HEALTHY)
                continue
            eng.wake.clear()
            timeout = None if gate.paused else max(0.0, next_check - now)
            try:
                async with asyncio.timeout(timeout):
                    await eng.wake.wait()
            except TimeoutError:
                pass

    async def _probe(self, url: str, timeout: float) -> tuple[bool, str]:
        """One GET /health_generate through the shared client: (healthy, what happened)."""
        try:
            await self._client.health(url, timeout=timeout)
        except EngineUnavailable as e:
            return False, str(e)
        return True, "HTTP 200"
