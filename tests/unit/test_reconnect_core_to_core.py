"""Re-registration after an outage, the real agent core wired to the real coordinator core (no sockets).

``AgentSession`` (agent/session.py) and ``CoordinatorCore`` (coordinator/core.py) exchange their messages
directly; the test plays both shells: it starts leases' runners, answers ``EngineWanted`` and ends
generations, and drops every message while the link is cut. At the moment of the reconnect the agent holds
a lease in each state a lease can be in (starting, waiting for an engine, generating, retrying after an engine
failure, scoring, committing); its ``Register.in_flight`` must list every one, so the coordinator keeps them all
for it. Afterwards no prompt is granted a second time and every group is accepted: a lease left out of
``in_flight`` would go back to pending, be granted again, and one of its two groups be refused as a duplicate
(issue 39).
"""

from __future__ import annotations

from agent.events import (
    AssignEngine,
    Connected,
    EngineChanged,
    EngineFailed,
    EnginesStarted,
    EngineWanted,
    GenerationEnded,
    LeaseCommitted,
    LeaseScored,
    MessageReceived,
    PendingReceipt,
    Reconnect,
    Send,
    StartLease,
    Tick,
)
from agent.leases import LeaseState
from agent.session import AgentSession, Phase
from common import protocol as p
from common.config import Liveness, RolloutConfig
from coordinator.core import CoordinatorCore, CoreSettings
from coordinator.effects import Persist

N = 4  # samples per prompt
LEASES = 6


class Link:
    """The two cores and the messages between them; ``cut`` drops every message, both ways."""

    def __init__(self):
        cfg = RolloutConfig(rollout_batch_size=LEASES, n_samples_per_prompt=N, prefetch=LEASES)
        self.core = CoordinatorCore(CoreSettings(cfg, Liveness(0.25, 3.0, 30.0), (40,), "fp"), now=0.0)
        self.agent = AgentSession(
            agent_id="a1",
            incarnation=1,
            payload_address="tcp://a1:7000",
            concurrency_per_engine=LEASES * N,
            coordinator="tcp://c:5555",
            dataset_fingerprint="fp",
            dataset_size=40,
        )
        self.cut = False
        self.now = 0.0
        self.started: list[int] = []  # leases whose runner the agent started (StartLease), in order
        self.granted: list[tuple[int, int, int]] = []  # every (lease, data_epoch, index) granted
        self.acks: list[p.ReceiptAck] = []
        self.assigned: dict[int, AssignEngine] = {}
        self.registers: list[p.Register] = []  # every Register the agent sent, delivered or not
        self.on_agent(self.agent.handle(EnginesStarted((("e0", "http://e0"),)), 0.0))

    def on_agent(self, instructions: list) -> None:
        """Carry out the agent core's instructions: messages to the coordinator, runners started, engines given."""
        for ins in instructions:
            if isinstance(ins, Send):
                if isinstance(ins.msg, p.Register):
                    self.registers.append(ins.msg)
                if not self.cut:
                    self.on_core(self.core.handle(b"a1", ins.msg, self.now))
            elif isinstance(ins, StartLease):
                self.started.append(ins.lease)
            elif isinstance(ins, AssignEngine):
                self.assigned[ins.lease] = ins

    def on_core(self, effects: list) -> None:
        """Deliver the coordinator core's messages to the agent (a ledger write is taken as done at once)."""
        for effect in effects:
            for send in effect.then if isinstance(effect, Persist) else [effect]:
                if send.to not in ("a1", b"a1") or self.cut:
                    continue
                if isinstance(send.msg, p.Grant):
                    self.granted += [(g.lease, g.data_epoch, g.index) for g in send.msg.leases]
                if isinstance(send.msg, p.ReceiptAck):
                    self.acks.append(send.msg)
                self.on_agent(self.agent.handle(MessageReceived(send.msg), self.now))

    def event(self, ev) -> None:
        self.on_agent(self.agent.handle(ev, self.now))

    def advance(self, to: float) -> None:
        """Time passes in small steps: both clocks tick and the coordinator sends its heartbeats."""
        while self.now < to:
            self.now = min(to, self.now + 0.25)
            self.on_core(self.core.tick(self.now) + self.core.heartbeats())
            if self.now >= self.agent.next_tick_at:
                out = self.agent.handle(Tick(), self.now)
                self.on_agent(out)
                if any(isinstance(i, Reconnect) for i in out) and not self.cut:
                    self.event(Connected((), ()))

    def finish(self, lease: int) -> None:
        """The lease's group is generated, scored and committed (its runner's events, in order)."""
        rec = self.agent.leases.get(lease)
        if rec.state is not LeaseState.GENERATING:
            self.event(EngineWanted(lease))
        self.event(GenerationEnded(lease))
        self.commit(lease)

    def commit(self, lease: int) -> None:
        rec = self.agent.leases.get(lease)
        if rec.state is not LeaseState.COMMITTING:
            self.event(LeaseScored(lease, N))
        key = f"{rec.data_epoch}:{rec.index}:{lease:x}"
        self.event(LeaseCommitted(lease, PendingReceipt(lease, rec.data_epoch, rec.index, key, N, {"n_samples": N})))


