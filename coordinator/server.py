"""The coordinator's I/O shell: a ZeroMQ ROUTER, the ledger writer, the clock.

The ROUTER is its own on ``--bind``, or, with ``--gateways``, one on a private
endpoint that gateway processes relay batches to (``coordinator/peer_io.py``
hides which: a read yields messages, a send queues or sends one).

It reads frames in turns: whenever the ROUTER is readable it takes every
message waiting (up to ``TURN_MESSAGES``) without awaiting between them,
hands each to ``CoordinatorCore`` inside one core turn (one pump per turn,
``coordinator/core.py``), and carries out the effects it returns: ``Send`` right away, ``Persist`` through the one
ledger writer thread (group commit: every Persist queued meanwhile goes in
the same transaction), sending its ``then`` messages only after the commit.
Messages to one destination leave in the order the core produced them: a
``Send`` to a peer that still has a message waiting on a commit is queued
behind it (a Control or Grant never overtakes the Welcome or Grant before it).

The ROUTER is a plain (not asyncio) socket driven from the loop: its
``zmq.FD`` is watched with ``add_reader`` and every send is non-blocking,
so a message costs no future, no timer and no task switch. The FD is
edge-triggered and a send may consume its signal, so every path that sends
outside a turn re-checks ``zmq.EVENTS`` afterwards (``_poke``).

Nothing blocking runs on the event loop: ledger commits run on the writer
thread, and the dataset rows a Grant carries (``Send.with_rows``, for agents
without their own replica) are read there right after the commit, in the same
job, before the Grant leaves in its place in line.

With CurveZMQ keys (``curve``, common/curve.py) the ROUTER is a CURVE server and
``KeyGate`` (common/zap.py), started before the loops, admits only the agents' and
trainers' public keys: an unknown peer is refused in the handshake and never reaches
the core. Agents learn the trainers' keys from the Welcome, for their payload endpoints.
Roles stay apart: each message's ZAP User-Id (the sender's public key) must belong to a role
that sends that message type ("agent -> coordinator" or "trainer -> coordinator" in
common/protocol.py), so an agent's key cannot attach as a trainer, nor a trainer's register.

A frame that cannot be decoded (malformed msgpack, unknown type, wrong
version, oversized) is answered with an ``Error`` naming the problem; the
loop keeps serving. Messages of a type the coordinator does not accept get
the same treatment.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import zmq

from common import faults
from common import protocol as p
from common.config import LOG_LEVELS, MIN_MAP_SIZE, MIN_MESSAGE_BYTES, Liveness, RolloutConfig
from common.curve import CoordinatorKeys
from common.dataset import Dataset
from common.errors import ConfigError, ProtocolError, StorageFull
from common.gc_tuning import quiet_gc
from common.lmdb_env import MAP_SIZE
from common.logs import LOG_FORMATS
from common.shuffle import SHUFFLE_ORDER, epoch_permutation
from common.transport import stop_on_signals, validate_endpoint
from coordinator.core import CoordinatorCore, CoreSettings, Persist, Send
from coordinator.core_settings import check_count, check_over_sampling
from coordinator.evaluation import EvalSpec
from coordinator.ledger import Ledger
from coordinator.peer_io import DirectIO, GatewayIO, open_peer_io
from coordinator.prompt_key import dataset_of
from coordinator.sources import TRAIN

log = logging.getLogger("rollfleet.coordinator")


def _senders(cls) -> set[str]:
    """The roles that send a message type, from its "sender -> receiver" docstring."""
    sender = (cls.__doc__ or "").split("->", 1)[0]
    return {"agent", "trainer"} if "any" in sender else {r for r in ("agent", "trainer") if r in sender}


SENDERS = {cls: _senders(cls) for cls in p.message_types().values()}

TURN_MESSAGES = 256
"""Most messages handled in one turn before the loop lets the writer and the clock run. A pump is
shared by up to this many messages; the sends of a finished commit wait for the turn in progress,
about 10 ms at 40 us a message, and up to about 100 ms when a loaded machine slows each message."""
HEARTBEAT_SLICES = 10
"""Steps the clock spreads each round of heartbeats over (see ``_clock``)."""


@dataclass(frozen=True)
class ServeSettings:
    """How ``coordinator serve`` runs its process (the flags that are not the rollout's ``RolloutConfig`` or
    ``Liveness``): where it binds and stores, what it may change on restart, its limits and metrics."""

    data_dir: str
    bind: str
    seed: int | None = None
    """``--shuffle-seed``: epochs in a seeded permutation; None: file order."""
    sync: bool = True
    max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES
    allow_config_change: bool = False
    starve_after: int | None = None
    starve_after_drops: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    map_size: int = MAP_SIZE
    curve: CoordinatorKeys | None = None
    curve_dir: str | None = None
    """Where ``curve`` came from: gateways load the keys themselves."""
    over_sampling: float = 1.0
    gateways: int = 0
    """``--gateways``: relay processes holding the peers' connections (coordinator/gateway.py); 0: none."""
    log_level: str = "INFO"
    log_format: str = "text"

    def __post_init__(self):
        """Every field is checked here, each error naming its flag, so a ``ServeSettings`` that exists is valid."""
        if not isinstance(self.data_dir, str) or not self.data_dir:
            raise ConfigError(f"--data-dir must name a directory, got {self.data_dir!r}")
        validate_endpoint(self.bind, "--bind")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"--shuffle-seed must be an integer, got {self.seed!r}")
        _check_int("--max-message-bytes", self.max_message_bytes, MIN_MESSAGE_BYTES)
        check_count("--starve-after", self.starve_after)
        check_count("--starve-after-drops", self.starve_after_drops)
        if self.metrics_port is not None:
            _check_int("--metrics-port", self.metrics_port, 0, 65535)
        _check_int("--map-size", self.map_size, MIN_MAP_SIZE)
        check_over_sampling(self.over_sampling)
        _check_int("--gateways", self.gateways, 0, 64)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")


