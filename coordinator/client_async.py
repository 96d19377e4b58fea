"""``AsyncRolloutClient``: the trainer API for asyncio code (``RolloutClient``, coordinator/client.py, runs one
on a private event-loop thread). What the API does: coordinator/client.py's docstring.

The client is a facade over its roles, each handed what it needs: ``TrainerSession`` (coordinator/client_session.py:
attach, join, re-attach, fencing), ``PayloadFetcher`` (coordinator/payloads.py: batches' payloads from the agents),
``WeightSender`` and ``ShardedWeights`` (coordinator/client_weights.py, coordinator/sharded_weights.py: weight
updates, reaching the coordinator through the client's ``_request`` only) and ``Recorder`` (coordinator/recorder.py).
Every answer is decoded into its record before it is returned (coordinator/client_results.py,
coordinator/client_stats.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from common import protocol as p
from common.curve import client_keys
from common.errors import Closed, RolloutError, StateError
from common.transport import validate_endpoint
from coordinator.batch import RolloutBatch
from coordinator.client_results import (
    EvalMetrics,
    MixtureResult,
    PauseResult,
    ResumeResult,
    RolloutState,
    WeightUpdateResult,
)
from coordinator.client_session import TrainerSession, check_rank, default_run
from coordinator.client_stats import FleetStats
from coordinator.client_weights import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, WeightSender
from coordinator.endpoint import FetchFailed, _Endpoint
from coordinator.payloads import PayloadFetcher
from coordinator.shares import decode_lengths

if TYPE_CHECKING:
    from coordinator.sharded_weights import ShardedWeights

log = logging.getLogger("rollfleet.client")


class AsyncRolloutClient:
    """The trainer's client for asyncio code: ``async with AsyncRolloutClient(addr) as client: ...``."""

    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        timeout: float | None = None,
        retry_interval: float = 2.0,
        fetch_timeout: float = 10.0,
        fetch_deadline: float = 30.0,
        attach: bool = True,
        expect: dict | None = None,
        curve_secret: str | None = None,
        curve_server_key: str | None = None,
        record: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        run: str | None = None,
        leader_wait: float = 60.0,
        balance: str = "tokens",
    ):
        """``rank``/``world_size``: this process's place in a trainer of several processes (torchrun,
        accelerate: one per GPU; docs/guides/sharded-trainers.md). Rank 0 leads: it attaches (fencing any
        other trainer), pauses, checkpoints, sets mixtures, evaluates and drives weight updates. A rank above 0
        joins its leader's session as a member: ``generate(t)`` returns that rank's share of batch ``t``.
        ``run`` names the launch the ranks belong to, so that a new launch's leader fences the old one's
        members (default: torchrun's ``TORCHELASTIC_RUN_ID`` and restart count, else ``ROLLFLEET_RUN``, else
        ""; "" joins any leader of the same ``world_size``). ``leader_wait``: seconds a member waits for a
        leader of its run to attach before it raises ``StateError``. ``balance`` (the leader's): ranks' shares
        of balanced tokens (``"tokens"``), or of equal group counts with tokens balanced among those
        (``"groups"``: a trainer whose per-process batch has a fixed size, e.g. TRL's).

        ``curve_secret``: this trainer's ``NAME.key_secret`` file; ``curve_server_key``: the coordinator's
        public key file (``coordinator.key``). Both or neither; a missing or malformed file raises ConfigError.

        ``fetch_timeout``: seconds one payload fetch from an agent may take (resent meanwhile);
        ``fetch_deadline``: seconds a batch's payloads on an agent that does not answer (down, or
        partitioned away from this trainer while the coordinator still hears it) are retried before
        they are reported missing, so the coordinator completes the batch with replacements.

        ``record``: a directory where every batch this client returns is written as
        ``rollout-<rollout_id>.parquet``, and every evaluation pass as ``eval-<name>-<pass>.json``
        (coordinator/recorder.py: on a thread, atomically, once per id; needs ``rollfleet[record]``);
        ``coordinator replay --from DIR`` serves them again. None: nothing is recorded, at no cost."""
        self.address = validate_endpoint(address, "coordinator address")
        self.rank, self.world_size = check_rank(rank, world_size)
        self.run = default_run() if run is None else str(run)
        if not (isinstance(leader_wait, (int, float)) and leader_wait > 0):
            raise ValueError(f"leader_wait must be a number of seconds > 0, got {leader_wait!r}")
        self.leader_wait = float(leader_wait)
        if balance not in ("tokens", "groups"):
            raise ValueError(f"balance must be 'tokens' or 'groups', got {balance!r}")
        self.balance = balance
        self.curve = client_keys(
            curve_secret, curve_server_key, secret_flag="curve_secret", server_flag="curve_server_key"
        )
        self.expect = dict(expect or {})
        """Rollout config fields the fleet must run with (``Attach.config_check``)."""
        self.client_id = client_id or f"trainer-{uuid.uuid4().hex[:8]}"
        self.requester = f"{self.client_id} rank {self.rank}/{self.world_size}"
        """How this process names itself to the agents it fetches payloads from (their debug log)."""
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.fetch_timeout = fetch_timeout
        if not (isinstance(fetch_deadline, (int, float)) and fetch_deadline > 0):
            raise ValueError(f"fetch_deadline must be a number of seconds > 0, got {fetch_deadline!r}")
        self.fetch_deadline = fetch_deadline
        self._attach_wanted = attach
        self.consumed = -1
        self._session = TrainerSession(
            client_id=self.client_id,
            expect=self.expect,
            rank=self.rank,
            world_size=self.world_size,
            run=self.run,
            balance=self.balance,
            retry_interval=retry_interval,
            timeout=timeout,
            leader_wait=self.leader_wait,
        )
        """The session at the coordinator: attach, join, re-attach (coordinator/client_session.py)."""
        self._ctx: zmq.asyncio.Context | None = None
        self._payloads: PayloadFetcher | None = None
        """Fetches batches' payloads from the agents (coordinator/payloads.py); made with the ZeroMQ context."""
        self._closed = False
        self._weights = WeightSender(self._request, self.address, lambda: self._session.heartbeat_interval)
        """Rank 0's side of weight updates (coordinator/client_weights.py), reaching the coordinator through
        ``_request`` only."""
        self._sharded: ShardedWeights | None = None
        """Every rank's side of weight updates with ``world_size > 1``, made at first use."""
        self._recorder = None
        if record is not None:
            from coordinator.recorder import Recorder

            self._recorder = Recorder(record)

    @property
    def config(self) -> dict:
        """The fleet's rollout config (``RolloutConfig`` as a dict), from the attach answer; {} before it."""
        return self._session.config

    @property
    def session(self) -> int:
        """This process's session id at the coordinator (0: not attached)."""
        return self._session.id

    async def __aenter__(self) -> AsyncRolloutClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._closed:
            raise Closed("client is closed")
        if self._session.endpoint is None:
            self._ctx = zmq.asyncio.Context()
            if self.curve is None:
                hint = " (if the fleet uses CurveZMQ keys, give curve_secret and curve_server_key)"
            else:
                hint = (
                    " (CurveZMQ: check that this client's public key is in the coordinator's --curve-dir trainers/ "
                    "and that curve_server_key is that coordinator's coordinator.key)"
                )
            self._session.endpoint = _Endpoint(self._ctx, self.address, "coordinator", curve=self.curve, hint=hint)
            self._payloads = PayloadFetcher(
                self._ctx,
                curve=self.curve,
                requester=self.requester,
                retry_interval=max(self.retry_interval, 2.0),
                timeout=self.fetch_timeout,
            )
        if self._attach_wanted:
            await self._session.ensure()

    async def _call(self, make, what: str) -> p.Message:
        """A session-bound trainer request (``make(session, req)``); its answer message."""
        await self.connect()
        return await self._session.call(make, what)

    async def _request(self, make, what: str) -> dict:
        """A session-bound trainer request (``make(session, req)``); its result: the ``Request`` seam
        (coordinator/client_session.py) the weight senders are handed."""
        await self.connect()
        return await self._session.request(make, what)

    # ---------------------------------------------------------------- API

    async def generate(
        self, rollout_id: int, prefetch: int | None = None, deadline: float | None = None
    ) -> RolloutBatch:
        """The batch for ``rollout_id``: exactly ``rollout_batch_size`` groups (fewer with ``deadline``).

        Asking for a batch not generated yet resumes a paused rollout (so a
        trainer restarted after dying while paused is not left waiting).
        ``prefetch`` (ready groups kept beyond demand), when given, replaces the
        coordinator's ``--prefetch`` for this and every later call, until another
        ``generate(..., prefetch=N)`` or a coordinator restart; None keeps the current one.

        ``deadline`` (seconds > 0): if the batch is not full that long after the coordinator first
        got this call, it is made of the groups ready then (at least one: with none ready, as soon
        as one is), a *partial batch*; ``batch.deficit`` (metric ``rollout/deficit``) says how many
        groups it lacks. It is recorded like any batch: asked again, the same id returns the same
        partial batch, and the prompts it lacks are generated for later batches. None: wait for a full batch.

        Raises ``NoCapacity`` when no engine is left anywhere (or every one is stale: push an
        update), and ``Starved`` when every recent group failed (a reward or filter that raises):
        its message names the failure,
        and the next call starts over (e.g. once the agents run a fixed reward).
        """
        if deadline is not None and not (isinstance(deadline, (int, float)) and 0 < deadline < float("inf")):
            raise ValueError(f"generate({rollout_id}): deadline must be a number of seconds > 0, got {deadline!r}")
        started = time.monotonic()
        wire_prefetch, wire_deadline = -1 if prefetch is None else prefetch, float(deadline or 0.0)
        unreachable_since: float | None = None
        while True:
            refs = await self._call(
                lambda s, req: p.Generate(s, req, rollout_id, wire_prefetch, wire_deadline, self.rank),
                f"generate({rollout_id})",
            )
            waited = time.monotonic() - started
            raw: list[bytes] | None = [] if self._recorder is not None else None
            try:
                groups = await self._payloads.fetch(refs.groups, raw)
                break
            except FetchFailed as exc:
                # The node holding some payloads is down. It either comes back (its
                # disk survives; the coordinator then has its new address) or is
                # retired, and the coordinator completes the batch with replacements.
                if self.timeout is not None and time.monotonic() - started > self.timeout:
                    raise RolloutError(f"generate({rollout_id}): {exc}") from None
                log.warning("generate(%d): %s; asking the coordinator again", rollout_id, exc)
                missing = exc.missing
                if exc.unreachable:
                    # Down or partitioned from us (the coordinator may still hear it, and then never
                    # retires it): past the deadline its groups count as missing and are replaced.
                    now = time.monotonic()
                    unreachable_since = now if unreachable_since is None else unreachable_since
                    if now - unreachable_since >= self.fetch_deadline:
                        log.warning(
                            "generate(%d): %d group(s) unreachable for %.1fs (fetch_deadline); reporting them "
                            "missing so the batch is completed with replacements",
                            rollout_id,
                            len(exc.unreachable),
                            now - unreachable_since,
                        )
                        missing = missing + exc.unreachable
                        unreachable_since = None
                else:
                    unreachable_since = None
                if missing:
                    # The node is up but lost them (wiped disk): the coordinator replaces them.
                    await self._request(lambda s, req, keys=missing: p.Missing(s, req, rollout_id, keys), "missing")
                else:
                    await asyncio.sleep(self.retry_interval)
        # Tell the coordinator the batch is in hand before returning it: from now on
        # its prompts are never generated again, even if their node is lost.
        await self._request(lambda s, req: p.Consumed(s, req, rollout_id, self.rank), "consumed")
        self.consumed = max(self.consumed, rollout_id)
        metrics = dict(refs.metrics)
        metrics["rollout/wait_seconds"] = waited
        metrics["rollout/fetch_seconds"] = time.monotonic() - started - waited
        fleet = self._session.fleet
        if self._recorder is not None and not self._recorder.batch_nowait(rollout_id, raw, metrics, fleet):
            # The writer is MAX_QUEUED batches behind (a slow disk): wait for room, off the loop.
            await asyncio.to_thread(self._recorder.batch, rollout_id, raw, metrics, fleet)
        share = refs.share or {}
        return RolloutBatch(
            rollout_id,
            groups,
            metrics,
            rank=self.rank,
            world_size=int(share.get("world_size", 1)),
            rank_lengths=decode_lengths(share.get("lengths")),
        )

    async def pause(self, drain: bool = True, abort: bool = False) -> PauseResult:
        """Stop admission; with ``drain`` wait until no lease is in flight (results durable). ``abort``: the agents
        abort the generations in flight instead of finishing them.

        The pause is durable: it survives a coordinator restart. It lasts until
        ``resume()`` or a ``generate()`` of a batch not generated yet.
        """
        self._leader_only("pause")
        answer = await self._request(lambda s, req: p.Pause(s, req, bool(drain), bool(abort)), "pause")
        return PauseResult.from_wire(answer)

    async def resume(self) -> ResumeResult:
        """Admission on again (durably); a ``pause(drain=True)`` still waiting for its drain raises ``StateError``."""
        self._leader_only("resume")
        return ResumeResult.from_wire(await self._request(lambda s, req: p.Resume(s, req), "resume"))

    async def set_mixture(self, weights: dict[str, float]) -> MixtureResult:
        """The training datasets' weights (``{"math": 0.7, "code": 0.3}``, names of ``--dataset NAME=PATH,...``;
        a name left out weighs 0) from the next batch not generated yet on (``MixtureResult.from_rollout_id``).
        Recorded in the ledger before the answer: a restart keeps it, and a batch generated again for its
        rollout id is the same."""
        self._leader_only("set_mixture")
        answer = await self._request(lambda s, req: p.SetMixture(s, req, dict(weights)), "set_mixture")
        return MixtureResult.from_wire(answer)

    async def state_dict(self) -> RolloutState:
        """The consumed frontier: the checkpoint payload, a plain dict of JSON data (``RolloutState``) to save with
        the model and hand back to ``load_state_dict``. Only while paused and drained."""
        self._leader_only("state_dict")
        return await self._request(lambda s, req: p.StateDict(s, req, self.consumed), "state_dict")

    async def load_state_dict(self, state: RolloutState) -> None:
        """Resume at a checkpoint (``state_dict()``'s payload, as loaded): batches after it are delivered again,
        identical."""
        self._leader_only("load_state_dict")
        if not isinstance(state, dict):
            raise StateError("not a rollfleet state_dict (format 1)")
        await self._request(lambda s, req: p.LoadStateDict(s, req, state), "load_state_dict")
        self.consumed = state["rollout_id"]

    async def evaluate(self, name: str) -> EvalMetrics:
        """One pass over the evaluation dataset ``name`` (``coordinator serve --eval-dataset NAME=PATH``); its metrics.

        Runs on the same fleet as training, first in line for free capacity, without the dynamic
        filter and without touching the training prompts or batches. Returns ``EvalMetrics``: mean reward,
        pass@k (``pass_at[k]``), response length, truncated ratio, the weight versions the samples came from.
        Every prompt is counted once, also across coordinator restarts (the pass resumes) and when
        this process dies and calls again (it joins the running pass). A later call starts the next pass.
        Raises ``RemoteError`` (code ``unknown_eval``) for a name the coordinator does not declare.
        """
        self._leader_only("evaluate")
        token = uuid.uuid4().hex
        msg = await self._call(lambda s, req: p.Evaluate(s, req, name, token), f"evaluate({name!r})")
        if self._recorder is not None and not self._recorder.evaluation_nowait(msg.result, self.consumed):
            await asyncio.to_thread(self._recorder.evaluation, msg.result, self.consumed)
        return EvalMetrics.from_wire(msg.result)

    def _leader_only(self, what: str) -> None:
        if self.rank:
            raise StateError(
                f"{what}() is the leader's call (rank 0); this is rank {self.rank} of {self.world_size}: "
                "call it on rank 0 only (members generate their shares and take part in weight updates)"
            )

    async def stats(self) -> FleetStats:
        """The coordinator's view of the fleet now (``FleetStats``: weights, batches, prompts, agents, datasets,
        evaluations; ``.raw`` is what ``coordinator status --json`` prints). Needs no session: any rank, or a
        client made with ``attach=False``, may ask."""
        await self.connect()
        return FleetStats.from_wire(await self._session.ask(lambda req: p.Stats(req), "stats"))

    # ---------------------------------------------------------------- weights

    def _ranks(self) -> ShardedWeights:
        """Every rank's side of the weight calls (``world_size > 1``), made at first use."""
        if self._sharded is None:
            from coordinator.sharded_weights import ShardedWeights

            self._sharded = ShardedWeights(self._weights, self.rank, self.world_size)
        return self._sharded

    async def update_weights_from_disk(
        self, path: str, version: int, *, timeout: float = DEFAULT_TIMEOUT, group=None
    ) -> WeightUpdateResult:
        """Every engine loads the checkpoint at ``path`` and serves ``version`` (greater than the fleet's);
        returns once they all do, with ``engines``: ``{"agent/engine": version}``.

        Raises ``WeightUpdateError`` naming the agent and engine that failed (or the deadline missed),
        ``StateError`` when another trainer's update runs or ``version`` is not above the current one.

        With ``world_size > 1`` every rank calls it (inside ``torch.distributed``'s default group, or ``group``):
        rank 0 alone asks the coordinator, and every rank returns its result or raises its error.
        """
        if self.world_size > 1:
            return await self._ranks().from_disk(path, version, timeout, group)
        return await self._weights.from_disk(path, version, timeout)

    async def update_weights(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool | None = None,
        group=None,
    ) -> WeightUpdateResult:
        """Broadcast ``named_tensors`` (a mapping or ``(name, tensor)`` pairs) to every engine as rank 0,
        in buckets of up to ``bucket_bytes``; returns as ``update_weights_from_disk`` does.

        ``backend="gloo"`` works on CPU tensors. ``timeout`` is the update's deadline (restarted by each
        bucket) and the process group's. ``verify``: every engine's copy of the first, middle and last
        tensor is compared with what was sent (``/get_weights_by_name``, their first rows) before it
        serves; a mismatch fails the update naming the engine. ``None`` (default): the first update
        of a group and every tenth after. Errors as ``update_weights_from_disk``.

        An update that fails because an engine was lost in it (code ``weights``) is retried once,
        transparently, on a new group; the result's ``retried`` is then the first attempt's error.

        With ``world_size > 1`` (a sharded trainer) every rank calls it with its own view of the model: FSDP2
        DTensors (gathered bucket by bucket with ``full_tensor()``), tensors every rank passes alike, or tensors
        only some ranks pass (sent to rank 0), inside ``torch.distributed``'s default group or ``group`` (no
        other collective may run on it meanwhile). Rank 0 sends each bucket to the engines; every rank returns
        rank 0's result (a retry is one on every rank) or raises its error; a rank lost mid-update makes the
        others raise ``WeightUpdateError`` and rank 0 abort the update (docs/weights.md, "Sharded trainers").
        """
        if self.world_size > 1:
            return await self._ranks().broadcast(named_tensors, version, backend, bucket_bytes, timeout, verify, group)
        return await self._weights.broadcast(named_tensors, version, backend, bucket_bytes, timeout, verify)

    async def catch_up(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = True,
        group=None,
    ) -> WeightUpdateResult:
        """Bring the engines behind the fleet's current ``version`` (restarted or joined since the last
        broadcast: ``stats().weights.behind``) up to it, while every other engine keeps serving and
        admission goes on. ``named_tensors`` are the current version's (e.g. the model before its next
        optimizer step); they are read only when some engine is behind. The result's ``engines`` are the
        engines brought back (empty: none was behind, or the fleet's
        weights came from disk, which agents re-load themselves). Verified by default. Raises
        ``WeightUpdateError`` as ``update_weights`` does, ``StateError`` when ``version`` is not the
        fleet's or another update runs. With ``world_size > 1`` every rank calls it, as ``update_weights``;
        with nothing behind every rank returns at once, nothing gathered.
        """
        if self.world_size > 1:
            return await self._ranks().catch_up(named_tensors, version, backend, bucket_bytes, timeout, verify, group)
        return await self._weights.catch_up(named_tensors, version, backend, bucket_bytes, timeout, verify)

    async def weight_version(self) -> int:
        """The fleet's current weight version (the last update recorded): ``stats().weights.version``."""
        return (await self.stats()).weights.version

    async def close(self) -> None:
        """Leave the fleet (the leader detaches, so the next trainer attaches at once) and release everything;
        batches queued for ``record`` are written first. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await self._weights.close()
        if self._sharded is not None:
            self._sharded.close()
        if self._recorder is not None:
            await asyncio.to_thread(self._recorder.close)  # what is queued is written before close returns
        await self._session.detach()
        if self._payloads is not None:
            await self._payloads.close()
        if self._session.endpoint is not None:
            await self._session.endpoint.close()
        if self._ctx is not None:
            self._ctx.term()
