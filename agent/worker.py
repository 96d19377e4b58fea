"""The agent process: one per GPU node, joined to the coordinator.

Tasks (all owned by one TaskGroup, all named):
- ``link``: the coordinator connection. Register (with unacknowledged
  receipts read back from the store and the leases still in flight), then
  heartbeats both ways; silence past the TTL or a ``Fence`` means reconnect
  with backoff and register again. Leases keep running meanwhile.
- ``lease-<id>``: one per leased prompt: n ``/generate`` calls on one engine,
  reward, dynamic filter, then *commit to the store, then send the receipt*.
  A group that loses its engine is retried on another one; a group aborted by
  a pause-with-abort is released back to the coordinator.
- ``payloads``: the data-plane endpoint trainers fetch groups from.
- ``engines``: the supervisor's monitor (restart, health, retirement).

Nothing here decides what to generate: the coordinator's leases do. The
agent's own bound is the pool's capacity, which the coordinator respects.
"""

from __future__ import annotations

import asyncio
import gc
import functools
import logging
import random
import time
from operator import itemgetter
from pathlib import Path

import zmq
import zmq.asyncio

from agent.engine_client import EngineClient, sample_status
from common.filters import load_filter
from agent.payload_server import PayloadServer
from agent.pool import GenerationPool
from common.rewards import load_reward
from agent.store import GroupStore
from agent.supervisor import EngineSupervisor
from common import protocol as p
from common.config import RolloutConfig
from common.errors import EngineError, EngineUnavailable, ProtocolError, RolloutError
from common.tokenizer import BYTE_TOKENIZER_NAME, load_tokenizer
from common.transport import dealer, send_nowait, stop_on_signals
from common.types import Group, Sample

log = logging.getLogger("rollfleet.agent")


_first, _second = itemgetter(0), itemgetter(1)  # per-token hot path: C-level, no Python frames


class LeaseAborted(Exception):
    """The group's requests were aborted by a pause-with-abort."""


class NoEngineLeft(Exception):
    """Every engine of this node is retired: the lease can never be generated here."""


class AgentExit(RolloutError):
    """The agent cannot continue (e.g. the coordinator refused it)."""


