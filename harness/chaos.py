"""The chaos run: every kind of failure, while batches flow; then quiesce and check the invariants.

Used by ``tests/cluster/test_chaos.py`` (bounded, in CI) and ``scripts/chaos.py``
(long runs). A trainer process (``harness/chaos_trainer.py``) pulls batches and
checkpoints; agents run two sim engines each, and one agent reaches the
coordinator through a ``TcpProxy``. The schedule causes, each at least once
and early (a shuffled plan), then at random:

    agent        SIGKILL an agent process, restart it on the same data dir
    engine       SIGKILL one live engine of an agent (its supervisor restarts it)
    coordinator  SIGKILL the coordinator, restart it on the same ledger
    trainer      SIGKILL the trainer; it resumes from its last checkpoint
    partition    cut the proxied agent's coordinator link until the coordinator
                 presumes it dead (longer than the agent TTL), then heal it
    node_lost    SIGKILL an agent and never restart it: the coordinator retires
                 it (short ``--retire-after``) and its unfetched groups are
                 generated again elsewhere
    node_join    start one more agent mid-run: after a broadcast its engines come
                 up behind the fleet's version and the trainer catches them up
    gateway      SIGKILL one of the coordinator's gateway processes (the run's
                 coordinator has ``gateways`` of them, 2 by default): its peers
                 redial and land on another or on its successor, which the
                 coordinator must have started within ``GATEWAY_RESTART_S``
    disk_full    fill the disk under one agent's data dir (a tmpfs of its own,
                 where the run may mount one: root) while it generates, leaving
                 no page or one page, so that its next commit meets LMDB's ENOSPC
                 or EIO (that agent runs without the free-space check, as if the
                 disk filled between the check and the commit); it must stop with
                 its one line, exit 1 and charge nothing to a prompt; then the
                 filler goes and it restarts on the same data dir. Drawn at
                 random, not required of every run: the agent meets its full disk
                 only if it commits while the disk is full, which a loaded machine
                 (a trainer behind, its engine restarting) may not give it

and, with weight updates, faults timed to one in flight (the coordinator's weight
lock held, read from its status every 10 ms):

    engine_in_update   SIGKILL an engine while an update runs (inside a
                       broadcast's begin, group, buckets or finish, a disk load)
    trainer_in_update  SIGKILL the trainer inside its own broadcast; it resumes

Meanwhile the trainer pushes a weight update every few batches (``--weights-every``),
alternating disk updates and gloo broadcasts, and catches up engines behind a
broadcast; one that fails under chaos is allowed and retried later, never hung on,
and the summary gives each failure's cause and the faults that fell inside it.

A failure counts only when it happened: a live pid was signalled, a partition
was seen by the coordinator. After the trainer's last batch the fleet is
quiesced (survivors registered, the lost node retired, a few more batches if
prompts that came back to pending are still behind the cursor, admission
paused, no lease in flight and no weight lock, the coordinator's counts steady),
its statistics and every serving engine's weight version taken, every process
stopped, and ``harness.chaos_check.check`` compares the consumed stream, the
weight updates, those statistics and versions, the ledger and every agent's
store. A run that missed a failure kind, or broke an invariant, lists it in
``problems``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from common import faults
from common.demo_data import write_arithmetic_dataset
from common.errors import NoCapacity
from coordinator.ledger import read_ledger
from harness.chaos_check import KINDS, SOURCES, WEIGHT_FAULTS, Findings, RunEvidence, batch_record, check
from harness.chaos_eval import eval_flag
from harness.chaos_evidence import (
    pending_behind_cursor,
    read_consumed,
    read_engine_versions,
    read_store,
    serving_engines,
    unfetched_by_agent,
)
from harness.chaos_trainer import rescue_from_disk
from harness.cluster import ROOT, Cluster, running_child
from harness.polling import wait_for
from harness.proxy import TcpProxy
from harness.small_disk import PAGE, DiskUnavailable, fill, small_disk, unfill

SIM_ARGS = "--token-latency-ms 2 --output-len-median 24 --output-len-max 64 --weight-sync-timeout 5 --preload-torch"
"""``--preload-torch``: engines come up with torch loaded, as SGLang's do; otherwise a fresh engine's first disk load
or rendezvous pays the import (seconds on loaded cores), and a node that joins during a disk update holds it
past its deadline."""
UPDATE_TIMEOUT = 15.0
"""A weight update's deadline. A failed update gives the fleet back at once (an engine lost in it aborts it,
the trainer closes its rendezvous); the deadline is for updates that are only slow, as every step is on two
loaded cores while agents, engines and the coordinator restart around it: not so short that slowness alone
fails one."""
ROWS, EXACT_ROWS, BATCH_SIZE = 600, 300, 4
ENGINES, CONCURRENCY = 2, 8  # per agent; concurrency is per engine: 16 samples = 4 groups per agent
TTL = 1.5  # the cluster's --agent-ttl
RETIRE_AFTER = 8.0
"""Long enough for a killed agent to restart and a partition to heal, short enough to retire a lost node."""
MAX_RESTARTS = 1000
"""Each agent's engine restart budget (``--max-restarts``, default 3 per 10 minutes): the schedule kills engines
far more often than any fleet sees, and an engine retired for it would end a long run in ``NoCapacity`` (every
engine retired). Retirement has its own tests (``test_faults_agent.py``)."""
GATEWAY_RESTART_S = 10.0
"""A SIGKILLed gateway's successor reports within this long (its first restart is immediate)."""
RANDOM_KINDS = ("agent", "agent", "engine", "engine", "hang", "coordinator", "partition", "trainer")
RANDOM_WEIGHT_FAULTS = ("engine_in_update", "engine_in_update", "trainer_in_update")
"""Added to ``RANDOM_KINDS`` when the run pushes weights."""
STALL = 300.0
"""Seconds without a consumed batch after which the run counts as hung."""
LOCK_WAIT = 20.0
"""How long a fault timed to an update waits for one to be in flight before it gives up (not counted)."""
DISK_SIZE = "64m"
"""The tmpfs under the full-disk agent's data dir (its store and its engines' logs)."""
DISK_FULL_WAIT = 15.0
"""How long the full-disk agent has to meet its full disk (its next commit) and stop; if it committed nothing
meanwhile, the filler goes and the fault did not happen (not counted)."""
DISK_FULL_GRACE = 10.0
"""How long past the filler's removal an agent still may stop on the full disk it met just before."""
DISK_FULL_LINE = "agent: error: the disk under agent store "


