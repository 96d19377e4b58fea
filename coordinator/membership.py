"""Fleet membership: which agents are alive, what they hold, and their fencing sessions.

An agent moves ALIVE -> DEAD (silent past the TTL: its leases go back to
pending) -> RETIRED (silent past ``retire_after``: its capacity and its
unfetched payloads leave the pool for good). A DEAD agent that speaks again
is fenced: its session is void, it must register again, and what it reports
then is reconciled against the ledger.

Sessions are fencing tokens: ``generation << 32 | counter``, where the
generation is bumped (durably) at every coordinator start, so a session
issued before a restart can never match one issued after it.

Pure: no I/O; time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALIVE, DEAD, RETIRED = "alive", "dead", "retired"


@dataclass
class AgentRecord:
    agent_id: str
    session: int
    incarnation: int
    peer: bytes
    capacity: int
    payload_address: str
    engines: list
    last_seen: float
    status: str = ALIVE
    leases: set[int] = field(default_factory=set)
    max_granted: int = 0
    """Highest lease id granted to this session (sent back in heartbeats)."""
    local_dataset: bool = False
    """The agent reads prompts from its own replica; grants carry indices only."""

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.leases)) if self.status == ALIVE else 0

    @property
    def usable(self) -> bool:
        """Alive with at least one engine that is not retired."""
        if self.status != ALIVE:
            return False
        return any(e.get("state") != "retired" for e in self.engines) if self.engines else self.capacity > 0


class Membership:
    def __init__(self, generation: int):
        self.generation = generation
        self._counter = 0
        self.agents: dict[str, AgentRecord] = {}
        self._by_session: dict[int, AgentRecord] = {}
        self._rr = 0

    def new_session(self) -> int:
        self._counter += 1
        return (self.generation << 32) | self._counter

    def register(
        self,
        agent_id: str,
        incarnation: int,
        peer: bytes,
        capacity: int,
        payload_address: str,
        engines: list,
        now: float,
    ) -> AgentRecord:
        old = self.agents.get(agent_id)
        if old is not None:
            self._by_session.pop(old.session, None)
        rec = AgentRecord(agent_id, self.new_session(), incarnation, peer, capacity, payload_address, engines, now)
        self.agents[agent_id] = rec
        self._by_session[rec.session] = rec
        return rec

    def placeholder(self, agent_id: str, now: float) -> None:
        """An agent known only from the ledger (after a restart): presumed dead until it registers."""
        if agent_id not in self.agents:
            self.agents[agent_id] = AgentRecord(agent_id, 0, 0, b"", 0, "", [], now, status=DEAD)

    def by_session(self, session: int) -> AgentRecord | None:
        rec = self._by_session.get(session)
        return rec if rec is not None and rec.status == ALIVE else None

    def expire(self, now: float, ttl: float, retire_after: float) -> tuple[list[AgentRecord], list[AgentRecord]]:
        """Agents newly presumed dead and newly retired at ``now``."""
        dead, retired = [], []
        for rec in self.agents.values():
            silent = now - rec.last_seen
            if rec.status == ALIVE and silent > ttl:
                rec.status = DEAD
                self._by_session.pop(rec.session, None)
                dead.append(rec)
            if rec.status == DEAD and silent > retire_after:
                rec.status = RETIRED
                retired.append(rec)
        return dead, retired

    def alive(self) -> list[AgentRecord]:
        return [r for r in self.agents.values() if r.status == ALIVE]

    def all_gone(self) -> bool:
        """Agents have joined, and none of them can generate any more."""
        return bool(self.agents) and all(
            r.status == RETIRED or (r.status == ALIVE and not r.usable) for r in self.agents.values()
        )

    def distribute(self, budget: int) -> dict[str, int]:
        """Split ``budget`` new leases over agents by free capacity, round robin.

        O(agents) per call: each pass hands every agent with room an equal
        share (at least one), starting from a rotating offset.
        """
        out: dict[str, int] = {}
        free = {r.agent_id: r.free for r in self.agents.values() if r.free > 0}
        if not free or budget <= 0:
            return out
        order = list(free)
        start = self._rr % len(order)
        self._rr += 1
        order = order[start:] + order[:start]
        while budget > 0 and order:
            share = max(1, budget // len(order))
            still = []
            for agent_id in order:
                if budget <= 0:
                    break
                n = min(share, free[agent_id], budget)
                out[agent_id] = out.get(agent_id, 0) + n
                free[agent_id] -= n
                budget -= n
                if free[agent_id] > 0:
                    still.append(agent_id)
            order = still
        return out
