"""The coordinator's state machine: leases, receipts, batches, trainer sessions.

Pure core (no sockets, no event loop, no clock): every handler takes an
event and ``now`` and returns *effects* for the I/O shell to carry out:

    Send(to, msg)        to an agent id (str) or a raw ZeroMQ peer (bytes)
    Persist(ops, then)   write ``ops`` to the ledger in one durable
                         transaction, and only after it commits send ``then``

Invariants kept here:
- Exactly once: a prompt ``(data_epoch, index)`` is accepted at most once.
  A receipt for a prompt already READY/DELIVERED under another group key is
  refused and the agent deletes that group; a retransmitted receipt (same
  key) is acknowledged again.
- Commit before acknowledgement: ReceiptAck, Welcome (with its acks) and
  batch replies travel in ``Persist.then``, after the ledger commit.
- Write-ahead leases: a Grant travels in ``Persist.then`` behind the frontier
  cursor that covers it, so after a crash every prompt that may be in flight
  on an agent is an orphan (kept for its agent for a TTL), never a fresh
  prompt handed to a second agent while the first still generates it.
- Pause is durable: a restart keeps the trainer's pause (and its drain).
- Bounded: leased + ready <= demand + prefetch, where demand is
  ``rollout_batch_size`` per waiting ``generate``. With no trainer pulling,
  admission stops once ``prefetch`` groups are in flight or ready.
- Idempotent: a recorded batch is replayed verbatim for the same rollout id.
- Fencing: agent and trainer messages carry sessions; a superseded or
  unknown session gets ``Fence``/an error and changes nothing.

The shell delivers the messages for one destination in the order the core
produced them: a ``Send`` waits behind an earlier ``Persist.then`` message to
the same destination (e.g. a Control never overtakes the Grant before it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.metrics import DropStats
from coordinator.frontier import DELIVERED, FILTERED, LEASED, PENDING, READY, Frontier
from coordinator.membership import ALIVE, AgentRecord, Membership

FILTER_PREFIX = "rollout/dynamic_filter"
MAX_FAILURES = 3
"""Failed attempts after which a prompt is filtered with reason ``generation_failed``."""


def range_order(size: int, data_epoch: int):
    return range(size)


@dataclass
class Send:
    to: Any  # agent id (str) or ZeroMQ peer id (bytes)
    msg: p.Message


@dataclass
class Persist:
    ops: list
    then: list = field(default_factory=list)


@dataclass
class ReadyGroup:
    agent_id: str
    key: str
    stats: dict
    seq: int


@dataclass
class PendingGenerate:
    peer: bytes
    req: int
    rollout_id: int


@dataclass
class Restored:
    """What the ledger holds after a restart."""

    generation: int
    cursors: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)  # (epoch, index) -> record
    batches: dict = field(default_factory=dict)  # rollout_id -> record
    trimmed_upto: int = -1
    last_rollout_id: int = -1
    paused: bool = False
    consumed_upto: int = -1
    last_checkpoint: int = -1


class CoordinatorCore:
    def __init__(
        self,
        config: RolloutConfig,
        liveness: Liveness,
        *,
        dataset_size: int,
        dataset_fingerprint: str,
        row: Callable[[int], tuple[Any, Any, dict]],
        order_for_epoch: Callable[[int], Any] = range_order,
        restored: Restored | None = None,
        now: float = 0.0,
    ):
        self.config = config
        self.liveness = liveness
        self.dataset_size = dataset_size
        self.dataset_fingerprint = dataset_fingerprint
        self._row = row
        restored = restored or Restored(generation=1)
        self.membership = Membership(restored.generation)
        self.frontier = Frontier(dataset_size, lambda e: order_for_epoch(dataset_size, e))
        self.leases: dict[int, tuple[str, int, int, int]] = {}  # lease -> (agent, epoch, index, rollout_id)
        self.leased_by: dict[tuple[int, int], int] = {}
        self._lease_counter = 0
        self.ready: deque[tuple[int, int]] = deque()
        self.ready_info: dict[tuple[int, int], ReadyGroup] = {}
        self._seq = 0
        self.batches: dict[int, dict] = dict(restored.batches)
        self.trimmed_upto = restored.trimmed_upto
        # Highest rollout id a trainer has fetched completely (ever): its prompts were trained on.
        self.consumed_upto = max(restored.consumed_upto, restored.trimmed_upto)
        self.last_rollout_id = max([restored.last_rollout_id, *self.batches]) if self.batches else restored.last_rollout_id
        self.pending: list[PendingGenerate] = []
        self.repairs: dict[int, list[tuple[bytes, int]]] = {}  # batch -> trainers waiting for it
        self.drain_waiters: list[tuple[bytes, int]] = []
        self.prefetch = config.effective_prefetch
        self.paused = restored.paused
        self.trainer_session = 0
        self.trainer_client = ""
        self._last_attach: tuple[str, int] = ("", 0)
        self.drops = DropStats()  # filter verdicts since the last batch was assembled
        self.filtered_total = 0
        self.last_checkpoint = restored.last_checkpoint
        self.epoch_last_rid: dict[int, int] = {}  # epoch -> last batch holding its prompts
        for rid, batch in self.batches.items():
            for g in batch["groups"]:
                self._note_epoch(g[1], rid)
        self.failures: dict[tuple[int, int], int] = {}  # prompts whose generation failed, by count
        self._last_tick = now
        self._restore(restored, now)

    # ------------------------------------------------------------------ restore

    def _restore(self, restored: Restored, now: float) -> None:
        if not restored.cursors and not restored.prompts:
            return
        states = {}
        ready = []
        for (epoch, index), rec in restored.prompts.items():
            st = {"r": READY, "d": DELIVERED, "f": FILTERED}[rec["s"]]
            states[(epoch, index)] = st
            if st == READY:
                ready.append((rec.get("seq", 0), epoch, index, rec))
        self.frontier.restore(restored.cursors, states, now, orphan_delay=self.liveness.ttl)
        for seq, epoch, index, rec in sorted(ready):
            self.ready.append((epoch, index))
            self.ready_info[(epoch, index)] = ReadyGroup(rec["a"], rec["k"], rec.get("st", {}), seq)
            self._seq = max(self._seq, seq)
        # Agents the ledger points at are known from now on, even if they never come
        # back: they are then retired on schedule and their groups replaced.
        referenced = {info.agent_id for info in self.ready_info.values()}
        referenced |= {g[2] for batch in self.batches.values() for g in batch["groups"]}
        for agent_id in referenced:
            self.membership.placeholder(agent_id, now)

    # ------------------------------------------------------------------ helpers

    def _next_lease(self) -> int:
        self._lease_counter += 1
        return (self.membership.generation << 32) | self._lease_counter

    def _persist(self, ops: list, then: list) -> Persist:
        ops.append(("meta", "cursors", {str(k): v for k, v in self.frontier.cursors().items()}))
        return Persist(ops, then)

    def _end_lease(self, lease: int) -> tuple[str, int, int, int] | None:
        info = self.leases.pop(lease, None)
        if info is None:
            return None
        agent_id, epoch, index, _ = info
        if self.leased_by.get((epoch, index)) == lease:
            del self.leased_by[(epoch, index)]
        rec = self.membership.agents.get(agent_id)
        if rec is not None:
            rec.leases.discard(lease)
        return info

    def _release_agent_leases(self, rec: AgentRecord, keep: set[int] = frozenset()) -> None:
        for lease in list(rec.leases):
            if lease in keep:
                continue
            info = self._end_lease(lease)
            if info is not None:
                self.frontier.release(info[1], info[2])

    @property
    def current_rollout_id(self) -> int:
        if self.pending:
            return self.pending[0].rollout_id
        return self.last_rollout_id + 1

    def statistics(self) -> dict:
        counts = self.frontier.counts()
        return {
            "agents": {r.agent_id: {"status": r.status, "capacity": r.capacity, "leases": len(r.leases), "engines": r.engines} for r in self.membership.agents.values()},
            "leased": len(self.leases),
            "ready": len(self.ready_info),
            "pending_generates": len(self.pending),
            "batches_in_repair": sorted(self.repairs),
            "prefetch": self.prefetch,
            "paused": self.paused,
            "trainer": self.trainer_client if self.trainer_session else None,
            "prompts": counts,
            "data_epochs": sorted(self.frontier.epochs),
            "last_rollout_id": self.last_rollout_id,
            "trimmed_upto": self.trimmed_upto,
            "consumed_upto": self.consumed_upto,
            "filtered_total": self.filtered_total,
        }

    # ------------------------------------------------------------------ agents

    def on_register(self, peer: bytes, msg: p.Register, now: float) -> list:
        if msg.dataset_fingerprint and (msg.dataset_fingerprint != self.dataset_fingerprint or msg.dataset_size != self.dataset_size):
            return [Send(peer, p.Error("dataset_mismatch", f"agent {msg.agent_id}'s dataset ({msg.dataset_size} rows, fingerprint {msg.dataset_fingerprint[:12]}) does not match the coordinator's ({self.dataset_size} rows, fingerprint {self.dataset_fingerprint[:12]})"))]
        if msg.capacity < 0:
            return [Send(peer, p.Error("bad_register", f"capacity must be >= 0, got {msg.capacity}"))]
        n = self.config.n_samples_per_prompt
        if 0 < msg.capacity < n:
            return [Send(peer, p.Error("too_small", f"agent {msg.agent_id}'s total engine concurrency ({msg.capacity}) is smaller than one group ({n} samples per prompt); raise --concurrency or add engines"))]
        old = self.membership.agents.get(msg.agent_id)
        reported = {}
        stale = []  # leases for prompts of closed (or never opened) epochs: drop them
        for item in msg.in_flight:
            if isinstance(item, list) and len(item) == 3 and isinstance(item[0], int):
                if self.frontier.valid(item[1], item[2]):
                    reported[item[0]] = (item[1], item[2])
                else:
                    stale.append(item[0])
        if old is not None:
            self._release_agent_leases(old, keep=set(reported))
        engines = [e for e in msg.engines if isinstance(e, dict)]
        rec = self.membership.register(msg.agent_id, msg.incarnation, peer, msg.capacity // n, msg.payload_address, engines, now)
        rec.local_dataset = bool(msg.dataset_fingerprint)
        cancel = stale
        for lease, (epoch, index) in reported.items():
            owner = self.leases.get(lease)
            if owner is not None and owner[0] == msg.agent_id:
                rec.leases.add(lease)
            elif owner is None and self.frontier.adopt(epoch, index):
                self.leases[lease] = (msg.agent_id, epoch, index, self.current_rollout_id)
                self.leased_by[(epoch, index)] = lease
                rec.leases.add(lease)
            else:
                cancel.append(lease)
        ops: list = []
        acks = []
        for receipt in msg.unacked:
            try:
                lease, epoch, index, key, stats = receipt["lease"], receipt["data_epoch"], receipt["index"], receipt["key"], receipt.get("stats", {})
            except (TypeError, KeyError):
                continue
            if not (isinstance(lease, int) and isinstance(key, str) and isinstance(stats, dict)):
                continue
            accepted, _ = self._accept(rec, lease, epoch, index, key, stats, ops)
            acks.append([key, accepted])
        welcome = p.Welcome(
            session=rec.session,
            config=self.config.to_dict(),
            heartbeat_interval=self.liveness.heartbeat_interval,
            ttl=self.liveness.ttl,
            acks=acks,
            cancel=cancel,
            paused=self.paused,
        )
        then: list = [Send(msg.agent_id, welcome)]
        # Storage reconciliation: whatever the agent stores that no batch, ready group
        # or pending receipt refers to was consumed behind a checkpoint, refused, or
        # belongs to a closed epoch, and a Trim for it was lost (agent down, restart).
        live = {info.key for info in self.ready_info.values() if info.agent_id == msg.agent_id}
        live |= {g[3] for batch in self.batches.values() for g in batch["groups"] if g[2] == msg.agent_id}
        live |= {r["key"] for r in msg.unacked if isinstance(r, dict) and isinstance(r.get("key"), str)}
        garbage = [k for k in msg.stored if isinstance(k, str) and k not in live]
        if garbage:
            then.append(Send(msg.agent_id, p.Trim(garbage)))
        # Nothing may reach the agent before its Welcome: grants ride behind it.
        pumped = self._pump(now)
        then += [e for e in pumped if isinstance(e, Send)]
        return [self._persist(ops, then)] + [e for e in pumped if not isinstance(e, Send)]

    def _agent(self, peer: bytes, session: int, now: float) -> AgentRecord | None:
        rec = self.membership.by_session(session)
        if rec is not None:
            rec.last_seen = now
            rec.peer = peer
        return rec

    def _fence(self, peer: bytes, session: int) -> list:
        return [Send(peer, p.Fence(f"session {session} is not current; register again"))]

    def on_heartbeat(self, peer: bytes, msg: p.Heartbeat, now: float) -> list:
        rec = self._agent(peer, msg.session, now)
        if rec is None:
            return self._fence(peer, msg.session)
        held = set(msg.leases)
        lost = [lease for lease in rec.leases if lease <= msg.max_lease and lease not in held]
        for lease in lost:
            info = self._end_lease(lease)
            if info is not None:
                self.frontier.release(info[1], info[2])
        return self._pump(now) if lost else []

    def _accept(self, rec: AgentRecord, lease: int, epoch: int, index: int, key: str, stats: dict, ops: list) -> tuple[bool, str]:
        """Record an agent's committed group unless the prompt is already accounted for."""
        info = self.leases.get(lease)
        if info is not None and info[0] == rec.agent_id:
            self._end_lease(lease)
        if isinstance(epoch, int) and self.frontier.is_closed(epoch):
            return False, "duplicate: its data epoch is complete"
        if not self.frontier.valid(epoch, index):
            return False, f"index {index!r} / data epoch {epoch!r} is not a prompt of an open epoch"
        state = self.frontier.state_of(epoch, index)
        if state in (READY, DELIVERED):
            existing = self.ready_info.get((epoch, index))
            if existing is not None and existing.key == key:
                return True, ""
            if state == DELIVERED and self._delivered_key(epoch, index) == key:
                return True, ""
            return False, "duplicate: prompt already accepted from another group"
        if state == FILTERED:
            return False, "duplicate: prompt already filtered"
        other = self.leased_by.get((epoch, index))
        if other is not None:
            self._end_lease(other)
        self.frontier.set(epoch, index, READY)
        self._seq += 1
        self.ready.append((epoch, index))
        self.ready_info[(epoch, index)] = ReadyGroup(rec.agent_id, key, stats, self._seq)
        self.drops.record_kept()
        ops.append(("prompt", epoch, index, {"s": "r", "a": rec.agent_id, "k": key, "st": stats, "seq": self._seq}))
        return True, ""

    def _delivered_key(self, epoch: int, index: int) -> str | None:
        for batch in self.batches.values():
            for g in batch["groups"]:
                if g[0] == index and g[1] == epoch:
                    return g[3]
        return None

    def on_receipt(self, peer: bytes, msg: p.Receipt, now: float) -> list:
        rec = self._agent(peer, msg.session, now)
        if rec is None:
            return self._fence(peer, msg.session)
        ops: list = []
        accepted, reason = self._accept(rec, msg.lease, msg.data_epoch, msg.index, msg.key, msg.stats, ops)
        ack = Send(rec.agent_id, p.ReceiptAck(msg.lease, msg.key, accepted, reason))
        return [self._persist(ops, [ack])] + self._pump(now)

    def on_filtered(self, peer: bytes, msg: p.Filtered, now: float) -> list:
        rec = self._agent(peer, msg.session, now)
        if rec is None:
            return self._fence(peer, msg.session)
        info = self.leases.get(msg.lease)
        if info is None or info[0] != rec.agent_id:
            return self._pump(now)  # lease was reissued; the successor accounts for the prompt
        self._end_lease(msg.lease)
        _, epoch, index, _ = info  # the lease's prompt, whatever the message claims
        return self._filter(epoch, index, rec.agent_id, msg.reason, now)

    def _filter(self, epoch: int, index: int, agent_id: str, reason: str, now: float) -> list:
        if self.frontier.state_of(epoch, index) not in (PENDING, LEASED):
            return self._pump(now)
        self.frontier.set(epoch, index, FILTERED)
        self.drops.record_dropped(reason)
        self.filtered_total += 1
        self.failures.pop((epoch, index), None)
        ops = [("prompt", epoch, index, {"s": "f", "a": agent_id, "why": reason})]
        return [self._persist(ops, [])] + self._pump(now)

    def on_release(self, peer: bytes, msg: p.Release, now: float) -> list:
        rec = self._agent(peer, msg.session, now)
        if rec is None:
            return self._fence(peer, msg.session)
        out: list = []
        for lease in msg.leases:
            info = self.leases.get(lease)
            if info is not None and info[0] == rec.agent_id:
                self._end_lease(lease)
                prompt = (info[1], info[2])
                if msg.reason.startswith("failed"):
                    # A prompt that keeps failing (a reward that raises on its label, a
                    # prompt too long for the engine) is filtered, not retried forever.
                    self.failures[prompt] = self.failures.get(prompt, 0) + 1
                    if self.failures[prompt] >= MAX_FAILURES:
                        out += self._filter(*prompt, rec.agent_id, "generation_failed", now)
                        continue
                self.frontier.release(*prompt)
        return out + self._pump(now)

    def on_capacity(self, peer: bytes, msg: p.Capacity, now: float) -> list:
        rec = self._agent(peer, msg.session, now)
        if rec is None:
            return self._fence(peer, msg.session)
        rec.capacity = max(0, msg.capacity) // self.config.n_samples_per_prompt
        rec.engines = [e for e in msg.engines if isinstance(e, dict)]
        return self._pump(now)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list:
        stalled = now - self._last_tick
        if stalled > self.liveness.ttl:
            # We, not the agents, were silent (stopped process, overloaded host):
            # nobody's silence counts for that long.
            for rec in self.membership.agents.values():
                rec.last_seen += stalled
        self._last_tick = now
        dead, retired = self.membership.expire(now, self.liveness.ttl, self.liveness.retire_after)
        out: list = []
        for rec in dead:
            self._release_agent_leases(rec)
        ops: list = []
        for rec in retired:
            for key, info in list(self.ready_info.items()):
                if info.agent_id == rec.agent_id:
                    del self.ready_info[key]
                    self.frontier.reopen(*key)
                    ops.append(("prompt", key[0], key[1], None))
            self._repair_batches(rec.agent_id, ops)
        if ops:
            out.append(self._persist(ops, []))
        return out + self._pump(now)

    def _repair_batches(self, agent_id: str, ops: list) -> None:
        """Recorded batches lose the groups of a retired node (``lost``); nothing else yet.

        What happens to the lost prompts is decided when a trainer asks for
        the batch again (``_start_repair``), because only then is it known
        whether the trainer had fetched the batch before the node went away.
        """
        for rid, batch in self.batches.items():
            lost = [g for g in batch["groups"] if g[2] == agent_id]
            if lost:
                self._lose_groups(rid, batch, lost, ops)

    def _lose_groups(self, rid: int, batch: dict, lost: list, ops: list) -> None:
        batch["groups"] = [g for g in batch["groups"] if g not in lost]
        batch.setdefault("lost", []).extend([g[1], g[0]] for g in lost)
        batch["metrics"]["rollout/replaced_groups"] = batch["metrics"].get("rollout/replaced_groups", 0.0) + len(lost)
        ops.append(("batch", rid, _snapshot(batch)))

    def _start_repair(self, rid: int, ops: list) -> None:
        """A trainer asks for a batch that lost groups: refill it.

        If no trainer ever fetched it, its lost prompts were never trained:
        they are generated again. If one did (``consumed_upto``), they stay
        delivered — never trained twice — and fresh prompts fill the batch.
        """
        batch = self.batches[rid]
        if rid > self.consumed_upto:
            for epoch, index in batch.get("lost", []):
                if self.frontier.is_open(epoch):
                    self.frontier.reopen(epoch, index)
                    ops.append(("prompt", epoch, index, None))
        batch["lost"] = []
        ops.append(("batch", rid, _snapshot(batch)))
        self.repairs[rid] = []

    def _fill_repairs(self) -> list:
        out = []
        size = self.config.rollout_batch_size
        for rid in sorted(self.repairs):
            batch = self.batches.get(rid)
            if batch is None:  # trimmed meanwhile
                self.repairs.pop(rid)
                continue
            ops: list = []
            while len(batch["groups"]) < size and self.ready:
                epoch, index = self.ready.popleft()
                info = self.ready_info.pop((epoch, index), None)
                if info is None:
                    continue
                self.frontier.set(epoch, index, DELIVERED)
                self._note_epoch(epoch, rid)
                ops.append(("prompt", epoch, index, {"s": "d", "a": info.agent_id, "k": info.key, "rid": rid}))
                batch["groups"].append([index, epoch, info.agent_id, info.key])
            if len(batch["groups"]) < size:
                if ops:
                    out.append(self._persist(ops + [("batch", rid, _snapshot(batch))], []))
                break
            waiters = self.repairs.pop(rid)
            ops.append(("batch", rid, _snapshot(batch)))
            out.append(self._persist(ops, [Send(peer, self._batch_reply(req, rid)) for peer, req in waiters]))
        return out

    def heartbeats(self) -> list[Send]:
        """One heartbeat per live agent, carrying what repairs a lost Grant or Control.

        ``paused`` lets an agent that missed a pause/resume catch up;
        ``max_lease`` (the highest lease granted to it) lets it list, in its
        next heartbeat, the grants it never received, which are then released.
        """
        return [
            Send(r.agent_id, p.Heartbeat(r.session, {"paused": self.paused, "max_lease": r.max_granted}))
            for r in self.membership.alive()
        ]

    # ------------------------------------------------------------------ trainer

    def on_attach(self, peer: bytes, msg: p.Attach, now: float) -> list:
        if (msg.client_id, msg.req) == self._last_attach and self.trainer_session:
            return [Send(peer, p.Ok(msg.req, self._attach_result()))]  # a resent Attach: same session
        mismatch = [k for k, v in msg.config_check.items() if self.config.to_dict().get(k, v) != v]
        if mismatch:
            return [Send(peer, p.Error("config_mismatch", f"rollout config differs from the running fleet's in {mismatch}", msg.req))]
        self._last_attach = (msg.client_id, msg.req)
        self.trainer_session = self.membership.new_session()
        self.trainer_client = msg.client_id
        # A replaced trainer's waiting calls are answered with an error, never silently dropped.
        out = [Send(g.peer, p.Error("fenced", "a newer trainer session attached", g.req)) for g in self.pending]
        self.pending.clear()
        return out + [Send(peer, p.Ok(msg.req, self._attach_result()))]

    def _attach_result(self) -> dict:
        return {
            "session": self.trainer_session,
            "config": self.config.to_dict(),
            "dataset_size": self.dataset_size,
            "dataset_fingerprint": self.dataset_fingerprint,
            "last_rollout_id": self.last_rollout_id,
            "trimmed_upto": self.trimmed_upto,
        }

    def _trainer_error(self, peer: bytes, session: int, req: int) -> list | None:
        """None if ``session`` is the current trainer's; else the error to send."""
        if session == self.trainer_session and session != 0:
            return None
        if self.trainer_session == 0:
            return [Send(peer, p.Error("unknown_session", f"no trainer session {session:x} here (coordinator restarted or trainer detached); attach again", req))]
        return [Send(peer, p.Error("fenced", f"trainer session {session:x} was replaced by a newer trainer", req))]

    def on_generate(self, peer: bytes, msg: p.Generate, now: float) -> list:
        err = self._trainer_error(peer, msg.session, msg.req)
        if err:
            return err
        if msg.prefetch >= 0:
            self.prefetch = msg.prefetch
        batch = self.batches.get(msg.rollout_id)
        repair: list = []
        if batch is not None and msg.rollout_id not in self.repairs:
            if len(batch["groups"]) >= self.config.rollout_batch_size:
                return [Send(peer, self._batch_reply(msg.req, msg.rollout_id))]
            ops: list = []
            self._start_repair(msg.rollout_id, ops)
            repair = [self._persist(ops, [])]
        # Asking for a batch that still needs generating resumes admission, as
        # in the seed: a trainer killed while paused (e.g. saving a checkpoint)
        # must not leave its successor's generate() waiting forever.
        waits = msg.rollout_id in self.repairs or msg.rollout_id > self.last_rollout_id
        resumed = self._resume() if self.paused and waits else []
        return repair + resumed + self._enqueue_generate(peer, msg, now)

    def _enqueue_generate(self, peer: bytes, msg: p.Generate, now: float) -> list:
        if msg.rollout_id in self.repairs:
            self.repairs[msg.rollout_id].append((peer, msg.req))
            return self._pump(now)
        if msg.rollout_id <= self.trimmed_upto:
            return [Send(peer, p.Error("trimmed", f"rollout {msg.rollout_id} is behind the checkpointed frontier ({self.trimmed_upto}); its groups were consumed", msg.req))]
        if msg.rollout_id <= self.last_rollout_id:
            return [Send(peer, p.Error("bad_rollout_id", f"rollout id {msg.rollout_id} was never generated and is older than the last batch ({self.last_rollout_id})", msg.req))]
        for g in self.pending:
            if g.rollout_id == msg.rollout_id:
                g.peer, g.req = peer, msg.req
                return self._pump(now)
        self.pending.append(PendingGenerate(peer, msg.req, msg.rollout_id))
        self.pending.sort(key=lambda g: g.rollout_id)
        return self._pump(now)

    def _batch_reply(self, req: int, rollout_id: int) -> p.BatchRefs:
        batch = self.batches[rollout_id]
        groups = []
        for index, epoch, agent_id, key in batch["groups"]:
            rec = self.membership.agents.get(agent_id)
            groups.append([index, agent_id, rec.payload_address if rec else "", key])
        return p.BatchRefs(req, rollout_id, groups, batch["metrics"])

    def _assemble(self, g: PendingGenerate) -> Persist:
        size = self.config.rollout_batch_size
        chosen = []
        while len(chosen) < size:
            epoch, index = self.ready.popleft()
            info = self.ready_info.pop((epoch, index), None)
            if info is None:
                continue  # reopened after its node was retired
            chosen.append((epoch, index, info))
        ops = []
        groups = []
        for epoch, index, info in chosen:
            self.frontier.set(epoch, index, DELIVERED)
            self._note_epoch(epoch, g.rollout_id)
            ops.append(("prompt", epoch, index, {"s": "d", "a": info.agent_id, "k": info.key, "rid": g.rollout_id}))
            groups.append([index, epoch, info.agent_id, info.key])
        metrics = self._metrics([c[2].stats for c in chosen], [c[0] for c in chosen])
        batch = {"groups": groups, "metrics": metrics}
        self.batches[g.rollout_id] = batch
        self.last_rollout_id = max(self.last_rollout_id, g.rollout_id)
        ops.append(("batch", g.rollout_id, _snapshot(batch)))
        ops.append(("meta", "last_rollout_id", self.last_rollout_id))
        self.drops = DropStats()
        self._close_epochs(ops)
        return self._persist(ops, [Send(g.peer, self._batch_reply(g.req, g.rollout_id))])

    def _note_epoch(self, epoch: int, rollout_id: int) -> None:
        self.epoch_last_rid[epoch] = max(self.epoch_last_rid.get(epoch, -1), rollout_id)

    def _close_epochs(self, ops: list) -> None:
        """Close complete epochs once every batch holding their prompts was fetched.

        Until then a lost node could still send some of their prompts back to
        pending, which needs the epoch open.
        """
        for closed in self.frontier.close_finished(lambda e: self.epoch_last_rid.get(e, -1) <= self.consumed_upto):
            self.epoch_last_rid.pop(closed, None)
            ops.append(("close_epoch", closed))

    def _metrics(self, stats: list[dict], epochs: list[int]) -> dict:
        n = len(stats)
        m = {k: float(v) for k, v in self.drops.metrics(FILTER_PREFIX).items()}

        def total(k):
            return float(sum(s.get(k, 0) for s in stats))

        samples = total("n_samples")
        m["rollout/groups"] = float(n)
        m["rollout/samples"] = samples
        m["rollout/prompt_tokens"] = total("prompt_tokens")
        m["rollout/response_tokens"] = total("response_tokens")
        m["rollout/response_len_mean"] = m["rollout/response_tokens"] / samples if samples else 0.0
        m["rollout/reward_mean"] = total("reward_sum") / samples if samples else 0.0
        m["rollout/truncated_ratio"] = total("truncated") / samples if samples else 0.0
        m["rollout/aborted_ratio"] = total("aborted") / samples if samples else 0.0
        gen = [s.get("gen_seconds", 0.0) for s in stats]
        m["rollout/gen_seconds_mean"] = sum(gen) / n if n else 0.0
        m["rollout/gen_seconds_max"] = max(gen) if gen else 0.0
        m["rollout/data_epoch"] = float(max(epochs) if epochs else 0)
        return m

    def on_trainer_control(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        if msg.action == "stats":
            return [Send(peer, p.Ok(msg.req, self.statistics()))]
        err = self._trainer_error(peer, msg.session, msg.req)
        if err:
            return err
        handler = getattr(self, f"_trainer_{msg.action}", None)
        if handler is None:
            return [Send(peer, p.Error("bad_request", f"unknown trainer action {msg.action!r}", msg.req))]
        return handler(peer, msg, now)

    def _trainer_pause(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        abort = bool(msg.args.get("abort", False))
        self.paused = True
        then: list = [Send(r.agent_id, p.Control("pause", abort)) for r in self.membership.alive()]
        if msg.args.get("drain", True) and self.leases:
            self.drain_waiters.append((peer, msg.req))
        else:
            then.append(Send(peer, p.Ok(msg.req, {"leased": len(self.leases)})))
        # Durable before acknowledged: a restarted coordinator stays paused.
        return [self._persist([("meta", "paused", True)], then)]

    def _resume(self) -> list:
        """Admission on again (durably); a pause still waiting for its drain is told why it never will."""
        self.paused = False
        then: list = [Send(r.agent_id, p.Control("resume")) for r in self.membership.alive()]
        then += [Send(peer, p.Error("resumed", "generation was resumed before the drain completed", req)) for peer, req in self.drain_waiters]
        self.drain_waiters.clear()
        return [self._persist([("meta", "paused", False)], then)]

    def _trainer_resume(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        out = self._resume()
        out[0].then.append(Send(peer, p.Ok(msg.req, {})))
        return out + self._pump(now)

    def _trainer_state_dict(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        if not self.paused or self.leases:
            return [Send(peer, p.Error("not_drained", f"state_dict needs a paused and drained rollout (paused={self.paused}, leases in flight={len(self.leases)}); call pause(drain=True) first", msg.req))]
        consumed = msg.args.get("consumed", -1)
        if not isinstance(consumed, int) or consumed > self.last_rollout_id:
            return [Send(peer, p.Error("bad_request", f"consumed rollout id {consumed!r} was never generated (last is {self.last_rollout_id})", msg.req))]
        ops: list = []
        out: list = []
        by_agent: dict[str, list[str]] = {}
        # Trim only behind the *previous* checkpoint: the trainer may die before
        # it has saved this one, and must then be able to resume from the last.
        previous = self.last_checkpoint
        for rid in sorted(r for r in self.batches if r <= previous):
            for index, epoch, agent_id, key in self.batches.pop(rid)["groups"]:
                by_agent.setdefault(agent_id, []).append(key)
            ops.append(("batch", rid, None))
        if previous > self.trimmed_upto:
            self.trimmed_upto = previous
            ops.append(("meta", "trimmed_upto", previous))
        if consumed > self.last_checkpoint:
            self.last_checkpoint = consumed
            ops.append(("meta", "last_checkpoint", consumed))
        for agent_id, keys in by_agent.items():
            rec = self.membership.agents.get(agent_id)
            if rec is not None and rec.status == ALIVE:
                out.append(Send(agent_id, p.Trim(keys)))
            # An agent that is down gets its trims at registration (storage reconciliation).
        state = {
            "format": 1,
            "rollout_id": consumed,
            "dataset_fingerprint": self.dataset_fingerprint,
            "dataset_size": self.dataset_size,
            "config": self.config.to_dict(),
        }
        return [self._persist(ops, out + [Send(peer, p.Ok(msg.req, state))])]

    def _trainer_load_state_dict(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        state = msg.args.get("state")
        if not isinstance(state, dict) or state.get("format") != 1:
            return [Send(peer, p.Error("bad_state", "not a rollfleet state_dict (format 1)", msg.req))]
        if state.get("dataset_fingerprint") != self.dataset_fingerprint:
            return [Send(peer, p.Error("bad_state", "checkpoint was taken on a different dataset (fingerprint differs)", msg.req))]
        rid = state.get("rollout_id")
        if not isinstance(rid, int) or rid < self.trimmed_upto:
            return [Send(peer, p.Error("bad_state", f"checkpoint at rollout {rid} is older than the last two checkpoints (batches up to {self.trimmed_upto} were trimmed)", msg.req))]
        if rid > self.last_rollout_id:
            return [Send(peer, p.Error("bad_state", f"checkpoint at rollout {rid} is newer than anything this coordinator delivered (last {self.last_rollout_id}); is this the right --data-dir?", msg.req))]
        return [Send(peer, p.Ok(msg.req, {"rollout_id": rid, "last_rollout_id": self.last_rollout_id}))]

    def _trainer_consumed(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        """The trainer fetched a batch completely; its prompts count as trained from now on."""
        rid = msg.args.get("rollout_id")
        if not isinstance(rid, int) or rid not in self.batches and rid > self.trimmed_upto:
            return [Send(peer, p.Error("bad_request", f"rollout {rid!r} was never delivered", msg.req))]
        if rid <= self.consumed_upto:
            return [Send(peer, p.Ok(msg.req, {"consumed_upto": self.consumed_upto}))]
        self.consumed_upto = rid
        ops: list = [("meta", "consumed_upto", rid)]
        self._close_epochs(ops)
        return [self._persist(ops, [Send(peer, p.Ok(msg.req, {"consumed_upto": rid}))])]

    def _trainer_missing(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        """An agent that is up answered that it no longer holds some groups of a batch
        (e.g. its disk was wiped): they are treated like groups of a lost node."""
        rid, keys = msg.args.get("rollout_id"), msg.args.get("keys")
        batch = self.batches.get(rid) if isinstance(rid, int) else None
        if batch is None or not isinstance(keys, list):
            return [Send(peer, p.Error("bad_request", f"no recorded batch {rid!r} with missing keys", msg.req))]
        lost = [g for g in batch["groups"] if g[3] in set(keys)]
        ops: list = []
        if lost:
            self._lose_groups(rid, batch, lost, ops)
        return [self._persist(ops, [Send(peer, p.Ok(msg.req, {"lost": len(lost)}))])]

    def _trainer_detach(self, peer: bytes, msg: p.TrainerControl, now: float) -> list:
        self.trainer_session = 0
        return [Send(peer, p.Ok(msg.req, {}))]

    # ------------------------------------------------------------------ pump

    def _pump(self, now: float) -> list:
        out: list = self._fill_repairs() if self.repairs else []
        size = self.config.rollout_batch_size
        while self.pending and not self.repairs and len(self.ready_info) >= size:
            out.append(self._assemble(self.pending.pop(0)))
        if (self.pending or self.repairs) and self.membership.all_gone() and len(self.ready_info) < size:
            why = "no agent with a live engine is left to generate on (all retired)"
            out += [Send(g.peer, p.Error("no_capacity", why, g.req)) for g in self.pending]
            out += [Send(peer, p.Error("no_capacity", why, req)) for waiters in self.repairs.values() for peer, req in waiters]
            self.pending.clear()
            for waiters in self.repairs.values():
                waiters.clear()
        if self.paused:
            if self.drain_waiters and not self.leases:
                out += [Send(peer, p.Ok(req, {"leased": 0})) for peer, req in self.drain_waiters]
                self.drain_waiters.clear()
            return out
        missing = sum(size - len(self.batches[r]["groups"]) for r in self.repairs if r in self.batches)
        target = size * len(self.pending) + missing + self.prefetch
        budget = target - len(self.leases) - len(self.ready_info)
        if budget <= 0:
            return out
        rollout_id = self.current_rollout_id
        granted: list = []
        for agent_id, n in self.membership.distribute(budget).items():
            rec = self.membership.agents[agent_id]
            grants = []
            for _ in range(n):
                taken = self.frontier.take(now)
                if taken is None:
                    break
                epoch, index = taken
                lease = self._next_lease()
                self.leases[lease] = (agent_id, epoch, index, rollout_id)
                self.leased_by[(epoch, index)] = lease
                rec.leases.add(lease)
                rec.max_granted = lease
                grant = {"lease": lease, "data_epoch": epoch, "index": index, "rollout_id": rollout_id}
                if not rec.local_dataset:
                    prompt, label, metadata = self._row(index)
                    grant.update(prompt=prompt, label=label, metadata=metadata)
                grants.append(grant)
            if grants:
                granted.append(Send(agent_id, p.Grant(rec.session, grants)))
        if granted:
            # Write-ahead: the cursor covering these leases is durable before they leave.
            out.append(self._persist([], granted))
        return out


def _snapshot(batch: dict) -> dict:
    """A copy of a batch for the ledger: the live dict may change before the write."""
    return {"groups": [list(g) for g in batch["groups"]], "metrics": dict(batch["metrics"]), "lost": [list(x) for x in batch.get("lost", [])]}
