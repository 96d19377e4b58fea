"""The weights executor: runs each weight-update step of docs/weights.md on this agent's engines.

The I/O half of agent/weight_state.py. The core hands it ``RunWeightsStep`` (one coordinator
``Weights*`` message) and ``SetWeights`` (the fleet's weights from a Welcome); it answers every
step with exactly one ``WeightsStepDone`` (the core sends the ``WeightsReport``).

Steps run one at a time, in arrival order (a bucket must follow its group's init on every
engine); within a step every engine is driven concurrently, each under ``step_deadline``.
A ``WeightsAbort`` cancels the step of its update still running and drops those queued.

Its parts, one role each (engines are those ``healthy`` or ``stale``; an error names the engine):

- agent/weight_disk.py: the ``disk`` step, and every engine behind the fleet's weights brought
  up to them (re-loaded from their checkpoint) or out of the pool;
- agent/weight_broadcast.py: the ``begin``, ``init``, ``bucket`` and ``finish`` steps of a
  distributed update or a catch-up, their group and weight-update sessions;
- agent/weight_verify.py: a verified update's read-back; agent/weight_calls.py: every call to an
  engine, bounded (a hung engine is an engine lost); agent/weight_engines.py: what each engine holds.

The ``abort`` step is here: engines that received part of the update re-load the last disk
checkpoint (the abort's ``path``) or stay out of the pool; the group is destroyed and every paused
engine continues, each within ``confirm_deadline``: an engine that does not answer (blocked in the
failed broadcast until its own timeout) is remembered as holding the group and is confirmed for no
update until a later ``begin`` destroys it; health checks resume with one forced check. An abort
never waits for an engine stuck in the failed update.

The fleet's weights are the core's ``current`` (``fleet``, read, never kept here): a step that
reaches new ones brings engines to them at once, the core records them from its ``WeightsStepDone``.

Invariant: after every step that ends an update (and after ``SetWeights``) each engine is
either ``healthy`` holding ``current.version`` or ``stale`` (out of the pool): an engine behind
is re-loaded from ``current.path`` when the fleet's weights came from disk, else it stays
stale until an update reaches it. ``prepare`` (the supervisor's hook) applies the same rule to
every engine that (re)starts, before it serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from agent.engine_client import EngineClient, parse_version
from agent.events import EngineVersion, RunWeightsStep, WeightsRecord, WeightsStepDone
from agent.supervisor import EngineSupervisor
from agent.weight_broadcast import BroadcastPath
from agent.weight_calls import CONFIRM_DEADLINE, STEP_DEADLINE, EngineCalls
from agent.weight_checks import PausedEngines
from agent.weight_disk import DiskPath
from agent.weight_engines import WeightEngines
from agent.weight_verify import Verifier
from common import protocol as p
from common.engine_info import EngineState
from common.errors import EngineError
from common.weight_step import WeightKind, WeightStep

log = logging.getLogger("rollfleet.agent.weights")

STEPS = {
    p.WeightsBegin: WeightStep.BEGIN,
    p.WeightsFromDisk: WeightStep.DISK,
    p.WeightsInitGroup: WeightStep.INIT,
    p.WeightsBucket: WeightStep.BUCKET,
    p.WeightsFinish: WeightStep.FINISH,
    p.WeightsAbort: WeightStep.ABORT,
}
"""The step each coordinator message is."""


class WeightsExecutor:
    def __init__(
        self,
        supervisor: EngineSupervisor,
        client: EngineClient,
        dispatch: Callable[[object], None],
        *,
        fleet: Callable[[], WeightsRecord],
        agent_id: str = "",
        step_deadline: float = STEP_DEADLINE,
        flush_deadline: float = 60.0,
        confirm_deadline: float = CONFIRM_DEADLINE,
    ):
        """``fleet``: the core's ``current`` (agent/weight_state.py), the fleet's weights as this agent knows them."""
        self.supervisor = supervisor
        self.client = client
        self.agent_id = agent_id
        self._dispatch = dispatch
        self.calls = EngineCalls(client, step_deadline)
        self.engines = WeightEngines(supervisor, self.calls, dispatch, fleet)
        self.verifier = Verifier(supervisor, client)
        self.disk = DiskPath(supervisor, self.engines, self.calls)
        self.broadcast = BroadcastPath(
            supervisor,
            self.engines,
            self.calls,
            self.verifier,
            self.disk.sweep,
            agent_id=agent_id,
            confirm_deadline=confirm_deadline,
            flush_deadline=flush_deadline,
        )
        self._queue: asyncio.Queue[RunWeightsStep | WeightsRecord] = asyncio.Queue()
        self._step: tuple[RunWeightsStep, asyncio.Task] | None = None
        self._silenced: set[int] = set()  # updates whose running step our own abort cancelled: not reported
        self._steps = {
            WeightStep.BEGIN: self.broadcast.begin,
            WeightStep.DISK: self.disk.step,
            WeightStep.INIT: self.broadcast.init,
            WeightStep.BUCKET: self.broadcast.bucket,
            WeightStep.FINISH: self.broadcast.finish,
            WeightStep.ABORT: self._abort,
        }

    # ------------------------------------------------------------------ views

    @property
    def current(self) -> WeightsRecord:
        """The fleet's weights engines are brought to (the core's ``current``, or those a running step reached)."""
        return self.engines.fleet()

    @property
    def paused_engines(self) -> PausedEngines:
        """Urls this executor paused: per-request aborts wait for them."""
        return self.calls.paused

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
        """The fleet's weights changed (a Welcome; the core holds ``record``): engines behind are brought up to
        them, in turn with the steps."""
        self._queue.put_nowait(record)

    async def run(self) -> None:
        """The executor's life: one job at a time until cancelled."""
        try:
            await self._run()
        finally:
            await self.calls.close()

    async def _run(self) -> None:
        while True:
            job = await self._queue.get()
            if isinstance(job, WeightsRecord):
                self.supervisor.pause_health_checks()  # a paused engine fails its health check
                try:
                    await self.disk.sweep()
                finally:
                    self.supervisor.resume_health_checks(force=True)
                continue
            task = asyncio.ensure_future(self._run_step(job))
            self._step = (job, task)
            try:
                await asyncio.wait([task])
            finally:
                self._step = None
                self.engines.landed = None  # reported, or cancelled: the core's record is the fleet's again
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

    async def prepare(self, name: str, url: str) -> EngineState:
        """The supervisor's hook for an engine that (re)started: ``healthy`` once it holds the fleet's weights."""
        engines = self.engines
        engines.restarted(name)
        self.calls.restarted(name, moved=self.supervisor.urls().get(name) != url)
        self.broadcast.restarted(name)
        self.verifier.restarted(name)
        self.disk.restarted(name)
        try:
            info = await self.client.model_info(url)
            label = info.get("weight_version", "default")
            engines.versions[name] = parse_version(label)
            if engines.versions[name] is None:
                raise EngineError(f"{url}/model_info: weight_version {label!r} is not an integer version")
            self.disk.restarted(name, info)
        except EngineError as exc:
            log.warning("engine %s: cannot read its weight version: %s", name, exc)
            engines.versions[name] = None
        self._dispatch(EngineVersion(name, engines.versions[name], self.supervisor.tp(name)))
        if engines.versions[name] == engines.fleet().version:
            return EngineState.HEALTHY
        return EngineState.HEALTHY if await self.disk.bring_up(name, url, mark=False) else EngineState.STALE

    # ------------------------------------------------------------------ steps

    async def _run_step(self, ins: RunWeightsStep) -> None:
        self.engines.step_begins()
        errors, record = await self._steps[STEPS[type(ins.msg)]](ins.msg)
        error = "; ".join(
            f"agent {self.agent_id}: {why}" if name == "*" else f"engine {name} of agent {self.agent_id}: {why}"
            for name, why in errors.items()
        )
        self._done(ins, not errors, error, record)

    def _done(self, ins: RunWeightsStep, ok: bool, error: str, record: WeightsRecord | None = None) -> None:
        msg = ins.msg
        serving = {name: self.engines.versions.get(name) for name in self.supervisor.urls(EngineState.HEALTHY)}
        step = STEPS[type(msg)]
        members = list(self.broadcast.members) if step is WeightStep.BEGIN and ok else []
        self._dispatch(
            WeightsStepDone(
                msg.update_id, step, ok, getattr(msg, "seq", 0), serving, error, record, ins.report, members
            )
        )

    async def _abort(self, msg: p.WeightsAbort) -> tuple[dict, WeightsRecord]:
        engines, broadcast = self.engines, self.broadcast
        if msg.catch_up:
            for name in engines.touched:
                engines.stale.add(name)  # partial weights: still out of the pool
            engines.touched.clear()
            if msg.update_id != broadcast.side_update:
                return {}, engines.fleet()  # aborted before its begin ran here: nothing of it to undo
            return await broadcast.end_catch_up({}), engines.fleet()
        fleet = engines.fleet()
        if msg.path:
            fleet = engines.land(WeightsRecord(msg.version, WeightKind.DISK.value, msg.path))
        elif fleet.version != msg.version:
            fleet = engines.land(WeightsRecord(msg.version, WeightKind.DISTRIBUTED.value, ""))
        for name in engines.touched:
            engines.stale.add(name)  # partial weights: out of the pool until re-loaded or updated
        engines.touched.clear()
        group, engines.group = engines.group, {}
        for name in await broadcast.leave(group, broadcast.group_name):
            engines.stale.add(name)  # still blocked in the failed broadcast: no update may count on it
        await broadcast.close_sessions()
        errors = await engines.continue_paused(deadline=broadcast.confirm_deadline)
        for name in errors:
            engines.stale.add(name)  # paused and not answering: it must not serve
        await self.disk.sweep()
        self.supervisor.resume_health_checks(force=True)
        return errors, fleet
