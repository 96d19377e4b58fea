"""The agent process: one per GPU node, joined to the coordinator.

A pure core and a thin shell, as dask splits ``WorkerState`` from ``BaseWorker``:

- agent/session.py, ``AgentSession``: every decision (registration, welcome
  reconciliation, fencing, grants, pause, the receipt outbox and its resends,
  capacity, shutdown) as ``handle(event, now) -> instructions``;
- agent/link.py, ``CoordinatorLink``: the coordinator socket, ticks, reconnects;
- agent/lease_runner.py, ``LeaseRunner``: one lease's generation, reward,
  filter and commit;
- this module, ``Agent``: wiring, the one place instructions are carried out
  (``handle``), start-up and the orderly shutdown.

Tasks (all owned by one TaskGroup, all named): ``link``; ``lease-<id>`` per
leased prompt; ``abort-<request id>`` per request a pause-with-abort cancels;
``payloads`` (the data-plane endpoint trainers fetch groups from);
``weights`` (weight-update steps, one at a time: agent/weights.py; each step runs in a child task
of it, not of the TaskGroup, so that an abort can cancel the step alone; cancelling ``weights``
cancels and awaits its step);
``engines`` (the supervisor's monitor: restart, health, retirement);
``stop-signal``. Beside them, aiohttp's own tasks serve generate functions' OpenAI endpoint
(agent/openai_server.py: loopback, any port), started with the engines and closed first at the end.

Nothing here decides what to generate: the coordinator's leases do. The
agent's own bound is the pool's capacity, which the coordinator respects.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import zmq.asyncio

from agent import tool_parsers
from agent.chat_render import ChatRenderer, RenderError
from agent.custom_rollout import LiveRids, load_generate
from agent.engine_client import EngineClient
from agent.engine_tokenizer import EngineTokenizer
from agent.engine_tokenizer import probe as probe_engine_tokenizer
from agent.events import (
    AbortRequests,
    AckReceipt,
    AssignEngine,
    CancelLease,
    CloseLink,
    Configure,
    EngineChanged,
    EnginesStarted,
    Exit,
    Log,
    MessageReceived,
    Reconnect,
    ReportEngineFailure,
    RunWeightsStep,
    Send,
    SetWeights,
    ShutdownRequested,
    StartLease,
    TrimGroups,
)
from agent.lease_runner import LeaseContext, LeaseRunner
from agent.link import AgentExit, CoordinatorLink
from agent.openai_server import OpenAIServer
from agent.payload_server import PayloadServer
from agent.session import AgentSession
from agent.settings import AgentSettings
from agent.store import GroupStore
from agent.supervisor import EngineSupervisor
from agent.weights import WeightsExecutor
from common import protocol as p
from common.curve import with_server_key
from common.engine_info import EngineState
from common.errors import EngineError, StorageFull
from common.filters import load_filter
from common.gc_tuning import quiet_gc
from common.rewards import load_reward
from common.tokenizer import BYTE_TOKENIZER_NAME, check_tokenizer, load_tokenizer
from common.transport import stop_on_signals

log = logging.getLogger("rollfleet.agent")

SHUTDOWN_BUDGET = 10.0
"""Seconds an orderly stop may take before the services are cancelled regardless."""

ABORT_WAIT = 600.0
"""Seconds a per-request abort waits for its engine, paused by a weight update, to continue."""

__all__ = ["Agent", "AgentExit"]


class Agent:
    def __init__(self, settings: AgentSettings):
        """``settings`` are checked already (agent/settings.py); ``curve`` there makes the payload endpoint a
        CURVE server with the agent's key pair, its public key in the address (docs/operate/keys.md)."""
        self.settings = settings
        coordinator, curve, dataset = settings.coordinator, settings.curve, settings.dataset
        self.coordinator = coordinator
        self.metrics_host, self.metrics_port = settings.metrics_host, settings.metrics_port
        self.observe = None  # the /metrics endpoint while running (agent/observe.py)
        self.store = GroupStore(
            settings.data_dir, agent_id=settings.agent_id, sync=settings.sync, map_size=settings.map_size
        )
        self.store.on_full = self._store_full
        self._stop: asyncio.Event | None = None
        self._fatal: StorageFull | None = None
        watch = settings.supervisor
        # One HTTP client to the engines: generation, aborts and the supervisor's health probes.
        self.client = EngineClient(api_key=watch.api_key)
        self.supervisor = EngineSupervisor(
            settings.engines,
            log_dir=settings.data_dir / "logs",
            start_timeout=watch.start_timeout,
            health_interval=watch.health_interval,
            health_timeout=watch.health_timeout,
            max_restarts=watch.max_restarts,
            restart_window=watch.restart_window,
            on_change=self._on_engine_change,
            client=self.client,
            api_key=watch.api_key,
        )
        self.agent_id = self.store.agent_id
        # Weight updates (agent/weights.py); it also brings every (re)started engine to the fleet's weights.
        self.weights = WeightsExecutor(
            self.supervisor,
            self.client,
            self.handle,
            fleet=lambda: self.session.weights.current,  # the core's record of the fleet's weights: the only one
            agent_id=self.agent_id,
        )
        self.supervisor.prepare = self.weights.prepare
        # The request ids in flight of generate functions' calls: what a sample's abort must name.
        self.live_rids = LiveRids()
        self._engine_urls: dict[str, str] = {}  # each engine's last URL (a down engine has none in the supervisor)
        self.ctx = zmq.asyncio.Context()
        bind = settings.payload_bind
        self.payloads = PayloadServer(self.ctx, self.store, bind, curve=curve.pair if curve else None)
        port = self.payloads.endpoint.rsplit(":", 1)[1]
        address = f"tcp://{settings.advertise_host}:{port}"
        self.payload_address = with_server_key(address, curve.pair.public if curve else None)
        self.dataset = dataset
        # Generate functions' OpenAI-compatible endpoint (agent/openai_server.py): loopback, any port.
        self.openai = OpenAIServer(settings.openai_host, settings.openai_port)
        self.session = AgentSession(
            agent_id=self.agent_id,
            incarnation=self.store.incarnation,
            payload_address=self.payload_address,
            concurrency_per_engine=settings.concurrency,
            coordinator=coordinator,
            dataset_fingerprint=dataset.fingerprint if dataset else "",
            dataset_size=len(dataset) if dataset else -1,
        )
        self.link = CoordinatorLink(
            self.ctx,
            coordinator,
            agent_id=self.agent_id,
            store=self.store,
            session=self.session,
            dispatch=self.handle,
            curve=curve,
        )
        self._tokenizer_name = settings.tokenizer
        self.tokenizer = None
        self.runners: dict[int, LeaseRunner] = {}
        self.tokens: dict[str, int] = {}  # generated per engine, shared by every LeaseContext (agent/observe.py)
        self._lease_ctx: LeaseContext | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._services: list[asyncio.Task] = []
        self._execute = {
            Send: lambda ins: self.link.send(ins.msg),
            StartLease: self._start_lease,
            AssignEngine: self._assign_engine,
            CancelLease: self._cancel_lease,
            AbortRequests: self._abort_requests,
            AckReceipt: lambda ins: self.store.ack_nowait(ins.key, ins.accepted),
            TrimGroups: lambda ins: self.store.trim_nowait(list(ins.keys)),
            ReportEngineFailure: lambda ins: self.supervisor.report_failure(ins.engine, ins.reason),
            Configure: self._configure,
            Reconnect: self.link.end,
            CloseLink: self.link.end,
            Exit: self.link.end,
            RunWeightsStep: lambda ins: self.weights.submit(ins),
            SetWeights: lambda ins: self.weights.set_current(ins.record),
            Log: lambda ins: log.log(ins.level, "%s", ins.text),
        }

    def handle(self, event) -> None:
        """Feed one event to the core and carry out its instructions, in order."""
        if isinstance(event, MessageReceived) and isinstance(event.msg, p.Welcome):
            # Who may fetch payloads is transport configuration, not a decision of the core.
            self.payloads.allow_trainers(event.msg.trainer_keys)
        for ins in self.session.handle(event, time.monotonic()):
            self._execute[type(ins)](ins)

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        stop_on_signals(loop, stop)
        try:
            if self.metrics_port is not None:
                await self._start_observe()  # before the engines: a slow start is visible on /metrics
            log.info("agent %s (incarnation %d): starting engines", self.agent_id, self.store.incarnation)
            await self.supervisor.start()
            self.handle(EnginesStarted(tuple((spec.name, spec.url) for spec in self.supervisor.healthy())))
            await self._load_tokenizer()
            log.info("agent %s: OpenAI endpoint for generate functions on %s", self.agent_id, await self.openai.start())
            # Engine responses are hundreds of thousands of small [logprob, id, text]
            # lists that die young; default GC thresholds make the collector rescan
            # everything live many times a second (measured: ~25% of agent CPU in W1).
            quiet_gc()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                link = tg.create_task(self.link.run(), name="link")
                self._services = [
                    tg.create_task(self.supervisor.run(), name="engines"),
                    tg.create_task(self.payloads.serve(), name="payloads"),
                    tg.create_task(self.weights.run(), name="weights"),
                    link,
                ]
                stopper = tg.create_task(stop.wait(), name="stop-signal")
                await asyncio.wait([link, stopper], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not link.done():
                    await self._shutdown()
        finally:
            await self._close()
        if self._fatal is not None:
            raise self._fatal

    def _store_full(self, exc: StorageFull) -> None:
        """The store's map or disk is full: stop in order (leases released, receipts sent) and exit 1."""
        if self._fatal is None:
            self._fatal = exc
            log.error("agent %s: stopping: %s", self.agent_id, exc)
            if self._stop is not None:
                self._stop.set()

    async def _shutdown(self) -> None:
        """Orderly stop within ``SHUTDOWN_BUDGET``.

        No new grants (capacity 0); leases still generating are cancelled and
        released at once, so the coordinator reissues them without waiting for
        the TTL; groups already past generation finish their commit and
        receipt; pending store writes are drained and outstanding receipts
        acknowledged (a later start then has nothing to recover). Only then
        are the services cancelled.
        """
        end = time.monotonic() + SHUTDOWN_BUDGET
        log.info("agent %s: shutting down", self.agent_id)
        self.handle(ShutdownRequested())
        unfinished = [runner.task for runner in self.runners.values()]
        if unfinished:
            await asyncio.wait(unfinished, timeout=max(0.1, end - time.monotonic()))
        try:
            await asyncio.wait_for(self.store.drain(), max(0.1, end - time.monotonic()))
        except TimeoutError:
            log.error("agent %s: store writes still pending at the shutdown deadline", self.agent_id)
        # Receipts in flight get their acks, unless the coordinator has gone quiet
        # (e.g. it is stopping too): then the next start recovers them instead.
        while time.monotonic() < end and self.session.awaiting_acks(time.monotonic()):
            await asyncio.sleep(0.05)
        if self.session.outbox:
            log.warning(
                "agent %s: %d receipt(s) unacknowledged at shutdown; they are sent again at the next start",
                self.agent_id,
                len(self.session.outbox),
            )
        for task in self._services:
            task.cancel()

    async def _start_observe(self) -> None:
        # Imported here: prometheus_client is only loaded by an agent that serves metrics.
        from agent.observe import AgentCollector
        from common.observe_http import ObserveServer

        observe = ObserveServer(self.metrics_host, self.metrics_port, AgentCollector(self))
        url = await observe.start()
        self.observe = observe
        log.info("agent %s: metrics on %s/metrics", self.agent_id, url)

    async def _close(self) -> None:
        await self.openai.close()
        if self.observe is not None:
            await self.observe.close()
        try:
            await asyncio.wait_for(self.supervisor.stop(), 30)
        except Exception as exc:  # cleanup must go on; report, don't hide
            log.error("stopping engines failed: %s", exc)
        await self.client.close()
        self.payloads.close()
        # An orderly stop lets its last messages (Release, Capacity) reach the coordinator.
        self.link.close(linger_ms=2000 if self.session.stopping else 0)
        self.ctx.term()
        try:
            await asyncio.wait_for(self.store.drain(), 10)
        except TimeoutError:
            log.error("agent %s: store writes did not finish before close", self.agent_id)
        self.store.close()

    async def _load_tokenizer(self) -> None:
        """``--tokenizer``, else the engines' ``tokenizer_path`` loaded here, else the engines' ``/tokenize``."""
        name = self._tokenizer_name
        if name is not None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, name)
            log.info("agent %s: tokenizer %s", self.agent_id, name)
            return
        url = self.supervisor.healthy()[0].url
        info = await self.client.model_info(url)
        name = info.get("tokenizer_path") or info.get("model_path") or BYTE_TOKENIZER_NAME
        try:
            check_tokenizer(name, "the engines' tokenizer")
            self.tokenizer = await asyncio.to_thread(load_tokenizer, name)
        except Exception as exc:  # a path only the server has, transformers missing, no network for a hub id
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            await probe_engine_tokenizer(self.client, url, name, why)
            urls = lambda: [spec.url for spec in self.supervisor.healthy()]  # noqa: E731
            self.tokenizer = EngineTokenizer(self.client, urls, name)
            log.warning("agent %s: tokenizer %r does not load here (%s); tokenizing through the engines' /tokenize",
                        self.agent_id, name, why)  # fmt: skip
            return
        log.info("agent %s: tokenizer %s", self.agent_id, name)

    def _on_engine_change(self, name: str, state: EngineState) -> None:
        # A restarted engine may come back stale (behind the fleet's weights): it has a new URL all the same.
        url = self.supervisor.urls().get(name)
        if url is not None:
            self._engine_urls[name] = url
        elif state.gone and name in self._engine_urls:
            # Its samples in flight go elsewhere now: a hung engine would hold them (and its leases) forever.
            dropped = self.client.drop(self._engine_urls[name], f"engine {name} is {state}")
            if dropped:
                log.info("agent %s: %d request(s) in flight on engine %s ended: it is %s",
                         self.agent_id, dropped, name, state)  # fmt: skip
        self.handle(EngineChanged(name, state, url, self.supervisor.all_retired()))

    # ------------------------------------------------------------------ instructions

    def _configure(self, ins: Configure) -> None:
        config = ins.config
        self._lease_ctx = LeaseContext(
            config,
            load_reward(config.reward),
            load_filter(config.dynamic_filter),
            self.tokenizer,
            self.dataset,
            self.client,
            self.store,
            self.agent_id,
            self.tokens,
            generate=load_generate(config.generate),
            weights=self.session.weights,
            openai=self.openai if config.generate else None,
            chat_renderer=self._chat_renderer(),
            tool_parser=tool_parsers.load(config.tool_parser),
            live_rids=self.live_rids,
        )

    def _chat_renderer(self):
        """The OpenAI endpoint's chat renderer for the agent's tokenizer, or why there is none (its calls say it)."""
        try:
            return ChatRenderer(self.tokenizer)
        except RenderError as exc:
            return str(exc)

    def _start_lease(self, ins: StartLease) -> None:
        runner = LeaseRunner(ins.grant, self._lease_ctx, self.handle)
        runner.task = self._tg.create_task(runner.run(), name=f"lease-{ins.lease:x}")
        runner.task.add_done_callback(functools.partial(self._runner_done, runner))
        self.runners[ins.lease] = runner

    def _runner_done(self, runner: LeaseRunner, task: asyncio.Task) -> None:
        if self.runners.get(runner.lease) is runner:
            del self.runners[runner.lease]

    def _assign_engine(self, ins: AssignEngine) -> None:
        runner = self.runners.get(ins.lease)
        if runner is not None and not runner.task.done():
            runner.assign(ins)

    def _cancel_lease(self, ins: CancelLease) -> None:
        runner = self.runners.get(ins.lease)
        if runner is not None:
            runner.task.cancel()

    def _abort_requests(self, ins: AbortRequests) -> None:
        for request_id in self.live_rids.expand_all(ins.request_ids):
            self._tg.create_task(self._abort_quietly(ins.url, request_id), name=f"abort-{request_id}")

    async def _abort_quietly(self, url: str, request_id: str) -> None:
        # Not while this agent has the engine paused: SGLang would drop the abort of a request held at its
        # pause gate, and every later one of it (agent/weight_checks.PausedEngines).
        await self.weights.paused_engines.wait_released(url, ABORT_WAIT)
        try:
            await self.client.abort(url, request_id)
        except EngineError as exc:
            log.warning("abort of %s on %s failed: %s", request_id, url, exc)
