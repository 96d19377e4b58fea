"""The agent's Prometheus metrics, read at scrape time from what the agent already holds.

Served on the agent's own event loop (``common/observe_http.py``); a scrape
reads the session core's engine table and counters, the supervisor's restart
counts, the per-engine token counts the lease runners keep (one dict update
per answered ``/generate``), the weights executor's version and the store's
LMDB meta pages. Nothing is computed between scrapes, and reading changes
nothing.

Every series carries ``agent`` (this node's id); per-engine ones ``engine`` too:

    agent_engine_up{engine}                      1 while healthy (in the pool)
    agent_engine_state{engine,state}             1 for the engine's current state
    agent_engine_restarts_total{engine}          relaunches since the agent started
    agent_engine_in_flight_samples{engine}       samples sent and not answered
    agent_engine_generated_tokens_total{engine}  completion tokens answered (rate() = tokens/s)
    agent_engine_weight_version{engine}          the version it serves (absent while unknown)
    agent_generated_tokens_total                 all engines together
    agent_groups_total{outcome}                  committed, filtered, released
    agent_samples_total, agent_engine_retries_total
    agent_leases_in_flight, agent_capacity_samples, agent_connected
    agent_store_groups, agent_store_bytes
    agent_weight_version                         the fleet version this agent holds
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agent.session import Phase
from common.engine_info import EngineState

if TYPE_CHECKING:
    from agent.session import AgentSession
    from agent.store import GroupStore
    from agent.supervisor import EngineSupervisor
    from agent.weights import WeightsExecutor


class Observed(Protocol):
    """What the metrics read of a running agent: agent/worker.py's ``Agent``, which imports this module."""

    agent_id: str
    session: AgentSession
    store: GroupStore
    supervisor: EngineSupervisor
    weights: WeightsExecutor
    tokens: dict[str, int]


class AgentCollector:
    def __init__(self, agent: Observed):
        self.agent = agent

    def _family(self, kind, name: str, doc: str, *labels: str):
        return kind(f"rollfleet_agent_{name}", doc, labels=["agent", *labels])

    def collect(self):
        agent = self.agent
        me = agent.agent_id
        session = agent.session
        engines = session.engines()
        restarts = agent.supervisor.restarts()
        tokens = agent.tokens
        up = self._family(GaugeMetricFamily, "engine_up", "1 while the engine is healthy (in the pool)", "engine")
        state = self._family(GaugeMetricFamily, "engine_state", "1 for the engine's current state", "engine", "state")
        rst = self._family(CounterMetricFamily, "engine_restarts", "Engine relaunches", "engine")
        inflight = self._family(GaugeMetricFamily, "engine_in_flight_samples", "Samples sent, unanswered", "engine")
        tok = self._family(CounterMetricFamily, "engine_generated_tokens", "Completion tokens answered", "engine")
        ver = self._family(GaugeMetricFamily, "engine_weight_version", "Weight version the engine serves", "engine")
        for e in engines:
            name = e.name
            up.add_metric([me, name], float(e.serving))
            for s in EngineState:
                state.add_metric([me, name, s.value], float(e.state is s))
            rst.add_metric([me, name], restarts.get(name, 0))
            inflight.add_metric([me, name], e.in_flight)
            tok.add_metric([me, name], tokens.get(name, 0))
            if e.version is not None:
                ver.add_metric([me, name], e.version)
        yield from (up, state, rst, inflight, tok, ver)
        total = self._family(CounterMetricFamily, "generated_tokens", "Completion tokens answered, all engines")
        total.add_metric([me], sum(tokens.values()))
        yield total
        c = session.counters
        groups = self._family(CounterMetricFamily, "groups", "Groups finished, by outcome", "outcome")
        for outcome, n in (
            ("committed", c.groups_committed),
            ("filtered", c.groups_filtered),
            ("released", c.groups_released),
            ("evaluated", c.groups_evaluated),
        ):
            groups.add_metric([me, outcome], n)
        yield groups
        for kind, name, doc, value in (
            (CounterMetricFamily, "samples", "Samples generated into groups", c.samples),
            (CounterMetricFamily, "engine_retries", "Groups moved to another engine after a failure", c.engine_retries),
            (GaugeMetricFamily, "leases_in_flight", "Leases this agent holds", len(session.leases)),
            (GaugeMetricFamily, "capacity_samples", "Samples the healthy engines may run at once", session.capacity()),
            (GaugeMetricFamily, "connected", "1 while registered with the coordinator", session.phase is Phase.ACTIVE),
        ):
            family = self._family(kind, name, doc)
            family.add_metric([me], float(value))
            yield family
        stored, size = agent.store.usage()
        for name, doc, value in (
            ("store_groups", "Groups in the agent's store", stored),
            ("store_bytes", "Bytes of the store's LMDB in use", size),
            ("weight_version", "The fleet weight version this agent holds", agent.weights.current.version),
        ):
            family = self._family(GaugeMetricFamily, name, doc)
            family.add_metric([me], float(value or 0))
            yield family
