"""Trainer sessions: attach, generate, pause/resume, checkpoints, consumed/missing, detach.

One trainer session at a time. Pure: events in, effects out.

Invariants kept here:
- Fencing: ``Attach`` opens a new session and fences the previous one (its
  waiting calls are answered with ``fenced``, never dropped, and a broadcast
  weight update it left in flight is aborted); every other
  trainer request names its session, and a superseded or unknown session
  gets an error and changes nothing.
- Idempotent: a resent ``Attach`` (same client id and request id) gets the
  same session; ``generate`` is idempotent by rollout id (a partial batch,
  made at its ``deadline``, too); ``pause``,
  ``resume`` and ``consumed`` by the state they set.
- Pause is durable: it is acknowledged only once the ledger holds it, so a
  restarted coordinator stays paused (and a drain waits for it).
- A checkpoint (``state_dict``) is taken only while paused and drained.
- An ``Attach`` whose expected configuration (``config_check``) differs from
  the fleet's in any field, or names a field the fleet does not have, is
  refused (``config_mismatch``) with every such field listed.
- A starved rollout (``coordinator/starvation.py``) answers waiting calls with
  ``starved``; the next new ``generate`` clears it and admission resumes.
- ``evaluate`` is a trainer call like the others: its session is checked here, and a pass it waits on
  resumes a paused rollout, as ``generate`` does (the pass itself: ``coordinator/evaluation.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common import protocol as p
from common.errors import ConfigError
from common.mixture import check_weights
from coordinator.effects import Persist, Send
from coordinator.membership import ALIVE, RETIRED
from coordinator.records import LedgerSnapshot, SetMixture, SetPaused

if TYPE_CHECKING:
    from coordinator.batches import Batches
    from coordinator.core_settings import CoreSettings
    from coordinator.counters import CoreCounters
    from coordinator.evaluation import Evaluations
    from coordinator.faces import WeightsFace
    from coordinator.lease_book import LeaseBook
    from coordinator.membership import Membership
    from coordinator.sources import TrainingSource


def config_differences(fleet: dict, expected: dict) -> str:
    """Why a trainer expecting ``expected`` may not attach to a fleet running ``fleet``; "" if it may."""
    unknown = sorted(k for k in expected if k not in fleet)
    differ = sorted(k for k in expected if k in fleet and fleet[k] != expected[k])
    parts = [f"{k}: the fleet runs {fleet[k]!r}, the trainer expects {expected[k]!r}" for k in differ]
    if unknown:
        parts.append(f"not rollout config fields: {unknown}")
    if not parts:
        return ""
    return f"rollout config differs from the running fleet's in {differ + unknown}: " + "; ".join(parts)


class TrainerSessions:
    def __init__(
        self,
        settings: CoreSettings,
        restored: LedgerSnapshot,
        *,
        membership: Membership,
        leases: LeaseBook,
        batches: Batches,
        training: TrainingSource,
        evaluations: Evaluations,
        weights: WeightsFace,
        counters: CoreCounters,
    ):
        """Its parts: membership (sessions, the agents told of a pause), the lease book (a drain waits for it to
        empty), the batches it asks for, the training source (the mixture's weights, its starvation record),
        the evaluation passes, and the weight updates (a trainer that leaves gives its update up)."""
        self._settings = settings
        self._membership = membership
        self._leases = leases
        self._batches = batches
        self._training = training
        self._evaluations = evaluations
        self._weights = weights
        self._counters = counters
        self.session = 0
        self.client = ""
        self.world = 1
        """Processes of the attached trainer: its leader (rank 0) attached, ranks above 0 join as members."""
        self.run = ""
        """The launch the leader belongs to (``Attach.run``): members of another launch are not let in."""
        self._last_attach: tuple[str, int] = ("", 0)
        self.paused = restored.paused
        self.drain_waiters: list[tuple[bytes, int]] = []
        self.state_waiters: list[tuple[bytes, p.StateDict]] = []
        """``state_dict`` calls made while paused with a lease in flight again (one an agent re-registering
        after a restart or an outage declared): answered once it ends, like a drain."""
        self.prefetch = settings.config.effective_prefetch
        self._requests = {
            p.Pause: self.on_pause,
            p.Resume: self.on_resume,
            p.SetMixture: self.on_set_mixture,
            p.StateDict: self.on_state_dict,
            p.LoadStateDict: self.on_load_state_dict,
            p.Consumed: self.on_consumed,
            p.Missing: self.on_missing,
            p.Detach: self.on_detach,
        }

    # ------------------------------------------------------------------ sessions

    def on_attach(self, peer: bytes, msg: p.Attach, now: float) -> list:
        if msg.world_size < 1 or not 0 <= msg.rank < msg.world_size:
            why = f"rank {msg.rank} is not in [0, world_size) for world_size {msg.world_size}"
            return [Send(peer, p.Error("bad_request", why, msg.req))]
        if msg.balance not in ("tokens", "groups"):
            why = f"balance must be 'tokens' or 'groups', not {msg.balance!r}"
            return [Send(peer, p.Error("bad_request", why, msg.req))]
        if msg.rank > 0:
            return self._join(peer, msg)
        if (msg.client_id, msg.req) == self._last_attach and self.session:
            return [Send(peer, p.Ok(msg.req, self._attach_result()))]  # a resent Attach: same session
        why = config_differences(self._settings.config.to_dict(), msg.config_check)
        if why:
            return [Send(peer, p.Error("config_mismatch", why, msg.req))]
        self._last_attach = (msg.client_id, msg.req)
        previous, self.session = self.session, self._membership.new_session()
        self.client = msg.client_id
        self.world, self.run = msg.world_size, msg.run
        self._batches.shares.attach(msg.world_size, msg.balance == "groups")
        # A replaced trainer's waiting calls (its members' too) are answered with an error, never silently dropped.
        fenced = "a newer trainer session attached"
        out = [Send(peer, p.Error("fenced", fenced, req)) for peer, req in self._batches.take_waiting(now)]
        out += self._evaluations.answer_waiters("fenced", fenced)
        out += self._weights.trainer_gone(previous, f"its trainer was replaced by {msg.client_id}", now)
        return out + [Send(peer, p.Ok(msg.req, self._attach_result()))]

    def _join(self, peer: bytes, msg: p.Attach) -> list:
        """A rank above 0 joins the leader's session as a member (members never fence anyone)."""
        where = f"rank {msg.rank} of {msg.world_size} (run {msg.run!r})"
        if not self.session:
            why = f"{where}: no leader (rank 0) is attached; start rank 0, or wait for it"
            return [Send(peer, p.Error("no_leader", why, msg.req))]
        if (self.world, self.run) != (msg.world_size, msg.run):
            why = (
                f"{where}: the attached leader {self.client} leads {self.world} rank(s) of run {self.run!r}, "
                "not this rank's"
            )
            return [Send(peer, p.Error("other_leader", why, msg.req))]
        why = config_differences(self._settings.config.to_dict(), msg.config_check)
        if why:
            return [Send(peer, p.Error("config_mismatch", why, msg.req))]
        return [Send(peer, p.Ok(msg.req, self._attach_result()))]

    def _attach_result(self) -> dict:
        settings, batches = self._settings, self._batches
        return {
            "session": self.session,
            "world_size": self.world,
            "run": self.run,
            "config": settings.config.to_dict(),
            "dataset_size": settings.dataset_size,
            "dataset_fingerprint": settings.fingerprint,
            "last_rollout_id": batches.last_rollout_id,
            "trimmed_upto": batches.trimmed_upto,
            "heartbeat_interval": settings.liveness.heartbeat_interval,
            "ttl": settings.liveness.ttl,
            "weights_version": self._weights.log.version,
        }

    def session_error(self, peer: bytes, session: int, req: int) -> list | None:
        """None if ``session`` is the current trainer's; else the error to send."""
        if session == self.session and session != 0:
            return None
        if self.session == 0:
            why = f"no trainer session {session:x} here (coordinator restarted or trainer detached); attach again"
            return [Send(peer, p.Error("unknown_session", why, req))]
        return [Send(peer, p.Error("fenced", f"trainer session {session:x} was replaced by a newer trainer", req))]

    def on_request(self, peer: bytes, msg: p.Message, now: float) -> list:
        """A session-bound trainer request (one of ``protocol.TRAINER_REQUESTS``)."""
        return self.session_error(peer, msg.session, msg.req) or self._requests[type(msg)](peer, msg, now)

    def on_weights(self, peer: bytes, msg: p.Message, now: float) -> list:
        """A weight update request (``UpdateWeights``, ``WeightBucket``, ``FinishWeights``, ``AbortWeights``,
        ``WeightsAlive``): its session is checked here, the update is the weight updates' (the client attached
        holds the lock it takes)."""
        return self.session_error(peer, msg.session, msg.req) or self._weights.on_request(peer, msg, self.client, now)

    def on_detach(self, peer: bytes, msg: p.Detach, now: float) -> list:
        previous, self.session = self.session, 0
        out = self._weights.trainer_gone(previous, "its trainer detached", now)
        return out + [Send(peer, p.Ok(msg.req, {}))]

    def on_evaluate(self, peer: bytes, msg: p.Evaluate, now: float) -> list:
        """One pass over an evaluation dataset (coordinator/evaluation.py), answered with its metrics."""
        err = self.session_error(peer, msg.session, msg.req)
        if err:
            return err
        evaluations = self._evaluations
        answer = evaluations.answer_now(peer, msg)
        if answer is not None:
            return answer
        joined = evaluations.join(peer, msg)
        # Like generate: a rollout left paused (a trainer that died checkpointing) is resumed.
        resumed = self.resume() if self.paused else []
        return joined + resumed + evaluations.finish(msg.name)

    # ------------------------------------------------------------------ generate

    def on_generate(self, peer: bytes, msg: p.Generate, now: float) -> list:
        err = self.session_error(peer, msg.session, msg.req)
        if err:
            return err
        batches = self._batches
        if msg.prefetch >= 0:
            self.prefetch = msg.prefetch
        batch = batches.recorded.get(msg.rollout_id)
        repair: list = []
        if batch is not None and msg.rollout_id not in batches.repairs:
            ops: list = []
            if msg.rank in batch.taken:  # a rank asking again for a share it took: it restarted
                batches.retake(msg.rollout_id, msg.rank, self._gone(), ops)
            batch = batches.shared(msg.rollout_id, ops)
            if len(batch.groups) >= batches.target(batch):  # complete (a partial batch: at its own size)
                answer = Send(peer, batches.reply(msg.req, msg.rollout_id, msg.rank))
                return [Persist(ops, [answer])] if ops else [answer]
            batches.start_repair(msg.rollout_id, ops)
            repair = [Persist(ops, [])]
        # Asking for a batch that still needs generating resumes admission, as
        # in the seed: a trainer killed while paused (e.g. saving a checkpoint)
        # must not leave its successor's generate() waiting forever. The leader's
        # call only: a member asking ahead must not undo the leader's pause.
        waits = msg.rank == 0 and (msg.rollout_id in batches.repairs or msg.rollout_id > batches.last_rollout_id)
        starvation = self._training.starvation
        if starvation.starved:
            if (peer, msg.req) in starvation.answered:  # a resend of a call already told: tell it again
                return repair + [Send(peer, p.Error("starved", starvation.reason, msg.req))]
            # A new call: the user may have fixed the reward and restarted the agents. Start over.
            starvation.clear()
        resumed = self.resume() if self.paused and waits else []
        error = batches.enqueue(peer, msg.req, msg.rollout_id, now, msg.deadline, msg.rank)
        return repair + resumed + ([Send(peer, error)] if error else [])

    # ------------------------------------------------------------------ pause

    def on_pause(self, peer: bytes, msg: p.Pause, now: float) -> list:
        self.paused = True
        then: list = [Send(r.agent_id, p.Control("pause", msg.abort)) for r in self._membership.alive()]
        if msg.drain and self._leases:
            self.drain_waiters.append((peer, msg.req))
        else:
            then.append(Send(peer, p.Ok(msg.req, {"leased": len(self._leases)})))
        # Durable before acknowledged: a restarted coordinator stays paused.
        return [Persist([SetPaused(True)], then)]

    def resume(self) -> list:
        """Admission on again (durably); a pause still waiting for its drain is told why it never will."""
        self.paused = False
        then: list = [Send(r.agent_id, p.Control("resume")) for r in self._membership.alive()]
        why = "generation was resumed before the drain completed"
        then += [Send(peer, p.Error("resumed", why, req)) for peer, req in self.drain_waiters]
        then += [Send(peer, p.Error("resumed", why, msg.req)) for peer, msg in self.state_waiters]
        self.drain_waiters.clear()
        self.state_waiters.clear()
        return [Persist([SetPaused(False)], then)]

    def on_resume(self, peer: bytes, msg: p.Resume, now: float) -> list:
        out = self.resume()
        out[0].then.append(Send(peer, p.Ok(msg.req, {})))
        return out

    def answer_drained(self, now: float) -> list:
        """Answer the pauses waiting for their drain once no lease is in flight: after the ledger holds the
        receipts that ended the last leases (a write behind theirs: the core writes the cursors with every
        ``Persist``), so a drained pause means results durable on the coordinator too, not only on the agents."""
        if not (self.drain_waiters or self.state_waiters) or self._leases:
            return []
        drained = [Send(peer, p.Ok(req, {"leased": 0})) for peer, req in self.drain_waiters]
        out: list = [Persist([], drained)] if drained else []
        self.drain_waiters.clear()
        waiting, self.state_waiters = self.state_waiters, []
        for peer, msg in waiting:
            out += self.on_state_dict(peer, msg, now)
        return out

    # ------------------------------------------------------------------ checkpoints

    def on_set_mixture(self, peer: bytes, msg: p.SetMixture, now: float) -> list:
        """The training datasets' weights from the next batch not recorded yet on, recorded before the answer."""
        training = self._training
        try:
            weights = check_weights(msg.weights, training.names)
        except ConfigError as exc:
            return [Send(peer, p.Error("bad_request", str(exc), msg.req))]
        start = self._batches.last_rollout_id + 1
        schedule = [(r, w) for r, w in training.schedule if r < start]
        schedule.append((start, [weights[name] for name in training.names]))
        training.schedule[:] = schedule
        answer = Send(peer, p.Ok(msg.req, {"from_rollout_id": start, "weights": weights}))
        return [Persist([SetMixture(tuple(schedule))], [answer])]

    def on_state_dict(self, peer: bytes, msg: p.StateDict, now: float) -> list:
        batches = self._batches
        leased = len(self._leases)
        if self.paused and leased:
            # Drained once, but a lease is in flight again (an agent re-registered and declared it):
            # answered when it ends, as the drain was.
            self.state_waiters = [(w, m) for w, m in self.state_waiters if m.req != msg.req or w != peer]
            self.state_waiters.append((peer, msg))
            return []
        if not self.paused:
            why = (
                f"state_dict needs a paused and drained rollout (paused={self.paused}, leases in flight={leased}); "
                "call pause(drain=True) first"
            )
            return [Send(peer, p.Error("not_drained", why, msg.req))]
        if msg.consumed > batches.last_rollout_id:
            why = f"consumed rollout id {msg.consumed!r} was never generated (last is {batches.last_rollout_id})"
            return [Send(peer, p.Error("bad_request", why, msg.req))]
        ops: list = []
        out: list = []
        for agent_id, keys in batches.checkpoint(msg.consumed, ops).items():
            rec = self._membership.agents.get(agent_id)
            if rec is not None and rec.status == ALIVE:
                out.append(Send(agent_id, p.Trim(keys)))
            # An agent that is down gets its trims at registration (storage reconciliation).
        state = {
            "format": 1,
            "rollout_id": msg.consumed,
            "dataset_fingerprint": self._settings.fingerprint,
            "dataset_size": self._settings.dataset_size,
            "config": self._settings.config.to_dict(),
            "mixture": [[start, list(w)] for start, w in self._training.schedule],
        }
        return [Persist(ops, out + [Send(peer, p.Ok(msg.req, state))])]

    def on_load_state_dict(self, peer: bytes, msg: p.LoadStateDict, now: float) -> list:
        batches = self._batches
        state = msg.state

        def bad(why: str) -> list:
            return [Send(peer, p.Error("bad_state", why, msg.req))]

        if state.get("format") != 1:
            return bad("not a rollfleet state_dict (format 1)")
        if state.get("dataset_fingerprint") != self._settings.fingerprint:
            return bad("checkpoint was taken on a different dataset (fingerprint differs)")
        rollout_id = state.get("rollout_id")
        if not isinstance(rollout_id, int) or rollout_id < batches.trimmed_upto:
            return bad(
                f"checkpoint at rollout {rollout_id} is older than the last two checkpoints "
                f"(batches up to {batches.trimmed_upto} were trimmed)"
            )
        if rollout_id > batches.last_rollout_id:
            return bad(
                f"checkpoint at rollout {rollout_id} is newer than anything this coordinator delivered "
                f"(last {batches.last_rollout_id}); is this the right --data-dir?"
            )
        return [Send(peer, p.Ok(msg.req, {"rollout_id": rollout_id, "last_rollout_id": batches.last_rollout_id}))]

    def on_consumed(self, peer: bytes, msg: p.Consumed, now: float) -> list:
        """The trainer fetched a batch completely; its prompts count as trained from now on."""
        batches, rollout_id = self._batches, msg.rollout_id
        if rollout_id not in batches.recorded and rollout_id > batches.trimmed_upto:
            return [Send(peer, p.Error("bad_request", f"rollout {rollout_id!r} was never delivered", msg.req))]
        if rollout_id <= batches.consumed_upto:
            return [Send(peer, p.Ok(msg.req, {"consumed_upto": batches.consumed_upto}))]
        ops: list = []
        if batches.take(rollout_id, msg.rank, ops):  # every rank holds its share now
            batches.consume(rollout_id, ops)
        answer = Send(peer, p.Ok(msg.req, {"consumed_upto": batches.consumed_upto}))
        return [Persist(ops, [answer])]

    def _gone(self) -> set[str]:
        """Agents whose payloads are gone for good (retired, or unknown to this coordinator)."""
        agents = self._membership.agents
        referenced = self._batches.referenced_agents()
        return {a for a in referenced if a not in agents or agents[a].status == RETIRED}

    def on_missing(self, peer: bytes, msg: p.Missing, now: float) -> list:
        """An agent that is up answered that it no longer holds some groups of a batch
        (e.g. its disk was wiped): they are treated like groups of a lost node."""
        batches = self._batches
        batch = batches.recorded.get(msg.rollout_id)
        if batch is None:
            why = f"no recorded batch {msg.rollout_id!r} with missing keys"
            return [Send(peer, p.Error("bad_request", why, msg.req))]
        keys = set(msg.keys)
        lost = [g for g in batch.groups if g.key in keys]
        ops: list = []
        if lost:
            batches.lose_groups(msg.rollout_id, lost, ops)
        return [Persist(ops, [Send(peer, p.Ok(msg.req, {"lost": len(lost)}))])]
