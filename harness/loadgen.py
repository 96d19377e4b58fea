"""Simulated agents for control-plane load: many agents per process, each speaking the real protocol.

One ``LoadWorker`` runs ``agents`` simulated agents in one process, in one plain (not asyncio)
loop over a ``zmq.Poller``: each agent has its own DEALER socket, routing id, incarnation and
session, so the coordinator sees exactly what it sees from a fleet of real ``agent join``
processes:

- ``Register`` (with the dataset fingerprint, so grants carry indices only, unless ``rows``),
  then a ``Heartbeat`` every interval the ``Welcome`` names, carrying the leases held and the
  highest lease seen (the coordinator reconciles against it), and engine states;
- ``Capacity`` every ``capacity_interval`` seconds (the same capacity: an engine "back");
- for each granted lease, after ``gen_ms`` (exponential mean; 0: at once), one outcome:
  ``Filtered`` with probability ``filtered_rate``, ``Release`` with ``release_rate``, else a
  ``Receipt`` for a group of ``n_samples``. ``rate`` (outcomes per second for this worker,
  0: unlimited) paces them with a token bucket.
- a ``Fence`` makes the agent register again; any ``Error`` is counted.

Measured, per worker, over the window between ``start_at`` and ``end_at`` (wall clock, so that
all workers share one window): outcomes sent, acks received, the **grant round trip** (from the
message that frees a slot to the ``Grant`` that refills it: each lease in a Grant takes the
oldest free-slot time of its agent), the **receipt-ack latency** (``Receipt`` sent to
``ReceiptAck`` received), and the worker's own CPU time. Latency samples are kept whole (one
float each) and returned to the caller, which merges workers' samples for percentiles.

The worker never serves payloads: trainers fetch payloads from agents, not from the
coordinator, so the coordinator's load does not depend on them.
"""

from __future__ import annotations

import heapq
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack
import zmq

from common import protocol as p

MAX_SAMPLES = 50_000
"""Latency samples kept per kind and worker (a uniform reservoir sample)."""


@dataclass
class LoadConfig:
    coordinator: str
    agents: int
    first_agent: int = 0
    """Agents are named ``sim-<first_agent + i>``."""
    capacity_groups: int = 32
    """Groups in flight per agent (its Register capacity is this times ``n_samples``)."""
    n_samples: int = 8
    gen_ms: float = 0.0
    filtered_rate: float = 0.0
    release_rate: float = 0.0
    rate: float = 0.0
    """Outcomes per second for this worker; 0: as fast as grants come."""
    capacity_interval: float = 30.0
    dataset_fingerprint: str = ""
    dataset_size: int = -1
    start_at: float = 0.0
    """Wall-clock (``time.time``) start of the measured window."""
    end_at: float = 0.0
    stop_at: float = 0.0
    """Wall-clock time the worker exits (after ``end_at``)."""
    seed: int = 0
    curve_secret: str = ""
    """With CurveZMQ: every simulated agent's key pair (one for all), and ``curve_server_key`` the coordinator's."""
    curve_server_key: str = ""


@dataclass
class SimAgent:
    agent_id: str
    sock: zmq.Socket
    incarnation: int
    session: int = 0
    heartbeat_interval: float = 1.0
    leases: dict = field(default_factory=dict)  # lease id -> (data_epoch, index)
    max_lease: int = 0
    freed: deque = field(default_factory=deque)  # monotonic times slots were freed, oldest first
    acks: dict = field(default_factory=dict)  # receipt key -> monotonic send time
    last_beat: float | None = None  # when the coordinator's last heartbeat arrived


@dataclass
class WorkerResult:
    outcomes: int = 0
    receipts: int = 0
    filtered: int = 0
    released: int = 0
    acks: int = 0
    refused: int = 0
    errors: int = 0
    fences: int = 0
    grants: int = 0
    leases: int = 0
    heartbeats: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    grant_rtt: list = field(default_factory=list)
    ack_latency: list = field(default_factory=list)
    beat_gaps: list = field(default_factory=list)
    """Seconds between consecutive heartbeats from the coordinator to one agent (it sends one every half
    interval: a gap well above that means its clock fell behind)."""
    error_samples: list = field(default_factory=list)


def _encode(msg: p.Message) -> bytes:
    return p.encode(msg)


