"""Over-sampling and partial batches: starting more groups than a batch needs, stopping the surplus,
and the ``generate`` deadline.

Over-sampling (``coordinator serve --over-sampling FACTOR``, 1.0 = off): while a trainer's
``generate`` waits, its batch's demand is ``ceil(rollout_batch_size x FACTOR)`` groups instead of
``rollout_batch_size`` (``batch_demand``; the prefetch is unchanged), so the batch fills with the
groups that finish first and the long tail of slow ones no longer holds the trainer. Once a batch
is assembled, the leases beyond the normal bound (``leased + ready > demand + prefetch``) are
*stopped* (``stop_excess``): the newest first, as they have made the least progress, one ``Stop``
per holding agent. The agent aborts their engine requests and gives them back with a ``Release``
whose reason is ``protocol.STOPPED``; their prompts are pending again, first in line
(``Frontier.release``), and are generated again later. Stopped groups are counted in the next
batch's metrics (``rollout/stopped_groups``) and as ``lease_ends_total{reason="stopped"}``.

Partial batches (``generate(rollout_id, deadline=S)``): if batch ``rollout_id`` is not full ``S``
seconds after the coordinator first got that ``generate`` (``PendingGenerate.since``, the core's
clock: ``tick`` evaluates it), it is assembled from the groups ready then, at least one (with none
ready, as soon as one is), and records its shortfall, ``rollout/deficit``, in its metrics and its
size in the ledger (``RecordedBatch.size``).

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
from common.errors import ConfigError
from common.mixture import EPOCH_BITS
from coordinator.effects import Send
from coordinator.membership import ALIVE

if TYPE_CHECKING:
    from coordinator.batches import PendingGenerate
    from coordinator.core import CoordinatorCore


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


def deadline_due(g: PendingGenerate, now: float) -> bool:
    """Whether a waiting ``generate`` with a deadline has reached it."""
    return g.deadline > 0 and now >= g.since + g.deadline


class OverSampling:
    """The over-sampling factor, the leases being stopped and the stopped-group count."""

    def __init__(self, core: CoordinatorCore, factor: float = 1.0):
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"--over-sampling must be a number >= 1.0 (1.0: off), got {factor!r}")
        self.core = core
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

    def stop_excess(self) -> list[Send]:
        """After an assembly: Stop the newest leases beyond ``demand + prefetch``, one message per agent."""
        if not self.on:
            return []
        core = self.core
        leases = core.admission.leases
        self.stopping &= leases.keys()  # ended meanwhile (receipt, filtered, released, failed, lost, expired)
        # Training leases only: an evaluation pass is never stopped and is outside the training bound.
        # Per training dataset: a mixture's dataset short of its share keeps its leases.
        training, batches = core.admission.training, core.batches
        stopping = [0] * len(training.in_flight)
        for lease_id in self.stopping:
            stopping[leases[lease_id].data_epoch >> EPOCH_BITS] += 1
        wanted = batches.wanted(core.trainer.prefetch)
        excess = [training.in_flight[s] - stopping[s] + batches.ready_count[s] - wanted[s] for s in range(len(wanted))]
        if max(excess) <= 0:
            return []
        agents = core.membership.agents

        def reachable(lease_id: int) -> bool:
            lease = leases[lease_id]
            rec = agents.get(lease.agent_id)
            return (
                core.admission.source_of(lease).bounded and rec is not None and rec.status == ALIVE and rec.session != 0
            )

        chosen: list[int] = []
        for s, n in enumerate(excess):
            if n > 0:
                mine = (i for i in leases if leases[i].data_epoch >> EPOCH_BITS == s and reachable(i))
                chosen += select_stops(mine, self.stopping, n)
        by_agent: dict[str, list[int]] = {}
        for lease_id in chosen:
            by_agent.setdefault(leases[lease_id].agent_id, []).append(lease_id)
        self.stopping.update(chosen)
        core.counters.stops_sent += len(chosen)
        return [Send(agent_id, p.Stop(agents[agent_id].session, ids)) for agent_id, ids in by_agent.items()]

    def on_stopped(self, lease_id: int) -> None:
        """A lease ended with a ``Release`` whose reason is ``protocol.STOPPED``."""
        self.stopping.discard(lease_id)
        self.stopped += 1
        self.core.counters.lease_ended("stopped")

    def batch_metrics(self, size: int, groups: int) -> dict[str, float]:
        """The metrics a batch of ``groups`` (of ``rollout_batch_size`` ``size``) adds; resets the stop count."""
        metrics = {"rollout/deficit": float(size - groups), "rollout/stopped_groups": float(self.stopped)}
        self.stopped = 0
        return metrics
