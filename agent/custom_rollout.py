"""A group made by a custom generate function (``--generate module:function``; common/generation.py).

The function is called once per sample, all samples concurrently; each gets an :class:`EngineHandle`
whose ``generate`` runs ``/generate`` on the engine the agent's core assigned to the group. The
group is one lease, so the same protocol with the core holds as for single-turn groups
(agent/lease_runner.py): one ``EngineWanted`` at the start, one ``GenerationEnded`` at the end, and
in between:

- **An aborted answer** (a weight update, a pause with abort, the engine's own abort). The group's
  :class:`_Gate` closes: calls not yet sent wait, calls in flight come back (the engine aborts them
  all), and once none is in flight the core is asked once (``GenerationEnded(aborted=True)``). Its
  answer opens the gate for everyone: ``resume`` continues each interrupted call from its partial
  output on the new assignment (partial rollout on) or starts that sample's function over (off);
  otherwise every sample starts over.
- **A turn about to start while a weight update runs** (its engine paused): it is not sent; the
  group asks the core as for an abort, once nothing is in flight, and the answer comes when the
  update is over. A paused engine is never sent new work it would hold through the update.
- **An engine that fails** (connection refused, 5xx): every sample starts over on the engine the
  core assigns next, at most ``MAX_ENGINE_FAILURES`` times.
- **An engine that refuses a request** (4xx): every sample starts over, at most ``MAX_REJECTED``
  times, then the prompt fails with the engine's message.
- **A busy engine** (503 queue full): that call is sent again after a backoff; nothing else changes.
- **Cancellation** (the lease given back, the agent stopping): every sample's task is cancelled; a
  sync function's next engine call raises ``CancelledError``. Nothing it made is kept.

**The OpenAI endpoint** (agent/openai_server.py): while a sample's function runs, its handle
carries ``openai_base_url`` / ``openai_api_key``, and the endpoint's calls go through the same
``generate``. What would end the sample (a restart, a failure) reaches the function there only as
an HTTP error, so it is handed to :func:`_sample` instead, which cancels the function and acts on it
as if ``generate`` had raised it. The function's None (or ``{reward, metadata}``) is the recording.

**Request ids.** Every ``/generate`` call gets its own rid, ``<base>-c<k>``: ``base`` is the sample's id in
the assignment (``rf-<lease>-<attempt>-<sample>``, fixed width, so ``<base>-c<k>`` prefix-matches only
calls of the same sample) and ``k`` counts the sample's calls. A function may run several calls of one
sample at once (``asyncio.gather``); SGLang refuses a second live request with the same rid (400
"Duplicate request ID detected"). The calls in flight are listed in the lease context's
:class:`LiveRids`, so that an abort of a sample's base rid (the core names base rids) can reach them:
SGLang ignores an abort of a rid it does not hold exactly.

Invariant: the core is asked about an abort only when none of the group's calls is in flight, as
for single-turn groups, so a new assignment never races an old request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from array import array
from typing import Any

from agent.engine_client import sample_status
from agent.events import EngineWanted, GenerationEnded
from agent.openai_session import Conversation
from agent.retry_policy import GroupRetries, busy_backoff
from agent.spans import continuation, join
from common.errors import EngineBusy, EngineRejected, EngineUnavailable, RolloutError
from common.generation import Generation, RolloutTask, Trajectory
from common.plugins import import_callable, is_async_callable
from common.types import Sample

log = logging.getLogger("rollfleet.agent")

SYNC_THREADS = 256
"""Worker threads for sync generate functions (each sample holds one while it runs)."""

_executor: concurrent.futures.ThreadPoolExecutor | None = None


class GenerateError(RolloutError):
    """A generate function raised, or returned something that is not a trajectory."""


def load_generate(spec: str):
    """The generate function named by ``spec`` (``module:function``), or None for the built-in single turn."""
    if not spec:
        return None
    return import_callable(spec, kind="generate")


class LiveRids:
    """The request ids in flight per base rid: what an abort of a sample must name on SGLang.

    A custom generate function's calls run as ``<base>-c<k>`` (see the module docstring); SGLang's
    ``/abort_request`` ignores a rid its tokenizer manager does not hold exactly, so an abort of
    ``base`` must be sent for each live call rid instead (:meth:`expand`). Entries leave with their
    calls: the registry holds only what is in flight. Event-loop thread only.
    """

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: dict[str, set[str]] = {}

    def add(self, base: str, rid: str) -> None:
        self._live.setdefault(base, set()).add(rid)

    def discard(self, base: str, rid: str) -> None:
        rids = self._live.get(base)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self._live[base]

    def expand(self, base: str) -> list[str]:
        """The live call rids of ``base`` (sorted), or ``[base]`` when none is live (the built-in
        single-turn path sends the base rid itself)."""
        rids = self._live.get(base)
        return sorted(rids) if rids else [base]

    def expand_all(self, bases) -> list[str]:
        """:meth:`expand` of each of ``bases``, in order."""
        return [rid for base in bases for rid in self.expand(base)]

    def __len__(self) -> int:
        return sum(len(r) for r in self._live.values())


class _Restart(BaseException):
    """Internal: start every sample of the group over (``engine_failed``: on another engine).

    A BaseException, like cancellation: a generate function's ``except Exception`` must not swallow it."""

    def __init__(self, why: str, *, engine_failed: bool = False, rejected: EngineRejected | None = None):
        super().__init__(why)
        self.engine_failed = engine_failed
        self.rejected = rejected


