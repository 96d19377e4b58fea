"""The coordinator's state machine: leases, receipts, batches, trainer sessions.

Pure core (no sockets, no event loop, no clock): ``handle(peer, msg, now)``
takes one decoded message and returns *effects* (``coordinator/effects.py``)
for the I/O shell to carry out:

    Send(to, msg)        to an agent id (str) or a raw ZeroMQ peer (bytes)
    Persist(ops, then)   write ``ops`` to the ledger in one durable
                         transaction, and only after it commits send ``then``

``CoordinatorCore`` is started with a validated ``CoreSettings``
(``coordinator/core_settings.py``), the ledger it resumes from and the time.
It builds the parts (counters, membership, the mixture's frontier, the lease
book, the training source, the ready groups, the ranks' shares), hands each
role, in its constructor, the parts it uses, routes messages to the roles and
runs the one pump. Parts and roles, each in its own module:

    lease_book.py    the leases in flight of every prompt source, lease ids,
                     leases held for silent agents, the one grant loop
    sources.py       prompt sources: the interface, the training datasets'
                     (the mixture's shares, filter verdicts, its starvation record)
    ready.py         ready groups waiting for a batch
    rank_shares.py   the attached trainer's ranks and their shares of batches
    admission.py     agents: register, heartbeat, receipts, filtered, release,
                     capacity, evaluation results, TTL and retirement (``tick``)
    batches.py       batch assembly, recorded batches, repair, trimming, demand
    oversampling.py  over-sampling (stopping the surplus leases)
    evaluation.py    evaluation passes: a prompt source per dataset
    trainer.py       trainer sessions: attach, generate, evaluate, pause/resume,
                     state dict, consumed, missing, detach
    capacity.py      whether any engine is left to generate on
    starvation.py    the streak of failed groups that stops admission
    weights.py       weight updates: the weight lock, each update's steps,
                     the weight log
    staleness.py     bounded staleness: admission and assembly rules
    prompt_key.py    a prompt's dataset, data epoch and index

A role sees another only through the verbs it was handed (``coordinator/faces.py``
for the weight updates and the pause); no role module imports this one.

Invariants kept across them:
- Exactly once: a prompt ``(data_epoch, index)`` is accepted at most once
  and delivered in at most one batch (admission.py, batches.py).
- Commit before acknowledgement: ReceiptAck, Welcome (with its acks) and
  batch replies travel in ``Persist.then``, after the ledger commit.
- Write-ahead leases: every ``Persist`` the core returns carries the frontier
  cursors, or (inside a server turn, whose Persists commit in one transaction)
  the turn's last one does, stamped as it leaves the core (``_stamped``; no
  role writes them),
  and a Grant travels in ``Persist.then`` behind the cursor that covers it, so
  after a crash every prompt that may be in flight on an agent is an orphan
  (kept for its agent for a TTL), never a fresh prompt handed to a second
  agent while the first still generates it.
- Nothing reaches an agent before its Welcome: the Welcome rides in the
  register's ``Persist``, the grants that fill the new capacity in the pump's,
  which comes after it.
- Pause is durable: a restart keeps the trainer's pause (and its drain).
- Failing user code burns no data: when every recent group failed (a reward
  or filter that raises) the rollout is starved; admission stops, waiting
  ``generate`` calls get ``starved`` with the dominant failure, and the
  prompts filtered for those failures are pending again (sources.py,
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

Turns and the pump: only the core pumps (assembly, then admission). Every
handler runs in a *turn*, and the pump runs once at its end. The shell may
hand the core every message it has read in one go as one turn (``begin_turn``,
``handle`` for each, ``end_turn``); a ``handle`` or ``tick`` outside one is a
turn of its own. The leases freed by a thousand receipts then go out as one
Grant per agent behind one cursor write, instead of a Grant and a write per
receipt. A pump only ever acts on the state the messages left, so running it
once after them yields what a pump after each would have, and messages to one
destination still leave in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import protocol as p
from coordinator.admission import Admission
from coordinator.batches import Batches
from coordinator.capacity import Capacity
from coordinator.core_settings import CoreSettings
from coordinator.counters import CoreCounters
from coordinator.effects import Persist, Send
from coordinator.evaluation import Evaluations
from coordinator.lease_book import LeaseBook
from coordinator.membership import ALIVE, Membership
from coordinator.mix_frontier import MixFrontier
from coordinator.oversampling import OverSampling
from coordinator.prompt_key import epoch_of
from coordinator.rank_shares import RankShares
from coordinator.ready import ReadyGroups
from coordinator.records import AgentStats, CoordinatorStats, LedgerSnapshot, SetCursors
from coordinator.sources import TrainingSource, mixture_schedule
from coordinator.staleness import Staleness
from coordinator.starvation import Starvation
from coordinator.trainer import TrainerSessions
from coordinator.weights import WeightUpdates

__all__ = ["CoordinatorCore", "CoreSettings", "Persist", "Send"]

WEIGHT_REQUESTS = (p.UpdateWeights, p.WeightBucket, p.FinishWeights, p.AbortWeights, p.WeightsAlive)
"""A trainer's weight requests: its session is checked by the trainer sessions, the rest is the weight updates'."""


class CoordinatorCore:
    def __init__(self, settings: CoreSettings, restored: LedgerSnapshot | None = None, now: float = 0.0):
        self.settings = settings
        config = self.config = settings.config
        self.liveness = settings.liveness
        restored = restored or LedgerSnapshot()
        self.now = now
        """The time of the event being handled."""
        self.counters = CoreCounters()
        """Events for observation (``coordinator/counters.py``); read only at scrape time."""
        self.membership = Membership(restored.generation)
        self.frontier = MixFrontier(list(settings.dataset_sizes), settings.order)
        """The mixture's frontier: each training dataset's data epochs and where every prompt stands."""
        self.staleness = Staleness(config.max_staleness, config.rollout_batch_size)
        self.leases = LeaseBook(self.membership, self.counters, keep_for_silent=not self.staleness.bounded)
        self.weights = WeightUpdates(restored, membership=self.membership, leases=self.leases, liveness=self.liveness)
        last_rollout_id = (
            max(restored.last_rollout_id, *restored.batches) if restored.batches else restored.last_rollout_id
        )
        schedule, self.start_ops = mixture_schedule(settings.datasets, restored, last_rollout_id)
        """``start_ops``: ledger operations this start must write before serving (the shell applies them)."""
        starvation = Starvation(settings.failures_to_starve, settings.drops_to_starve)
        self.training = TrainingSource(config, self.frontier, self.leases, starvation, self.counters, schedule)
        self.leases.add_source(self.training)
        self.ready = ReadyGroups(len(settings.dataset_sizes), oldest_first=self.staleness.bounded)
        self.oversampling = OverSampling(
            settings.over_sampling, self.leases, self.training, self.membership, self.counters
        )
        self.capacity = Capacity(self.membership, self.weights)
        self.batches = Batches(
            restored,
            batch_size=config.rollout_batch_size,
            ready=self.ready,
            shares=RankShares(self.payload_address),
            training=self.training,
            leases=self.leases,
            frontier=self.frontier,
            staleness=self.staleness,
            oversampling=self.oversampling,
            capacity=self.capacity,
            counters=self.counters,
        )
        self.evaluations = Evaluations(list(settings.eval_specs), restored, self.leases)
        self.trainer = TrainerSessions(
            settings,
            restored,
            membership=self.membership,
            leases=self.leases,
            batches=self.batches,
            training=self.training,
            evaluations=self.evaluations,
            weights=self.weights,
            counters=self.counters,
        )
        self.admission = Admission(
            settings,
            now,
            membership=self.membership,
            leases=self.leases,
            frontier=self.frontier,
            training=self.training,
            ready=self.ready,
            batches=self.batches,
            weights=self.weights,
            pause=self.trainer,
            oversampling=self.oversampling,
            evaluations=self.evaluations,
            counters=self.counters,
        )
        self.gateway_stats: Callable[[float], list] | None = None
        """The serving process's gateways, for ``statistics`` (set by coordinator/server.py; none without)."""
        self._beat_round: list[str] = []  # the agents of the heartbeat round in progress (heartbeats)
        self._in_turn = False
        self._pump_due = False
        self._unstamped = False  # a Persist of the open turn waits for end_turn's cursor stamp
        a, t = self.admission, self.trainer
        self._routes: dict[type, Callable[[bytes, Any, float], list]] = {
            p.Register: a.on_register,
            p.Heartbeat: a.on_heartbeat,
            p.Receipt: a.on_receipt,
            p.Filtered: a.on_filtered,
            p.Release: a.on_release,
            p.Capacity: a.on_capacity,
            p.EvalResult: a.on_eval_result,
            p.Evaluate: t.on_evaluate,
            p.Attach: t.on_attach,
            p.Generate: t.on_generate,
            p.Stats: self._on_stats,
            **{cls: t.on_weights for cls in WEIGHT_REQUESTS},
            p.WeightsReport: a.on_weights_report,
            **{cls: t.on_request for cls in p.TRAINER_REQUESTS},
        }
        self._restore(restored, now)

    def _restore(self, restored: LedgerSnapshot, now: float) -> None:
        if not restored.cursors and not restored.prompts:
            return
        states = {prompt: st.status for prompt, st in restored.prompts.items()}
        self.frontier.restore(restored.cursors, states, now, orphan_delay=self.liveness.ttl)
        self.ready.restore(restored.prompts)
        # Agents the ledger points at are known from now on, even if they never come
        # back: they are then retired on schedule and their groups replaced.
        for agent_id in self.batches.referenced_agents():
            self.membership.placeholder(agent_id, now)

    @property
    def dataset_size(self) -> int:
        """Rows of the training data, every dataset of a mixture together."""
        return self.settings.dataset_size

    @property
    def dataset_fingerprint(self) -> str:
        return self.settings.fingerprint

    # ------------------------------------------------------------------ events

    def handle(self, peer: bytes, msg: p.Message, now: float) -> list:
        """Effects of one message from ``peer`` at ``now`` (the pump's too, unless a turn is open)."""
        route = self._routes.get(type(msg))
        if route is None:
            why = f"the coordinator does not accept {msg.TYPE!r} messages"
            return [Send(peer, p.Error("unexpected", why, getattr(msg, "req", 0)))]
        self.now = now
        if not self._in_turn:
            return self._in_a_turn(lambda: route(peer, msg, now), now)
        self._pump_due = True
        out = route(peer, msg, now)
        if not self._unstamped:
            self._unstamped = any(type(e) is Persist for e in out)
        return out

    def begin_turn(self) -> None:
        """Messages handled from now until ``end_turn`` share one pump and one cursor stamp, both by ``end_turn``.

        The caller commits every ``Persist`` of a turn, ``end_turn``'s included, in one ledger transaction (the
        server queues them in one synchronous step and its writer takes the whole queue), so the stamp on the
        turn's last ``Persist`` covers them all."""
        self._in_turn, self._pump_due, self._unstamped = True, False, False

    def end_turn(self, now: float) -> list:
        """Close the turn: the one pump its messages asked for, and the cursors behind every ``Persist`` of it."""
        self._in_turn = False
        out = self._pump(now) if self._pump_due else []
        self._pump_due = False
        if self._unstamped and not any(type(e) is Persist for e in out):
            out.append(Persist([], []))
        self._unstamped = False
        return self._stamped(out)

    def tick(self, now: float) -> list:
        """The clock: agents silent past the TTL lose their leases, past ``retire_after`` their groups;
        a weight update past its deadline is aborted; a batch past its deadline is assembled partial."""
        self.now = now
        return self._in_a_turn(lambda: self.admission.tick(now) + self.weights.tick(now), now)

    def _in_a_turn(self, step: Callable[[], list], now: float) -> list:
        """``step``'s effects, with a pump due: in the open turn, or in a turn of its own, pumped at once."""
        if self._in_turn:
            self._pump_due = True
            out = step()
            if not self._unstamped:
                self._unstamped = any(type(e) is Persist for e in out)
            return out
        self.begin_turn()
        try:
            out = self._stamped(step())
        except BaseException:
            self._in_turn = False
            raise
        self._pump_due = True
        return out + self.end_turn(now)

    def _stamped(self, effects: list) -> list:
        """``effects``, each ``Persist`` with the frontier cursors as they stand now (write-ahead for any grant
        in its ``then``; in one transaction the ledger writes the last)."""
        stamp = None
        for e in effects:
            if type(e) is Persist:
                stamp = stamp or SetCursors(self.frontier.cursors())
                e.ops.append(stamp)
        return effects

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
                out.append(Send(r.agent_id, p.Heartbeat(r.session, max_lease=r.max_granted, paused=paused)))
        return out

    def _on_stats(self, peer: bytes, msg: p.Stats, now: float) -> list:
        return [Send(peer, p.Ok(msg.req, self.statistics(now).to_dict()))]

    # ------------------------------------------------------------------ the pump

    def _pump(self, now: float) -> list:
        """Assemble what can be assembled, then admit new prompts up to demand + prefetch."""
        self.now = now
        trainer, batches, training, ready = self.trainer, self.batches, self.training, self.ready
        out = batches.pump(now, trainer.prefetch)
        if trainer.paused:
            return out + trainer.answer_drained(now)
        if self.weights.stops_admission:
            return out  # a weight update runs: no lease may start on weights about to change
        out += self._pump_evaluations(now)
        if training.starvation.starved:
            return out  # every recent group failed: leasing more prompts would only burn them
        t_next, updates = batches.current_rollout_id, self.weights.log.updates
        outstanding = self.leases.training_leases + len(ready)
        wanted = training.plan(batches.wanted(trainer.prefetch), ready.count)
        allowed = self.staleness.budget(outstanding, t_next, updates)
        budget = wanted
        if allowed is not None:
            budget = min(budget, allowed)
            # Rule 1 by shares (staleness.py): each dataset may have in flight or ready what the batches the bound
            # admits hold of it, so the budget is never spent on a mix those batches cannot be made of.
            allowance = training.allowance(t_next, self.staleness.last_admitted(updates))
            budget = min(budget, training.limit(allowance, ready.count))
            self.staleness.note_admission(wanted, budget, now)
        if budget <= 0:
            return out
        granted = self.leases.grant(training, budget, t_next, updates, now)
        if granted:
            # Write-ahead: the cursor covering these leases is durable before they leave (``_stamped``).
            out.append(Persist([], granted))
        return out

    def _pump_evaluations(self, now: float) -> list:
        """Evaluation prompts go first to free capacity (a trainer waits on them); a pass nobody can
        run answers its waiting calls."""
        evaluations = self.evaluations
        if not evaluations.wanted:
            return []
        why = self.capacity.why_none()
        if why is not None:
            return evaluations.answer_waiters("no_capacity", why)
        return evaluations.grant(self.batches.current_rollout_id, self.weights.log.updates, now)

    def update_wait(self) -> str | None:
        """Why the first waiting batch cannot be completed before a weight update is pushed (``--max-staleness``:
        ``Staleness.update_wait``), or None. ``statistics()["waiting_for_update"]``, ``coordinator status``."""
        batches, training, in_flight = self.batches, self.training, self.leases.training_leases
        if not self.staleness.bounded or not batches.pending or batches.repairs:
            return None
        t, updates = batches.pending[0].rollout_id, self.weights.log.updates
        have = zip(batches.composition(t), self.ready.count, training.in_flight, strict=True)
        lacking = [training.names[d] if training.mixed else "" for d, (n, r, f) in enumerate(have) if r + f < n]
        budget = self.staleness.budget(in_flight + len(self.ready), t, updates)
        return self.staleness.update_wait(t, updates, lacking, budget, in_flight)

    # ------------------------------------------------------------------ views

    def peer_of(self, agent_id: str) -> bytes | None:
        """The ZeroMQ peer an agent last spoke from."""
        rec = self.membership.agents.get(agent_id)
        return rec.peer if rec is not None else None

    def payload_address(self, agent_id: str) -> str:
        """Where trainers fetch ``agent_id``'s payloads; empty if the agent is unknown."""
        rec = self.membership.agents.get(agent_id)
        return rec.payload_address if rec is not None else ""

    def statistics(self, now: float | None = None) -> CoordinatorStats:
        batches, trainer, training = self.batches, self.trainer, self.training
        at = self.now if now is None else now
        agents = {
            r.agent_id: AgentStats(
                r.status,
                r.capacity,
                len(r.leases),
                tuple(e.to_dict() for e in r.engines),
                r.session,
                round(max(0.0, at - r.last_seen), 3),
            )
            for r in self.membership.agents.values()
        }
        return CoordinatorStats(
            agents=agents,
            leased=len(self.leases),
            ready=len(self.ready),
            pending_generates=len(batches.pending),
            batches_in_repair=tuple(sorted(batches.repairs)),
            prefetch=trainer.prefetch,
            paused=trainer.paused,
            starved=training.starvation.reason,
            trainer=trainer.client if trainer.session else None,
            prompts=self.frontier.counts(),
            data_epochs=tuple(sorted({epoch_of(key) for key in self.frontier.epochs})),
            last_rollout_id=batches.last_rollout_id,
            trimmed_upto=batches.trimmed_upto,
            consumed_upto=batches.consumed_upto,
            filtered_total=training.filtered_total,
            fenced_messages=dict(self.admission.fenced),
            weights=self.weights.statistics(at),
            evaluations=self.evaluations.statistics(),
            sources=self.dataset_statistics(),
            held=len(self.leases.held),
            receipts={"accepted": self.counters.receipts_accepted, "refused": self.counters.receipts_refused},
            gateways=self.gateway_stats(at) if self.gateway_stats is not None else [],
            waiting_for_update=self.update_wait(),
        )

    def dataset_statistics(self) -> dict:
        """``CoordinatorStats.sources``: each training dataset's weight, prompts by state, epochs, filtered."""
        training = self.training
        weights = training.weights_at(self.batches.last_rollout_id + 1)
        return {
            name: {
                "weight": weights[d],
                "prompts": self.frontier.counts(d),
                "data_epochs": sorted(self.frontier.parts[d].epochs),
                "filtered": training.filtered_count[d],
            }
            for d, name in enumerate(training.names)
        }
