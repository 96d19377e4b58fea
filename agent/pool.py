"""The agent's generation pool: which engine runs the next group, and how much fits.

Pure (no I/O): the agent tells it which engines are healthy and when a
group starts and ends; it answers with the engine to use and the node's
capacity.

- Capacity is the node's total engine concurrency in samples; the
  coordinator leases ``capacity // n_samples_per_prompt`` groups to the node,
  so the pool itself never has to queue groups.
- Concurrency is samples sent, not the engine's slots: a group keeps its
  share until its longest sample ends, so with concurrency equal to the
  engine's ``max_running_requests`` a long tail leaves most slots idle
  (lognormal lengths with sigma 1.0: utilisation at most 0.33). Sending about
  4x the slots lets the engine's own queue refill each slot the moment it
  frees (scripts/bench/w2_long_tail.py: 1.000), at the price of queueing in
  a group's latency.
- All samples of a group go to one engine, so its prompt prefix is cached
  once (radix cache), and the least-loaded healthy engine gets the group.
- An engine that goes down stops receiving groups at once; groups that were
  on it are retried by the agent on another engine (nothing lost).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineSlot:
    name: str
    url: str
    concurrency: int
    healthy: bool = True
    in_flight: int = 0  # samples


class GenerationPool:
    def __init__(self, concurrency_per_engine: int):
        if concurrency_per_engine < 1:
            raise ValueError(f"engine concurrency must be >= 1, got {concurrency_per_engine}")
        self.concurrency_per_engine = concurrency_per_engine
        self.engines: dict[str, EngineSlot] = {}

    def set_engine(self, name: str, url: str | None, healthy: bool) -> bool:
        """Record an engine's state; returns True if the node's capacity changed."""
        before = self.capacity()
        slot = self.engines.get(name)
        if slot is None:
            slot = self.engines[name] = EngineSlot(name, url or "", self.concurrency_per_engine, healthy)
        slot.healthy = healthy
        if url:
            slot.url = url
        return self.capacity() != before

    def capacity(self) -> int:
        return sum(e.concurrency for e in self.engines.values() if e.healthy)

    def pick(self) -> EngineSlot | None:
        """The healthy engine with the most free slots, or None if none is healthy."""
        best = None
        for e in self.engines.values():
            if e.healthy and (best is None or e.concurrency - e.in_flight > best.concurrency - best.in_flight):
                best = e
        return best

    def start(self, slot: EngineSlot, samples: int) -> None:
        slot.in_flight += samples

    def finish(self, slot: EngineSlot, samples: int) -> None:
        slot.in_flight = max(0, slot.in_flight - samples)
