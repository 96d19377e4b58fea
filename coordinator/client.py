"""The trainer API: pull batches, pause/resume, checkpoint.

    from coordinator.client import RolloutClient

    with RolloutClient("tcp://coordinator:5555") as client:
        for step in range(100):
            batch = client.generate(step)
            tensors = batch.to_tensors()      # torch, padded
            print(batch.metrics["rollout/reward_mean"])

``generate(rollout_id)`` asks the coordinator for the batch of that id (a
list of references), then fetches the payloads from the agents that hold
them, in parallel. Asked twice for the same id, it returns the same groups.

Every request is safe to resend: the client resends a request that got no
answer (e.g. while the coordinator restarts) and re-attaches transparently
when the coordinator no longer knows its session. If another trainer
attached meanwhile, calls raise ``Fenced`` instead.

``RolloutClient(addr, expect={...})`` attaches only to a fleet whose rollout
configuration has those values (``StateError`` listing the fields otherwise).
``evaluate(name)`` runs one pass over an evaluation dataset and returns its metrics (mean
reward, pass@k, response length, truncated ratio).
Weight updates (docs/weights.md): ``update_weights_from_disk(path, version)``
and ``update_weights(named_tensors, version, backend=..., bucket_bytes=...)``
(this process is rank 0 of the engines' update group; coordinator/client_weights.py)
return once every engine serves ``version``; ``weight_version()`` reads it.

``RolloutClient(addr, record="DIR")`` also writes every batch it returns to ``DIR/rollout-<id>.parquet``
on a thread (coordinator/recorder.py); ``coordinator replay --from DIR`` serves them again to this same
API, with no fleet (docs/guides/record-and-replay.md).

CurveZMQ (docs/operate/keys.md): ``RolloutClient(addr, curve_secret="trainer.key_secret",
curve_server_key="coordinator.key")`` connects with this trainer's key pair to the coordinator
holding that public key, and to the agents' payload endpoints with the keys their addresses carry.

``AsyncRolloutClient`` is the same API for asyncio code; ``RolloutClient``
runs one on a private event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid

import zmq
import zmq.asyncio

from common import protocol as p
from common.curve import client_keys
from common.errors import Closed, Fenced, RolloutError, StateError
from common.transport import validate_endpoint
from coordinator.batch import RolloutBatch
from coordinator.client_weights import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, WeightSender
from coordinator.endpoint import FetchFailed, _Endpoint, _raise_remote
from coordinator.payloads import PayloadFetcher
from coordinator.shares import decode_lengths

__all__ = ["AsyncRolloutClient", "FetchFailed", "RolloutBatch", "RolloutClient"]

log = logging.getLogger("rollfleet.client")

MAX_REATTACH = 20
"""Re-attaches one call may make (a coordinator restarted that many times while it waited) before it
gives up: a bound against a coordinator that forgets sessions at once, not a limit on restarts."""


def check_rank(rank, world_size) -> tuple[int, int]:
    """``(rank, world_size)`` validated: ints, ``world_size >= 1``, ``0 <= rank < world_size``."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def default_run() -> str:
    """The launch this process belongs to, from the launcher's environment ("" when none says)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return os.environ.get("ROLLFLEET_RUN", "")


class AsyncRolloutClient:
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
        self.session = 0
        self.config: dict = {}
        self.consumed = -1
        self.heartbeat_interval = 1.0
        """Seconds between ``WeightsAlive`` beats while a broadcast runs (the coordinator's, from attach)."""
        self._ctx: zmq.asyncio.Context | None = None
        self._coord: _Endpoint | None = None
        self._payloads: PayloadFetcher | None = None
        """Fetches batches' payloads from the agents (coordinator/payloads.py); made with the ZeroMQ context."""
        self._closed = False
        self._weights = WeightSender(self)
        self._attaching = asyncio.Lock()
        """Held while attaching: concurrent calls that find the coordinator restarted attach once, not each."""
        self._recorder = None
        if record is not None:
            from coordinator.recorder import Recorder

            self._recorder = Recorder(record)
        self._fleet: dict = {}
        """What a recorded file keeps of the fleet (``rollfleet.fleet``): the attach answer's config and dataset."""

    async def __aenter__(self) -> AsyncRolloutClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        if self._closed:
            raise Closed("client is closed")
        if self._coord is None:
            self._ctx = zmq.asyncio.Context()
            if self.curve is None:
                hint = " (if the fleet uses CurveZMQ keys, give curve_secret and curve_server_key)"
            else:
                hint = (
                    " (CurveZMQ: check that this client's public key is in the coordinator's --curve-dir trainers/ "
                    "and that curve_server_key is that coordinator's coordinator.key)"
                )
            self._coord = _Endpoint(self._ctx, self.address, "coordinator", curve=self.curve, hint=hint)
            self._payloads = PayloadFetcher(
                self._ctx,
                curve=self.curve,
                requester=self.requester,
                retry_interval=max(self.retry_interval, 2.0),
                timeout=self.fetch_timeout,
            )
        if self._attach_wanted and not self.session:
            async with self._attaching:
                if not self.session:
                    await self._attach()

    async def _attach(self, rejoin: bool = False) -> None:
        """Open a session (the leader), or join the leader's (a member: waiting up to ``leader_wait`` for a leader
        of its run to attach). ``rejoin``: a member whose session was replaced; a leader of another run having
        attached meanwhile fences it (``Fenced``) instead of being waited for."""
        started = time.monotonic()
        while True:
            msg, _ = await self._coord.request(
                lambda req: p.Attach(
                    req, self.client_id, self.expect, self.rank, self.world_size, self.run, self.balance
                ),
                retry_interval=self.retry_interval,
                timeout=self.timeout,
                what="attach" if self.rank == 0 else f"join (rank {self.rank})",
            )
            if not (isinstance(msg, p.Error) and msg.code in ("no_leader", "other_leader")):
                break
            if rejoin and msg.code == "other_leader":
                raise Fenced(f"rank {self.rank}: a new trainer run's leader attached ({msg.message})", code="fenced")
            if time.monotonic() - started > self.leader_wait:
                raise StateError(f"no leader for this rank after {self.leader_wait:.0f}s (leader_wait): {msg.message}")
            await asyncio.sleep(min(0.5, self.retry_interval))
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        self.session = msg.result["session"]
        self.config = msg.result["config"]
        self.heartbeat_interval = float(msg.result.get("heartbeat_interval", 1.0))
        self._fleet = {
            k: msg.result.get(k) for k in ("config", "dataset_size", "dataset_fingerprint", "weights_version")
        }
        if self.rank:
            log.info("joined session %x at %s as rank %d of %d", self.session, self.address, self.rank, self.world_size)
        else:
            log.info("attached to %s as %s (session %x)", self.address, self.client_id, self.session)

    async def _call(self, make, what: str):
        """A coordinator request that re-attaches once if the coordinator restarted.

        Calls in flight together (a ``generate`` waiting while weights are pushed) share one
        re-attach: the first to hear ``unknown_session`` attaches, the others see the new session
        and ask again with it. A ``fenced`` answer to a session this client has already left
        behind is such a call, asked again too; ``Fenced`` is raised only when another trainer
        replaced this client's current session. A ``generate`` that waits long may span several
        coordinator restarts: each one is attached again, up to ``MAX_REATTACH``."""
        await self.connect()
        for _ in range(MAX_REATTACH):
            async with self._attaching:
                session = self.session
            msg, frames = await self._coord.request(
                lambda req, s=session: make(s, req), retry_interval=self.retry_interval, timeout=self.timeout, what=what
            )
            if isinstance(msg, p.Error) and msg.code == "unknown_session":
                async with self._attaching:
                    if self.session == session:  # nobody attached again meanwhile
                        log.warning("coordinator no longer knows session %x (restarted); attaching again", session)
                        self.session = 0
                        await self._attach()
                continue
            if isinstance(msg, p.Error) and msg.code == "fenced" and session != self.session:
                continue  # answered to the session this client had before it attached again
            if isinstance(msg, p.Error) and msg.code == "fenced" and self.rank:
                # A member: its leader attached again (a coordinator restart) or a new run's leader came.
                async with self._attaching:
                    if self.session == session:
                        self.session = 0
                        await self._attach(rejoin=True)
                continue
            if isinstance(msg, p.Error):
                _raise_remote(msg)
            return msg
        raise RolloutError(f"{what}: could not re-attach to {self.address}")

    async def _request(self, make, what: str) -> dict:
        """A session-bound trainer request (``make(session, req)``); its result."""
        msg = await self._call(make, what)
        return msg.result

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
        if self._recorder is not None and not self._recorder.batch_nowait(rollout_id, raw, metrics, self._fleet):
            # The writer is MAX_QUEUED batches behind (a slow disk): wait for room, off the loop.
            await asyncio.to_thread(self._recorder.batch, rollout_id, raw, metrics, self._fleet)
        share = refs.share or {}
        return RolloutBatch(
            rollout_id,
            groups,
            metrics,
            rank=self.rank,
            world_size=int(share.get("world_size", 1)),
            rank_lengths=decode_lengths(share.get("lengths")),
        )

    async def pause(self, drain: bool = True, abort: bool = False) -> dict:
        """Stop admission; with ``drain`` wait until no lease is in flight (results durable).

        The pause is durable: it survives a coordinator restart. It lasts until
        ``resume()`` or a ``generate()`` of a batch not generated yet.
        """
        self._leader_only("pause")
        return await self._request(lambda s, req: p.Pause(s, req, bool(drain), bool(abort)), "pause")

    async def resume(self) -> dict:
        self._leader_only("resume")
        return await self._request(lambda s, req: p.Resume(s, req), "resume")

    async def set_mixture(self, weights: dict) -> dict:
        """The training datasets' weights (``{"math": 0.7, "code": 0.3}``, names of ``--dataset NAME=PATH,...``;
        a name left out weighs 0) from the next batch not generated yet on; returns ``{"from_rollout_id",
        "weights"}``. Recorded in the ledger before the answer: a restart keeps it, and a batch generated
        again for its rollout id is the same."""
        self._leader_only("set_mixture")
        return await self._request(lambda s, req: p.SetMixture(s, req, dict(weights)), "set_mixture")

    async def state_dict(self) -> dict:
        """The consumed frontier, as plain JSON data. Only while paused and drained."""
        self._leader_only("state_dict")
        return await self._request(lambda s, req: p.StateDict(s, req, self.consumed), "state_dict")

    async def load_state_dict(self, state: dict) -> None:
        """Resume at a checkpoint: batches after it are delivered again, identical."""
        self._leader_only("load_state_dict")
        if not isinstance(state, dict):
            raise StateError("not a rollfleet state_dict (format 1)")
        await self._request(lambda s, req: p.LoadStateDict(s, req, state), "load_state_dict")
        self.consumed = state["rollout_id"]

    async def evaluate(self, name: str) -> dict:
        """One pass over the evaluation dataset ``name`` (``coordinator serve --eval-dataset NAME=PATH``); its metrics.

        Runs on the same fleet as training, first in line for free capacity, without the dynamic
        filter and without touching the training prompts or batches. Returns ``{"name", "pass",
        "prompts", "samples", "failed_prompts", "n_samples", "reward_mean", "pass@1", "pass@2", ...,
        "pass@<n_samples>", "response_length_mean", "truncated_ratio", "weight_versions"}``.
        Every prompt is counted once, also across coordinator restarts (the pass resumes) and when
        this process dies and calls again (it joins the running pass). A later call starts the next pass.
        Raises ``RemoteError`` (code ``unknown_eval``) for a name the coordinator does not declare.
        """
        self._leader_only("evaluate")
        token = uuid.uuid4().hex
        msg = await self._call(lambda s, req: p.Evaluate(s, req, name, token), f"evaluate({name!r})")
        if self._recorder is not None and not self._recorder.evaluation_nowait(msg.result, self.consumed):
            await asyncio.to_thread(self._recorder.evaluation, msg.result, self.consumed)
        return msg.result

    def _leader_only(self, what: str) -> None:
        if self.rank:
            raise StateError(
                f"{what}() is the leader's call (rank 0); this is rank {self.rank} of {self.world_size}: "
                "call it on rank 0 only (members generate their shares and take part in weight updates)"
            )

    async def stats(self) -> dict:
        await self.connect()
        msg, _ = await self._coord.request(
            lambda req: p.Stats(req), retry_interval=self.retry_interval, timeout=self.timeout or 30, what="stats"
        )
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        return msg.result

    # ---------------------------------------------------------------- weights

    async def update_weights_from_disk(
        self, path: str, version: int, *, timeout: float = DEFAULT_TIMEOUT, group=None
    ) -> dict:
        """Every engine loads the checkpoint at ``path`` and serves ``version`` (greater than the fleet's);
        returns ``{"update_id", "version", "engines": {"agent/engine": version}}`` once they all do.

        Raises ``WeightUpdateError`` naming the agent and engine that failed (or the deadline missed),
        ``StateError`` when another trainer's update runs or ``version`` is not above the current one.

        With ``world_size > 1`` every rank calls it (inside ``torch.distributed``'s default group, or ``group``):
        rank 0 alone asks the coordinator, and every rank returns its result or raises its error.
        """
        if self.world_size > 1:
            return await self._weights.sharded().from_disk(path, version, timeout, group)
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
    ) -> dict:
        """Broadcast ``named_tensors`` (a mapping or ``(name, tensor)`` pairs) to every engine as rank 0,
        in buckets of up to ``bucket_bytes``; returns as ``update_weights_from_disk`` does.

        ``backend="gloo"`` works on CPU tensors. ``timeout`` is the update's deadline (restarted by each
        bucket) and the process group's. ``verify``: every engine's copy of the first, middle and last
        tensor is compared with what was sent (``/get_weights_by_name``, their first rows) before it
        serves; a mismatch fails the update naming the engine. ``None`` (default): the first update
        of a group and every tenth after. Errors as ``update_weights_from_disk``.

        An update that fails because an engine was lost in it (code ``weights``) is retried once,
        transparently, on a new group; the result then also holds ``"retried"``: the first attempt's error.

        With ``world_size > 1`` (a sharded trainer) every rank calls it with its own view of the model: FSDP2
        DTensors (gathered bucket by bucket with ``full_tensor()``), tensors every rank passes alike, or tensors
        only some ranks pass (sent to rank 0), inside ``torch.distributed``'s default group or ``group`` (no
        other collective may run on it meanwhile). Rank 0 sends each bucket to the engines; every rank returns
        rank 0's result (a retry is one on every rank) or raises its error; a rank lost mid-update makes the
        others raise ``WeightUpdateError`` and rank 0 abort the update (docs/weights.md, "Sharded trainers").
        """
        if self.world_size > 1:
            return await self._weights.sharded().broadcast(
                named_tensors, version, backend, bucket_bytes, timeout, verify, group
            )
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
    ) -> dict:
        """Bring the engines behind the fleet's current ``version`` (restarted or joined since the last
        broadcast: ``stats()["weights"]["behind"]``) up to it, while every other engine keeps serving and
        admission goes on. ``named_tensors`` are the current version's (e.g. the model before its next
        optimizer step); they are read only when some engine is behind. Returns ``{"update_id",
        "version", "engines"}`` with the engines brought back (empty: none was behind, or the fleet's
        weights came from disk, which agents re-load themselves). Verified by default. Raises
        ``WeightUpdateError`` as ``update_weights`` does, ``StateError`` when ``version`` is not the
        fleet's or another update runs. With ``world_size > 1`` every rank calls it, as ``update_weights``;
        with nothing behind every rank returns at once, nothing gathered.
        """
        if self.world_size > 1:
            return await self._weights.sharded().catch_up(
                named_tensors, version, backend, bucket_bytes, timeout, verify, group
            )
        return await self._weights.catch_up(named_tensors, version, backend, bucket_bytes, timeout, verify)

    async def weight_version(self) -> int:
        """The fleet's current weight version (the last update recorded)."""
        return (await self.stats())["weights"]["version"]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._weights.close()
        if self._recorder is not None:
            await asyncio.to_thread(self._recorder.close)  # what is queued is written before close returns
        if self.session and self._coord is not None and not self.rank:  # a member leaves the session to its leader
            # Leave the fleet for the next trainer; best effort, a dead coordinator must not block close().
            try:
                await self._coord.request(
                    lambda req: p.Detach(self.session, req), retry_interval=0.5, timeout=1.0, what="detach"
                )
            except RolloutError:
                pass
        if self._payloads is not None:
            await self._payloads.close()
        if self._coord is not None:
            await self._coord.close()
        if self._ctx is not None:
            self._ctx.term()