def states(link: Link) -> dict[int, LeaseState]:
    return {rec.lease: rec.state for rec in link.agent.leases.records()}


def test_a_reconnect_keeps_a_lease_in_every_state_and_no_prompt_is_made_twice():
    link = Link()
    link.event(Connected((), ()))
    assert link.agent.phase is Phase.ACTIVE and len(link.started) == LEASES, link.started
    starting, waiting, generating, retrying, scoring, committing = link.started
    for lease in (generating, retrying, scoring, committing):
        link.event(EngineWanted(lease))
    link.event(GenerationEnded(scoring))
    link.event(GenerationEnded(committing))
    link.event(LeaseScored(committing, N))
    link.event(EngineFailed(retrying, "connection refused"))  # e0 leaves the pool: nothing may start
    link.event(EngineWanted(waiting))
    expected = {
        starting: LeaseState.STARTING,
        waiting: LeaseState.WAITING,
        generating: LeaseState.GENERATING,
        retrying: LeaseState.RETRYING,
        scoring: LeaseState.SCORING,
        committing: LeaseState.COMMITTING,
    }
    assert states(link) == expected

    # The link is cut past both TTLs: the coordinator presumes the agent dead and holds its leases; the agent
    # gives its session up. Nothing the agent holds has moved meanwhile.
    link.cut = True
    link.advance(4.0)
    assert link.agent.phase is Phase.DISCONNECTED and len(link.core.leases.held) == LEASES
    assert states(link) == expected
    link.cut = False
    link.event(Connected((), ()))
    prompt_of = {lease: [epoch, index] for lease, epoch, index in link.granted}
    assert sorted(link.registers[-1].in_flight) == sorted([lease, *prompt_of[lease]] for lease in expected)
    assert link.agent.phase is Phase.ACTIVE and not link.core.leases.held
    assert sorted(link.core.leases.leases) == sorted(expected), "the coordinator kept every lease for it"

    # The engine comes back; every lease runs to its end, and so does every lease granted after.
    link.event(EngineChanged("e0", "healthy", "http://e0"))
    for lease in (generating, retrying, waiting, starting, scoring):
        link.finish(lease)
    link.commit(committing)
    while len(link.started) > len({a.key for a in link.acks}):
        for lease in [rec.lease for rec in link.agent.leases.records()]:
            link.finish(lease)
    prompts = [(epoch, index) for _, epoch, index in link.granted]
    assert len(prompts) == len(set(prompts)), "a prompt was granted twice"
    assert link.acks and all(ack.accepted for ack in link.acks), [a for a in link.acks if not a.accepted]
    assert link.core.counters.receipts_refused == 0
    assert {a.lease for a in link.acks} >= set(expected)