@dataclass
class ChaosReport(Findings):
    actions: list = field(default_factory=list)
    """``(seconds since start, kind, target, batches consumed)`` per failure caused."""
    kills: Counter = field(default_factory=Counter)
    """Failures caused, by kind."""
    kinds: tuple[str, ...] = ()
    """The failure kinds this run had to cause, each at least once."""
    extra_batches: int = 0
    """Batches pulled at quiesce, after the trainer's, to settle prompts back to pending behind the cursor."""


class ChaosRun:
    def __init__(
        self,
        workdir: Path,
        *,
        batches: int = 30,
        agents: int = 3,
        seed: int = 0,
        interval: tuple[float, float] = (0.5, 1.5),
        weights_every: int = 3,
        log=print,
        generate: str = "",
        evaluate_every: int = 0,
        gateways: int = 2,
    ):
        if agents < 3:
            raise ValueError("the chaos run needs 3 agents: one behind the proxy, one lost for good, one more")
        self.workdir = workdir
        self.batches = batches
        self.rng = random.Random(seed)
        self.interval = interval
        self.log = log
        # Two training datasets with their own rewards (the second without a filter): every batch holds two
        # groups of each, whatever the faults.
        arith = write_arithmetic_dataset(workdir / "arith.jsonl", ROWS)
        exact = write_arithmetic_dataset(workdir / "exact.jsonl", EXACT_ROWS, seed=7)
        self.cluster = Cluster(
            workdir,
            datasets=[f"arith={arith},weight=1", f"exact={exact},weight=1,reward=exact,filter=none"],
            rollout_batch_size=BATCH_SIZE,
            n_samples_per_prompt=4,
            max_new_tokens=48,
            gateways=gateways,
        )
        self.names = [f"agent-{i}" for i in range(agents)]
        self.proxied = self.names[0]
        self.disk_agent = self.names[-1]  # on a small disk of its own, which disk_full fills
        self._mounts = contextlib.ExitStack()
        try:
            self.disk: Path | None = self._mounts.enter_context(small_disk(workdir / self.disk_agent, DISK_SIZE))
        except DiskUnavailable as exc:
            log(f"chaos: no disk_full fault in this run: {exc}")
            self.disk = None
        self.proxy: TcpProxy | None = None
        self.lost: set[str] = set()
        self.consumed = workdir / "consumed.jsonl"
        self.ckpt = workdir / "checkpoint.json"
        self.weights_every = weights_every
        self.generate = generate  # a custom generate function for every sample (e.g. multi-turn), or ""
        self.evaluate_every = evaluate_every  # an evaluation pass every K batches (harness/chaos_eval.py)
        self.weights_log = workdir / "weights.jsonl"
        torch = importlib.util.find_spec("torch") is not None  # the trainer broadcasts only with it
        self.with_torch = torch
        self.weight_kinds = () if not weights_every else ("disk", "distributed") if torch else ("disk",)
        weight_faults = () if not weights_every else WEIGHT_FAULTS if torch else WEIGHT_FAULTS[:1]
        gateway = ("gateway",) if gateways else ()
        disk = ("disk_full",) if self.disk is not None else ()
        self.kinds = KINDS + gateway + weight_faults
        self.random_kinds = RANDOM_KINDS + gateway + disk + tuple(k for k in RANDOM_WEIGHT_FAULTS if k in weight_faults)
        self.joined: list[str] = []
        self.engine_versions: dict[str, str | None] = {}
        self.trainer: subprocess.Popen | None = None
        self.trainer_runs = 0
        self.trainer_killed_at = -(10**9)
        self.report = ChaosReport(kinds=self.kinds)
        self.extra_batches = 0  # pulled at quiesce to settle every prompt behind the cursor
        self.never_reissued: set[tuple[int, int]] = set()
        self.stuck: list[str] = []  # seen while the schedule ran: a dead agent still holding leases
        self.started = time.monotonic()
        self.started_wall = time.time()  # the trainer logs its updates in wall-clock time
        self.hit_at = self.started

    # ------------------------------------------------------------ processes

    def start_coordinator(self) -> None:
        extra = ["--generate", self.generate] if self.generate else []
        extra += eval_flag(self.workdir) if self.evaluate_every else []
        self.cluster.start_coordinator("--retire-after", str(RETIRE_AFTER), *extra)

    def start_agent(self, name: str, wait: bool = True) -> None:
        via = self.proxy.address if name == self.proxied else None
        unchecked = name == self.disk_agent and self.disk is not None  # its commits meet the full disk in LMDB
        with _environ({faults.ENV: "no_space_check=1"} if unchecked else {}):
            self.cluster.start_agent(
                name,
                "--max-restarts",
                str(MAX_RESTARTS),
                engines=ENGINES,
                concurrency=CONCURRENCY,
                sim_args=SIM_ARGS,
                wait=wait,
                coordinator=via,
            )

    def start_trainer(self) -> None:
        resume = self.trainer_runs > 0
        self.trainer_runs += 1
        self.trainer_log = self.workdir / f"trainer-{self.trainer_runs}.log"
        flags = {
            "coordinator": self.cluster.address,
            "batches": self.batches,
            "consumed": self.consumed,
            "checkpoint": self.ckpt,
            "checkpoint-every": 4,
            "weights-every": self.weights_every,
            "weights-dir": self.workdir / "weights",
            "weights-log": self.weights_log,
            "update-timeout": UPDATE_TIMEOUT,
            "evaluate-every": self.evaluate_every,
            "eval-log": self.workdir / "evaluations.jsonl",
        }
        argv = [sys.executable, "-m", "harness.chaos_trainer"] + [
            x for k, v in flags.items() for x in (f"--{k}", str(v))
        ]
        argv += ["--resume"] if resume else []
        with open(self.trainer_log, "ab") as out:
            self.trainer = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )

    def n_consumed(self) -> int:
        """Distinct batches the trainer has returned so far (a batch fetched again after a resume counts once)."""
        return len({rec["rid"] for rec in read_consumed(self.consumed)})

    def survivors(self) -> list[str]:
        return [n for n in self.names if n not in self.lost]

    def live_agents(self) -> list[str]:
        return [n for n in self.survivors() if self.cluster.agents[n].alive()]

    def live_engines(self, name: str) -> list[int]:
        """Engine pids of ``name``'s current process that are running (not exited, not someone else's)."""
        parent = self.cluster.agents[name].pid
        return [pid for pid in self.cluster.engine_pids_of(name) if running_child(pid, parent)]

    def unfetched(self) -> Counter:
        try:
            return unfetched_by_agent(read_ledger(self.cluster.tmp / "coordinator"))
        except lmdb.Error:
            return Counter()

    def agent_status(self, name: str) -> str | None:
        try:
            entry = self.cluster.status(timeout=2)["agents"].get(name)
        except Exception:  # the coordinator is restarting
            return None
        return entry["status"] if entry else None

    def presumed_dead(self, name: str, why: str) -> bool:
        """Wait until the coordinator presumes ``name`` dead; False if it never does. A dead agent's leases are
        back to pending at that moment (reissued, never left leased): one it still holds is a problem."""

        def dead():
            entry = self.cluster.status(timeout=2)["agents"].get(name)
            return entry if entry and entry["status"] in ("dead", "retired") else None

        try:
            entry = wait_for(dead, TTL * 4 + 2, f"the coordinator to presume {name} dead ({why})")
        except AssertionError as exc:
            self.log(f"chaos: {exc}")
            return False
        if entry["leases"]:
            self.stuck.append(f"{name}, presumed dead ({why}), still holds {entry['leases']} lease(s): never reissued")
        return True

    # ------------------------------------------------------------ the schedule

    def feasible(self, kind: str, planned: bool) -> bool:
        n = self.n_consumed()
        if kind == "agent":
            return bool(self.live_agents())
        if kind in ("engine", "hang"):
            return any(self.live_engines(name) for name in self.live_agents())
        if kind == "coordinator":
            return self.cluster.coordinator.alive()
        if kind == "trainer":
            room = planned or (n >= self.trainer_killed_at + 8 and n < self.batches - 8)
            return self.ckpt.exists() and self.trainer.poll() is None and room
        if kind == "partition":
            return self.proxied in self.live_agents() and self.agent_status(self.proxied) == "alive"
        if kind == "node_lost":  # a node holding groups no trainer fetched yet: they must be made again
            held = self.unfetched()
            return not self.lost and any(held[n] for n in self.losable())
        if kind == "node_join":
            return not self.joined and n >= 2
        if kind == "gateway":
            return bool(self.live_gateways())
        if kind == "disk_full":  # past its start, and serving: a full disk at start is a start failure
            name = self.disk_agent
            started = name in self.live_agents() and "engines up:" in self.cluster.agents[name].text()
            return started and self.agent_status(name) == "alive"
        if kind == "engine_in_update":
            return self.trainer.poll() is None and self.feasible("engine", planned)
        if kind == "trainer_in_update":
            return self.feasible("trainer", planned)
        raise ValueError(kind)

    def next_kind(self, plan: list[str]) -> tuple[str | None, bool]:
        for kind in plan:
            if self.feasible(kind, planned=True):
                plan.remove(kind)
                return kind, True
        if plan:
            return None, True  # wait until a planned failure can happen
        kind = self.rng.choice(self.random_kinds)
        return (kind, False) if self.feasible(kind, planned=False) else (None, False)

    def cause(self, kind: str) -> str | None:
        """Cause one failure; what was hit, or None if nothing was (then it does not count)."""
        return getattr(self, f"_{kind}")()

    def _agent(self) -> str | None:
        live = self.live_agents()
        if not live:
            return None
        name = self.rng.choice(live)
        if not _kill(self.cluster.agents[name].popen):
            return None
        self.hit_at = time.monotonic()
        time.sleep(self.rng.uniform(0.2, 1.5))  # down for a while, then back on the same data dir
        self.start_agent(name, wait=False)
        return name

    def _engine_target(self) -> tuple[str, int] | None:
        """An engine to hit: ``(agent, pid)``. Only an agent past its start: an engine that dies while its agent
        starts is a start failure by design (the agent exits with the engine's error), not a fault the supervisor
        recovers from."""
        started = [n for n in self.live_agents() if "engines up:" in self.cluster.agents[n].text()]
        targets = [(name, pid) for name in started for pid in self.live_engines(name)]
        return self.rng.choice(targets) if targets else None

    def _engine(self) -> str | None:
        target = self._engine_target()
        if target is None:
            return None
        name, pid = target
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.hit_at = time.monotonic()
        return f"{name} engine pid {pid}"

    def _hang(self) -> str | None:
        """A gray failure: an engine frozen (SIGSTOP: alive, never answering) for a while, then thawed or killed."""
        target = self._engine_target()
        if target is None:
            return None
        name, pid = target
        frozen_for, kill = self.rng.uniform(0.5, 4.0), self.rng.random() < 0.5
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None
        self.hit_at = time.monotonic()
        try:
            time.sleep(frozen_for)  # the fault's duration, not a wait for a condition
        finally:
            with contextlib.suppress(ProcessLookupError):  # never left stopped
                if kill:
                    os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        return f"{name} engine pid {pid} frozen {frozen_for:.1f}s, then {'killed' if kill else 'thawed'}"

    def _coordinator(self) -> str | None:
        proc = self.cluster.coordinator
        if not _kill(proc.popen):
            return None
        self.hit_at = time.monotonic()
        time.sleep(self.rng.uniform(0.1, 1.0))
        self.start_coordinator()
        return "coordinator"

    def live_gateways(self) -> list[dict]:
        """The coordinator's gateways that report and run as its children."""
        try:
            gateways = self.cluster.status(timeout=2).get("gateways") or []
        except Exception:  # the coordinator is restarting
            return []
        parent = self.cluster.coordinator.pid
        return [g for g in gateways if g.get("up") and g.get("pid") and running_child(g["pid"], parent)]

    def _gateway(self) -> str | None:
        live = self.live_gateways()
        if not live:
            return None
        g = self.rng.choice(live)
        try:
            os.kill(g["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.hit_at = time.monotonic()

        try:
            self.cluster.gateway_successor(g, GATEWAY_RESTART_S)
        except AssertionError as exc:
            self.stuck.append(str(exc))
        return f"gateway {g['gateway']} pid {g['pid']}"

    def _trainer(self) -> str | None:
        if not _kill(self.trainer):
            return None
        self.hit_at = time.monotonic()
        self.trainer_killed_at = self.n_consumed()
        self.start_trainer()
        return f"trainer (resumes from {json.loads(self.ckpt.read_text())['rollout_id']})"

    def _partition(self) -> str | None:
        hold = self.rng.uniform(TTL + 1.0, TTL + 2.5)
        cut = self.hit_at = time.monotonic()
        self.proxy.partition()
        seen = self.presumed_dead(self.proxied, "behind a partition")
        time.sleep(max(0.0, cut + hold - time.monotonic()))  # the fault's duration, not a wait for a condition
        self.proxy.heal()
        return f"{self.proxied} for {time.monotonic() - cut:.1f}s" if seen else None

    def losable(self) -> list[str]:
        """Agents node_lost may take: not the proxied one (partitions), not the one on a small disk (disk_full)."""
        return [n for n in self.live_agents() if n not in (self.proxied, self.disk_agent)]

    def _disk_full(self) -> str | None:
        """The disk under an agent's store fills while it generates: it stops in one line, charging no prompt."""
        name, leave = self.disk_agent, self.rng.choice((0, PAGE))
        proc = self.cluster.agents[name]
        seen = len(proc.text())
        self.hit_at = time.monotonic()
        fill(self.disk, leave)
        try:
            code = proc.popen.wait(DISK_FULL_WAIT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            unfill(self.disk)
        if code is None:
            # A commit that met the full disk just before the filler went still ends the agent, a moment after the
            # wait gave up (its shutdown takes a second or two on a loaded machine): that is a hit, not a miss.
            try:
                code = proc.popen.wait(DISK_FULL_GRACE)
            except subprocess.TimeoutExpired:
                return None  # nothing committed meanwhile: no full disk was met
        text = proc.text()
        lines = [line for line in text.splitlines() if line.startswith("agent: error:")]
        after = text[seen:]
        charged = [line for line in after.splitlines() if "failed unexpectedly" in line or ") failed: " in line]
        if code != 1 or len(lines) != 1 or DISK_FULL_LINE not in lines[0] or "Traceback" in after or charged:
            shown = charged[0] if charged else after[after.find("Traceback") :][:3000] if "Traceback" in after else ""
            self.stuck.append(
                f"{name} met a full disk and exited with {code}, not with its one line and 1, or charged a prompt "
                f"({len(lines)} error line(s), {'a' if 'Traceback' in after else 'no'} traceback): "
                f"{'; '.join(lines) or after[-2000:]} {shown}"
            )
        how = next((h for h in ("ENOSPC", "EIO", "left, ") if lines and h in lines[0]), "?")
        time.sleep(self.rng.uniform(0.2, 1.0))  # the disk freed a moment later, then the agent back on it
        self.start_agent(name, wait=False)
        return f"{name} ({'no page' if leave == 0 else 'one page'} left: {how})"

    def _node_lost(self) -> str | None:
        held = self.unfetched()
        live = self.losable()
        if not live:
            return None
        name = max(live, key=lambda n: (held[n], self.rng.random()))
        if not _kill(self.cluster.agents[name].popen):
            return None
        self.hit_at = time.monotonic()
        self.lost.add(name)  # never restarted
        if not self.presumed_dead(name, "lost for good"):
            self.stuck.append(f"{name} was SIGKILLed but the coordinator never presumed it dead")
        return f"{name} holding {held[name]} unfetched group(s)"

    def _node_join(self) -> str | None:
        name = f"agent-{len(self.names)}"
        self.names.append(name)
        self.joined.append(name)
        self.start_agent(name, wait=False)
        return f"{name} (a new node)"

    def update_in_flight(self, steps: tuple[str, ...], kinds: tuple[str, ...]) -> dict | None:
        """The coordinator's weight lock once an update of one of ``kinds`` is at one of ``steps`` (polled every
        10 ms, for at most ``LOCK_WAIT``); None if none came (the trainer finished or was between updates)."""
        deadline = time.monotonic() + LOCK_WAIT
        while time.monotonic() < deadline and self.trainer.poll() is None:
            try:
                lock = self.cluster.status(timeout=2)["weights"]["lock"]
            except Exception:  # the coordinator is restarting
                lock = None
            if lock is not None and lock["step"] in steps and lock.get("kind") in kinds:
                return lock
            time.sleep(0.01)
        return None

    def _engine_in_update(self) -> str | None:
        lock = self.update_in_flight(("begin", "group", "init", "bucket", "finish", "disk"), ("disk", "distributed"))
        if lock is None:
            return None
        target = self._engine()
        return f"{target} in update {lock['update_id']:#x} ({lock['kind']}, step {lock['step']})" if target else None

    def _trainer_in_update(self) -> str | None:
        lock = self.update_in_flight(("group", "init", "bucket"), ("distributed",))
        if lock is None:
            return None
        target = self._trainer()
        return f"{target}, killed in its broadcast {lock['update_id']:#x} (step {lock['step']})" if target else None

    # ------------------------------------------------------------ the run

    def run(self) -> ChaosReport:
        with self._mounts:  # the small disk stays until its store is read
            return self._run()

    def _run(self) -> ChaosReport:
        try:
            self.start_coordinator()
            self.proxy = TcpProxy("127.0.0.1", self.cluster.port)
            for name in self.names:
                self.start_agent(name)
            self.start_trainer()
            self.drive()
            stats = self.quiesce()
            record = {"stats": stats, "actions": self.report.actions, "lost_agents": sorted(self.lost)}
            (self.workdir / "quiesced.json").write_text(json.dumps(record, indent=1))  # for a post-mortem
        finally:
            if self.trainer is not None:
                _kill(self.trainer)
            leaks = self.cluster.stop_all()
            if self.proxy is not None:
                self.proxy.close()
        evidence = RunEvidence(
            batches=self.batches + self.extra_batches,
            batch_size=BATCH_SIZE,
            dataset_size=ROWS,
            dataset_sizes=dict(zip(SOURCES, (ROWS, EXACT_ROWS), strict=True)),
            shares={name: BATCH_SIZE // len(SOURCES) for name in SOURCES},
            consumed=read_consumed(self.consumed),
            stats=stats,
            ledger=read_ledger(self.cluster.tmp / "coordinator"),
            stores={name: read_store(self.cluster.tmp / name) for name in self.names},
            lost_agents=set(self.lost),
            kills=self.report.kills,
            kinds=self.kinds,
            faults=[(self.started_wall + at, kind) for at, kind, _, _ in self.report.actions],
            never_reissued=self.never_reissued,
            weight_updates=read_consumed(self.weights_log),
            weight_kinds=self.weight_kinds,
            engine_versions=self.engine_versions,
            evaluations=read_consumed(self.workdir / "evaluations.jsonl"),
        )
        findings = check(evidence)
        for name in Findings.__dataclass_fields__:
            setattr(self.report, name, getattr(findings, name))
        self.report.extra_batches = self.extra_batches
        self.report.problems += self.stuck + [f"leak: {leak}" for leak in leaks]
        self.report.unaccounted_prompts += len(self.stuck)
        return self.report

    def drive(self) -> None:
        plan = list(self.kinds)
        self.rng.shuffle(plan)
        # A hang is a stream that stops moving, whatever the machine's speed: fail when no batch was consumed for
        # STALL seconds (plus a generous cap on the whole run), not when a loaded machine is merely slow.
        cap = time.monotonic() + max(600, self.batches * 30)
        progress, progressed = self.n_consumed(), time.monotonic()
        while self.trainer.poll() is None:
            now, n = time.monotonic(), self.n_consumed()
            if n != progress:
                progress, progressed = n, now
            if now - progressed > STALL or now > cap:
                why = f"no batch for {now - progressed:.0f}s" if now - progressed > STALL else "past its cap"
                raise AssertionError(f"chaos run did not finish: {why}; consumed {n} batches")
            time.sleep(self.rng.uniform(*self.interval))
            if self.trainer.poll() is not None:
                break
            kind, planned = self.next_kind(plan)
            if kind is None:
                continue
            n = self.n_consumed()
            self.hit_at = time.monotonic()  # each cause sets the moment it struck
            target = self.cause(kind)
            if target is None:
                self.log(f"chaos: {kind}: nothing to hit")
                if planned:
                    plan.append(kind)
                continue
            self.report.kills[kind] += 1
            self.report.actions.append((round(self.hit_at - self.started, 2), kind, target, n))
            self.log(f"chaos: {kind}: {target} (consumed {n}/{self.batches})")
        if self.trainer.returncode != 0:
            raise AssertionError(
                f"trainer failed with {self.trainer.returncode}: {self.trainer_log.read_text()[-3000:]}"
            )

    def pending_behind_cursor(self) -> set[tuple[int, int]]:
        return pending_behind_cursor(read_ledger(self.cluster.tmp / "coordinator"), order=range(ROWS))  # unshuffled

    def reissue(self, client) -> set[tuple[int, int]]:
        """No prompt forgotten: a prompt that came back to pending is leased again before any fresh one, so a few
        more batches settle every prompt now behind the cursor. Returns those that never were (none, unless a
        requeue lost them). The extra batches join the consumed stream like the trainer's."""
        behind = self.pending_behind_cursor()
        deadline = time.monotonic() + 60
        with open(self.consumed, "a") as log:
            while behind and self.extra_batches < 10 and time.monotonic() < deadline:
                try:
                    batch = client.generate(self.batches + self.extra_batches)
                except NoCapacity as exc:
                    if "push a weight update" not in str(exc):
                        raise
                    # Every engine restarted after the last broadcast: a disk update brings them back.
                    self.log(f"chaos: {exc}: a disk update")
                    rescue_from_disk(client, self.workdir / "weights", self.weights_log, self.with_torch)
                    continue
                log.write(json.dumps(batch_record(batch, "reissue")) + "\n")
                log.flush()
                self.extra_batches += 1
                behind &= self.pending_behind_cursor()
        return behind

    def quiesce(self) -> dict:
        """Bring the fleet to rest; the coordinator's statistics then (what ``check`` compares the ledger with)."""
        self.proxy.heal()
        for name in self.survivors():
            self.cluster.wait_agent_registered(name, timeout=60)
        for name in self.lost:
            try:
                wait_for(
                    lambda name=name: self.agent_status(name) in ("retired", None),
                    RETIRE_AFTER + 30,
                    f"{name}, lost for good, to be retired",
                )
            except AssertionError as exc:
                self.log(f"chaos: {exc}")  # the checker reports it
        with self.cluster.client(timeout=60) as client:
            self.never_reissued = self.reissue(client)
            client.pause(drain=False)  # admission off; what is in flight finishes
        last: list[dict] = []

        def settled():
            stats = self.cluster.status(timeout=5)
            agents = stats["agents"]
            steady = bool(last) and _at_rest(last[-1]) == _at_rest(stats)
            last.append(stats)
            alive = all(agents[n]["status"] == "alive" for n in self.survivors())
            return steady and not stats["leased"] and stats["weights"]["lock"] is None and alive

        try:
            wait_for(settled, 60, "the fleet to come to rest (no lease in flight, counts steady)", interval=0.5)
        except AssertionError as exc:
            self.log(f"chaos: {exc}")  # the checker reports what stayed in flight
        self.never_reissued &= self.pending_behind_cursor()  # one leased by the last extra batch has settled now
        self.engine_versions = self.wait_engines_agree(last[-1])
        return last[-1]

    def wait_engines_agree(self, stats: dict) -> dict[str, str | None]:
        """The weight version each serving engine reports, once they all report the fleet's (or after a while:
        the checker names the ones that do not)."""
        engines, want = serving_engines(stats), str(stats["weights"]["version"])
        seen: list[dict] = []

        def agree():
            seen.append(read_engine_versions(engines))
            return all(v == want or (v == "default" and want == "0") for v in seen[-1].values())

        try:
            wait_for(agree, 20, f"every serving engine to report weight version {want}", interval=0.5)
        except AssertionError as exc:
            self.log(f"chaos: {exc}: {seen[-1]}")
        return seen[-1]


def run_chaos(workdir: Path, **options) -> ChaosReport:
    """One chaos run in ``workdir``; ``options`` are ``ChaosRun``'s (batches, agents, seed, ...)."""
    return ChaosRun(Path(workdir), **options).run()


# ---------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set while a process is spawned (the run's one thread spawns them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _at_rest(stats: dict) -> tuple:
    return (stats["leased"], stats["ready"], tuple(sorted(stats["prompts"].items())), stats["data_epochs"])


def _kill(popen: subprocess.Popen) -> bool:
    """SIGKILL the process group of a process we started and reap it; True only if our signal ended it
    (not if it had exited by itself, even a moment before)."""
    if popen.poll() is not None:
        return False
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return popen.wait(10) == -signal.SIGKILL