class _SampleRestart(BaseException):
    """Internal: start this sample's function over (a weight update with partial rollout off)."""


class _Gate:
    """The group's current engine assignment, and the one resolution of each abort."""

    def __init__(self, runner, assignment):
        self.runner = runner
        self.assignment = assignment
        self._weights = runner.ctx.weights  # the agent's WeightState (read only), or None
        self.epoch = self._weights.begun if self._weights is not None else 0
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._resolution: asyncio.Future | None = None

    async def send(self, sample: int, call: int, input_ids: list[int], params: dict) -> tuple[dict, Any]:
        """One ``/generate`` on the current assignment; returns the answer and the assignment it ran on.

        The call runs as ``<base>-c<call>`` (``call``: the sample's call counter), listed in the lease
        context's :class:`LiveRids` while it is in flight.

        A call about to start while a weight update runs on the agent (or after one began since the
        assignment) is not sent to the paused engine: the group asks the core first, as an aborted
        call would, and goes on with its answer once the update is over.
        """
        while True:
            await self._open.wait()
            w = self._weights
            if w is None or not (w.updating or w.begun != self.epoch):
                break
            if not (await self.aborted()).resume:
                raise _Restart("a weight update began")
        assignment = self.assignment
        base = assignment.request_ids[sample]
        rid = f"{base}-c{call}"
        live = self.runner.ctx.live_rids
        live.add(base, rid)
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self.runner.ctx.client.generate(assignment.url, input_ids, params, rid), assignment
        finally:
            live.discard(base, rid)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def aborted(self):
        """An answer came back aborted: the core's answer (the new assignment), asked once for the group."""
        if self._resolution is None:
            self._resolution = asyncio.get_running_loop().create_future()
            self._open.clear()
            try:
                await self._idle.wait()
                assignment = await self.runner._ask(GenerationEnded(self.runner.lease, aborted=True))
            except BaseException as exc:
                if not self._resolution.done():
                    self._resolution.set_exception(exc)
                raise
            self.assignment = assignment
            if self._weights is not None:
                self.epoch = self._weights.begun
            self._resolution.set_result(assignment)
            self._resolution = None
            self._open.set()
            return assignment
        return await asyncio.shield(self._resolution)


