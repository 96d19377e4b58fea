"""Over-sampling and partial batches: starting more groups than a batch needs, stopping the surplus,
and the ``generate`` deadline.

Over-sampling (``coordinator serve --over-sampling FACTOR``, 1.0 = off): while a trainer's
``generate`` waits, its batch's demand is ``ceil(rollout_batch_size x FACTOR)`` groups instead of
``rollout_batch_size`` (``batch_demand``; the prefetch is unchanged), so the batch fills with the
groups that finish first and the long tail of slow ones no longer holds the trainer. Once a batch
is assembled, the leases beyond the normal bound (``leased + ready > demand + prefetch``) are
*stopped* (``stop_excess``): the newest first, as they have made the least progress, one ``Stop``
per holding agent. The agent aborts their engine requests and gives them back with a ``Release``
whose reason is ``ReleaseReason.STOPPED``; their prompts are pending again, first in line
(``Frontier.release``), and are generated again later. Stopped groups are counted in the next
batch's metrics (``rollout/stopped_groups``) and as ``lease_ends_total{reason="stopped"}``.

Partial batches (``generate(rollout_id, deadline=S)``): if batch ``rollout_id`` is not full ``S``
seconds after the coordinator first got that ``generate`` (``PendingGenerate.since`` and ``due``,
coordinator/batches.py; the core's clock: ``tick`` evaluates it), it is assembled from the groups
ready then, at least one (with none ready, as soon as one is), and records its shortfall,
``rollout/deficit``, in its metrics and its size in the ledger (``RecordedBatch.size``).

Invariants:
- Nothing is lost, nothing committed is discarded: a stopped lease stays the coordinator's until
  the agent's Release or Receipt ends it. A group that finished before the stop arrived is accepted
  like any other and is ready for the next batch; a Stop lost in transit only means its groups
  complete (heartbeat reconciliation still covers the leases). A lease is stopped at most once.
- Bounded: a lease being stopped still counts against admission until it ends, so in flight + ready
  never exceeds ``ceil(B x FACTOR)`` per waiting batch + repairs + prefetch.
- A partial batch is a batch like any other: recorded before it is sent, replayed verbatim for the
  same rollout id (after a restart too), and a repair fills it to its own recorded size.

Pure: no I/O, no clock; ``now`` comes from the core.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from common import protocol as p
from coordinator.effects import Send
from coordinator.membership import ALIVE
from coordinator.prompt_key import dataset_of

if TYPE_CHECKING:
    from coordinator.counters import CoreCounters
    from coordinator.lease_book import LeaseBook
    from coordinator.membership import Membership
    from coordinator.sources import TrainingSource


def batch_demand(size: int, factor: float) -> int:
    """Groups started for one waiting batch of ``size``: ``ceil(size x factor)``, never below ``size``."""
    return max(size, math.ceil(round(size * factor, 9)))  # round: 10 x 1.1 is 11.000000000000002


def select_stops(leases: Iterable[int], skip: Collection[int], n: int) -> list[int]:
    """The ``n`` newest leases not in ``skip``, newest first.

    Lease ids grow with every grant (and across restarts: ``generation << 32 | counter``), so the
    highest ids were granted last and have made the least progress.
    """
    if n <= 0:
        return []
    return heapq.nlargest(n, (lease for lease in leases if lease not in skip))


class OverSampling:
    """The over-sampling factor, the leases being stopped and the stopped-group count."""

    def __init__(
        self,
        factor: float,
        leases: LeaseBook,
        training: TrainingSource,
        membership: Membership,
        counters: CoreCounters,
    ):
        """``factor``: ``--over-sampling`` (checked by the settings, coordinator/core_settings.py); ``leases``: the
        lease book whose training leases it stops; ``training``: their leases in flight by dataset;
        ``membership``: the agents holding them."""
        self._leases = leases
        self._training = training
        self._membership = membership
        self._counters = counters
        self.factor = float(factor)
        self.stopping: set[int] = set()
        """Leases a Stop was sent for, until their Release or Receipt (or expiry) ends them."""
        self.stopped = 0
        """Groups given back stopped since the last batch (its successor's ``rollout/stopped_groups``)."""

    @property
    def on(self) -> bool:
        return self.factor > 1.0

    def demand(self, size: int) -> int:
        """Groups wanted for one waiting batch of ``size`` groups."""
        return batch_demand(size, self.factor)

    def stop_excess(self, wanted: list[int], ready: list[int]) -> list[Send]:
        """After an assembly: Stop the newest leases beyond ``demand + prefetch``, one message per agent.
        ``wanted``: groups wanted in flight or ready by training dataset (``Batches.wanted``); ``ready``: the
        ready groups by dataset."""
        if not self.on:
            return []
        leases = self._leases.leases
        self.stopping &= leases.keys()  # ended meanwhile (receipt, filtered, released, failed, lost, expired)
        # Training leases only: an evaluation pass is never stopped and is outside the training bound.
        # Per training dataset: a mixture's dataset short of its share keeps its leases.
        in_flight = self._training.in_flight
        stopping = [0] * len(in_flight)
        for lease_id in self.stopping:
            stopping[dataset_of(leases[lease_id].data_epoch)] += 1
        excess = [in_flight[d] - stopping[d] + ready[d] - wanted[d] for d in range(len(wanted))]
        if max(excess) <= 0:
            return []
        agents = self._membership.agents
        source_of = self._leases.source_of

        def reachable(lease_id: int) -> bool:
            lease = leases[lease_id]
            rec = agents.get(lease.agent_id)
            return source_of(lease).bounded and rec is not None and rec.status == ALIVE and rec.session != 0

        chosen: list[int] = []
        for d, n in enumerate(excess):
            if n > 0:
                mine = (i for i in leases if dataset_of(leases[i].data_epoch) == d and reachable(i))
                chosen += select_stops(mine, self.stopping, n)
        by_agent: dict[str, list[int]] = {}
        for lease_id in chosen:
            by_agent.setdefault(leases[lease_id].agent_id, []).append(lease_id)
        self.stopping.update(chosen)
        self._counters.stops_sent += len(chosen)
        return [Send(agent_id, p.Stop(agents[agent_id].session, ids)) for agent_id, ids in by_agent.items()]

    def on_stopped(self, lease_id: int) -> None:
        """A lease ended with a ``Release`` whose reason is ``ReleaseReason.STOPPED``."""
        self.stopping.discard(lease_id)
        self.stopped += 1
        self._counters.lease_ended("stopped")

    def batch_metrics(self, size: int, groups: int) -> dict[str, float]:
        """The metrics a batch of ``groups`` (of ``rollout_batch_size`` ``size``) adds; resets the stop count."""
        metrics = {"rollout/deficit": float(size - groups), "rollout/stopped_groups": float(self.stopped)}
        self.stopped = 0
        return metrics
