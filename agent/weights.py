"""The weights executor: runs each weight-update step of docs/weights.md on this agent's engines.

The I/O half of agent/weight_state.py. The core hands it ``RunWeightsStep`` (one coordinator
``Weights*`` message) and ``SetWeights`` (the fleet's weights from a Welcome); it answers every
step with exactly one ``WeightsStepDone`` (the core sends the ``WeightsReport``).

Steps run one at a time, in arrival order (a bucket must follow its group's init on every
engine); within a step every engine is driven concurrently, each under ``step_deadline``.
A ``WeightsAbort`` cancels the step of its update still running and drops those queued.

Per step (engines are those ``healthy`` or ``stale``; an error names the engine):

- ``begin``: health checks paused; every engine is confirmed for the group: its process is
  alive, an earlier group it still holds is destroyed, and it is paused (mode ``abort``:
  in-flight samples come back partial), each within ``confirm_deadline``. The report's
  ``members`` are the engines confirmed; one that fails is left out (a dead one goes ``down``
  at once, one still blocked in a failed update's broadcast stays ``stale``) and the update
  goes on without it.
- ``disk``: health checks paused; per engine pause, ``/update_weights_from_disk`` (label
  ``str(version)``, cache flushed), continue, and ``/model_info`` must say ``str(version)``;
  then health checks resume with one forced check.
- ``init``: each engine named in ``rank_offsets`` joins the group (the call blocks until the
  trainer's rank 0 joins too). The group is kept for later updates until an abort or a restart.
- ``bucket``: each engine of the group receives the bucket (``flush_cache`` false).
- ``finish``: each engine of the group gets the label, a cache flush, continue, and the check;
  engines left out of the update are behind.
- ``abort``: engines that received part of the update re-load the last disk checkpoint (the
  abort's ``path``) or stay out of the pool; the group is destroyed and every paused engine
  continues, each within ``confirm_deadline``: an engine that does not answer (blocked in the
  failed broadcast until its own timeout) is remembered as holding the group and is confirmed
  for no update until a later ``begin`` destroys it; health checks resume with one forced check.
  An abort never waits for an engine stuck in the failed update.

Invariant: after every step that ends an update (and after ``SetWeights``) each engine is
either ``healthy`` holding ``current.version`` or ``stale`` (out of the pool): an engine behind
is re-loaded from ``current.path`` when the fleet's weights came from disk, else it stays
stale until an update reaches it. ``prepare`` (the supervisor's hook) applies the same rule to
every engine that (re)starts, before it serves.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from agent.engine_client import EngineClient, parse_version
from agent.events import EngineVersion, RunWeightsStep, WeightsRecord, WeightsStepDone
from agent.supervisor import EngineSupervisor
from agent.weight_checks import PausedEngines, Reading, compare_checksums, lacks_read_back, reading
from common import protocol as p
from common.errors import EngineError, EngineRejected

log = logging.getLogger("rollfleet.agent.weights")

T = TypeVar("T")

STEP_DEADLINE = 600.0
"""Seconds one engine may take for one step (an init waits for the trainer to join)."""

CONFIRM_DEADLINE = 3.0
"""Seconds one engine may take to be confirmed for a group, or to leave a failed one. SGLang 0.5.23's pause
(mode ``abort``) aborts, then re-checks once a second until no request holds its lock: with requests in
flight it answers after one second, sometimes two."""

CALL_DEADLINE = 5.0
"""Seconds a short control call to one engine may take (pause, continue, label, version check): past it the
engine is hung (alive but not answering, e.g. SIGSTOPped), left out of the step and restarted as a dead one."""

LIVENESS_INTERVAL = 2.0
LIVENESS_TIMEOUT = 5.0
"""A long call (a disk load, a flush waiting for requests, a session end re-packing weights, a checksum pass)
may take as long as it needs while the engine answers ``/model_info`` (its HTTP front, not its scheduler)
within ``LIVENESS_TIMEOUT`` every ``LIVENESS_INTERVAL`` seconds; one that does not is hung."""

CONTINUE_DEADLINE = 3600.0
"""Seconds the continue of an engine whose pause outlived its deadline, or that hung, is tried for (once a
second): SGLang's continue queues behind the pause still running there, and a frozen engine is continued
once it thaws, so no engine is ever left paused by us."""

STEPS = {
    p.WeightsBegin: "begin",
    p.WeightsFromDisk: "disk",
    p.WeightsInitGroup: "init",
    p.WeightsBucket: "bucket",
    p.WeightsFinish: "finish",
    p.WeightsAbort: "abort",
}


class Hung(EngineError):
    """An engine did not answer a call within its deadline: it is out of the step and goes down."""


class WeightsExecutor:
    def __init__(
        self,
        supervisor: EngineSupervisor,
        client: EngineClient,
        dispatch: Callable[[object], None],
        *,
        agent_id: str = "",
        step_deadline: float = STEP_DEADLINE,
        flush_deadline: float = 60.0,
        confirm_deadline: float = CONFIRM_DEADLINE,
    ):
        self.supervisor = supervisor
        self.client = client
        self.agent_id = agent_id
        self.step_deadline = step_deadline
        self.confirm_deadline = confirm_deadline
        self.flush_deadline = flush_deadline
        self._dispatch = dispatch
        self.current = WeightsRecord()
        self.versions: dict[str, int | None] = {}
        self.stale: set[str] = set()  # up, but not on current's weights (partial, or behind)
        self.group: dict[str, str] = {}  # engines in the trainer's update group: name -> url
        self.group_name = ""
        self.side: dict[str, str] = {}  # engines in the open catch-up's group (its own, ended with it)
        self.side_name = ""
        self._side_update = 0  # the catch-up update the last ``begin`` was for
        self._paused: dict[str, str] = {}  # engines the open update paused
        self._touched: set[str] = set()  # engines the open update sent weights to
        self.held: dict[str, str] = {}  # engines that did not leave a failed group: name -> group name
        self._members: list[str] = []  # engines the last ``begin`` confirmed
        self.sessions: dict[str, str] = {}  # engines with a weight-update session we opened: name -> url
        self._sessionless: set[str] = set()  # engines without session endpoints (SGLang before 0.5.23)
        self._read_mode: dict[str, str] = {}  # how an engine's weights are read back: "values" or "checksum"
        self._disk_format: dict[str, str | None] = {}  # the load_format its disk loads need (None: its own)
        self._warned: set[str] = set()  # engines whose limits were said (once): verification, data parallelism
        self.paused_engines = PausedEngines()  # urls this executor paused: per-request aborts wait for them
        self._background: set[asyncio.Task] = set()  # continues sent after a pause that outlived its deadline
        self._hung: dict[str, str] = {}  # engines found hung in the running step: name -> why
        self._step_restarts: dict[str, int] = {}  # each engine's relaunches when the running step began
        self._lost: set[str] = set()  # engines sent down as hung, until they are prepared again
        self._resuming: dict[str, asyncio.Task] = {}  # the pending continue of an engine (_continue_later)
        self._queue: asyncio.Queue[RunWeightsStep | WeightsRecord] = asyncio.Queue()
        self._step: tuple[RunWeightsStep, asyncio.Task] | None = None
        self._silenced: set[int] = set()  # updates whose running step our own abort cancelled: not reported
        self._steps = {
            "begin": self._begin,
            "disk": self._disk,
            "init": self._init,
            "bucket": self._bucket,
            "finish": self._finish,
            "abort": self._abort,
        }

    # ------------------------------------------------------------------ from the core

    def submit(self, ins: RunWeightsStep) -> None:
        msg = ins.msg
        if isinstance(msg, p.WeightsAbort):
            # An abort of our own (``report=False``: the session the update belonged to is gone) ends its steps
            # without a word to the coordinator: a failure report would reach it under the new session and
            # abort the same update there, which this agent re-joins (a disk update resent at registration).
            silent = not ins.report
            kept = []
            while not self._queue.empty():
                job = self._queue.get_nowait()
                if isinstance(job, RunWeightsStep) and job.msg.update_id == msg.update_id:
                    self._done(replace(job, report=job.report and not silent), False, "aborted before it ran")
                else:
                    kept.append(job)
            for job in kept:
                self._queue.put_nowait(job)
            if self._step is not None and self._step[0].msg.update_id == msg.update_id:
                if silent:
                    self._silenced.add(msg.update_id)
                self._step[1].cancel()
        self._queue.put_nowait(ins)

    def set_current(self, record: WeightsRecord) -> None:
        """The fleet's weights (a Welcome): engines behind are brought up to them, in turn with the steps."""
        self._queue.put_nowait(record)

    async def run(self) -> None:
        """The executor's life: one job at a time until cancelled."""
        try:
            await self._run()
        finally:
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            if isinstance(job, WeightsRecord):
                self.current = job
                self.supervisor.pause_health_checks()  # a paused engine fails its health check
                try:
                    await self._sweep()
                finally:
                    self.supervisor.resume_health_checks(force=True)
                continue
            task = asyncio.ensure_future(self._run_step(job))
            self._step = (job, task)
            try:
                await asyncio.wait([task])
            finally:
                self._step = None
                if not task.done():  # we are cancelled: so is the step
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if task.cancelled():
                # The abort that cancelled it continues the engines and resumes health checks.
                silent = job.msg.update_id in self._silenced
                self._silenced.discard(job.msg.update_id)
                self._done(replace(job, report=job.report and not silent), False, "aborted while it ran")
            else:
                task.result()

    async def prepare(self, name: str, url: str) -> str:
        """The supervisor's hook for an engine that (re)started: ``healthy`` once it holds ``current``."""
        self.group.pop(name, None)
        self.side.pop(name, None)
        self.held.pop(name, None)  # a new process holds no group
        self.sessions.pop(name, None)  # nor a weight-update session
        self._lost.discard(name)
        resuming = self._resuming.pop(name, None)
        if resuming is not None and self.supervisor.urls().get(name) != url:
            resuming.cancel()  # a new process at another address: the old one's continue means nothing
        for known in (self._sessionless, self._warned):
            known.discard(name)
        for cached in (self._read_mode, self._disk_format):
            cached.pop(name, None)
        self.stale.discard(name)
        try:
            info = await self.client.model_info(url)
            label = info.get("weight_version", "default")
            self.versions[name] = parse_version(label)
            if self.versions[name] is None:
                raise EngineError(f"{url}/model_info: weight_version {label!r} is not an integer version")
            # Launched with ``--load-format dummy`` (random weights, real ones to come): a disk load in the
            # server's own format would be refused, so it is asked for in the checkpoint's.
            self._disk_format[name] = "auto" if info.get("load_format") == "dummy" else None
        except EngineError as exc:
            log.warning("engine %s: cannot read its weight version: %s", name, exc)
            self.versions[name] = None
        self._dispatch(EngineVersion(name, self.versions[name], self.supervisor.tp(name)))
        if self.versions[name] == self.current.version:
            return "healthy"
        return "healthy" if await self._bring_up(name, url, mark=False) else "stale"

    # ------------------------------------------------------------------ steps

    async def _run_step(self, ins: RunWeightsStep) -> None:
        step = STEPS[type(ins.msg)]
        self._hung.clear()
        self._step_restarts = self.supervisor.restarts()
        errors, record = await self._steps[step](ins.msg)
        error = "; ".join(
            f"agent {self.agent_id}: {why}" if name == "*" else f"engine {name} of agent {self.agent_id}: {why}"
            for name, why in errors.items()
        )
        self._done(ins, not errors, error, record)

    def _done(self, ins: RunWeightsStep, ok: bool, error: str, record: WeightsRecord | None = None) -> None:
        msg = ins.msg
        serving = {name: self.versions.get(name) for name in self.supervisor.urls("healthy")}
        step = STEPS[type(msg)]
        members = list(self._members) if step == "begin" and ok else []
        self._dispatch(
            WeightsStepDone(
                msg.update_id, step, ok, getattr(msg, "seq", 0), serving, error, record, ins.report, members
            )
        )

    async def _begin(self, msg: p.WeightsBegin) -> tuple[dict, None]:
        """Confirm every engine for the group (a catch-up: every engine behind ``version``); the ones
        that fail are left out, not an error."""
        engines = self.supervisor.urls()
        self._touched.clear()
        self._members = []
        if msg.catch_up:
            self._side_update = msg.update_id
            engines = {
                name: url
                for name, url in engines.items()
                if name in self.stale or self.versions.get(name) != msg.version
            }
            if not engines:
                return {}, None  # all current: the serving engines were never paused
        for name in [n for n in engines if not self._joinable(n)]:
            del engines[name]  # never paused nor confirmed: it serves until the update's end finds it behind
        self.supervisor.pause_health_checks()
        pause_sent: set[str] = set()

        async def confirm(name: str, url: str) -> None:
            if not self.supervisor.alive(name):
                raise EngineError(f"{url}: its process exited")
            held = self.held.get(name)
            if held:
                try:
                    await self.client.destroy_weights_update_group(url, held)
                except EngineRejected:
                    pass  # 400: the group is gone already (its broadcast failed and cleaned up)
                self.held.pop(name, None)
            pause_sent.add(name)
            await self._pause(url)
            await self._open_session(name, url)

        failed = await self._each(engines, confirm, deadline=self.confirm_deadline)
        for name in failed.keys() & pause_sent:
            self._continue_later(name, engines[name])  # left out: it must not stay paused
        for name, why in failed.items():
            log.warning("engine %s left out of weight update %#x: %s", name, msg.update_id, why)
            if name in self.held:
                self._set_serving(name, False)  # still in the failed broadcast: out of the pool
            else:
                self.supervisor.report_failure(name, f"not confirmed for a weight update: {why}")
        confirmed = {name: url for name, url in engines.items() if name not in failed}
        self._paused.update(confirmed)
        self._members = list(confirmed)
        if msg.catch_up and not confirmed:
            self.supervisor.resume_health_checks(force=True)
        return {}, None

    def _joinable(self, name: str) -> bool:
        """Whether the engine can join a weight-update group: SGLang refuses one (an assert, HTTP 500) on a
        server with data parallelism unless it runs DP attention. Said once per engine."""
        if self.supervisor.dp(name) <= 1 or self.supervisor.server_info(name).get("enable_dp_attention"):
            return True
        if name not in self._warned:
            self._warned.add(name)
            log.warning(
                "engine %s has dp_size %d without DP attention: SGLang cannot take broadcasts there; it is left out "
                "of distributed updates and out of the pool after one (update it from disk, or run it with tp only)",
                name,
                self.supervisor.dp(name),
            )
        return False

    async def _disk(self, msg: p.WeightsFromDisk) -> tuple[dict, WeightsRecord | None]:
        self.supervisor.pause_health_checks()
        engines = {name: url for name, url in self.supervisor.urls().items() if self.supervisor.alive(name)}
        self._paused.update(engines)

        async def load(name: str, url: str) -> None:
            await self._pause(url)
            self._touched.add(name)  # loading: it may hold part of the checkpoint until the load ends
            try:
                load = self.client.update_weights_from_disk(
                    url, msg.path, str(msg.version), flush_cache=True, load_format=self._disk_format.get(name)
                )
                await self._watched(url, "/update_weights_from_disk", load)
            finally:
                await self._continue(url)
            await self._verify(name, url, msg.version)
            self._touched.discard(name)  # a load that completed is whole: the engine holds the version

        errors = await self._each(engines, load)
        # One that died during its load is left out, not a failure of the update: it restarts and
        # loads the recorded checkpoint on the way up (``prepare``), like any restarted engine.
        dead = await self._drop_lost(errors, msg.update_id, "loading from disk")
        for name in engines:
            self._paused.pop(name, None)
            self._set_serving(name, name not in errors and name not in dead)
        record = None
        if not errors:
            record = self.current = WeightsRecord(msg.version, "disk", msg.path)
            self._touched.clear()
            await self._sweep()
        self.supervisor.resume_health_checks(force=True)
        return errors, record

    async def _init(self, msg: p.WeightsInitGroup) -> tuple[dict, None]:
        engines = self.supervisor.urls()
        offsets = {}
        for name in engines:
            offset = msg.rank_offsets.get(f"{self.agent_id}/{name}", msg.rank_offsets.get(name))
            if offset is not None:
                offsets[name] = int(offset)
        members = {name: engines[name] for name in offsets}
        if msg.update_id == self._side_update:
            self.side, self.side_name = {}, msg.group_name
            group = self.side
        else:
            await self._leave(self.group, self.group_name)  # a new group replaces the fleet's old one
            self.group, self.group_name = {}, msg.group_name
            group = self.group

        async def join(name: str, url: str) -> None:
            await self.client.init_weights_update_group(
                url,
                master_address=msg.master_address,
                master_port=msg.master_port,
                rank_offset=offsets[name],
                world_size=msg.world_size,
                group_name=msg.group_name,
                backend=msg.backend,
            )
            group[name] = url

        errors = await self._each(members, join)
        if not members:
            errors = {"*": "none of this agent's engines is in rank_offsets"}
        return errors, None

    async def _bucket(self, msg: p.WeightsBucket) -> tuple[dict, None]:
        group = self.side if msg.update_id == self._side_update else self.group
        if not group:
            return {"*": "no update group on this agent (no init step succeeded)"}, None
        self._touched.update(group)
        return await self._each(
            dict(group),
            lambda name, url: self.client.update_weights_from_distributed(
                url, names=msg.names, dtypes=msg.dtypes, shapes=msg.shapes, group_name=msg.group_name
            ),
        ), None

    async def _finish(self, msg: p.WeightsFinish) -> tuple[dict, WeightsRecord | None]:
        catch_up = msg.update_id == self._side_update
        updated = dict(self.side if catch_up else self.group)

        readings: dict[str, Reading] = {}

        async def end(name: str, url: str) -> None:
            await self._bounded(url, "/update_weight_version", self.client.update_weight_version(url, str(msg.version)))
            # Closing the session re-packs the weights: read-backs come after it.
            await self._watched(url, "/end_weight_update", self._close_session(name, url))
            await self._watched(url, "/flush_cache", self.client.flush_cache(url, deadline=self.flush_deadline))
            if msg.verify:
                got = await self._watched(url, "the read-back", self._read_back(name, url, msg.verify))
                if got is not None:
                    readings[name] = got

        async def serve(name: str, url: str) -> None:
            await self._continue(url)
            await self._verify(name, url, msg.version)

        errors = await self._each(updated, end)
        errors.update(self._compare(readings, msg.verify))
        errors.update(await self._each({n: u for n, u in updated.items() if n not in errors}, serve))
        dead = await self._drop_lost(errors, msg.update_id, "finishing")
        for name in updated:
            self._paused.pop(name, None)
            self._set_serving(name, name not in errors and name not in dead)
        if catch_up:
            return await self._end_catch_up(errors), None
        continued = await self._continue_paused()
        await self._drop_lost(continued, msg.update_id, "continuing")
        errors.update(continued)
        record = None
        if not errors:
            record = self.current = WeightsRecord(msg.version, "distributed", "")
            self._touched.clear()
            await self._sweep()  # engines left out of the update are behind it now
        self.supervisor.resume_health_checks(force=True)
        return errors, record

    async def _end_catch_up(self, errors: dict[str, str]) -> dict[str, str]:
        """A catch-up ends: its group goes (the fleet's stays), every engine it paused continues."""
        side, self.side, self._side_update = self.side, {}, 0
        await self._close_sessions()
        for name in await self._leave(side, self.side_name):
            self.stale.add(name)
            self._set_serving(name, False)
        errors.update(await self._continue_paused(deadline=self.confirm_deadline))
        self.supervisor.resume_health_checks(force=True)
        return errors

    async def _leave(self, group: dict[str, str], group_name: str) -> dict[str, str]:
        """Each engine of ``group`` destroys it, within ``confirm_deadline``; those that did not answer
        (still blocked in a failed broadcast) are remembered as holding it: ``{name: why}``."""
        if not group:
            return {}

        async def leave(name: str, url: str) -> None:
            try:
                await self.client.destroy_weights_update_group(url, group_name)
            except EngineRejected as exc:
                log.info("engine %s: destroying the update group: %s", name, exc)  # 400 when it never formed

        stuck = await self._each(group, leave, deadline=self.confirm_deadline)
        for name, why in stuck.items():
            log.warning("engine %s still holds weight-update group %s: %s", name, group_name, why)
            self.held[name] = group_name
        return stuck

    async def _abort(self, msg: p.WeightsAbort) -> tuple[dict, WeightsRecord]:
        if msg.catch_up:
            for name in self._touched:
                self.stale.add(name)  # partial weights: still out of the pool
            self._touched.clear()
            if msg.update_id != self._side_update:
                return {}, self.current  # aborted before its begin ran here: nothing of it to undo
            return await self._end_catch_up({}), self.current
        if msg.path:
            self.current = WeightsRecord(msg.version, "disk", msg.path)
        elif self.current.version != msg.version:
            self.current = WeightsRecord(msg.version, "distributed", "")
        for name in self._touched:
            self.stale.add(name)  # partial weights: out of the pool until re-loaded or updated
        self._touched.clear()
        group, self.group = self.group, {}
        for name in await self._leave(group, self.group_name):
            self.stale.add(name)  # still blocked in the failed broadcast: no update may count on it
        await self._close_sessions()
        errors = await self._continue_paused(deadline=self.confirm_deadline)
        for name in errors:
            self.stale.add(name)  # paused and not answering: it must not serve
        await self._sweep()
        self.supervisor.resume_health_checks(force=True)
        return errors, self.current

    # ------------------------------------------------------------------ helpers

    async def _each(
        self, engines: dict[str, str], fn: Callable[[str, str], Awaitable], *, deadline: float | None = None
    ) -> dict[str, str]:
        """Run ``fn(name, url)`` on every engine at once, each within ``deadline`` (default: the step
        deadline); ``{name: error}``."""
        deadline = self.step_deadline if deadline is None else deadline

        async def one(name: str, url: str) -> tuple[str, str | None]:
            try:
                async with asyncio.timeout(deadline):
                    await fn(name, url)
            except TimeoutError:
                return name, f"no answer from {url} within {deadline:g}s"
            except Hung as exc:
                self._hung[name] = str(exc)
                return name, str(exc)
            except EngineError as exc:
                return name, str(exc) or type(exc).__name__
            return name, None

        results = await asyncio.gather(*(one(name, url) for name, url in engines.items()))
        return {name: why for name, why in results if why is not None}

    async def _continue_paused(self, *, deadline: float | None = None) -> dict[str, str]:
        paused, self._paused = self._paused, {}
        return await self._each(paused, lambda name, url: self._continue(url), deadline=deadline)

    async def _pause(self, url: str) -> None:
        """Pause in mode ``abort`` (in-flight samples come back partial); per-request aborts wait from now."""
        self.paused_engines.hold(url)
        await self._bounded(url, "/pause_generation", self.client.pause_generation(url, "abort"))

    async def _continue(self, url: str) -> None:
        await self._bounded(url, "/continue_generation", self.client.continue_generation(url))
        self.paused_engines.release(url)

    async def _bounded(self, url: str, what: str, call: Awaitable[T]) -> T:
        """A short control call: Hung past ``CALL_DEADLINE``."""
        try:
            async with asyncio.timeout(CALL_DEADLINE):
                return await call
        except TimeoutError:
            raise Hung(f"{url}: no answer to {what} within {CALL_DEADLINE:g}s") from None

    async def _watched(self, url: str, what: str, call: Awaitable[T]) -> T:
        """A long call: as long as it takes while the engine's front answers (``LIVENESS_*``); Hung otherwise."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=LIVENESS_INTERVAL)
                if done:
                    return task.result()
                try:
                    async with asyncio.timeout(LIVENESS_TIMEOUT):
                        await self.client.model_info(url)
                except (TimeoutError, EngineError) as exc:
                    why = str(exc) or f"no answer within {LIVENESS_TIMEOUT:g}s"
                    raise Hung(f"{url}: {what} unanswered and /model_info too: {why}") from None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _continue_later(self, name: str, url: str) -> None:
        """Continue an engine whose pause outlived its deadline, or that hung: the pause goes on on the server (a
        client that gives up does not end it) and a continue queues behind it there; a frozen engine answers
        once it thaws. Tried once a second until it answers, the engine is prepared again (a new process), or
        ``CONTINUE_DEADLINE`` passes."""

        async def resume() -> None:
            end = asyncio.get_running_loop().time() + CONTINUE_DEADLINE
            while True:
                try:
                    await self._continue(url)
                except EngineError as exc:
                    if asyncio.get_running_loop().time() > end:
                        log.warning("engine %s: gave up continuing it after its late pause: %s", name, exc)
                        return
                    await asyncio.sleep(1.0)
                else:
                    log.info("engine %s continued after a pause that outlived its deadline", name)
                    return

        old = self._resuming.pop(name, None)
        if old is not None:
            old.cancel()
        task = asyncio.ensure_future(resume())
        task.set_name(f"continue-{name}")
        self._resuming[name] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _open_session(self, name: str, url: str) -> None:
        """Open the engine's weight-update session (SGLang 0.5.23 refuses broadcasts outside one); nothing on
        an engine without the endpoints. One left open (an update whose end never reached it) is closed first."""
        if name in self._sessionless:
            return
        try:
            opened = await self.client.begin_weight_update(url)
        except EngineRejected as exc:
            if "already open" not in str(exc):
                raise
            log.warning("engine %s had a weight-update session open: closing it before this update", name)
            await self.client.end_weight_update(url)
            opened = await self.client.begin_weight_update(url)
        if opened:
            self.sessions[name] = url
        else:
            self._sessionless.add(name)
            log.info("engine %s has no weight-update sessions (SGLang before 0.5.23): updates run without", name)

    async def _close_session(self, name: str, url: str) -> None:
        if self.sessions.get(name) != url:
            return
        try:
            await self.client.end_weight_update(url)
        except EngineRejected as exc:
            if "no weight-update session" not in str(exc):
                raise
        self.sessions.pop(name, None)

    async def _close_sessions(self) -> None:
        """Every session this agent opened is closed, each within ``confirm_deadline``; one that cannot be (an
        engine still blocked in a failed broadcast) is closed by the next update's begin."""
        stuck = await self._each(dict(self.sessions), self._close_session, deadline=self.confirm_deadline)
        for name, why in stuck.items():
            log.warning("engine %s: its weight-update session is still open (%s): the next update closes it", name, why)

    async def _read_back(self, name: str, url: str, verify: dict) -> Reading | None:
        """A verified update on one engine: the sampled rows where its model has ``/get_weights_by_name``
        (checked here), else its ``/weights_checker`` checksums (a Reading, compared by :meth:`_compare`)."""
        mode = self._read_mode.get(name)
        if mode != "checksum" and verify.get("values"):
            try:
                await self._check_values(name, url, verify)
            except EngineRejected as exc:
                if mode == "values" or not lacks_read_back(exc):
                    raise
                self._read_mode[name] = "checksum"
                log.info("engine %s: %s; its updates are verified with /weights_checker", name, exc)
            else:
                self._read_mode[name] = "values"
                return None
        try:
            out = await self.client.weights_checker(url, "checksum")
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            raise EngineError(
                f"{url} cannot verify weights: its model has no /get_weights_by_name and the server no "
                "/weights_checker; push with verify=False"
            ) from None
        return reading(url, out, self.supervisor.server_info(name))

    def _compare(self, readings: dict[str, Reading], verify: dict) -> dict[str, str]:
        """Checksums against the trainer's where they can be compared, and engines of one layout against each
        other; an engine checked neither way is said once (its verification is limited)."""
        errors, unchecked = compare_checksums(readings, dict(verify.get("checksums") or {}))
        for name, why in unchecked.items():
            if name not in self._warned:
                self._warned.add(name)
                log.warning("engine %s: weight verification limited: %s", name, why)
        return errors

    async def _check_values(self, name: str, url: str, verify: dict) -> None:
        """A verified update: the engine holds exactly the rows the trainer sent of each sampled tensor
        (``/get_weights_by_name``); EngineError naming the first tensor that differs."""
        rows = int(verify.get("rows", 1))
        dp = int(getattr(self.supervisor, "dp", lambda _name: 1)(name))
        for tensor, expected in dict(verify.get("values", {})).items():
            got = await self.client.get_weights_by_name(url, tensor, rows)
            if dp > 1 and isinstance(got, list) and len(got) == dp:
                # One answer per data-parallel rank: every replica must hold the rows.
                bad = next((i for i, one in enumerate(got) if not _same(one, expected)), None)
                if bad is None:
                    continue
                got = got[bad]
            if not _same(got, expected):
                raise EngineError(
                    f"{url} holds weights that differ from what the trainer sent: {tensor!r} (first {rows} rows: "
                    f"{_brief(got)} on the engine, {_brief(expected)} sent)"
                )

    async def _verify(self, name: str, url: str, version: int) -> None:
        """``/model_info`` must say ``str(version)``; EngineError naming the engine otherwise."""
        label = (await self._bounded(url, "/model_info", self.client.model_info(url))).get("weight_version")
        self._set_version(name, parse_version(label))
        if label != str(version):
            raise EngineError(f"{url} reports weight version {label!r} after the update, expected {str(version)!r}")

    def _set_version(self, name: str, version: int | None) -> None:
        if self.versions.get(name, -1) != version:
            self.versions[name] = version
            self._dispatch(EngineVersion(name, version, self.supervisor.tp(name)))

    async def _drop_lost(self, errors: dict[str, str], update_id: int, doing: str) -> set[str]:
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
        hung, self._hung = self._hung, {}
        for name in names:
            if name in hung and name not in gone:
                gone.add(name)
                self._lose(name, hung[name])
        for name in gone:
            why = errors.pop(name)
            log.warning("engine %s lost %s for weight update %#x: left out: %s", name, doing, update_id, why)
            self._touched.discard(name)
            self.group.pop(name, None)
            self.sessions.pop(name, None)  # a dead process holds none
            self.stale.add(name)
        return gone

    def _lose(self, name: str, why: str) -> None:
        """A hung engine goes down (the supervisor restarts it, or probes a ``url`` one) and, once it answers
        again, is continued: it never stays paused by us."""
        url = self.supervisor.urls().get(name)
        self._lost.add(name)
        self.supervisor.fail(name, f"hung in a weight update: {why}")
        if url is not None:
            self._continue_later(name, url)

    def _set_serving(self, name: str, serving: bool) -> None:
        (self.stale.discard if serving else self.stale.add)(name)
        self.supervisor.mark(name, "healthy" if serving else "stale")

    async def _sweep(self) -> None:
        """Every engine not on ``current`` (or holding partial weights) is brought up to it or left stale."""
        behind = [
            (name, url)
            for name, url in self.supervisor.urls().items()
            if (name in self.stale or self.versions.get(name) != self.current.version)
            and name not in self.held
            and name not in self._lost  # going down: its restart brings it up to date
        ]
        for name in self.held:
            if name in self.supervisor.urls():
                self._set_serving(name, False)
        await asyncio.gather(*(self._bring_up(name, url, mark=True) for name, url in behind))

    async def _bring_up(self, name: str, url: str, *, mark: bool) -> bool:
        """Re-load ``current`` from disk on one engine if the fleet's weights came from disk; True if it holds them.

        ``mark``: move it in the supervisor (``stale`` while it loads); otherwise the caller decides its state.
        """
        record = self.current
        if mark:
            self._set_serving(name, False)
        else:
            self.stale.add(name)
        if record.kind != "disk" or not record.path:
            log.warning(
                "engine %s is not on weight version %d (%s): out of the pool until an update reaches it",
                name,
                record.version,
                record.kind or "launch weights",
            )
            return False
        try:
            await self._pause(url)
            try:
                load = self.client.update_weights_from_disk(
                    url, record.path, str(record.version), load_format=self._disk_format.get(name)
                )
                await self._watched(url, "/update_weights_from_disk", load)
            finally:
                await self._continue(url)
            await self._verify(name, url, record.version)
        except EngineError as exc:
            log.error(
                "engine %s: re-loading weight version %d from %s failed: %s", name, record.version, record.path, exc
            )
            if isinstance(exc, Hung):
                self._lose(name, str(exc))
            return False
        log.info("engine %s re-loaded weight version %d from %s", name, record.version, record.path)
        if self.current.version != record.version:
            # The fleet moved on while it loaded (an update it was not part of): bring it up to that one instead.
            return await self._bring_up(name, url, mark=mark)
        self.stale.discard(name)
        if mark:
            self._set_serving(name, True)
        return True


def _same(got, expected, rtol: float = 1e-5) -> bool:
    """Whether two nested lists of numbers match in shape and value (NaN matches NaN; an engine that
    rounds through another dtype on the way out, within ``rtol``)."""
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(_same(g, e, rtol) for g, e in zip(got, expected, strict=True))
        )
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return False
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    return got == expected or abs(got - expected) <= rtol * max(abs(expected), abs(got))


def _brief(values, limit: int = 6) -> str:
    """The first few numbers of a nested list, for an error message."""
    flat: list = []
    stack = [values]
    while stack and len(flat) <= limit:
        item = stack.pop(0)
        if isinstance(item, list):
            stack[:0] = item
        else:
            flat.append(item)
    more = ", ..." if len(flat) > limit else ""
    return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else repr(v) for v in flat[:limit]) + more + "]"