class Agent:
    def __init__(
        self,
        *,
        coordinator: str,
        data_dir: str,
        engine_specs: list,
        concurrency: int,
        payload_bind: str,
        advertise_host: str,
        agent_id: str | None = None,
        tokenizer: str | None = None,
        dataset=None,
        sync: bool = True,
        supervisor_options: dict | None = None,
    ):
        self.coordinator = coordinator
        self.store = GroupStore(data_dir, agent_id=agent_id, sync=sync)
        options = {"log_dir": Path(data_dir) / "logs", **(supervisor_options or {})}
        self.supervisor = EngineSupervisor(engine_specs, on_change=self._on_engine_change, **options)
        self.agent_id = self.store.agent_id
        self.pool = GenerationPool(concurrency)
        self.ctx = zmq.asyncio.Context()
        self.payloads = PayloadServer(self.ctx, self.store, payload_bind)
        port = self.payloads.endpoint.rsplit(":", 1)[1]
        self.payload_address = f"tcp://{advertise_host}:{port}"
        self._tokenizer_name = tokenizer
        self.tokenizer = None
        self.dataset = dataset
        self.client: EngineClient | None = None
        self.session = 0
        self.config: RolloutConfig | None = None
        self.reward = None
        self.filter = None
        self.sock: zmq.asyncio.Socket | None = None
        self.last_heard = time.monotonic()
        self.heartbeat_interval = 1.0
        self.ttl = 5.0
        self.in_flight: dict[int, dict] = {}  # lease -> grant
        self.tasks: dict[int, asyncio.Task] = {}
        self.committing: set[int] = set()  # leases past generation: committing or reporting
        self.rids: dict[int, tuple[str, list[str]]] = {}  # lease -> (engine url, rids)
        self.max_lease = 0
        self.paused = False
        self.aborting: set[int] = set()
        self.engine_change = asyncio.Event()
        self.outbox_sent: dict[str, float] = {}
        self.stopping = False
        self.counters = {"groups_committed": 0, "groups_filtered": 0, "groups_released": 0, "samples": 0, "engine_retries": 0}
        self._tg: asyncio.TaskGroup | None = None
        self._services: list[asyncio.Task] = []

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        stop_on_signals(loop, stop)
        self.client = EngineClient()
        try:
            log.info("agent %s (incarnation %d): starting engines", self.agent_id, self.store.incarnation)
            await self.supervisor.start()
            for spec in self.supervisor.healthy():
                self.pool.set_engine(spec.name, spec.url, True)
            await self._load_tokenizer()
            # Engine responses are hundreds of thousands of small [logprob, id, text]
            # lists that die young; default GC thresholds make the collector rescan
            # everything live many times a second. Freeze start-up objects and
            # collect less often (measured: ~25% of agent CPU in W1).
            gc.freeze()
            gc.set_threshold(50_000, 50, 100)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                link = tg.create_task(self._link(), name="link")
                self._services = [
                    tg.create_task(self.supervisor.run(), name="engines"),
                    tg.create_task(self.payloads.serve(), name="payloads"),
                    link,
                ]
                stopper = tg.create_task(stop.wait(), name="stop-signal")
                await asyncio.wait([link, stopper], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not link.done():
                    await self._shutdown()
        finally:
            await self._close()

    async def _shutdown(self, deadline: float = 10.0) -> None:
        """Orderly stop within ``deadline``.

        No new grants (capacity 0); leases still generating are cancelled and
        released at once, so the coordinator reissues them without waiting for
        the TTL; groups already past generation finish their commit and
        receipt; pending store writes are drained and outstanding receipts
        acknowledged (a later start then has nothing to recover). Only then
        are the services cancelled.
        """
        self.stopping = True
        end = time.monotonic() + deadline
        log.info("agent %s: shutting down", self.agent_id)
        if self.session:
            self._send(p.Capacity(self.session, 0, self._engines()))
        generating = [lease for lease in self.tasks if lease not in self.committing]
        for lease in generating:
            self.tasks[lease].cancel()
        # Snapshot first: each cancelled task removes its lease from in_flight as it ends.
        if generating and self.session:
            self._send(p.Release(self.session, generating, "agent shutting down"))
        unfinished = list(self.tasks.values())
        if unfinished:
            await asyncio.wait(unfinished, timeout=max(0.1, end - time.monotonic()))
        try:
            await asyncio.wait_for(self.store.drain(), max(0.1, end - time.monotonic()))
        except TimeoutError:
            log.error("agent %s: store writes still pending at the shutdown deadline", self.agent_id)
        # Receipts in flight get their acks, unless the coordinator has gone quiet
        # (e.g. it is stopping too): then the next start recovers them instead.
        while self.outbox_sent and self.session and time.monotonic() < end and time.monotonic() - self.last_heard < 2 * self.heartbeat_interval:
            await asyncio.sleep(0.05)
        if self.outbox_sent:
            log.warning("agent %s: %d receipt(s) unacknowledged at shutdown; they are sent again at the next start", self.agent_id, len(self.outbox_sent))
        for t in self._services:
            t.cancel()

    async def _close(self) -> None:
        try:
            await asyncio.wait_for(self.supervisor.stop(), 30)
        except Exception as exc:  # cleanup must go on; report, don't hide
            log.error("stopping engines failed: %s", exc)
        await self.client.close()
        self.payloads.close()
        if self.sock is not None:
            # An orderly stop lets its last messages (Release, Capacity) reach the coordinator.
            self.sock.close(linger=2000 if self.stopping else 0)
        self.ctx.term()
        try:
            await asyncio.wait_for(self.store.drain(), 10)
        except TimeoutError:
            log.error("agent %s: store writes did not finish before close", self.agent_id)
        self.store.close()

    async def _load_tokenizer(self) -> None:
        name = self._tokenizer_name
        if name is None:
            healthy = self.supervisor.healthy()
            info = await self.client.model_info(healthy[0].url)
            name = info.get("tokenizer_path") or info.get("model_path") or BYTE_TOKENIZER_NAME
        self.tokenizer = await asyncio.to_thread(load_tokenizer, name)
        log.info("agent %s: tokenizer %s", self.agent_id, name)

    def _on_engine_change(self, name: str, state: str) -> None:
        url = None
        for spec in self.supervisor.healthy():
            if spec.name == name:
                url = spec.url
        changed = self.pool.set_engine(name, url, state == "healthy")
        log.log(logging.INFO if state == "healthy" else logging.WARNING,
                "agent %s: engine %s is %s (capacity now %d samples)", self.agent_id, name, state, self.pool.capacity())
        self.engine_change.set()
        if self.session and (changed or state == "retired"):
            self._send(p.Capacity(self.session, self.pool.capacity(), self._engines()))

    def _engines(self) -> list[dict]:
        states = {s: self.supervisor.state(s) for s in self.pool.engines}
        return self.pool.describe(states)

    # ------------------------------------------------------------------ coordinator link

    def _send(self, msg: p.Message) -> None:
        if self.sock is None:
            return
        send_nowait(self.sock, [p.encode(msg)], functools.partial(_send_failed, msg.TYPE))

    async def _link(self) -> None:
        backoff = 0.2
        while True:
            if self.sock is not None:
                self.sock.close(linger=0)
            self.sock = dealer(self.ctx, self.coordinator, identity=f"agent:{self.agent_id}".encode())
            self.session = 0
            try:
                await self._register()
                backoff = 0.2
                await self._session_loop()
            except AgentExit:
                raise
            except _Reconnect as why:
                if self.stopping:
                    log.info("agent %s: coordinator link lost while shutting down: %s", self.agent_id, why)
                    self.session = 0
                    return
                log.warning("agent %s: reconnecting to the coordinator: %s", self.agent_id, why)
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 10.0)

    async def _register(self) -> None:
        stored, unacked = await asyncio.to_thread(self.store.snapshot)
        in_flight = [[lease, g["data_epoch"], g["index"]] for lease, g in self.in_flight.items()]
        reg = p.Register(
            agent_id=self.agent_id,
            incarnation=self.store.incarnation,
            capacity=self.pool.capacity(),
            payload_address=self.payload_address,
            engines=self._engines(),
            unacked=unacked,
            in_flight=in_flight,
            dataset_fingerprint=self.dataset.fingerprint if self.dataset else "",
            dataset_size=len(self.dataset) if self.dataset else -1,
            stored=stored,
        )
        frame = p.encode(reg)
        wait = 1.0
        while True:
            await self.sock.send(frame)
            deadline = time.monotonic() + wait
            while (left := deadline - time.monotonic()) > 0 and await self.sock.poll(left * 1000):
                msg = self._decode(await self.sock.recv())
                if isinstance(msg, p.Welcome):
                    await self._welcome(msg)
                    return
                if isinstance(msg, p.Error):
                    if msg.code in ("dataset_mismatch", "too_small", "bad_register"):
                        raise AgentExit(f"coordinator refused agent {self.agent_id}: {msg.message}")
                    log.error("coordinator error during registration: %s", msg.message)
                # Anything else belongs to a session we no longer have; drop it.
            log.info("agent %s: no answer from coordinator %s yet; retrying", self.agent_id, self.coordinator)
            wait = min(wait * 2, 8.0)

    async def _welcome(self, msg: p.Welcome) -> None:
        config = RolloutConfig.from_dict(msg.config)
        if config != self.config:
            self.reward = load_reward(config.reward)
            self.filter = load_filter(config.dynamic_filter)
            self.config = config
        self.session = msg.session
        self.heartbeat_interval = msg.heartbeat_interval
        self.ttl = msg.ttl
        self.last_heard = time.monotonic()
        self.outbox_sent.clear()
        for key, accepted in msg.acks:
            self.store.ack_nowait(key, accepted)
        # Receipts committed while we were registering went out under no session
        # and were dropped: send every one the Welcome did not answer.
        answered = {key for key, _ in msg.acks}
        await self.store.drain()
        now = time.monotonic()
        for r in await asyncio.to_thread(self.store.unacked):
            if r["key"] not in answered:
                self._send(p.Receipt(self.session, r["lease"], r["data_epoch"], r["index"], r["key"], r["n_samples"], r.get("stats", {})))
                self.outbox_sent[r["key"]] = now
        for lease in msg.cancel:
            task = self.tasks.get(lease)
            if task is not None:
                task.cancel()
        self._set_paused(msg.paused, abort=False)
        log.info("agent %s: registered (session %x, capacity %d samples, %d receipts recovered)", self.agent_id, self.session, self.pool.capacity(), len(msg.acks))

    def _decode(self, frame: bytes) -> p.Message | None:
        try:
            return p.decode(frame)
        except ProtocolError as exc:
            log.error("bad message from the coordinator: %s", exc)
            return None

    async def _session_loop(self) -> None:
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._send(p.Heartbeat(self.session, self._stats(), list(self.in_flight), self.max_lease))
                next_beat = now + self.heartbeat_interval
                await self._resend_stale_receipts()
            if now - self.last_heard > self.ttl:
                raise _Reconnect(f"coordinator silent for {now - self.last_heard:.1f}s (TTL {self.ttl}s)")
            if not await self.sock.poll(max(1, (next_beat - now) * 1000)):
                continue
            msg = self._decode(await self.sock.recv())
            self.last_heard = time.monotonic()
            if msg is None:
                continue
            await self._handle(msg)

    async def _resend_stale_receipts(self) -> None:
        """Receipts unacknowledged for a TTL are sent again (the coordinator dedupes)."""
        now = time.monotonic()
        stale = [k for k, t in self.outbox_sent.items() if now - t > self.ttl]
        if not stale:
            return
        for receipt in await asyncio.to_thread(self.store.unacked):
            if receipt["key"] in stale:
                self._send(p.Receipt(self.session, receipt["lease"], receipt["data_epoch"], receipt["index"], receipt["key"], receipt["n_samples"], receipt.get("stats", {})))
                self.outbox_sent[receipt["key"]] = now

    async def _handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Grant):
            if msg.session != self.session:
                return
            if self.stopping:
                self.max_lease = max([self.max_lease, *(g["lease"] for g in msg.leases)])
                self._send(p.Release(self.session, [g["lease"] for g in msg.leases], "agent shutting down"))
                return
            for grant in msg.leases:
                self._start_lease(grant)
        elif isinstance(msg, p.ReceiptAck):
            self.outbox_sent.pop(msg.key, None)
            if not msg.accepted:
                log.info("coordinator refused group %s (%s); deleting it", msg.key, msg.reason)
            # Not awaited: the next grant must not queue behind an fsync.
            self.store.ack_nowait(msg.key, msg.accepted)
        elif isinstance(msg, p.Control):
            if msg.action == "pause":
                self._set_paused(True, abort=msg.abort)
            elif msg.action == "resume":
                self._set_paused(False, abort=False)
        elif isinstance(msg, p.Trim):
            self.store.trim_nowait(msg.keys)
        elif isinstance(msg, p.Heartbeat):
            if msg.session != self.session:
                return
            # Repairs a lost Grant (our next heartbeat lists what we hold, so grants
            # we never saw are released) and a lost pause/resume.
            self.max_lease = max(self.max_lease, int(msg.stats.get("max_lease", 0) or 0))
            paused = bool(msg.stats.get("paused", self.paused))
            if paused != self.paused:
                self._set_paused(paused, abort=False)
        elif isinstance(msg, p.Fence):
            raise _Reconnect(f"fenced: {msg.reason}")
        elif isinstance(msg, p.Error):
            log.error("coordinator error: [%s] %s", msg.code, msg.message)

    def _set_paused(self, paused: bool, *, abort: bool) -> None:
        self.paused = paused
        if paused and abort:
            for lease in list(self.rids):
                self.aborting.add(lease)
                url, rids = self.rids[lease]
                for rid in rids:
                    self._tg.create_task(self._abort_quietly(url, rid), name=f"abort-{rid}")

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self.client.abort(url, rid)
        except EngineError as exc:
            log.warning("abort of %s on %s failed: %s", rid, url, exc)

    def _stats(self) -> dict:
        return {**self.counters, "in_flight": len(self.in_flight), "capacity": self.pool.capacity(), "stored_groups": self.store.count()}

    # ------------------------------------------------------------------ leases

    def _start_lease(self, grant: dict) -> None:
        lease = grant["lease"]
        self.max_lease = max(self.max_lease, lease)
        if lease in self.in_flight:
            return
        self.in_flight[lease] = grant
        self.tasks[lease] = self._tg.create_task(self._run_lease(grant), name=f"lease-{lease:x}")

    async def _run_lease(self, grant: dict) -> None:
        lease = grant["lease"]
        try:
            await self._generate_and_commit(grant)
        except LeaseAborted:
            self.counters["groups_released"] += 1
            self._send(p.Release(self.session, [lease], "aborted by pause"))
        except NoEngineLeft:
            self.counters["groups_released"] += 1
            self._send(p.Release(self.session, [lease], f"no engine left on agent {self.agent_id}"))
        except asyncio.CancelledError:
            raise
        except RolloutError as exc:
            # Bad reward/filter code or a rejected request: give the prompt back
            # and say why (the coordinator filters a prompt that keeps failing);
            # the agent keeps serving.
            log.error("lease %x (index %d) failed: %s", lease, grant["index"], exc)
            self._send(p.Release(self.session, [lease], f"failed: {exc}"))
        except Exception as exc:
            # Anything else (a chat template that rejects a row, a store error) is a
            # failure of this one prompt, not of the agent.
            log.exception("lease %x (index %d) failed unexpectedly", lease, grant["index"])
            self._send(p.Release(self.session, [lease], f"failed: {type(exc).__name__}: {exc}"))
        finally:
            self.in_flight.pop(lease, None)
            self.tasks.pop(lease, None)
            self.committing.discard(lease)
            self.rids.pop(lease, None)
            self.aborting.discard(lease)

    async def _generate_and_commit(self, grant: dict) -> None:
        config = self.config
        lease, epoch, index = grant["lease"], grant["data_epoch"], grant["index"]
        if "prompt" in grant:
            prompt, label, metadata = grant["prompt"], grant["label"], dict(grant.get("metadata") or {})
        else:  # replicated dataset: the grant carries the index only
            row = self.dataset.row(index)
            prompt, label, metadata = row.prompt, row.label, dict(row.metadata)
        metadata["prompt"] = prompt
        input_ids = self.tokenizer.encode(prompt)
        started = time.monotonic()
        results = await self._generate(lease, input_ids, config)
        gen_seconds = time.monotonic() - started
        samples = []
        for out in results:
            meta = out["meta_info"]
            logprobs = meta.get("output_token_logprobs") or []
            tokens = out.get("output_ids")
            if tokens is None:
                tokens = list(map(_second, logprobs))
            spans = meta.get("weight_versions") or []
            samples.append(
                Sample(
                    prompt_tokens=input_ids,
                    response_tokens=tokens,
                    response_logprobs=list(map(_first, logprobs)),
                    loss_mask=[1] * len(tokens),
                    reward=0.0,
                    status=sample_status(meta.get("finish_reason")),
                    weight_version=str(meta.get("weight_version", "")),
                    label=label,
                    metadata=metadata,
                    response_text=out.get("text", ""),
                    weight_versions=[[s.get("version"), s.get("start"), s.get("end")] for s in spans if isinstance(s, dict)],
                )
            )
            if len(samples[-1].response_logprobs) != len(tokens):
                raise EngineError(f"engine returned {len(tokens)} tokens but {len(samples[-1].response_logprobs)} logprobs for lease {lease:x}")
        for sample, reward in zip(samples, await self.reward.score(samples)):
            sample.reward = float(reward)
        verdict = await self.filter.check(samples)
        # No await from here to the commit: a shutdown either cancels the lease
        # before this point (and releases it) or lets it commit and report.
        self.committing.add(lease)
        stats = {
            "n_samples": len(samples),
            "prompt_tokens": len(input_ids) * len(samples),
            "response_tokens": sum(len(s.response_tokens) for s in samples),
            "reward_sum": sum(s.reward for s in samples),
            "truncated": sum(s.status == "truncated" for s in samples),
            "aborted": sum(s.status == "aborted" for s in samples),
            "gen_seconds": gen_seconds,
        }
        self.counters["samples"] += len(samples)
        if not verdict.keep:
            self.counters["groups_filtered"] += 1
            self._send(p.Filtered(self.session, lease, epoch, index, verdict.reason, stats))
            return
        group = Group(index=index, samples=samples, data_epoch=epoch, rollout_id=grant["rollout_id"], label=label, metadata=metadata, agent_id=self.agent_id, gen_seconds=gen_seconds)
        key = f"{epoch}:{index}:{lease:x}"
        receipt = {"lease": lease, "data_epoch": epoch, "index": index, "key": key, "n_samples": len(samples), "stats": stats}
        await self.store.commit(key, group.to_wire(), receipt)
        self.counters["groups_committed"] += 1
        self.outbox_sent[key] = time.monotonic()
        self._send(p.Receipt(self.session, lease, epoch, index, key, len(samples), stats))

    async def _generate(self, lease: int, input_ids: list[int], config: RolloutConfig) -> list[dict]:
        """All samples of the group on one engine; retried elsewhere if the engine dies."""
        n = config.n_samples_per_prompt
        params = config.sampling_params()
        attempt = 0
        while True:
            # A lease that has not reached an engine while the rollout is paused goes
            # back to the coordinator: waiting here would stall a pause(drain=True).
            if lease in self.aborting or self.paused:
                raise LeaseAborted()
            slot = self.pool.pick()
            if slot is None:
                if self.supervisor.all_retired():
                    raise NoEngineLeft()
                self.engine_change.clear()
                try:
                    await asyncio.wait_for(self.engine_change.wait(), 1.0)
                except TimeoutError:
                    pass
                continue
            rids = [f"rf-{lease:016x}-{attempt:03d}-{i:04d}" for i in range(n)]
            self.rids[lease] = (slot.url, rids)
            self.pool.start(slot, n)
            calls = [asyncio.ensure_future(self.client.generate(slot.url, input_ids, params, rid)) for rid in rids]
            try:
                results = await asyncio.gather(*calls)
            except EngineUnavailable as exc:
                failure = exc
            else:
                failure = None
            finally:
                # A failed or cancelled group takes its sibling requests down with it
                # (closing the connection aborts them on the engine).
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                self.pool.finish(slot, n)
                self.rids.pop(lease, None)
            if failure is not None:
                attempt += 1
                self.counters["engine_retries"] += 1
                log.warning("lease %x: engine %s failed (%s); retrying on another engine", lease, slot.name, failure)
                self.supervisor.report_failure(slot.name, str(failure))
                if self.pool.set_engine(slot.name, None, False) and self.session:
                    self._send(p.Capacity(self.session, self.pool.capacity(), self._engines()))
                await asyncio.sleep(0.1)
                continue
            if any(sample_status(r["meta_info"].get("finish_reason")) == "aborted" for r in results):
                if lease in self.aborting or self.paused:
                    raise LeaseAborted()
                attempt += 1
                continue  # aborted by the engine itself (e.g. its own pause): generate again
            return results


class _Reconnect(Exception):
    pass


def _send_failed(kind: str, exc: BaseException) -> None:
    if isinstance(exc, zmq.Again):
        log.warning("send queue to the coordinator is full; %s dropped (repaired by resend/lease expiry)", kind)
    else:
        log.warning("sending %s to the coordinator failed: %s", kind, exc)