def _check_int(flag: str, value, low: int, high: float = math.inf) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        bounds = f">= {low}" if high == math.inf else f"from {low} to {high}"
        raise ConfigError(f"{flag} must be an integer {bounds}, got {value!r}")


class CoordinatorServer:
    def __init__(
        self,
        settings: ServeSettings,
        *,
        dataset: Dataset,
        config: RolloutConfig,
        liveness: Liveness,
        eval_datasets: dict[str, tuple[Dataset, EvalSpec]] | None = None,
        mixture: list[tuple[Dataset, int | None]] | None = None,
    ):
        """``mixture``: each training dataset and its shuffle seed, in ``config.mixture``'s order (then
        ``dataset`` is their combination, ``MixtureDatasets``); None: ``dataset`` is the one training dataset."""
        s = self.settings = settings
        data_dir, seed, curve = s.data_dir, s.seed, s.curve
        self.dataset = dataset
        self.eval_datasets = {name: ds for name, (ds, _) in (eval_datasets or {}).items()}
        self.source_datasets = {TRAIN: dataset, **{p.EVAL_SOURCE + n: ds for n, ds in self.eval_datasets.items()}}
        """Each prompt source's dataset (coordinator/sources.py), by the key its leases carry."""
        parts = mixture or [(dataset, seed)]
        self.training_datasets = [ds for ds, _ in parts]
        """Each training dataset, by its number in the mixture (``PromptKey.dataset``: coordinator/prompt_key.py)."""
        self.observe = None  # the /metrics and status page endpoint while serving (coordinator/observe.py)
        # Bind before the ledger is touched: a start that fails (port in use, a refused
        # config) leaves the data dir as it was.
        self.ctx = zmq.Context()
        self.ledger = None
        self.io: DirectIO | GatewayIO | None = None
        self._roles: dict[str, set[str]] | None = None  # public key (Z85) -> its roles, with keys
        if curve is not None:
            self._roles = {}
            for role, keys in (("agent", curve.agents), ("trainer", curve.trainers)):
                for key in keys:
                    self._roles.setdefault(key.decode("ascii"), set()).add(role)
        self.forbidden = 0
        try:
            self.io = open_peer_io(self.ctx, s, after_flush=self._poke)
            self.sock, self.endpoint = self.io.sock, self.io.endpoint
            self.ledger = Ledger(data_dir, sync=s.sync, map_size=s.map_size)
            # The shuffle algorithm is part of the shape: positions in one order name other rows in another.
            order = SHUFFLE_ORDER if seed is not None else None
            shape = {**config.batch_shape(), "shuffle_seed": seed, "shuffle_order": order}
            if mixture:
                shape["dataset_seeds"] = [dataset_seed for _, dataset_seed in mixture]
                order = order or (SHUFFLE_ORDER if any(x is not None for _, x in mixture) else None)
                shape["shuffle_order"] = order
            restored = self.ledger.open_run(
                len(dataset), dataset.fingerprint, config=shape, allow_change=s.allow_config_change
            )
        except BaseException:
            if self.ledger is not None:
                self.ledger.close()
            if self.io is not None:
                self.io.close()
            self.ctx.term()
            raise
        core_settings = CoreSettings(
            config,
            liveness,
            dataset_sizes=tuple(len(ds) for ds, _ in parts),
            fingerprint=dataset.fingerprint,
            order=lambda d, n, e: epoch_permutation(n, e, parts[d][1]),
            starve_after=s.starve_after,
            starve_after_drops=s.starve_after_drops,
            over_sampling=s.over_sampling,
            trainer_keys=tuple(sorted(k.decode("ascii") for k in curve.trainers)) if curve else (),
            eval_specs=tuple(spec for _, spec in (eval_datasets or {}).values()),
        )
        self.core = CoordinatorCore(core_settings, restored, time.monotonic())
        self.core.gateway_stats = self.io.statistics
        if self.core.start_ops:
            self.ledger.apply(self.core.start_ops)
        # One thread for the ledger's commits and the dataset rows Grants carry (the datasets' file
        # handles are used from it alone).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-writer")
        self._persist_queue: asyncio.Queue[Persist | None] = asyncio.Queue()
        self._held: dict = {}  # destination -> the last queued Persist holding a message to it
        self._writing = False  # the writer holds a batch it has not finished sending
        self._readable = asyncio.Event()
        self.errors_sent = 0
        log.info(
            "coordinator generation %d listening on %s (%d prompts)", restored.generation, self.endpoint, len(dataset)
        )

    # ---------------------------------------------------------------- effects

    def _send(self, to, msg: p.Message) -> None:
        if isinstance(to, str):
            peer = self.core.peer_of(to)
            if peer is None:
                return
        else:
            peer = to
        if faults.INJECTED is not None and faults.INJECTED.coordinator_drops(msg):  # tests only
            return
        # A failed send (peer gone, or at its HWM) is repaired by the protocol: agents
        # resend (receipts) and heartbeats reconcile; trainers retry.
        self.io.send(peer, p.encode(msg), msg.TYPE)

    def _deliver(self, s: Send) -> None:
        """Send now, unless an earlier message to the same destination still waits on a commit."""
        holder = self._held.get(s.to)
        if holder is not None:
            holder.then.append(s)
        else:
            self._send(s.to, s.msg)

    def _run(self, effects: list) -> None:
        for eff in effects:
            if isinstance(eff, Send):
                self._deliver(eff)
            elif isinstance(eff, Persist):
                if eff.ops or any(s.with_rows for s in eff.then):
                    self._persist_queue.put_nowait(eff)
                    for s in eff.then:
                        self._held[s.to] = eff
                else:
                    for s in eff.then:
                        self._deliver(s)

    async def _ledger_writer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._persist_queue.get()
            self._writing = True
            batch = [first]
            while not self._persist_queue.empty():
                batch.append(self._persist_queue.get_nowait())
            ops = [op for eff in batch for op in eff.ops]
            grants = [s for eff in batch for s in eff.then if s.with_rows]
            try:
                # One hop to the writer thread and back: the commit, then the rows its Grants carry.
                filled = await loop.run_in_executor(self._writer, self._commit, ops, grants)
            except StorageFull as exc:
                # Nothing held behind this write is sent; the coordinator stops (the TaskGroup ends).
                log.error("%s; the coordinator stops", exc)
                raise
            for eff in batch:
                for s in eff.then:
                    msg = filled.get(id(s), s.msg) if s.with_rows else s.msg
                    if msg is not None:
                        self._send(s.to, msg)
                    if self._held.get(s.to) is eff:
                        del self._held[s.to]
            self._writing = False
            self._poke()

    def _commit(self, ops: list, grants: list[Send]) -> dict[int, p.Grant | None]:
        """Writer thread: commit ``ops``, then fill ``grants`` with their rows (``_read_rows``)."""
        self.ledger.apply(ops)
        return self._read_rows(grants) if grants else {}

    def _read_rows(self, grants: list[Send]) -> dict[int, p.Grant | None]:
        """Each Grant with its leases' dataset rows added (writer thread, after the commit); None if a row
        is unreadable.

        A Grant that is not sent is repaired like a lost one: the agent's next
        heartbeat omits its leases, which are then released.
        """
        out: dict[int, p.Grant | None] = {}
        for s in grants:
            try:
                leases = []
                for lease in s.msg.leases:
                    if lease.source == TRAIN:
                        row = self.training_datasets[dataset_of(lease.data_epoch)].row(lease.index)
                    else:
                        row = self.source_datasets[lease.source].row(lease.index)
                    leases.append(replace(lease, prompt=row.prompt, label=row.label, metadata=row.metadata))
                out[id(s)] = p.Grant(s.msg.session, leases)
            except Exception:
                log.exception("cannot read the dataset rows of a grant to %s; its leases will be released", s.to)
                out[id(s)] = None
        return out

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every queued ledger write has committed (orderly shutdown)."""
        deadline = time.monotonic() + timeout
        while (self._writing or not self._persist_queue.empty()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(self._writer, lambda: None)

    # ---------------------------------------------------------------- loops

    def _dispatch(self, peer: bytes, frame: bytes, now: float, user: str | None = None) -> None:
        try:
            msg = p.decode(frame, max_bytes=self.settings.max_message_bytes)
            if user is not None and not SENDERS[type(msg)] & self._roles.get(user, set()):
                self.forbidden += 1
                log.warning(
                    "refused a %r message from key %s... (%s): not a message its role sends",
                    msg.TYPE,
                    user[:8],
                    "/".join(sorted(self._roles.get(user, ()))) or "no role",
                )
                self._send(peer, p.Error("forbidden", f"this key may not send {msg.TYPE!r}", getattr(msg, "req", 0)))
                return
        except ProtocolError as exc:
            self.errors_sent += 1
            log.warning("rejected message from %r: %s", peer[:40], exc)
            code = type(exc).__name__
            self._send(
                peer,
                p.Error(
                    {"VersionMismatch": "version_mismatch", "MessageTooLarge": "too_large"}.get(code, "malformed"),
                    str(exc),
                    p.peek_req(frame),
                ),
            )
            return
        self._run(self.core.handle(peer, msg, now))

    def _on_frames(self, peer: bytes, frames: list, now: float, user: str | None = None) -> None:
        """``frames``: what followed the peer's routing id, one message frame."""
        if len(frames) != 1:
            self._send(peer, p.Error("malformed", f"expected one message frame, got {len(frames)}"))
            return
        try:
            self._dispatch(peer, frames[0], now, user)
        except Exception:
            # A bug handling one message must not take the fleet down; it is logged loudly.
            log.exception("internal error handling a message from %r", peer[:40])
            self._send(peer, p.Error("internal", "internal coordinator error; see its log", p.peek_req(frames[0])))

    def _turn(self) -> int:
        """Handle every message waiting (up to ``TURN_MESSAGES``) as one core turn; how many there were."""
        read, now, n = self.io.read, time.monotonic(), 0
        self.core.begin_turn()
        try:
            while n < TURN_MESSAGES:
                entries = read()  # one message, or one gateway's batch of them
                if entries is None:
                    break
                for peer, frames, user in entries:
                    self._on_frames(peer, frames, now, user)
                n += len(entries)
        finally:
            self._run(self.core.end_turn(now))
        return n

    def _poke(self) -> None:
        """A send may have consumed the FD's edge: wake the reader if messages wait."""
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._readable.set()

    async def _recv_loop(self) -> None:
        loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._readable.set)
        try:
            while True:
                try:
                    # The timeout only backs up _poke: a missed edge costs at most this much delay.
                    async with asyncio.timeout(0.1):
                        await self._readable.wait()
                except TimeoutError:
                    pass
                self._readable.clear()
                while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._turn()
                    await asyncio.sleep(0)  # the writer's commits and the clock run between turns
        finally:
            loop.remove_reader(fd)

    async def _clock(self) -> None:
        """Every half heartbeat interval: expire silent agents and send each live agent a heartbeat.

        The heartbeats go out in ``HEARTBEAT_SLICES`` steps spread over that half interval, not in
        one callback: at 10,000 agents one callback would hold the loop for a few hundred
        milliseconds twice a second, and every grant and ack waiting behind it."""
        step = self.core.liveness.heartbeat_interval / 2 / HEARTBEAT_SLICES
        last_report = 0.0
        part = 0
        while True:
            await asyncio.sleep(step)
            now = time.monotonic()
            if part == 0:
                self._run(self.core.tick(now))
            for beat in self.core.heartbeats(part, HEARTBEAT_SLICES):
                self._deliver(beat)  # behind any grant still waiting on the ledger
            part = (part + 1) % HEARTBEAT_SLICES
            self._poke()
            if now - last_report > 30:
                last_report = now
                s = self.core.statistics()
                log.info(
                    "agents alive %d/%d, leased %d, ready %d, last rollout %d, prompts %s",
                    sum(a.status == "alive" for a in s.agents.values()),
                    len(s.agents),
                    s.leased,
                    s.ready,
                    s.last_rollout_id,
                    s.prompts,
                )

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        stop_on_signals(loop, stop)
        self.io.start()
        try:
            if self.settings.metrics_port is not None:
                await self._start_observe()
            quiet_gc()  # the ledger's state and the dataset are loaded: out of every later collection
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._ledger_writer(), name="ledger-writer"),
                    tg.create_task(self._recv_loop(), name="recv"),
                    tg.create_task(self._clock(), name="clock"),
                ]
                supervisor = tg.create_task(self.io.supervise(), name="gateways")
                await stop.wait()
                supervisor.cancel()
                log.info("coordinator shutting down: flushing the ledger")
                tasks[1].cancel()
                tasks[2].cancel()
                await self.flush()
                tasks[0].cancel()
        finally:
            if self.observe is not None:
                await self.observe.close()
            self.close()

    async def _start_observe(self) -> None:
        # Imported here: prometheus_client is only loaded by a coordinator that serves metrics.
        from common.observe_http import ObserveServer
        from coordinator.observe import CoordinatorCollector
        from coordinator.status_page import routes

        observe = ObserveServer(
            self.settings.metrics_host, self.settings.metrics_port, CoordinatorCollector(self), routes=routes(self)
        )
        url = await observe.start()
        self.observe = observe
        log.info("coordinator metrics on %s/metrics, status page on %s/", url, url)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.io.close()
        self.ctx.term()
        self.ledger.close()