class EngineHandle:
    """What a generate function calls: ``await generate(input_ids, **params)``, ``encode``, ``decode``."""

    def __init__(self, gate: _Gate, sample: int, sampling: dict, partial: bool, tokenizer):
        self._gate = gate
        self._sample = sample
        self._sampling = sampling
        self._partial = partial
        self._tokenizer = tokenizer
        self._session = None  # the sample's OpenAI endpoint while its function runs (agent/openai_server.py)
        self._calls = 0  # the sample's /generate calls so far: each runs with its own rid (``<base>-c<k>``)

    @property
    def openai_base_url(self) -> str:
        """This sample's OpenAI-compatible endpoint (``http://HOST:PORT/v1/s/<token>``) while its function runs."""
        return self._endpoint().base_url

    @property
    def openai_api_key(self) -> str:
        """The key ``openai_base_url`` wants (``Authorization: Bearer ...``)."""
        return self._endpoint().api_key

    def _endpoint(self):
        if self._session is None:
            raise GenerateError("this agent serves no OpenAI endpoint to generate functions")
        return self._session

    async def _endpoint_generate(self, input_ids: list[int], params: dict) -> Generation:
        """``generate`` for a call on the OpenAI endpoint: what ends the sample is handed to its owner.

        A restart (weight update without partial rollout, failed or refusing engine) or a failure
        would reach the function as an exception from ``engine.generate``; through the endpoint it
        reaches the harness only as an HTTP error, so the owner (:func:`_sample`) acts on it instead.
        """
        from agent.openai_server import SessionEnded

        session = self._session
        try:
            return await self.generate(input_ids, **params)
        except (_Restart, _SampleRestart, Exception) as exc:
            if session is not None:
                session.fail(exc)
            why = "the sample starts over" if isinstance(exc, (_Restart, _SampleRestart)) else "the sample failed"
            raise SessionEnded(f"{why}: {exc}" if str(exc) else why) from None

    async def encode(self, text: Any) -> list[int]:
        """Token ids of ``text`` (a string or chat messages) with the agent's tokenizer (or the engines')."""
        encode_async = getattr(self._tokenizer, "encode_async", None)
        return list(await encode_async(text) if encode_async is not None else self._tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids))

    async def generate(self, input_ids: list[int], **params: Any) -> Generation:
        """Generate after ``input_ids`` with the group's sampling params, ``params`` overriding them."""
        merged = {**self._sampling, **params}
        merged.pop("n", None)
        answers: list[dict] = []
        busy_rounds = 0
        tokens = self._gate.runner.ctx.tokens
        while True:
            ids, budget = continuation(list(input_ids), answers, merged)
            try:
                self._calls += 1
                out, assignment = await self._gate.send(self._sample, self._calls, ids, budget)
            except EngineBusy:
                busy_rounds += 1
                await asyncio.sleep(busy_backoff(busy_rounds))
                continue
            except EngineRejected as exc:
                raise _Restart(str(exc), rejected=exc) from None
            except EngineUnavailable as exc:
                raise _Restart(str(exc), engine_failed=True) from None
            busy_rounds = 0
            answers.append(out)
            n = out["meta_info"].get("completion_tokens")
            if isinstance(n, int):
                tokens[assignment.engine] = tokens.get(assignment.engine, 0) + n
            if sample_status(out["meta_info"].get("finish_reason")) != "aborted":
                return _generation(answers)
            resolution = await self._gate.aborted()
            if not resolution.resume:
                raise _Restart("the generation was aborted")
            if not self._partial:
                raise _SampleRestart()
            if budget["max_new_tokens"] - len(_generation([out]).tokens) <= 0:
                return _generation(answers)


