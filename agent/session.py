"""The agent's pure core: its session with the coordinator and its leases.

``AgentSession.handle(event, now) -> list[Instruction]``: no sockets, no event
loop, no clock (``now`` is passed in, ``time.monotonic()`` in production). The
shell feeds it the events of agent/events.py and carries out the instructions
it returns, in order. It keeps the lease table (agent/leases.py: one
``LeaseRecord`` per lease, the generation pool) and the receipts the
coordinator has not answered yet (the outbox). The lease handlers live in
agent/lease_flow.py, weight-update bookkeeping in agent/weight_state.py.

Link phases::

    DISCONNECTED --Connected--> REGISTERING --Welcome--> ACTIVE
         ^                          |  Error (refused): Exit     |
         +------ Reconnect ---------+----------------------------+  Fence, or silence past the TTL

Lease states (``LeaseState``)::

    STARTING --EngineWanted--> GENERATING --GenerationEnded--> SCORING --LeaseScored--> COMMITTING --> (gone)
                  |   ^              |  aborted by the engine: GENERATING again
                  v   |              |  EngineFailed
                WAITING              v
           (no healthy engine)    RETRYING --EngineWanted--> GENERATING / WAITING

Invariants:
- Commit, then receipt: a Receipt is sent only for ``LeaseCommitted`` (the
  store commit returned). It stays in the outbox until a ReceiptAck or the
  Welcome answers it, and is sent again every TTL while unanswered (a lost ack).
- One registration per attempt: every resend of a Register (unanswered,
  however long the partition) is the same message with the same ``req``, which
  the coordinator answers with the one session it made for it; a new attempt
  (a new ``Connected``) gets a new ``req``.
- Session-bound messages (Receipt, Filtered, Release, Capacity, Heartbeat)
  leave only under a current session. Without one they are not sent: the
  next Register (unacknowledged receipts, leases in flight), the Welcome's
  resend of every unanswered receipt and the heartbeat's lease list repair
  what they would have said.
- Every lease ends exactly one way: a receipt, a Filtered, a Release (pause,
  no engine left, failure, shutdown), or silently when the coordinator cancels
  it (Welcome). Its pool slot is held from ``AssignEngine`` until its group
  comes back, fails or is cancelled, and given back exactly once.
- Pause gives back at once every lease not on an engine (a drain must not wait
  for them); leases on an engine finish, unless the pause aborts them.
- Stop (over-sampling, coordinator/oversampling.py) gives a lease back the same
  way (reason ``stopped``): at once if it is not on an engine, once its
  aborted requests come back if it is; a lease past generation completes and
  reports as usual (never discard a finished group). Ignored while paused.
- Shutdown: capacity 0; every lease not yet past scoring is cancelled and
  released in one message; leases committing finish and report.
- Weight updates (agent/weight_state.py): while one is under way no lease is
  put on an engine (it waits, ``WAITING``); a lease whose generation an update
  aborted is assigned again with ``resume`` once it is over, keeping what it
  generated. A pause still gives such a lease back.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

from agent.events import (
    AbortRequests,
    AckReceipt,
    CloseLink,
    Configure,
    Connected,
    EngineChanged,
    EngineFailed,
    EnginesStarted,
    EngineVersion,
    EngineWanted,
    Exit,
    GenerationEnded,
    Instruction,
    LeaseCommitted,
    LeaseEvaluated,
    LeaseFailed,
    LeaseFiltered,
    LeaseScored,
    Log,
    MessageReceived,
    PendingReceipt,
    Reconnect,
    Send,
    ShutdownRequested,
    Tick,
    TrimGroups,
    WeightsStepDone,
)
from agent.lease_flow import LeaseFlow
from agent.leases import ABORT_PAUSE, ABORT_SHUTDOWN, NOT_ON_ENGINE, LeaseState, LeaseTable
from agent.outbox import Outbox
from agent.weight_state import OPENS, WeightState
from common import protocol as p
from common.config import RolloutConfig
from common.engine_info import EngineInfo, EngineState

REFUSALS = ("dataset_mismatch", "too_small", "bad_register")
"""Error codes that answer a Register for good: the agent exits instead of retrying."""

FIRST_REGISTER_WAIT = 1.0
MAX_REGISTER_WAIT = 8.0
"""A Register without an answer is sent again after 1, 2, 4, 8, 8, ... seconds."""


class Phase(enum.Enum):
    DISCONNECTED = "disconnected"
    REGISTERING = "registering"
    ACTIVE = "active"


@dataclass(slots=True)
class Counters:
    groups_committed: int = 0
    groups_filtered: int = 0
    groups_evaluated: int = 0
    groups_released: int = 0
    samples: int = 0
    engine_retries: int = 0


class AgentSession(LeaseFlow):
    def __init__(
        self,
        *,
        agent_id: str,
        incarnation: int,
        payload_address: str,
        concurrency_per_engine: int,
        coordinator: str = "",
        dataset_fingerprint: str = "",
        dataset_size: int = -1,
    ):
        self.agent_id = agent_id
        self.incarnation = incarnation
        self.payload_address = payload_address
        self.coordinator = coordinator
        self.dataset_fingerprint = dataset_fingerprint
        self.dataset_size = dataset_size
        self.phase = Phase.DISCONNECTED
        self.session = 0
        self.config: RolloutConfig | None = None
        self.heartbeat_interval = 1.0
        self.ttl = 5.0
        self.last_heard = 0.0
        self.next_beat = 0.0
        self.leases = LeaseTable(concurrency_per_engine)
        self.outbox = Outbox()
        self.max_lease = 0
        self.paused = False
        self.stopping = False
        self.counters = Counters()
        self.weights = WeightState()
        self.welcomes = 0  # sessions begun so far
        self._register: p.Register | None = None
        self._register_req = 0  # one per registration attempt: every resend of it carries the same
        self._register_wait = FIRST_REGISTER_WAIT
        self._register_deadline = math.inf
        self._events = {
            Connected: self._on_connected,
            MessageReceived: self._on_message,
            Tick: self._on_tick,
            EnginesStarted: self._on_engines_started,
            EngineChanged: self._on_engine_changed,
            EngineWanted: self._on_engine_wanted,
            GenerationEnded: self._on_generation_ended,
            EngineFailed: self._on_engine_failed,
            LeaseScored: self._on_scored,
            LeaseFiltered: self._on_filtered,
            LeaseEvaluated: self._on_evaluated,
            LeaseCommitted: self._on_committed,
            LeaseFailed: self._on_failed,
            ShutdownRequested: self._on_shutdown,
            WeightsStepDone: self._on_weights_done,
            EngineVersion: self._on_engine_version,
        }
        self._messages = {
            p.Grant: self._on_grant,
            p.ReceiptAck: self._on_ack,
            p.Control: self._on_control,
            p.Stop: self._on_stop,
            p.Trim: self._on_trim,
            p.Heartbeat: self._on_heartbeat,
            p.Fence: self._on_fence,
            p.Error: self._on_error,
            **{kind: self._on_weights_step for kind in OPENS},
        }

    def handle(self, event, now: float) -> list[Instruction]:
        out: list[Instruction] = []
        self._events[type(event)](event, now, out)
        return out

    # ------------------------------------------------------------------ queries

    @property
    def next_tick_at(self) -> float:
        """When the link must send the next ``Tick`` (register resend, heartbeat, TTL check)."""
        if self.phase is Phase.REGISTERING:
            return self._register_deadline
        if self.phase is Phase.ACTIVE:
            return min(self.next_beat, self.last_heard + self.ttl)
        return math.inf

    def capacity(self) -> int:
        """Samples this node can generate at once (what the coordinator leases against)."""
        return 0 if self.stopping else self.leases.capacity()

    def engines(self) -> list[EngineInfo]:
        return self.leases.engines()

    def awaiting_acks(self, now: float) -> bool:
        """Receipts are unanswered and the coordinator still talks to us (shutdown waits for this)."""
        return bool(self.outbox) and self.phase is Phase.ACTIVE and now - self.last_heard < 2 * self.heartbeat_interval

    def stats(self, stored_groups: int) -> dict:
        return {
            "groups_committed": self.counters.groups_committed,
            "groups_filtered": self.counters.groups_filtered,
            "groups_evaluated": self.counters.groups_evaluated,
            "groups_released": self.counters.groups_released,
            "samples": self.counters.samples,
            "engine_retries": self.counters.engine_retries,
            "in_flight": len(self.leases),
            "capacity": self.leases.capacity(),
            "stored_groups": stored_groups,
        }

    # ------------------------------------------------------------------ link

    def _send(self, msg: p.Message, out: list) -> None:
        if self.phase is Phase.ACTIVE:
            out.append(Send(msg))

    def _on_connected(self, ev: Connected, now: float, out: list) -> None:
        self.phase = Phase.REGISTERING
        self.session = 0
        for raw in ev.unacked:
            try:
                receipt = PendingReceipt.from_dict(raw)
            except (KeyError, TypeError):
                out.append(Log(logging.WARNING, f"agent {self.agent_id}: malformed receipt in the outbox: {raw!r}"))
                continue
            self.outbox.recover(receipt)
        self._register_req += 1
        self._register = p.Register(
            agent_id=self.agent_id,
            incarnation=self.incarnation,
            capacity=self.capacity(),
            payload_address=self.payload_address,
            engines=self.engines(),
            unacked=list(ev.unacked),
            in_flight=[[r.lease, r.data_epoch, r.index] for r in self.leases.records()],
            dataset_fingerprint=self.dataset_fingerprint,
            dataset_size=self.dataset_size,
            stored=list(ev.stored),
            req=self._register_req,
        )
        self._register_wait = FIRST_REGISTER_WAIT
        self._register_deadline = now + self._register_wait
        out.append(Send(self._register))

    def _on_tick(self, ev: Tick, now: float, out: list) -> None:
        if self.phase is Phase.REGISTERING:
            if now >= self._register_deadline:
                out.append(
                    Log(
                        logging.INFO,
                        f"agent {self.agent_id}: no answer from coordinator {self.coordinator} yet; retrying",
                    )
                )
                self._register_wait = min(self._register_wait * 2, MAX_REGISTER_WAIT)
                self._register_deadline = now + self._register_wait
                out.append(Send(self._register))  # the same Register: its lists match what was read with it
            return
        if self.phase is not Phase.ACTIVE:
            return
        if now >= self.next_beat:
            stats = self.stats(ev.stored_groups)
            out.append(Send(p.Heartbeat(self.session, stats, list(self.leases), self.max_lease, self.engines())))
            self.next_beat = now + self.heartbeat_interval
            for receipt in self.outbox.due(now, self.ttl):  # a lost ReceiptAck
                out.append(Send(receipt.to_message(self.session)))
        if now - self.last_heard > self.ttl:
            self._end_session(f"coordinator silent for {now - self.last_heard:.1f}s (TTL {self.ttl}s)", out)

    def _end_session(self, reason: str, out: list) -> None:
        self.phase = Phase.DISCONNECTED
        self.session = 0
        out.append(CloseLink(reason) if self.stopping else Reconnect(reason))

    def _on_message(self, ev: MessageReceived, now: float, out: list) -> None:
        msg = ev.msg
        if self.phase is Phase.REGISTERING:
            if isinstance(msg, p.Welcome):
                self._on_welcome(msg, now, out)
            elif isinstance(msg, p.Error):
                if msg.code in REFUSALS:
                    out.append(Exit(f"coordinator refused agent {self.agent_id}: {msg.message}"))
                else:
                    out.append(Log(logging.ERROR, f"coordinator error during registration: {msg.message}"))
            # Anything else belongs to a session we no longer have: dropped.
            return
        if self.phase is not Phase.ACTIVE:
            return
        self.last_heard = now
        handler = self._messages.get(type(msg))
        if handler is not None:
            handler(msg, now, out)
        # A second Welcome (an answer to a resent Register) is ignored: our session is the first one's.

    def _on_welcome(self, msg: p.Welcome, now: float, out: list) -> None:
        config = RolloutConfig.from_dict(msg.config)
        if config != self.config:
            out.append(Configure(config))
            self.config = config
        self.phase = Phase.ACTIVE
        self.welcomes += 1
        self.session = msg.session
        self.heartbeat_interval = msg.heartbeat_interval
        self.ttl = msg.ttl
        self.last_heard = now
        self.next_beat = now
        refused = [key for key, accepted in msg.acks if not accepted]
        for key, accepted in msg.acks:
            out.append(AckReceipt(key, accepted))
            self.outbox.answer(key)
        if refused:
            out.append(
                Log(logging.INFO, f"coordinator refused {len(refused)} recovered groups {refused}; deleting them")
            )
        # Receipts committed while we registered (or sent under the old session)
        # were not answered by this Welcome: send every one again.
        for receipt in self.outbox.send_all(now):
            out.append(Send(receipt.to_message(self.session)))
        for lease in msg.cancel:
            self._forget(lease, out)
        self._set_paused(msg.paused, False, out)
        self.weights.on_welcome(msg.weights, out)
        out.append(
            Log(
                logging.INFO,
                f"agent {self.agent_id}: registered (session {self.session:x}, capacity "
                f"{self.leases.capacity()} samples, {len(msg.acks)} receipts recovered)",
            )
        )

    def _on_ack(self, msg: p.ReceiptAck, now: float, out: list) -> None:
        self.outbox.answer(msg.key)
        if not msg.accepted:
            out.append(Log(logging.INFO, f"coordinator refused group {msg.key} ({msg.reason}); deleting it"))
        # Unknown keys are acknowledged too: the store may hold a receipt we never sent (a cancelled commit).
        out.append(AckReceipt(msg.key, msg.accepted))

    def _on_control(self, msg: p.Control, now: float, out: list) -> None:
        if msg.action == "pause":
            self._set_paused(True, msg.abort, out)
        elif msg.action == "resume":
            self._set_paused(False, False, out)

    def _on_trim(self, msg: p.Trim, now: float, out: list) -> None:
        out.append(TrimGroups(tuple(msg.keys)))

    def _on_heartbeat(self, msg: p.Heartbeat, now: float, out: list) -> None:
        if msg.session != self.session:
            return
        # Repairs a lost Grant (our next heartbeat lists what we hold, so grants
        # we never saw are released) and a lost pause/resume.
        self.max_lease = max(self.max_lease, msg.max_lease)
        if msg.paused is not None and msg.paused != self.paused:
            self._set_paused(msg.paused, False, out)

    def _on_fence(self, msg: p.Fence, now: float, out: list) -> None:
        self._end_session(f"fenced: {msg.reason}", out)

    def _on_error(self, msg: p.Error, now: float, out: list) -> None:
        out.append(Log(logging.ERROR, f"coordinator error: [{msg.code}] {msg.message}"))

    # ------------------------------------------------------------------ pause, engines, shutdown

    def _set_paused(self, paused: bool, abort: bool, out: list) -> None:
        self.paused = paused
        if not paused:
            return
        for rec in self.leases.records():
            if rec.state in NOT_ON_ENGINE:
                self._release(rec, ABORT_PAUSE, out)
            elif abort and rec.state is LeaseState.GENERATING and rec.abort is None:
                rec.abort = ABORT_PAUSE
                out.append(AbortRequests(rec.url, rec.request_ids))

    def _on_engines_started(self, ev: EnginesStarted, now: float, out: list) -> None:
        for name, url in ev.engines:
            self.leases.set_engine(name, EngineState.HEALTHY, url)

    def _on_weights_step(self, msg: p.Message, now: float, out: list) -> None:
        self.weights.on_step(msg, out)

    def _on_weights_done(self, ev: WeightsStepDone, now: float, out: list) -> None:
        if self.weights.on_done(ev, self.session, lambda msg: self._send(msg, out), out):
            for rec in self.leases.records(LeaseState.WAITING):
                self._next_engine(rec, out)

    def _on_engine_version(self, ev: EngineVersion, now: float, out: list) -> None:
        self.leases.engine_layout[ev.name] = (ev.tp, ev.version)

    def _on_engine_changed(self, ev: EngineChanged, now: float, out: list) -> None:
        self.leases.all_retired = ev.all_retired
        changed = self.leases.set_engine(ev.name, ev.state, ev.url)
        out.append(
            Log(
                logging.INFO if ev.state == EngineState.HEALTHY else logging.WARNING,
                f"agent {self.agent_id}: engine {ev.name} is {ev.state} "
                f"(capacity now {self.leases.capacity()} samples)",
            )
        )
        if changed or ev.state == EngineState.RETIRED:
            self._send(p.Capacity(self.session, self.capacity(), self.engines()), out)
        for rec in self.leases.records(LeaseState.WAITING):
            self._next_engine(rec, out)

    def _on_shutdown(self, ev: ShutdownRequested, now: float, out: list) -> None:
        self.stopping = True
        self._send(p.Capacity(self.session, 0, self.engines()), out)
        generating = [rec.lease for rec in self.leases.records() if rec.state is not LeaseState.COMMITTING]
        for lease in generating:
            self._forget(lease, out)
        if generating:
            self._send(p.Release(self.session, generating, ABORT_SHUTDOWN), out)

    # ------------------------------------------------------------------ receipts

    def _on_committed(self, ev: LeaseCommitted, now: float, out: list) -> None:
        # Reported even if the lease was forgotten meanwhile: the group is durable, the coordinator decides.
        self.leases.pop(ev.lease)
        self.counters.groups_committed += 1
        if self.phase is Phase.ACTIVE:
            out.append(Send(ev.receipt.to_message(self.session)))
            self.outbox.add(ev.receipt, now)
        else:
            self.outbox.add(ev.receipt, None)
