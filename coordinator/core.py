"""The coordinator's state machine: leases, receipts, batches, trainer sessions.

Pure core (no sockets, no event loop, no clock): ``handle(peer, msg, now)``
takes one decoded message and returns *effects* (``coordinator/effects.py``)
for the I/O shell to carry out:

    Send(to, msg)        to an agent id (str) or a raw ZeroMQ peer (bytes)
    Persist(ops, then)   write ``ops`` to the ledger in one durable
                         transaction, and only after it commits send ``then``

``CoordinatorCore`` owns the shared state (frontier, membership, config) and
routes; each role lives in its own module:

    admission.py   agents: register, heartbeat, receipts, filtered, release,
                   capacity, lease issuing, TTL and retirement (``tick``)
    batches.py     ready groups, batch assembly, repair, trimming
    oversampling.py  over-sampling (stopping the surplus leases) and partial
                   batches at a ``generate`` deadline
    trainer.py     trainer sessions: attach, generate, pause/resume,
                   state dict, consumed, missing, detach
    starvation.py  the streak of failed groups that stops admission
    weights.py     weight updates: the weight lock, each update's steps,
                   the weight log
    staleness.py   bounded staleness: admission and assembly rules

Invariants kept across them:
- Exactly once: a prompt ``(data_epoch, index)`` is accepted at most once
  and delivered in at most one batch (admission.py, batches.py).
- Commit before acknowledgement: ReceiptAck, Welcome (with its acks) and
  batch replies travel in ``Persist.then``, after the ledger commit.
- Write-ahead leases: every ``Persist`` carries the frontier cursors, and a
  Grant travels in ``Persist.then`` behind the cursor that covers it, so
  after a crash every prompt that may be in flight on an agent is an orphan
  (kept for its agent for a TTL), never a fresh prompt handed to a second
  agent while the first still generates it.
- Pause is durable: a restart keeps the trainer's pause (and its drain).
- Failing user code burns no data: when every recent group failed (a reward
  or filter that raises) the rollout is starved; admission stops, waiting
  ``generate`` calls get ``starved`` with the dominant failure, and the
  prompts filtered for those failures are pending again (admission.py,
  starvation.py). The next ``generate`` starts over.
- One weight update at a time: while the weight lock is held no prompt is
  leased; versions never move backwards (weights.py).
- Bounded staleness (``--max-staleness``): no batch holds a group started
  more than ETA updates before it (staleness.py).
- Bounded: leased + ready <= demand + prefetch, where demand is
  ``rollout_batch_size`` per waiting ``generate`` (times ``--over-sampling``:
  once its batch is assembled, the surplus leases are stopped). With no trainer pulling,
  admission stops once ``prefetch`` groups are in flight or ready.
- Evaluation passes (evaluation.py) run on the same agents, first in line for
  free capacity, and never touch the training frontier, its bound or its
  batches; each evaluation prompt's result is durable and counted once.
- Idempotent: a recorded batch is replayed verbatim for the same rollout id.
- Fencing: agent and trainer messages carry sessions; a superseded or
  unknown session gets ``Fence``/an error and changes nothing.

The shell delivers the messages for one destination in the order the core
produced them: a ``Send`` waits behind an earlier ``Persist.then`` message to
the same destination (e.g. a Control never overtakes the Grant before it).

Turns: the shell may hand the core every message it has read in one go as a
*turn* (``begin_turn``, ``handle`` for each, ``end_turn``). Within a turn the
handlers' ``pump`` (assembly and admission) is deferred to ``end_turn``, which
runs it once: the leases freed by a thousand receipts go out as one Grant per
agent behind one cursor write, instead of a Grant and a write per receipt.
Nothing else changes: a pump only ever acts on the state the messages left,
so running it once after them yields what the last of the per-message pumps
would have, and messages to one destination still leave in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import protocol as p
from common.config import Liveness, RolloutConfig
from common.mixture import DEFAULT, EPOCH_MASK, SourceSpec
from coordinator.admission import Admission
from coordinator.batches import Batches
from coordinator.counters import CoreCounters
from coordinator.effects import Persist, Send
from coordinator.evaluation import EvalSpec, Evaluations
from coordinator.membership import ALIVE, Membership
from coordinator.mix_frontier import MixFrontier
from coordinator.oversampling import OverSampling
from coordinator.records import AgentStats, CoordinatorStats, LedgerSnapshot, SetCursors, SetMixture
from coordinator.staleness import Staleness
from coordinator.starvation import default_starve_after
from coordinator.trainer import TrainerSessions
from coordinator.weights import WeightUpdates

__all__ = ["CoordinatorCore", "Persist", "Send", "range_order"]


def range_order(size: int, data_epoch: int):
    return range(size)


class CoordinatorCore:
    def __init__(
        self,
        config: RolloutConfig,
        liveness: Liveness,
        *,
        dataset_size: int,
        dataset_fingerprint: str,
        order_for_epoch: Callable[[int, int], Any] = range_order,
        restored: LedgerSnapshot | None = None,
        now: float = 0.0,
        starve_after: int | None = None,
        starve_after_drops: int | None = None,
        trainer_keys=(),
        eval_specs: list[EvalSpec] = (),
        over_sampling: float = 1.0,
        source_sizes: list[int] | None = None,
        source_orders: Callable[[int, int, int], Any] | None = None,
    ):
        """``source_sizes``: each training source's prompts, in ``config.mixture``'s order (default: one source
        of ``dataset_size``); ``source_orders(source, size, data_epoch)``: its order (default ``order_for_epoch``)."""
        self.config = config
        self.trainer_keys = list(trainer_keys)
        """The trainers' CurveZMQ public keys (Z85), handed to agents in the Welcome for their payload endpoints."""
        self.starve_after = starve_after or default_starve_after(config.rollout_batch_size)
        """Consecutive failed groups after which the rollout is starved (``coordinator/starvation.py``)."""
        self.starve_after_drops = starve_after_drops or dataset_size or None
        """Consecutive filter drops after which the rollout is starved (default: the dataset's size, an epoch)."""
        self.liveness = liveness
        self.dataset_size = dataset_size
        self.dataset_fingerprint = dataset_fingerprint
        restored = restored or LedgerSnapshot()
        self.counters = CoreCounters()
        """Events for observation (``coordinator/counters.py``); read only at scrape time."""
        self.membership = Membership(restored.generation)
        self.sources = [SourceSpec.from_dict(d) for d in config.mixture] or [SourceSpec(DEFAULT)]
        """The training sources (common/mixture.py), in order: a source's number is its place here."""
        sizes = list(source_sizes) if source_sizes is not None else [dataset_size]
        if len(sizes) != len(self.sources):
            raise ValueError(f"{len(sizes)} dataset sizes for {len(self.sources)} training sources")
        configured = [spec.weight for spec in self.sources]
        self.mixture_schedule = list(restored.mixture) or [(0, configured)]
        """``[(from rollout id, weights)]``: the mixture's weights from each rollout id on (``set_mixture``)."""
        self.start_ops: list = []
        """Ledger operations this start must write before serving (the shell applies them)."""
        orders = source_orders or (lambda source, n, e: order_for_epoch(n, e))
        self.frontier = MixFrontier(sizes, orders)
        self.staleness = Staleness(config.max_staleness, config.rollout_batch_size)
        self.oversampling = OverSampling(self, over_sampling)
        self.weights = WeightUpdates(self, restored)
        self.batches = Batches(self, restored)
        old = restored.changed.get("mixture", [None])[0]
        if old and len(old) == len(configured) and not restored.mixture:  # batches so far: the last start's weights
            self.mixture_schedule[:] = [(0, [float(d.get("weight", 1.0)) for d in old])]
        if self.mixture_schedule[-1][1] != configured and "mixture" in restored.changed:
            # The weights on the command line changed at this start (--allow-config-change): from the next batch.
            self.mixture_schedule.append((self.batches.last_rollout_id + 1, configured))
            self.start_ops.append(SetMixture(tuple(self.mixture_schedule)))
        self.trainer = TrainerSessions(self, restored)
        self.admission = Admission(self, now)
        self.evaluations = Evaluations(self, list(eval_specs), restored)
        self.now = now
        """The time of the event being handled (batch metrics read it)."""
        self.gateway_stats: Callable[[float], list] | None = None
        """The serving process's gateways, for ``statistics`` (set by coordinator/server.py; none without)."""
        self._beat_round: list[str] = []  # the agents of the heartbeat round in progress (heartbeats)
        self._in_turn = False
        self._pump_due = False
        a, t, w = self.admission, self.trainer, self.weights
        self._routes: dict[type, Callable[[bytes, Any, float], list]] = {
            p.Register: a.on_register,
            p.Heartbeat: a.on_heartbeat,
            p.Receipt: a.on_receipt,
            p.Filtered: a.on_filtered,
            p.Release: a.on_release,
            p.Capacity: a.on_capacity,
            p.EvalResult: a.on_eval_result,
            p.Evaluate: self.evaluations.on_evaluate,
            p.Attach: t.on_attach,
            p.Generate: t.on_generate,
            p.Stats: self._on_stats,
            p.UpdateWeights: w.on_update,
            p.WeightBucket: w.on_bucket,
            p.FinishWeights: w.on_finish,
            p.AbortWeights: w.on_abort_request,
            p.WeightsAlive: w.on_alive,
            p.WeightsReport: w.on_report,
            **{cls: t.on_request for cls in p.TRAINER_REQUESTS},
        }
        self._restore(restored, now)

    def _restore(self, restored: LedgerSnapshot, now: float) -> None:
        if not restored.cursors and not restored.prompts:
            return
        states = {prompt: st.status for prompt, st in restored.prompts.items()}
        self.frontier.restore(restored.cursors, states, now, orphan_delay=self.liveness.ttl)
        self.batches.restore_ready(restored.prompts)
        # Agents the ledger points at are known from now on, even if they never come
        # back: they are then retired on schedule and their groups replaced.
        for agent_id in self.batches.referenced_agents():
            self.membership.placeholder(agent_id, now)

    # ------------------------------------------------------------------ events

    def handle(self, peer: bytes, msg: p.Message, now: float) -> list:
        """Effects of one message from ``peer`` at ``now``."""
        route = self._routes.get(type(msg))
        if route is None:
            why = f"the coordinator does not accept {msg.TYPE!r} messages"
            return [Send(peer, p.Error("unexpected", why, getattr(msg, "req", 0)))]
        self.now = now
        return route(peer, msg, now)

    def begin_turn(self) -> None:
        """Messages handled from now until ``end_turn`` defer their pump to it."""
        self._in_turn, self._pump_due = True, False

    def end_turn(self, now: float) -> list:
        """Close the turn: the one pump its messages asked for."""
        self._in_turn = False
        if not self._pump_due:
            return []
        self._pump_due = False
        return self.pump(now)

    def tick(self, now: float) -> list:
        """The clock: agents silent past the TTL lose their leases, past ``retire_after`` their groups;
        a weight update past its deadline is aborted."""
        self.now = now
        return self.admission.tick(now) + self.weights.tick(now)

    def heartbeats(self, part: int = 0, parts: int = 1) -> list[Send]:
        """One heartbeat to each live agent of slice ``part`` of ``parts`` of the round, carrying what
        repairs a lost Grant or Control. Slice 0 starts a round with the agents known then, so the clock
        can send one slice a step (coordinator/server.py) and each agent still hears once a round.

        ``paused`` lets an agent that missed a pause/resume catch up; ``max_lease`` (the highest lease
        granted to it) lets it list, in its next heartbeat, the grants it never received, which are
        then released.
        """
        agents = self.membership.agents
        if part == 0:
            self._beat_round = list(agents)
        paused = self.trainer.paused
        out = []
        for agent_id in self._beat_round[part::parts]:
            r = agents.get(agent_id)
            if r is not None and r.status == ALIVE:
                out.append(Send(r.agent_id, p.Heartbeat(r.session, {"paused": paused, "max_lease": r.max_granted})))
        return out

    def _on_stats(self, peer: bytes, msg: p.Stats, now: float) -> list:
        return [Send(peer, p.Ok(msg.req, self.statistics(now).to_dict()))]

    # ------------------------------------------------------------------ shared

    def persist(self, ops: list, then: list) -> Persist:
        """A ledger write that also records the frontier cursors (write-ahead for any grant in ``then``)."""
        ops.append(SetCursors(self.frontier.cursors()))
        return Persist(ops, then)

    def pump(self, now: float) -> list:
        """Assemble what can be assembled, then admit new prompts up to demand + prefetch.

        Inside a turn it only notes that a pump is due (``end_turn`` runs it)."""
        if self._in_turn:
            self._pump_due = True
            return []
        self.now = now
        out = self.batches.pump()
        if self.trainer.paused:
            return out + self.trainer.answer_drained()
        if self.weights.stops_admission:
            return out  # a weight update runs: no lease may start on weights about to change
        out += self._pump_evaluations(now)
        if self.admission.starvation.starved:
            return out  # every recent group failed: leasing more prompts would only burn them
        training, t_next, updates = self.admission.training, self.batches.current_rollout_id, self.weights.log.updates
        outstanding = self.admission.training_leases + len(self.batches.ready_info)
        wanted = training.plan(self.batches.wanted(self.trainer.prefetch), self.batches.ready_count)
        allowed = self.staleness.budget(outstanding, t_next, updates)
        budget = wanted
        if allowed is not None:
            budget = min(budget, allowed)
            # Rule 1 by shares (staleness.py): each dataset may have in flight or ready what the batches the bound
            # admits hold of it, so the budget is never spent on a mix those batches cannot be made of.
            allowance = training.allowance(t_next, self.staleness.last_admitted(updates))
            budget = min(budget, training.limit(allowance, self.batches.ready_count))
            self.staleness.note_admission(wanted, budget, now)
        if budget <= 0:
            return out
        granted = self.admission.grant(self.admission.training, budget, self.batches.current_rollout_id, now)
        if granted:
            # Write-ahead: the cursor covering these leases is durable before they leave.
            out.append(self.persist([], granted))
        return out

    def update_wait(self) -> str | None:
        """Why the first waiting batch cannot be completed before a weight update is pushed (``--max-staleness``:
        ``Staleness.update_wait``), or None. ``statistics()["waiting_for_update"]``, ``coordinator status``."""
        batches, training = self.batches, self.admission.training
        if not self.staleness.bounded or not batches.pending or batches.repairs:
            return None
        t, updates = batches.pending[0].rollout_id, self.weights.log.updates
        have = zip(batches.composition(t), batches.ready_count, training.in_flight, strict=True)
        lacking = [training.names[s] if training.mixed else "" for s, (n, r, f) in enumerate(have) if r + f < n]
        outstanding = self.admission.training_leases + len(batches.ready_info)
        budget = self.staleness.budget(outstanding, t, updates)
        return self.staleness.update_wait(t, updates, lacking, budget, self.admission.training_leases)

    def _pump_evaluations(self, now: float) -> list:
        """Evaluation prompts go first to free capacity (a trainer waits on them); a pass nobody can
        run answers its waiting calls."""
        evaluations = self.evaluations
        if not evaluations.wanted:
            return []
        why = self.batches.no_capacity()
        if why is not None:
            return evaluations.answer_waiters("no_capacity", why)
        return evaluations.grant(now)

    def peer_of(self, agent_id: str) -> bytes | None:
        """The ZeroMQ peer an agent last spoke from."""
        rec = self.membership.agents.get(agent_id)
        return rec.peer if rec is not None else None

    def payload_address(self, agent_id: str) -> str:
        """Where trainers fetch ``agent_id``'s payloads; empty if the agent is unknown."""
        rec = self.membership.agents.get(agent_id)
        return rec.payload_address if rec is not None else ""

    def statistics(self, now: float | None = None) -> CoordinatorStats:
        batches, trainer = self.batches, self.trainer
        at = self.now if now is None else now
        agents = {
            r.agent_id: AgentStats(
                r.status,
                r.capacity,
                len(r.leases),
                tuple(dict(e) for e in r.engines),
                r.session,
                round(max(0.0, at - r.last_seen), 3),
            )
            for r in self.membership.agents.values()
        }
        return CoordinatorStats(
            agents=agents,
            leased=len(self.admission.leases),
            ready=len(batches.ready_info),
            pending_generates=len(batches.pending),
            batches_in_repair=tuple(sorted(batches.repairs)),
            prefetch=trainer.prefetch,
            paused=trainer.paused,
            starved=self.admission.starvation.reason,
            trainer=trainer.client if trainer.session else None,
            prompts=self.frontier.counts(),
            data_epochs=tuple(sorted({key & EPOCH_MASK for key in self.frontier.epochs})),
            last_rollout_id=batches.last_rollout_id,
            trimmed_upto=batches.trimmed_upto,
            consumed_upto=batches.consumed_upto,
            filtered_total=self.admission.training.filtered_total,
            fenced_messages=dict(self.admission.fenced),
            weights=self.weights.statistics(self.now if now is None else now),
            evaluations=self.evaluations.statistics(),
            sources=self.source_statistics(),
            held=len(self.admission.held),
            receipts={"accepted": self.counters.receipts_accepted, "refused": self.counters.receipts_refused},
            gateways=self.gateway_stats(at) if self.gateway_stats is not None else [],
            waiting_for_update=self.update_wait(),
        )

    def source_statistics(self) -> dict:
        """``CoordinatorStats.sources``: each training dataset's weight, prompts by state, epochs, filtered."""
        training = self.admission.training
        weights = training.weights_at(self.batches.last_rollout_id + 1)
        return {
            name: {
                "weight": weights[s],
                "prompts": self.frontier.counts(s),
                "data_epochs": sorted(self.frontier.parts[s].epochs),
                "filtered": training.filtered_count[s],
            }
            for s, name in enumerate(training.names)
        }