class SyncEngineHandle:
    """The same handle for a sync generate function, which runs in a worker thread: calls block."""

    def __init__(self, handle: EngineHandle, loop: asyncio.AbstractEventLoop):
        self._handle = handle
        self._loop = loop
        self.cancelled = False
        self._pending: set[concurrent.futures.Future] = set()

    def encode(self, text: Any) -> list[int]:
        return self._run(self._handle.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._handle.decode(ids)

    @property
    def openai_base_url(self) -> str:
        return self._handle.openai_base_url

    @property
    def openai_api_key(self) -> str:
        return self._handle.openai_api_key

    def generate(self, input_ids: list[int], **params: Any) -> Generation:
        return self._run(self._handle.generate(input_ids, **params))

    def _run(self, coro):
        if self.cancelled:
            coro.close()
            raise asyncio.CancelledError()
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._pending.add(fut)
        try:
            return fut.result()
        finally:
            self._pending.discard(fut)

    def cancel(self) -> None:
        self.cancelled = True
        for fut in list(self._pending):
            fut.cancel()


def _generation(answers: list[dict]) -> Generation:
    tokens, logprobs, text, spans = join(answers)
    meta = answers[-1]["meta_info"]
    reason = meta.get("finish_reason") or {}
    return Generation(
        tokens=list(tokens),
        logprobs=list(logprobs),
        text=text,
        finish_reason=str(reason.get("type") or "stop"),
        weight_versions=spans,
        matched_stop=reason.get("matched"),
    )


async def _call(fn, task: RolloutTask, handle: EngineHandle):
    if is_async_callable(fn):
        return await fn(task, handle)
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="rollfleet-generate")
    loop = asyncio.get_running_loop()
    sync = SyncEngineHandle(handle, loop)
    try:
        return await loop.run_in_executor(_executor, functools.partial(fn, task, sync))
    finally:
        sync.cancel()  # cancelled or done: a thread still running gets CancelledError at its next call


async def _sample(fn, task: RolloutTask, handle: EngineHandle) -> Trajectory:
    ctx = handle._gate.runner.ctx
    while True:
        conversation = session = None
        if ctx.openai is not None:  # the sample's OpenAI endpoint, open while its function runs
            conversation = Conversation(ctx.chat_renderer, ctx.tool_parser, task.sampling["max_new_tokens"])
            session = handle._session = ctx.openai.open(conversation, handle._endpoint_generate)
        try:
            out = await _run(fn, task, handle, session)
        except _SampleRestart:
            continue
        finally:
            if session is not None:
                handle._session = None
                ctx.openai.end(session, "its generate function is over")
        return _result(out, conversation)


