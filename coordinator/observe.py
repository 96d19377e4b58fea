"""What the coordinator shows an operator: Prometheus metrics and the status page's JSON.

Both are read at request time, on the coordinator's event loop, from state
that already exists: the core's levels (membership, frontier, admission,
batches, weights), its event counters (``coordinator/counters.py``) and the
ledger's page count. Nothing here runs per message; a scrape is one pass over
the agents (O(agents)), the epochs and the counters. Reading never changes
state, so a scrape cannot alter what the fleet does.

Metric names (all ``rollfleet_``; counters end in ``_total``):

    receipts_total{outcome}           accepted | refused
    leases_granted_total
    registrations_total{outcome}      new (a session made) | resent (a resend answered with its session)
    lease_ends_total{reason}          receipt, filtered, released, failed, lost, expired, held_released,
                                      held_reassigned, reregistered, stopped, evaluated
    stops_sent_total                  over-sampled leases a Stop was sent for
    leases_in_flight, leases_held, groups_ready
    groups_dropped_total{reason}      filter verdicts and prompts given up, by reason
    batches_total, batch_latency_seconds (histogram: generate arrival -> batch recorded)
    partial_batches_total             batches made short at a generate deadline
    trainer_wait_seconds_total        time during which a generate waited
    trainer_waiting_generates
    agents{status}                    alive | dead | retired
    engines{state}                    over the alive agents' engines
    fleet_capacity_groups             groups the alive agents may run at once
    prompts{state}, data_epoch, dataset_prompts
    ledger_bytes, ledger_entries{table}
    weight_version, weight_updates_total
    batch_staleness_mean, batch_staleness_max (the last batch)
    paused, starved, fenced_messages_total{type}
    gateway_up{gateway}, gateway_peers{gateway}, gateway_restarts_total{gateway},
    gateway_messages_total{gateway,direction}   in (from peers) | out (to peers), with --gateways
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from common.engine_info import EngineState
from coordinator.membership import ALIVE, DEAD, RETIRED
from coordinator.prompt_key import dataset_of, epoch_of

if TYPE_CHECKING:
    from coordinator.core import CoordinatorCore
    from coordinator.ledger import Ledger
    from coordinator.peer_io import DirectIO, GatewayIO


class Observed(Protocol):
    """What the metrics and the status page read of a running coordinator: coordinator/server.py's
    ``CoordinatorServer``, which imports this module (so this module names only the parts it reads)."""

    core: CoordinatorCore
    ledger: Ledger
    io: DirectIO | GatewayIO
    endpoint: str


AGENT_STATUSES = (ALIVE, DEAD, RETIRED)
ENGINE_STATES = tuple(s.value for s in EngineState)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"rollfleet_{name}", doc, value=value)


def _labelled(kind, name: str, doc: str, label: str, values: dict):
    family = kind(f"rollfleet_{name}", doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], value)
    return family


class CoordinatorCollector:
    """A Prometheus collector over a running coordinator (registered with ``auto_describe`` off)."""

    def __init__(self, server: Observed):
        self.server = server

    def collect(self):
        core = self.server.core
        c, leases, batches, membership = core.counters, core.leases, core.batches, core.membership
        now = time.monotonic()
        yield _labelled(
            CounterMetricFamily,
            "receipts",
            "Receipts of committed groups, by outcome",
            "outcome",
            {"accepted": c.receipts_accepted, "refused": c.receipts_refused},
        )
        yield CounterMetricFamily("rollfleet_leases_granted", "Prompt leases granted to agents", value=c.leases_granted)
        yield _labelled(
            CounterMetricFamily,
            "registrations",
            "Agent Registers, by outcome",
            "outcome",
            {"new": c.registrations, "resent": c.registers_resent},
        )
        yield _labelled(CounterMetricFamily, "lease_ends", "Leases ended, by how", "reason", c.lease_ends)
        yield CounterMetricFamily("rollfleet_stops_sent", "Over-sampled leases a Stop was sent for", value=c.stops_sent)
        yield _gauge("leases_in_flight", "Leases held by agents now", len(leases))
        yield _gauge("leases_held", "Leases kept for agents presumed dead (not retired)", len(leases.held))
        yield _gauge("groups_ready", "Groups committed on agents, waiting for a batch", len(core.ready))
        yield _labelled(CounterMetricFamily, "groups_dropped", "Groups filtered, by reason", "reason", c.drops)
        yield CounterMetricFamily("rollfleet_batches", "Trainer batches assembled", value=c.batches)
        yield CounterMetricFamily(
            "rollfleet_partial_batches", "Batches made short at a generate deadline", value=c.partial_batches
        )
        yield HistogramMetricFamily(
            "rollfleet_batch_latency_seconds",
            "From a trainer's generate reaching the coordinator to its batch being recorded",
            buckets=c.latency_buckets(),
            sum_value=c.latency_sum,
        )
        yield CounterMetricFamily(
            "rollfleet_trainer_wait_seconds", "Time during which a trainer generate waited", value=c.trainer_wait_s(now)
        )
        yield _gauge("trainer_waiting_generates", "Trainer generate calls waiting now", len(batches.pending))
        statuses = dict.fromkeys(AGENT_STATUSES, 0)
        engines = dict.fromkeys(ENGINE_STATES, 0)
        capacity = 0
        for rec in membership.agents.values():
            statuses[rec.status] = statuses.get(rec.status, 0) + 1
            if rec.status == ALIVE:
                capacity += rec.capacity
                for e in rec.engines:
                    engines[e.state.value] += 1
        yield _labelled(GaugeMetricFamily, "agents", "Agents known, by status", "status", statuses)
        yield _labelled(GaugeMetricFamily, "engines", "Engines of the alive agents, by state", "state", engines)
        yield _gauge("fleet_capacity_groups", "Groups the alive agents may generate at once", capacity)
        yield _labelled(
            GaugeMetricFamily, "prompts", "Prompts of the open data epochs, by state", "state", core.frontier.counts()
        )
        yield _gauge("data_epoch", "The newest open data epoch", max(core.frontier.parts[0].epochs, default=0))
        yield _gauge("dataset_prompts", "Rows in the dataset", core.dataset_size)
        training = core.training
        if training.mixed:  # a mixture: each dataset's weight for the next batch and its prompts by state
            weights = training.weights_at(batches.last_rollout_id + 1)
            yield _labelled(GaugeMetricFamily, "source_weight", "A training dataset's weight", "dataset",
                            dict(zip(training.names, weights, strict=True)))  # fmt: skip
            family = GaugeMetricFamily(
                "rollfleet_source_prompts", "A training dataset's prompts of its open epochs, by state",
                labels=["dataset", "state"],
            )  # fmt: skip
            for number, name in enumerate(training.names):
                for state, n in core.frontier.counts(number).items():
                    family.add_metric([name, state], n)
            yield family
        usage = self.server.ledger.usage()
        yield _gauge("ledger_bytes", "Bytes of the ledger's LMDB in use", usage["bytes"])
        yield _labelled(
            GaugeMetricFamily,
            "ledger_entries",
            "Ledger records, by table",
            "table",
            {"prompts": usage["prompts"], "batches": usage["batches"]},
        )
        log = core.weights.log
        yield _gauge("weight_version", "The fleet's weight version", log.version)
        yield CounterMetricFamily("rollfleet_weight_updates", "Weight updates pushed", value=log.updates)
        last = c.recent[-1].metrics if c.recent else {}
        yield _gauge("batch_staleness_mean", "Mean staleness of the last batch", last.get("rollout/staleness_mean", 0))
        yield _gauge("batch_staleness_max", "Largest staleness in the last batch", last.get("rollout/staleness_max", 0))
        yield _gauge("last_rollout_id", "The newest recorded batch", batches.last_rollout_id)
        yield _gauge("paused", "1 while the trainer has admission paused", float(core.trainer.paused))
        yield _gauge("starved", "1 while the rollout is starved", float(core.training.starvation.starved))
        yield _labelled(
            CounterMetricFamily,
            "fenced_messages",
            "Agent messages refused for a stale session",
            "type",
            core.admission.fenced,
        )
        if gateways := self.server.io.statistics(now):  # none without --gateways
            yield from _gateway_metrics(gateways)


def _gateway_metrics(gateways: list[dict]):
    by = {g["gateway"]: g for g in gateways}
    yield _labelled(GaugeMetricFamily, "gateway_up", "1 while a gateway reports", "gateway",
                    {k: float(g["up"]) for k, g in by.items()})  # fmt: skip
    yield _labelled(GaugeMetricFamily, "gateway_peers", "Peers a gateway heard from in the last 5 s", "gateway",
                    {k: g.get("peers", 0) for k, g in by.items()})  # fmt: skip
    yield _labelled(CounterMetricFamily, "gateway_restarts", "Gateway processes restarted", "gateway",
                    {k: g["restarts"] for k, g in by.items()})  # fmt: skip
    family = CounterMetricFamily(
        "rollfleet_gateway_messages", "Messages a gateway relayed, by direction", labels=["gateway", "direction"]
    )
    for k, g in sorted(by.items()):
        family.add_metric([str(k), "in"], g.get("messages_in", 0))
        family.add_metric([str(k), "out"], g.get("messages_out", 0))
    yield family


def status_snapshot(server: Observed) -> dict:
    """The status page's data (``/status.json``): fleet, frontier, recent batches, drops, weights."""
    core = server.core
    c, batches = core.counters, core.batches
    now = time.monotonic()
    fleet = [
        {
            "agent": rec.agent_id,
            "status": rec.status,
            "capacity": rec.capacity,
            "leases": len(rec.leases),
            "seen_s_ago": round(max(0.0, now - rec.last_seen), 1),
            "engines": [
                {k: e.to_dict()[k] for k in ("name", "state", "in_flight", "version", "tp")} for e in rec.engines
            ],
        }
        for rec in sorted(core.membership.agents.values(), key=lambda r: r.agent_id)
    ]
    names = core.training.names
    epochs = [
        {
            "dataset": names[dataset_of(key)],
            "epoch": epoch_of(key),
            "position": ep.cursor,
            "size": len(ep.order),
            "finished": ep.finished,
        }
        for key, ep in sorted(core.frontier.epochs.items())
    ]
    recent = [
        {
            "rollout_id": b.rollout_id,
            "age_s": round(now - b.at, 1),
            "wait_s": round(b.wait_s, 4),
            "groups": b.groups,
            "reward_mean": b.metrics.get("rollout/reward_mean"),
            "response_len_mean": b.metrics.get("rollout/response_len_mean"),
            "dropped_ratio": b.metrics.get("rollout/dynamic_filter/dropped_ratio"),
            "staleness_max": b.metrics.get("rollout/staleness_max"),
        }
        for b in c.recent
    ]
    return {
        "endpoint": server.endpoint,
        "dataset_size": core.dataset_size,
        "fleet": fleet,
        "frontier": {
            "epochs": epochs,
            "prompts": core.frontier.counts(),
            "leases_in_flight": len(core.leases),
            "leases_held": len(core.leases.held),
            "groups_ready": len(core.ready),
            "datasets": core.dataset_statistics(),  # not the whole statistics(): those build a record per agent
        },
        "batches": {
            "assembled": c.batches,
            "last_rollout_id": batches.last_rollout_id,
            "consumed_upto": batches.consumed_upto,
            "pending_generates": len(batches.pending),
            "trainer_wait_s": round(c.trainer_wait_s(now), 3),
            "recent": recent,
        },
        "receipts": {"accepted": c.receipts_accepted, "refused": c.receipts_refused},
        "registrations": {"new": c.registrations, "resent": c.registers_resent},
        "drops": dict(sorted(c.drops.items())),
        "weights": core.weights.statistics(now),
        "paused": core.trainer.paused,
        "starved": core.training.starvation.reason,
        "waiting_for_update": core.update_wait(),
        "gateways": server.io.statistics(now),
    }
