"""Fleet membership: which agents are alive, what they hold, and their fencing sessions.

An agent moves ALIVE -> DEAD (silent past the TTL: its leases go back to
pending) -> RETIRED (silent past ``retire_after``: its capacity and its
unfetched payloads leave the pool for good). A DEAD agent that speaks again
is fenced: its session is void, it must register again, and what it reports
then is reconciled against the ledger.

One registration per attempt: a Register resent while unanswered (same agent
id, incarnation and ``req``) while the session it made is still current is the
same request and gets the same session (``same_registration``); a partition
that delays several resends to the heal makes one session, not one per copy.

Sessions are fencing tokens: ``generation << 32 | counter``, where the
generation is bumped (durably) at every coordinator start, so a session
issued before a restart can never match one issued after it.

Each agent's engines are the typed records it last reported (``EngineInfo``: Register,
Capacity, heartbeats); the status shows them as they came.

Pure: no I/O; time is passed in.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from common.engine_info import EngineInfo, EngineState

ALIVE, DEAD, RETIRED = "alive", "dead", "retired"


@dataclass
class AgentRecord:
    agent_id: str
    session: int
    incarnation: int
    peer: bytes
    capacity: int
    payload_address: str
    engines: list[EngineInfo]
    """As the agent last reported them."""
    last_seen: float
    status: str = ALIVE
    leases: set[int] = field(default_factory=set)
    max_granted: int = 0
    """Highest lease id granted to this session (sent back in heartbeats)."""
    local_dataset: bool = False
    """The agent reads prompts from its own replica; grants carry indices only."""
    register_req: int = 0
    """``Register.req`` of the registration that made this session (0: none)."""
    welcome: Any = None
    """The Welcome that answered it: a resend of that Register (same incarnation and req, the
    session still current) is answered with it again instead of a new session."""

    def same_registration(self, incarnation: int, req: int) -> bool:
        """``Register(incarnation, req)`` is a resend of the one that made this (current) session."""
        return (
            bool(req)
            and self.status == ALIVE
            and self.welcome is not None
            and (self.incarnation, self.register_req) == (incarnation, req)
        )

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.leases)) if self.status == ALIVE else 0

    @property
    def usable(self) -> bool:
        """Alive with at least one engine that is not retired."""
        if self.status != ALIVE:
            return False
        return any(e.state is not EngineState.RETIRED for e in self.engines) if self.engines else self.capacity > 0

    def note_versions(self, versions: dict) -> None:
        """Engines (by name) now serving these weight versions, as a weight update's report says: the status shows
        the new version at once, not at the agent's next heartbeat."""
        self.engines = [
            dataclasses.replace(e, version=versions[e.name]) if e.name in versions else e for e in self.engines
        ]


class Membership:
    def __init__(self, generation: int):
        self.generation = generation
        self._counter = 0
        self.agents: dict[str, AgentRecord] = {}
        self._by_session: dict[int, AgentRecord] = {}
        self._witness: dict[str, str] = {}
        self.room: OrderedDict[str, None] = OrderedDict()
        """Agents that may have free capacity, in grant order (the longest without a grant first).
        ``distribute`` checks each one it reaches and drops the full ones; ``note_room`` adds an
        agent whose capacity may have grown (a lease ended, a Capacity, a registration);
        ``refresh_room`` (the clock) re-adds any that was missed. Free capacity is never found by
        scanning the fleet, so a pump costs what it grants, not the number of agents. An
        OrderedDict (a linked list): removing at the front leaves no holes to skip."""

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
        engines: list[EngineInfo],
        now: float,
    ) -> AgentRecord:
        old = self.agents.get(agent_id)
        if old is not None:
            self._by_session.pop(old.session, None)
        rec = AgentRecord(agent_id, self.new_session(), incarnation, peer, capacity, payload_address, engines, now)
        self.agents[agent_id] = rec
        self._by_session[rec.session] = rec
        self.note_room(rec)
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

    def find(self, name: str, pred) -> AgentRecord | None:
        """An agent for which ``pred`` holds, or None: the one found under ``name`` last time while
        it still qualifies, else by a scan. Fleet-wide "is there any ..." questions asked on every
        pump cost O(1) while the answer stays yes."""
        agent_id = self._witness.get(name)
        rec = self.agents.get(agent_id) if agent_id is not None else None
        if rec is not None and pred(rec):
            return rec
        for rec in self.agents.values():
            if pred(rec):
                self._witness[name] = rec.agent_id
                return rec
        self._witness.pop(name, None)
        return None

    def all_gone(self) -> bool:
        """Agents have joined, and none of them can generate any more (each retired, or alive with no usable
        engine)."""
        may_generate = lambda r: r.status == DEAD or (r.status == ALIVE and r.usable)  # noqa: E731
        return bool(self.agents) and self.find("may_generate", may_generate) is None

    def note_room(self, rec: AgentRecord) -> None:
        if rec.agent_id not in self.room and rec.free > 0:
            self.room[rec.agent_id] = None

    def refresh_room(self) -> None:
        """Every agent with free capacity is in ``room`` (O(agents); the clock runs it)."""
        for rec in self.agents.values():
            self.note_room(rec)

    def distribute(self, budget: int) -> dict[str, int]:
        """Split ``budget`` new leases over agents with free capacity, round robin.

        Each pass hands the first ``budget`` agents in ``room`` an equal share (at least one)
        and sends each to the back of the line while it has room left. The work is
        O(leases granted + full agents met), whatever the size of the fleet.
        """
        out: dict[str, int] = {}
        room, agents = self.room, self.agents
        while budget > 0 and room:
            batch = list(islice(room, budget))
            share = max(1, budget // len(batch))
            for agent_id in batch:
                rec = agents.get(agent_id)
                left = (rec.free if rec is not None else 0) - out.get(agent_id, 0)
                del room[agent_id]
                if left <= 0:
                    continue
                n = min(share, left, budget)
                out[agent_id] = out.get(agent_id, 0) + n
                budget -= n
                if left > n:
                    room[agent_id] = None
                if budget <= 0:
                    break
        return out