class RolloutClient:
    """Blocking twin of ``AsyncRolloutClient`` (runs it on a private loop thread)."""

    def __init__(self, address: str, **kwargs):
        self._async = AsyncRolloutClient(address, **kwargs)  # a bad address fails here, before any thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollfleet-client", daemon=True)
        self._thread.start()
        try:
            self._run(self._async.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro):
        if self._loop.is_closed():
            coro.close()
            raise Closed("client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def config(self) -> dict:
        return self._async.config

    @property
    def rank(self) -> int:
        return self._async.rank

    @property
    def world_size(self) -> int:
        return self._async.world_size

    def generate(self, rollout_id: int, prefetch: int | None = None, deadline: float | None = None) -> RolloutBatch:
        return self._run(self._async.generate(rollout_id, prefetch, deadline))

    def pause(self, drain: bool = True, abort: bool = False) -> dict:
        return self._run(self._async.pause(drain, abort))

    def resume(self) -> dict:
        return self._run(self._async.resume())

    def set_mixture(self, weights: dict) -> dict:
        return self._run(self._async.set_mixture(weights))

    def state_dict(self) -> dict:
        return self._run(self._async.state_dict())

    def load_state_dict(self, state: dict) -> None:
        self._run(self._async.load_state_dict(state))

    def evaluate(self, name: str) -> dict:
        return self._run(self._async.evaluate(name))

    def stats(self) -> dict:
        return self._run(self._async.stats())

    def update_weights_from_disk(
        self, path: str, version: int, *, timeout: float = DEFAULT_TIMEOUT, group=None
    ) -> dict:
        return self._run(self._async.update_weights_from_disk(path, version, timeout=timeout, group=group))

    def update_weights(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool | None = None,
        group=None,
    ) -> dict:
        return self._run(
            self._async.update_weights(
                named_tensors,
                version,
                backend=backend,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                verify=verify,
                group=group,
            )
        )

    def catch_up(
        self,
        named_tensors,
        version: int,
        *,
        backend: str = "nccl",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        verify: bool = True,
        group=None,
    ) -> dict:
        return self._run(
            self._async.catch_up(
                named_tensors,
                version,
                backend=backend,
                bucket_bytes=bucket_bytes,
                timeout=timeout,
                verify=verify,
                group=group,
            )
        )

    def weight_version(self) -> int:
        return self._run(self._async.weight_version())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._async.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