class LoadWorker:
    def __init__(self, cfg: LoadConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, cfg.agents + 64)  # libzmq's default allows 1023 sockets a context
        self.poller = zmq.Poller()
        self.agents: list[SimAgent] = []
        self.by_sock: dict = {}
        self.timers: list = []  # (due, seq, kind, agent, lease id): leases due, heartbeats, capacity
        self._seq = 0
        self.outbox: deque = deque()  # (agent, lease id) ready to report, paced by ``rate``
        self.tokens = 0.0
        self.last_refill = time.monotonic()
        self.res = WorkerResult()
        self.measuring = False
        self._seen: dict[int, int] = {}
        self.engines = [p.EngineInfo(f"e{i}", p.EngineState.HEALTHY, f"http://sim:{i}") for i in range(8)]
        pid = os.getpid()
        keys = None
        if cfg.curve_secret:
            from common.curve import client_keys, make_client

            keys = client_keys(cfg.curve_secret, cfg.curve_server_key, secret_flag="secret", server_flag="server")
        for i in range(cfg.agents):
            agent_id = f"sim-{cfg.first_agent + i}"
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.ROUTING_ID, agent_id.encode())
            if keys is not None:
                make_client(sock, keys)
            sock.connect(cfg.coordinator)
            agent = SimAgent(agent_id, sock, incarnation=(pid << 20) | i)
            self.agents.append(agent)
            self.by_sock[sock] = agent
            self.poller.register(sock, zmq.POLLIN)

    # ------------------------------------------------------------------ sending

    def _send(self, agent: SimAgent, msg: p.Message) -> None:
        agent.sock.send(_encode(msg), zmq.NOBLOCK)

    def _register(self, agent: SimAgent) -> None:
        cfg = self.cfg
        agent.session = 0
        agent.leases.clear()
        agent.freed.clear()
        agent.acks.clear()
        self._send(
            agent,
            p.Register(
                agent_id=agent.agent_id,
                incarnation=agent.incarnation,
                capacity=cfg.capacity_groups * cfg.n_samples,
                payload_address="tcp://127.0.0.1:1",
                engines=self.engines,
                unacked=[],
                in_flight=[],
                dataset_fingerprint=cfg.dataset_fingerprint,
                dataset_size=cfg.dataset_size,
                stored=[],
            ),
        )

    def _heartbeat(self, agent: SimAgent) -> None:
        stats = {
            "groups_committed": self.res.receipts,
            "in_flight": len(agent.leases),
            "capacity": self.cfg.capacity_groups * self.cfg.n_samples,
            "stored_groups": 0,
        }
        self._send(agent, p.Heartbeat(agent.session, stats, list(agent.leases), agent.max_lease, self.engines))
        self.res.heartbeats += 1

    def _report(self, agent: SimAgent, lease_id: int) -> None:
        """The outcome of one lease: a receipt, a filter verdict or a release."""
        where = agent.leases.pop(lease_id, None)
        if where is None or not agent.session:
            return  # released by reconciliation or a new session meanwhile
        epoch, index = where
        cfg, res = self.cfg, self.res
        now = time.monotonic()
        agent.freed.append(now)
        r = self.rng.random()
        n = cfg.n_samples
        stats = {
            "n_samples": n,
            "prompt_tokens": 256 * n,
            "response_tokens": 512 * n,
            "reward_sum": float(r < 0.5) * n,
            "truncated": 0,
            "aborted": 0,
            "gen_seconds": cfg.gen_ms / 1000,
        }
        if r < cfg.filtered_rate:
            self._send(agent, p.Filtered(agent.session, lease_id, epoch, index, "zero_std", stats))
            kind = "filtered"
        elif r < cfg.filtered_rate + cfg.release_rate:
            self._send(agent, p.Release(agent.session, [lease_id], p.ReleaseReason.NO_ENGINE))
            kind = "released"
        else:
            key = f"{epoch}:{index}:{lease_id:x}"
            agent.acks[key] = now
            self._send(agent, p.Receipt(agent.session, lease_id, epoch, index, key, n, stats))
            kind = "receipts"
        if self.measuring:
            res.outcomes += 1
            setattr(res, kind, getattr(res, kind) + 1)

    # ------------------------------------------------------------------ receiving

    def _sample(self, into: list, value: float) -> None:
        """Keep a uniform sample of at most ``MAX_SAMPLES`` values (reservoir sampling)."""
        self._seen[id(into)] = seen = self._seen.get(id(into), 0) + 1
        if len(into) < MAX_SAMPLES:
            into.append(value)
        else:
            j = self.rng.randrange(seen)
            if j < MAX_SAMPLES:
                into[j] = value

    def _on_frame(self, agent: SimAgent, frame: bytes, now: float) -> None:
        version, mtype, body = msgpack.unpackb(frame, raw=False)
        res = self.res
        if mtype == "grant":
            if body["session"] != agent.session:
                return
            if self.measuring:
                res.grants += 1
            for lease in body["leases"]:
                lease_id = lease["lease"]  # a LeaseGrant record: a map on the wire
                agent.leases[lease_id] = (lease["data_epoch"], lease["index"])
                agent.max_lease = max(agent.max_lease, lease_id)
                freed_at = agent.freed.popleft() if agent.freed else None
                if self.measuring:
                    res.leases += 1
                    if freed_at is not None:
                        self._sample(res.grant_rtt, now - freed_at)
                if self.cfg.gen_ms > 0:
                    self._at(now + self.rng.expovariate(1000.0 / self.cfg.gen_ms), "lease", agent, lease_id)
                else:
                    self.outbox.append((agent, lease_id))
        elif mtype == "receipt_ack":
            sent = agent.acks.pop(body["key"], None)
            if self.measuring:
                res.acks += 1
                res.refused += not body["accepted"]
                if sent is not None:
                    self._sample(res.ack_latency, now - sent)
        elif mtype == "welcome":
            if agent.session:
                return  # an answer to a resent Register
            agent.session = body["session"]
            agent.heartbeat_interval = body["heartbeat_interval"]
            # Spread the fleet's heartbeats over the interval.
            self._at(now + self.rng.uniform(0, agent.heartbeat_interval), "beat", agent, agent.session)
            self._at(now + self.rng.uniform(0, self.cfg.capacity_interval), "capacity", agent, agent.session)
            # A fresh agent's whole capacity is free: its first grants are not round trips.
        elif mtype == "fence":
            res.fences += 1
            self._register(agent)
        elif mtype == "error":
            res.errors += 1
            if len(res.error_samples) < 5:
                res.error_samples.append(f"{body.get('code')}: {body.get('message')}")
        elif mtype == "heartbeat":
            if self.measuring and agent.last_beat is not None:
                self._sample(res.beat_gaps, now - agent.last_beat)
            agent.last_beat = now
        # control, trim: nothing to do for a simulated agent

    # ------------------------------------------------------------------ loop

    def _at(self, due: float, kind: str, agent: SimAgent, data: int) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (due, self._seq, kind, agent, data))

    def _fire(self, kind: str, agent: SimAgent, data: int, now: float) -> None:
        if kind == "lease":
            self.outbox.append((agent, data))
        elif data == agent.session:  # timers of an older session lapse
            if kind == "beat":
                self._heartbeat(agent)
                self._at(now + agent.heartbeat_interval, kind, agent, data)
            else:
                cap = self.cfg.capacity_groups * self.cfg.n_samples
                self._send(agent, p.Capacity(agent.session, cap, self.engines))
                self._at(now + self.cfg.capacity_interval, kind, agent, data)

    def _drain_outbox(self, now: float) -> None:
        rate = self.cfg.rate
        if rate > 0:
            self.tokens = min(self.tokens + (now - self.last_refill) * rate, max(1.0, rate * 0.05))
            self.last_refill = now
            while self.outbox and self.tokens >= 1:
                self.tokens -= 1
                self._report(*self.outbox.popleft())
        else:
            while self.outbox:
                self._report(*self.outbox.popleft())

    def run(self) -> WorkerResult:
        cfg = self.cfg
        for agent in self.agents:
            self._register(agent)
        cpu0 = wall0 = 0.0
        done = False
        while not done:
            now_wall = time.time()
            if not self.measuring and cfg.start_at <= now_wall < cfg.end_at:
                self.measuring = True
                cpu0, wall0 = time.process_time(), time.monotonic()
            elif self.measuring and now_wall >= cfg.end_at:
                self.measuring = False
                self.res.cpu_s = time.process_time() - cpu0
                self.res.wall_s = time.monotonic() - wall0
            done = now_wall >= cfg.stop_at
            now = time.monotonic()
            wait_ms = 20
            if self.timers:
                wait_ms = max(0, min(wait_ms, int((self.timers[0][0] - now) * 1000)))
            if self.outbox:
                wait_ms = 0 if cfg.rate <= 0 else min(wait_ms, 1)
            for sock, _ in self.poller.poll(wait_ms):
                agent = self.by_sock[sock]
                now = time.monotonic()
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frame(agent, frame, now)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, kind, agent, data = heapq.heappop(self.timers)
                self._fire(kind, agent, data, now)
            self._drain_outbox(now)
        for agent in self.agents:
            agent.sock.close(linger=0)
        self.ctx.term()
        return self.res
