"""One lease, start to end: n ``/generate`` calls on one engine, reward, filter, commit, report.

A ``LeaseRunner`` is the I/O half of a lease; its decisions belong to the
agent's core (agent/session.py), which it talks to through ``dispatch``:

    EngineWanted ........ the core answers with ``assign()`` (or cancels the task)
    GenerationEnded ..... aborted samples (or ones the engine refused): the core assigns again or
                          gives the lease back
    EngineFailed ........ the engine died mid-group: retried on another engine shortly
    LeaseScored ......... past generation: from here the lease commits even during shutdown
    LeaseFiltered / LeaseCommitted / LeaseFailed: the lease's one outcome

Invariants:
- Commit, then receipt: ``LeaseCommitted`` is dispatched only after the store
  commit returned; the core sends the receipt.
- All samples of a group run on one engine; a failed or cancelled group takes
  its sibling requests down with it (closing a connection aborts it on SGLang).
- No await between ``LeaseScored`` and queueing the commit: a shutdown either
  cancels the lease before it (and releases it) or lets it commit and report.
- Cancellation (the core forgot the lease, or the agent stops) is re-raised.
- Engine errors end in a bounded number of tries (no silent stall, no endless retry):
  ``EngineBusy`` (503 "The request queue is full.") is backpressure: the engine stays
  healthy, the refused samples are asked for again after a growing backoff (the samples that
  ran are kept), each time through the core so a pause or a weight update still applies;
  ``EngineRejected`` (HTTP 4xx) starts the group over at most ``MAX_REJECTED`` times in all,
  then the prompt fails with the engine's message; ``EngineUnavailable`` (connection refused,
  other 5xx) is reported (the supervisor decides about the engine) and the group is retried on
  another engine, at most ``MAX_ENGINE_FAILURES`` times, then the prompt fails. A failed prompt
  is a ``LeaseFailed``: the coordinator counts it like a failing reward (``Starved`` when all fail).
- A single-turn sample runs as its base rid (``AssignEngine.request_ids[i]``): one call per sample
  per round, every round's calls done (or cancelled) before the next, and each round on a new
  assignment (new rids), so no two calls of one sample are ever in flight and an abort of the base
  rid reaches it. Generate functions' calls carry ``<base>-c<k>`` (agent/custom_rollout.py).
- The per-token work is two C-level ``map(itemgetter)`` passes per sample
  (agent/spans.py); only a sample a weight update interrupted has several answers to join.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent import custom_rollout
from agent.engine_client import EngineClient, sample_status
from agent.events import (
    AssignEngine,
    EngineWanted,
    GenerationEnded,
    LeaseCommitted,
    LeaseEvaluated,
    LeaseFailed,
    LeaseFiltered,
    LeaseScored,
    PendingReceipt,
)
from agent.leases import group_size
from agent.retry_policy import GroupRetries, busy_backoff
from agent.spans import continuation, held_tokens
from agent.spans import join as spans_join
from agent.store import GroupStore
from common import faults
from common import protocol as p
from common.config import RolloutConfig
from common.errors import (
    EngineBusy,
    EngineError,
    EngineRejected,
    EngineUnavailable,
    RolloutError,
    StateError,
    StorageFull,
)
from common.filters import FilterError, load_filter
from common.generation import RolloutTask
from common.mixture import DEFAULT, EPOCH_MASK
from common.rewards import RewardError, load_reward
from common.types import Group, Sample

_ONE = array("b", [1])

log = logging.getLogger("rollfleet.agent")


def _failure_kind(exc: RolloutError) -> p.FailureKind:
    """The step that failed."""
    if isinstance(exc, RewardError):
        return p.FailureKind.REWARD_ERROR
    if isinstance(exc, FilterError):
        return p.FailureKind.FILTER_ERROR
    if isinstance(exc, custom_rollout.GenerateError):
        return p.FailureKind.GENERATE_ERROR
    return p.FailureKind.GENERATION_FAILED


@dataclass(frozen=True, slots=True)
class LeaseContext:
    """What every lease of one rollout configuration shares."""

    config: RolloutConfig
    reward: Any
    filter: Any
    tokenizer: Any
    dataset: Any
    client: EngineClient
    store: GroupStore
    agent_id: str
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens generated per engine name, across configurations (the agent's metrics read it)."""
    generate: Any = None
    """The custom generate function (``--generate``), or None: one ``/generate`` per sample."""
    weights: Any = None
    """The agent core's ``WeightState`` (read only): a generate function's next turn waits out an update."""
    openai: Any = None
    """The agent's OpenAI endpoint (agent/openai_server.py) for generate functions, or None."""
    chat_renderer: Any = None
    """The endpoint's chat renderer (agent/chat_render.py), or why there is none (a string)."""
    tool_parser: Any = None
    """``--tool-parser``, loaded (agent/tool_parsers.py)."""
    loaded: dict = field(default_factory=dict)
    """Training sources' own rewards and filters (``LeaseGrant.reward``, ``filter``), loaded once each."""
    live_rids: custom_rollout.LiveRids = field(default_factory=custom_rollout.LiveRids)
    """The rids of generate functions' calls in flight, by the sample's base rid (agent/custom_rollout.py):
    an abort of a base rid must name them (``live_rids.expand(base)``). Pass the agent's one registry so
    that it outlives a reconfiguration."""

    def reward_for(self, spec: str) -> Any:
        """The reward of a grant whose source names ``spec`` ("": the fleet's)."""
        return self._own(load_reward, spec) if spec else self.reward

    def filter_for(self, spec: str) -> Any:
        """The dynamic filter of a grant whose source names ``spec`` ("": the fleet's)."""
        return self._own(load_filter, spec) if spec else self.filter

    def _own(self, load: Callable[[str], Any], spec: str) -> Any:
        if (load, spec) not in self.loaded:
            self.loaded[(load, spec)] = load(spec)
        return self.loaded[(load, spec)]


