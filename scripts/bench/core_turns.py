#!/usr/bin/env python
"""The coordinator's pure core alone: CPU per receipt against the fleet's size and the turn's size.

In one process, with no socket and no ledger: ``--agents`` simulated agents (8 healthy engines
each) register, a trainer attaches and pulls batches of 1024 groups, and every granted lease is
answered with a Receipt, ``--turn`` receipts per core turn (``begin_turn``/``end_turn``, as the
server reads its socket). Every message in and out is msgpack-encoded, and each receipt decoded,
as the server does. It isolates the core's own cost per receipt and what a turn costs on top:
small turns are what a fleet at moderate load produces, one pump each, so a cost per pump that
grows with the fleet shows here first (at 1000 agents and turns of 1, a scan of every agent per
pump cost 510 us per receipt against 62 without).

Output: one JSON line per (agents, turn) pair; ``--profile`` prints a cProfile table instead.

    python scripts/bench/core_turns.py                        # agents 10,1000 x turns 1,8,64
    python scripts/bench/core_turns.py --agents 1000 --turns 1 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import protocol as p  # noqa: E402
from common.config import Liveness, RolloutConfig  # noqa: E402
from coordinator.core import CoordinatorCore, CoreSettings, Persist, Send  # noqa: E402

GROUP, BATCH, IN_FLIGHT = 8, 1024, 4096
ENGINES = [p.EngineInfo(f"e{i}", p.EngineState.HEALTHY, "http://sim") for i in range(8)]


class Fleet:
    """The core and everything around it that the server and the agents would do, in-process."""

    def __init__(self, agents: int):
        cfg = RolloutConfig(rollout_batch_size=BATCH, n_samples_per_prompt=GROUP, prefetch=IN_FLIGHT + 2 * BATCH)
        self.core = CoordinatorCore(CoreSettings(cfg, Liveness(1.0, 30.0, 60.0), (10_000_000,), "fp"), now=0.0)
        self.leases: deque = deque()  # (agent, session, lease) granted and not yet answered
        self.batches: list[int] = []
        self.receipts = 0
        slots = (IN_FLIGHT // agents + 1) * GROUP
        for i in range(agents):
            aid = f"n{i}"
            self.turn([(aid.encode(), p.Register(aid, 1, slots, f"tcp://{aid}:1", ENGINES, [], []))], 0.0)
        attached = self.core.handle(b"trainer", p.Attach(1, "bench"), 0.0)
        self.trainer = next(s for s in attached if isinstance(s, Send)).msg.result["session"]
        self.rollout, self.req = 0, 10
        self.run(self.core.handle(b"trainer", p.Generate(self.trainer, self.req, 0), 0.0))

    def run(self, effects: list) -> None:
        for eff in effects:
            for s in eff.then if isinstance(eff, Persist) else [eff]:
                p.encode(s.msg)
                if isinstance(s.msg, p.Grant):
                    self.leases.extend((s.to, s.msg.session, lease) for lease in s.msg.leases)
                elif isinstance(s.msg, p.BatchRefs):
                    self.batches.append(s.msg.rollout_id)

    def turn(self, messages: list, now: float) -> None:
        core = self.core
        core.begin_turn()
        for peer, msg in messages:
            self.run(core.handle(peer, msg, now))
        while self.batches:
            done = self.batches.pop()
            self.run(core.handle(b"trainer", p.Consumed(self.trainer, self.req + 1, done), now))
            self.rollout, self.req = self.rollout + 1, self.req + 2
            self.run(core.handle(b"trainer", p.Generate(self.trainer, self.req, self.rollout), now))
        self.run(core.end_turn(now))

    def receipts_turn(self, n: int, now: float) -> None:
        messages = []
        for _ in range(min(n, len(self.leases))):
            agent, session, lease = self.leases.popleft()
            key = f"{lease.data_epoch}:{lease.index}:{lease.lease:x}"
            stats = {"n_samples": GROUP, "reward_sum": 2.0}
            msg = p.Receipt(session, lease.lease, lease.data_epoch, lease.index, key, GROUP, stats)
            messages.append((agent.encode() if isinstance(agent, str) else agent, p.decode(p.encode(msg))))
        self.receipts += len(messages)
        self.turn(messages, now)


def measure(agents: int, turn: int, receipts: int, profile: bool) -> dict:
    fleet = Fleet(agents)
    now = 1.0

    def loop() -> None:
        nonlocal now
        while fleet.receipts < receipts:
            fleet.receipts_turn(turn, now)
            now += 0.001

    t0 = time.process_time()
    if profile:
        prof = cProfile.Profile()
        prof.runcall(loop)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    else:
        loop()
    cpu = time.process_time() - t0
    return {
        "bench": "core_turns",
        "metric": "core_cpu_us_per_receipt",
        "value": round(cpu / fleet.receipts * 1e6, 1),
        "unit": "us",
        "agents": agents,
        "turn": turn,
        "receipts": fleet.receipts,
        "batches": fleet.rollout,
        "profiled": profile,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="10,1000", help="comma-separated fleet sizes")
    ap.add_argument("--turns", default="1,8,64", help="comma-separated receipts per turn")
    ap.add_argument("--receipts", type=int, default=30_000, help="receipts per measurement")
    ap.add_argument("--profile", action="store_true", help="cProfile each measurement (stderr)")
    args = ap.parse_args(argv)
    for agents in (int(x) for x in args.agents.split(",")):
        for turn in (int(x) for x in args.turns.split(",")):
            print(json.dumps(measure(agents, turn, args.receipts, args.profile)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
