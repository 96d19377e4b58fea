"""The lease half of the agent's core: grants, engine assignment, generation outcomes, releases.

``LeaseFlow`` is mixed into ``AgentSession`` (agent/session.py), which owns the state it works on
(``leases``, ``config``, ``paused``, ``stopping``, ``weights``, ``counters``, ``session``) and
routes these events and messages here. Pure like the rest of the core: every method takes the
event, ``now`` and the list of instructions to append to. The invariants are the session's.
"""

from __future__ import annotations

import logging

from agent.events import (
    AbortRequests,
    CancelLease,
    EngineFailed,
    EngineWanted,
    GenerationEnded,
    LeaseEvaluated,
    LeaseFailed,
    LeaseFiltered,
    LeaseScored,
    Log,
    ReportEngineFailure,
    StartLease,
)
from agent.leases import (
    ABORT_PAUSE,
    ABORT_SHUTDOWN,
    ABORT_STOP,
    NO_ENGINE,
    NOT_ON_ENGINE,
    LeaseRecord,
    LeaseState,
    group_size,
)
from common import protocol as p


class LeaseFlow:
    def _on_grant(self, msg: p.Grant, now: float, out: list) -> None:
        if msg.session != self.session:
            return
        grants = []
        for grant in msg.leases:  # typed and checked as the message was decoded (protocol.LeaseGrant)
            self.max_lease = max(self.max_lease, grant.lease)
            grants.append((grant.lease, grant.data_epoch, grant.index, grant))
        if self.stopping:
            if grants:
                self._send(p.Release(self.session, [g[0] for g in grants], ABORT_SHUTDOWN), out)
            return
        for lease, epoch, index, grant in grants:
            if lease in self.leases:
                continue  # a duplicate grant: the lease already runs
            if self.paused:
                # Generating now would stall a pause(drain=True); the coordinator reissues it on resume.
                self.counters.groups_released += 1
                self._send(p.Release(self.session, [lease], ABORT_PAUSE), out)
                continue
            rec = self.leases.add(lease, epoch, index)
            rec.n_samples = group_size(grant, self.config.n_samples_per_prompt)
            out.append(StartLease(lease, grant))

    def _on_engine_wanted(self, ev: EngineWanted, now: float, out: list) -> None:
        rec = self.leases.get(ev.lease)
        if rec is not None and rec.state in NOT_ON_ENGINE:
            self._next_engine(rec, out)

    def _on_stop(self, msg: p.Stop, now: float, out: list) -> None:
        """Over-sampled leases the coordinator no longer needs: abort and give back those still generating."""
        if msg.session != self.session or self.paused:
            return  # a pause has its own say over in-flight work (and a resume brings admission back)
        for lease in msg.leases:
            rec = self.leases.get(lease)
            if rec is None or rec.abort == ABORT_STOP:
                continue  # not ours (any more), or stopped already
            if rec.state in NOT_ON_ENGINE:
                self._release(rec, ABORT_STOP, out)
            elif rec.state is LeaseState.GENERATING:
                # Given back when its aborted generation comes back (_next_engine). A stop outranks a
                # pause's abort still under way: the lease is counted as over-sampled.
                rec.abort = ABORT_STOP
                out.append(AbortRequests(rec.url, rec.request_ids))
            # SCORING/COMMITTING: finished generating; its receipt (or Filtered) ends the lease.

    def _next_engine(self, rec: LeaseRecord, out: list) -> None:
        if rec.abort is not None:
            self._release(rec, rec.abort, out)
        elif self.paused:
            # Not on an engine while paused: give it back, a pause(drain=True) must not wait for it.
            self._release(rec, ABORT_PAUSE, out)
        elif self.weights.updating:
            rec.state = LeaseState.WAITING  # assigned when the update is over
        else:
            self._assign(rec, out)

    def _assign(self, rec: LeaseRecord, out: list) -> None:
        assignment = self.leases.assign(rec, rec.n_samples, self.weights.begun)
        if assignment is not None:
            out.append(assignment)
        elif self.leases.all_retired:
            self._release(rec, NO_ENGINE, out)
        else:
            rec.state = LeaseState.WAITING

    def _on_generation_ended(self, ev: GenerationEnded, now: float, out: list) -> None:
        rec = self.leases.get(ev.lease)
        if rec is None or rec.state is not LeaseState.GENERATING:
            return
        rec.resume = ev.aborted and self.weights.interrupted(rec.epoch)
        self.leases.free(rec)
        if ev.aborted:
            self._next_engine(rec, out)  # aborted by the engine itself (e.g. its own pause): generate again
        else:
            rec.state = LeaseState.SCORING

    def _on_engine_failed(self, ev: EngineFailed, now: float, out: list) -> None:
        rec = self.leases.get(ev.lease)
        if rec is None or rec.state is not LeaseState.GENERATING:
            return
        engine = rec.engine
        self.leases.free(rec)
        rec.state, rec.resume = LeaseState.RETRYING, False
        self.counters.engine_retries += 1
        out.append(
            Log(
                logging.WARNING,
                f"lease {rec.lease:x}: engine {engine} failed ({ev.reason}); retrying on another engine",
            )
        )
        out.append(ReportEngineFailure(engine, ev.reason))
        if self.leases.mark_failed(engine):
            self._send(p.Capacity(self.session, self.capacity(), self.engines()), out)

    def _on_scored(self, ev: LeaseScored, now: float, out: list) -> None:
        rec = self.leases.get(ev.lease)
        if rec is not None:
            rec.state = LeaseState.COMMITTING
            self.counters.samples += ev.n_samples

    def _on_filtered(self, ev: LeaseFiltered, now: float, out: list) -> None:
        rec = self.leases.pop(ev.lease)
        if rec is None:
            return
        self.counters.groups_filtered += 1
        self._send(p.Filtered(self.session, rec.lease, rec.data_epoch, rec.index, ev.reason, ev.stats), out)

    def _on_evaluated(self, ev: LeaseEvaluated, now: float, out: list) -> None:
        rec = self.leases.pop(ev.lease)
        if rec is None:
            return
        self.counters.groups_evaluated += 1
        self._send(p.EvalResult(self.session, rec.lease, ev.name, ev.eval_pass, rec.index, ev.result), out)

    def _on_failed(self, ev: LeaseFailed, now: float, out: list) -> None:
        rec = self.leases.pop(ev.lease)
        if rec is None:
            return
        # A failure tells the coordinator to count it: a prompt that keeps failing is filtered.
        if ev.failure is not None:
            self._send(p.Release(self.session, [rec.lease], p.ReleaseReason.FAILED, ev.failure), out)
        else:
            self._send(p.Release(self.session, [rec.lease], p.ReleaseReason.NOT_COMMITTED), out)

    def _release(self, rec: LeaseRecord, reason: p.ReleaseReason, out: list) -> None:
        """Give an unfinished lease back to the coordinator and stop its runner."""
        self._forget(rec.lease, out)
        self.counters.groups_released += 1
        self._send(p.Release(self.session, [rec.lease], reason), out)

    def _forget(self, lease: int, out: list) -> None:
        if self.leases.pop(lease) is not None:
            out.append(CancelLease(lease))