async def _run(fn, task: RolloutTask, handle: EngineHandle, session):
    """The function's result, or what a call on its endpoint ended the sample with (the function cancelled).

    Restarts and cancellation pass through (BaseExceptions); a RolloutError names its step already;
    anything else the function raised is a ``GenerateError``.
    """
    job = asyncio.ensure_future(_call(fn, task, handle))
    try:
        await asyncio.wait({job} if session is None else {job, session.failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not job.done():
            job.cancel()  # a failure on the endpoint, or this sample cancelled: the harness goes with it
            await asyncio.gather(job, return_exceptions=True)
    if session is not None and session.failed.done():
        failure = session.failed.result()
        if isinstance(failure, (_Restart, _SampleRestart, RolloutError)):
            raise failure
        raise GenerateError(f"a call on the OpenAI endpoint failed: {type(failure).__name__}: {failure}")
    try:
        return job.result()
    except RolloutError:
        raise
    except Exception as exc:
        raise GenerateError(f"generate function raised {type(exc).__name__}: {exc}") from exc


def _result(out: Any, conversation: Conversation | None) -> Trajectory:
    """What the function returned; None, or a dict of ``reward`` (and ``metadata``) only: the recording."""
    own = isinstance(out, dict) and set(out) <= {"reward", "metadata"}
    if conversation is not None and (out is None or own):
        if not conversation.calls:
            what = "None" if out is None else f"only {sorted(out)}"
            raise GenerateError(f"generate function returned {what} and made no call on its OpenAI endpoint")
        traj = conversation.trajectory()
        if own:
            traj.reward = out.get("reward")
            traj.metadata.update(out.get("metadata") or {})
        return as_trajectory(traj)
    return as_trajectory(out)


def as_trajectory(out: Any) -> Trajectory:
    """A generate function's return value as a :class:`Trajectory` (a dict of its fields is accepted)."""
    if isinstance(out, Trajectory):
        traj = out
    elif isinstance(out, dict):
        unknown = set(out) - {"tokens", "logprobs", "loss_mask", "reward", "metadata", "status", "text",
                              "weight_versions"}  # fmt: skip
        if unknown:
            raise GenerateError(f"generate function returned unknown field(s) {sorted(unknown)}")
        traj = Trajectory(reward=out.get("reward"), metadata=out.get("metadata"))
        traj.tokens = list(out.get("tokens") or [])
        traj.logprobs = list(out.get("logprobs") or [])
        traj.loss_mask = list(out["loss_mask"]) if "loss_mask" in out else [1] * len(traj.tokens)
        traj.weight_versions = list(out.get("weight_versions") or [])
        traj.texts = [str(out.get("text") or "")]
        traj.status = out.get("status")
    else:
        raise GenerateError(f"generate function returned {type(out).__name__}, expected a Trajectory or a dict")
    n = len(traj.tokens)
    if len(traj.logprobs) != n or len(traj.loss_mask) != n:
        raise GenerateError(
            f"generate function returned {n} tokens, {len(traj.logprobs)} logprobs and {len(traj.loss_mask)} "
            "loss-mask entries; they must be equal"
        )
    if any(m not in (0, 1) for m in traj.loss_mask):
        raise GenerateError("generate function returned a loss_mask with entries other than 0 and 1")
    if traj.status not in (None, "completed", "truncated", "aborted"):
        raise GenerateError(f"generate function returned status {traj.status!r}")
    if traj.reward is not None and not isinstance(traj.reward, (int, float)):
        raise GenerateError(f"generate function returned reward {traj.reward!r}, not a number")
    return traj


async def generate_group(runner, fn, tasks: list[RolloutTask]) -> list[Trajectory]:
    """Every sample of ``runner``'s group made by ``fn``, on engines the core assigns."""
    ctx = runner.ctx
    assignment = await runner._ask(EngineWanted(runner.lease))
    retries = GroupRetries(runner)
    while True:
        gate = _Gate(runner, assignment)
        handles = [
            EngineHandle(gate, i, t.sampling, ctx.config.partial_rollout, ctx.tokenizer) for i, t in enumerate(tasks)
        ]
        try:
            async with asyncio.TaskGroup() as tg:
                jobs = [tg.create_task(_sample(fn, t, h)) for t, h in zip(tasks, handles, strict=True)]
        except BaseExceptionGroup as eg:
            errors = [e for e in eg.exceptions if not isinstance(e, _Restart)]
            if errors:
                raise errors[0] from None  # the prompt fails with it (a RolloutError names the step)
            restart = eg.exceptions[0]
        else:
            runner._dispatch(GenerationEnded(runner.lease))
            return [j.result() for j in jobs]
        if restart.engine_failed:
            assignment = await retries.engine_failed(restart)
        elif restart.rejected is not None:
            assignment = await retries.engine_refused(restart.rejected, str(restart))
        else:
            assignment = gate.assignment  # the core's answer to the abort: start over on it


def to_sample(traj: Trajectory, prompt_tokens: array, label, metadata: dict) -> Sample:
    meta = {**metadata, **traj.metadata} if traj.metadata else metadata
    spans = traj.weight_versions
    return Sample(
        prompt_tokens=prompt_tokens if traj.prompt_tokens is None else array("i", traj.prompt_tokens),
        response_tokens=array("i", traj.tokens),
        response_logprobs=array("d", traj.logprobs),
        loss_mask=array("b", traj.loss_mask),
        reward=0.0,
        status=traj.status or "completed",
        weight_version=str(spans[-1][0]) if spans else "",
        label=label,
        metadata=meta,
        response_text=traj.text,
        weight_versions=spans,
    )