class LeaseRunner:
    def __init__(self, grant: p.LeaseGrant, ctx: LeaseContext, dispatch: Callable[[object], None]):
        self.grant = grant
        self.lease: int = grant.lease
        self.ctx = ctx
        self._dispatch = dispatch
        self._assignment: asyncio.Future[AssignEngine] | None = None
        self.task: asyncio.Task | None = None

    def assign(self, assignment: AssignEngine) -> None:
        """The core's answer to this lease's ``EngineWanted`` (or to an aborted generation)."""
        fut = self._assignment
        if fut is not None and fut.cancelled():
            return  # the runner is being cancelled (the agent stops): nothing to run
        if fut is None or fut.done():
            raise StateError(f"lease {self.lease:x} was assigned an engine it did not ask for")
        fut.set_result(assignment)

    def _ask(self, event) -> asyncio.Future[AssignEngine]:
        # The future exists before the event is dispatched: the core may answer at once.
        fut = self._assignment = asyncio.get_running_loop().create_future()
        self._dispatch(event)
        return fut

    async def run(self) -> None:
        grant = self.grant
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except StorageFull:
            # The agent stops for it (agent/worker.py); the prompt is not to blame: given back uncounted.
            self._dispatch(LeaseFailed(self.lease, failure=None))
        except RolloutError as exc:
            # Bad reward/filter code or a rejected request: give the prompt back and
            # say why, tagged by step (the coordinator filters a prompt that keeps
            # failing, and stops admission when every group fails); the agent keeps serving.
            log.error("lease %x (index %d) failed: %s", self.lease, grant.index, exc)
            self._dispatch(LeaseFailed(self.lease, p.Failure.of(_failure_kind(exc), str(exc))))
        except Exception as exc:
            # Anything else (a chat template that rejects a row, a store error) is a
            # failure of this one prompt, not of the agent.
            log.exception("lease %x (index %d) failed unexpectedly", self.lease, grant.index)
            detail = f"{type(exc).__name__}: {exc}"
            self._dispatch(LeaseFailed(self.lease, p.Failure.of(p.FailureKind.GENERATION_FAILED, detail)))

    async def _run(self) -> None:
        ctx, grant, lease = self.ctx, self.grant, self.lease
        epoch, index = grant.data_epoch, grant.index
        if grant.prompt is not None:
            prompt, label, metadata = grant.prompt, grant.label, dict(grant.metadata)
        else:  # replicated dataset: the grant carries the index only
            row = ctx.dataset.row(index)
            prompt, label, metadata = row.prompt, row.label, dict(row.metadata)
        metadata["prompt"] = prompt
        encode_async = getattr(ctx.tokenizer, "encode_async", None)  # the engines' /tokenize (engine_tokenizer.py)
        input_ids = await encode_async(prompt) if encode_async is not None else ctx.tokenizer.encode(prompt)
        started = time.monotonic()
        prompt_tokens = array("i", input_ids)  # one array shared by the group's samples, as the list was
        if ctx.generate is None:
            results = await self._generate(input_ids)
            samples = [self._sample(answers, prompt_tokens, label, metadata) for answers in results]
            given = [None] * len(samples)
        else:
            trajectories = await self._generate_custom(prompt, input_ids, label, metadata, index)
            samples = [custom_rollout.to_sample(t, prompt_tokens, label, metadata) for t in trajectories]
            given = [t.reward for t in trajectories]
        gen_seconds = time.monotonic() - started
        scores = await ctx.reward_for(grant.reward).score(samples) if None in given else given
        for sample, own, reward in zip(samples, given, scores, strict=True):
            sample.reward = float(reward if own is None else own)
        if grant.eval:  # an evaluation prompt: no filter, nothing stored (coordinator/evaluation.py)
            self._dispatch(LeaseScored(lease, len(samples)))
            result = p.EvalOutcome(
                rewards=[s.reward for s in samples],
                lengths=[len(s.response_tokens) for s in samples],
                truncated=sum(s.status == "truncated" for s in samples),
                versions=sorted({s.weight_version for s in samples}),
            )
            self._dispatch(LeaseEvaluated(lease, grant.eval, grant.eval_pass, result))
            return
        verdict = await ctx.filter_for(grant.filter).check(samples)
        self._dispatch(LeaseScored(lease, len(samples)))
        stats = {
            "n_samples": len(samples),
            "prompt_tokens": len(input_ids) * len(samples),
            "response_tokens": sum(len(s.response_tokens) for s in samples),
            "reward_sum": sum(s.reward for s in samples),
            "truncated": sum(s.status == "truncated" for s in samples),
            "aborted": sum(s.status == "aborted" for s in samples),
            "gen_seconds": gen_seconds,
            # Each sample's tokens: what a sharded trainer's shares and micro-batch counts are computed from.
            "lengths": [len(s.prompt_tokens) + len(s.response_tokens) for s in samples],
        }
        if not verdict.keep:
            self._dispatch(LeaseFiltered(lease, verdict.reason, stats))
            return
        group = Group(
            index=index,
            samples=samples,
            data_epoch=epoch & EPOCH_MASK,  # the source's own epoch (common/mixture.py: epoch keys)
            source=grant.dataset or DEFAULT,
            rollout_id=grant.rollout_id,
            label=label,
            metadata=metadata,
            agent_id=ctx.agent_id,
            gen_seconds=gen_seconds,
        )
        receipt = PendingReceipt(lease, epoch, index, f"{epoch}:{index}:{lease:x}", len(samples), stats)
        if faults.INJECTED is not None:  # tests only: die before the commit, or between it and the receipt
            faults.INJECTED.before_commit(receipt.key)
        await ctx.store.commit(receipt.key, group.to_wire(), receipt.to_dict())
        if faults.INJECTED is not None:
            faults.INJECTED.after_commit(receipt.key)
        self._dispatch(LeaseCommitted(lease, receipt))

    async def _generate_custom(self, prompt, input_ids: list[int], label, metadata: dict, index: int) -> list:
        """The group made by the ``--generate`` function (agent/custom_rollout.py), one call per sample."""
        params = self._params()
        tasks = [
            RolloutTask(prompt, list(input_ids), label, dict(metadata), dict(params), index, i)
            for i in range(self._n_samples())
        ]
        return await custom_rollout.generate_group(self, self.ctx.generate, tasks)

    def _params(self) -> dict:
        """The fleet's sampling parameters, with an evaluation dataset's own over them."""
        params = self.ctx.config.sampling_params()
        params.update(self.grant.sampling)
        return params

    def _n_samples(self) -> int:
        return group_size(self.grant, self.ctx.config.n_samples_per_prompt)

    def _sample(self, answers: list[dict], prompt_tokens: array, label, metadata: dict) -> Sample:
        """One sample from its ``/generate`` answers (several when a weight update interrupted it)."""
        try:
            tokens, response_logprobs, text, spans = spans_join(answers)
        except EngineError as exc:
            raise EngineError(f"{exc} for lease {self.lease:x}") from None
        meta = answers[-1]["meta_info"]
        return Sample(
            prompt_tokens=prompt_tokens,
            response_tokens=tokens,
            response_logprobs=response_logprobs,
            loss_mask=_ONE * len(tokens),
            reward=0.0,
            status=sample_status(meta.get("finish_reason")),
            weight_version=str(spans[-1][0] if spans else meta.get("weight_version", "")),
            label=label,
            metadata=metadata,
            response_text=text,
            weight_versions=spans,
        )

    async def _generate(self, input_ids: list[int]) -> list[list[dict]]:
        """All samples of the group on one engine (on another one if that engine dies): each sample's answers.

        A sample a weight update aborted (the core's answer says ``resume``) keeps its answer and is
        continued from it with partial rollout on, or generated again from its prompt with it off;
        samples that finished are kept. Any other abort, or a failed engine, starts the group over.
        Samples the engine was too busy for are asked for again, the others kept. The module
        docstring bounds the tries.
        """
        client, params = self.ctx.client, self._params()
        partial = self.ctx.config.partial_rollout
        assignment = await self._ask(EngineWanted(self.lease))
        answers: list[list[dict]] = [[] for _ in assignment.request_ids]
        todo = list(range(len(answers)))  # samples without a final answer
        retries, busy_rounds = GroupRetries(self), 0
        while True:
            calls = {
                i: asyncio.ensure_future(
                    client.generate(
                        assignment.url, *continuation(input_ids, answers[i], params), assignment.request_ids[i]
                    )
                )
                for i in todo
            }
            results, busy, failure = await _round(calls)
            if isinstance(failure, EngineRejected):
                assignment = await retries.engine_refused(failure)
                answers, todo = [[] for _ in answers], list(range(len(answers)))
                continue
            if failure is not None:
                # The engine is (maybe) down: the supervisor checks it; the group goes elsewhere, boundedly often.
                assignment = await retries.engine_failed(failure)
                answers, todo = [[] for _ in answers], list(range(len(answers)))
                continue
            aborted = []
            tokens = self.ctx.tokens
            for i, out in results.items():
                answers[i].append(out)
                n = out["meta_info"].get("completion_tokens")
                if isinstance(n, int):
                    tokens[assignment.engine] = tokens.get(assignment.engine, 0) + n
                if sample_status(out["meta_info"].get("finish_reason")) == "aborted":
                    aborted.append(i)
            if not aborted and not busy:
                self._dispatch(GenerationEnded(self.lease))
                return answers
            if busy:
                busy_rounds += 1
                wait = busy_backoff(busy_rounds)
                level = logging.WARNING if busy_rounds == 1 else logging.INFO
                log.log(level, "lease %x: engine %s queue full for %d sample(s); asking again in %.1fs (round %d)",
                        self.lease, assignment.engine, len(busy), wait, busy_rounds)  # fmt: skip
                await asyncio.sleep(wait)
            else:
                busy_rounds = 0
            # A weight update's (the core answers resume), a pause with abort (it gives the lease back) or the engine's.
            assignment = await self._ask(GenerationEnded(self.lease, aborted=True))
            if not assignment.resume and aborted:
                answers, todo = [[] for _ in answers], list(range(len(answers)))
                continue
            # Busy samples never ran: what finished meanwhile is kept (no weight update began, or
            # the core says resume and keeps it anyway).
            todo = []
            for i in sorted(aborted + busy):
                if i in aborted and not partial:
                    answers[i] = []
                if held_tokens(answers[i]) < params["max_new_tokens"]:
                    todo.append(i)


async def _round(calls: dict[int, asyncio.Future]) -> tuple[dict[int, dict], list[int], BaseException | None]:
    """Wait for one round of ``/generate`` calls: (answers by sample, samples refused as busy, the failure).

    A busy refusal lets the other calls run on; any other error ends the round at once, its
    sibling calls cancelled (closing a connection aborts the request on SGLang).
    """
    pending = set(calls.values())
    failure: BaseException | None = None
    try:
        while pending and failure is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for fut in done:
                exc = fut.exception()
                if exc is not None and not isinstance(exc, EngineBusy):
                    failure = exc
                    break
    finally:
        for fut in calls.values():
            fut.cancel()
        await asyncio.gather(*calls.values(), return_exceptions=True)
    if failure is not None:
        if not isinstance(failure, (EngineRejected, EngineUnavailable)):
            raise failure  # not an HTTP error (a bad answer shape, a bug): the prompt fails at once
        return {}, [], failure
    busy = [i for i, fut in calls.items() if isinstance(fut.exception(), EngineBusy)]
    return {i: fut.result() for i, fut in calls.items() if fut.exception() is None}, busy, None
