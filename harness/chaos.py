"""The chaos run: kill agents, engines, the coordinator and the trainer while batches flow.

Used by ``tests/cluster/test_chaos.py`` (bounded, in CI) and ``scripts/chaos.py``
(long runs). A trainer process (``harness/chaos_trainer.py``) pulls batches and
checkpoints; this driver SIGKILLs and restarts random agents, random engines
and the coordinator, and the trainer once (which resumes from its last
checkpoint). At the end ``check`` reads the consumed stream, the
coordinator's ledger and every agent's store and verifies:

- no dataset prompt ``(data_epoch, index)`` is consumed twice;
- a batch delivered again after the trainer's resume has the same groups;
- every group an agent committed is consumed, ready in the ledger, or still
  in that agent's receipt outbox (to be reconciled at its next registration)
  — nothing committed is in limbo;
- every prompt of every open epoch is delivered, filtered (with a reason) or
  pending, and every delivered one is in a recorded or consumed batch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from coordinator.ledger import read_ledger
from harness.cluster import ROOT, Cluster


@dataclass
class ChaosReport:
    batches: int = 0
    actions: list = field(default_factory=list)
    duplicated: int = 0
    lost: int = 0
    replay_mismatches: int = 0
    unaccounted_prompts: int = 0
    replaced_groups: int = 0
    problems: list = field(default_factory=list)


def _read_consumed(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_store(data_dir: Path) -> tuple[set[str], set[str]]:
    env = lmdb.open(str(data_dir / "store"), readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            groups = {k.decode() for k, _ in txn.cursor(db=env.open_db(b"groups", txn=txn, create=False))}
            outbox = {k.decode() for k, _ in txn.cursor(db=env.open_db(b"outbox", txn=txn, create=False))}
        return groups, outbox
    finally:
        env.close()


def run_chaos(workdir: Path, *, batches: int = 30, agents: int = 3, seed: int = 0, interval: tuple[float, float] = (0.5, 1.5),
              log=print) -> ChaosReport:
    rng = random.Random(seed)
    cluster = Cluster(workdir, rows=600, rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=48)
    report = ChaosReport()
    consumed = workdir / "consumed.jsonl"
    ckpt = workdir / "checkpoint.json"
    sim = "--token-latency-ms 2 --output-len-median 24 --output-len-max 64"
    trainer = None
    try:
        cluster.start_coordinator()
        names = [f"agent-{i}" for i in range(agents)]
        for name in names:
            cluster.start_agent(name, concurrency=16, sim_args=sim)

        def start_trainer(resume: bool) -> subprocess.Popen:
            log_file = open(workdir / f"trainer-{'resumed' if resume else 'first'}.log", "ab")
            argv = [sys.executable, "-m", "harness.chaos_trainer", "--coordinator", cluster.address,
                    "--batches", str(batches), "--consumed", str(consumed), "--checkpoint", str(ckpt), "--checkpoint-every", "4"]
            if resume:
                argv.append("--resume")
            return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)

        trainer = start_trainer(False)
        trainer_killed = False
        planned = ["agent", "engine", "coordinator"]
        rng.shuffle(planned)
        deadline = time.monotonic() + max(240, batches * 8)
        while trainer.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"chaos run did not finish in time; consumed {len(_read_consumed(consumed))} batches")
            time.sleep(rng.uniform(*interval))
            if trainer.poll() is not None:
                break
            n_consumed = len(_read_consumed(consumed))
            # Every kind of failure happens at least once, early; then at random.
            action = planned.pop() if planned else rng.choice(["agent", "agent", "engine", "engine", "coordinator"])
            if not trainer_killed and ckpt.exists() and n_consumed >= batches // 2:
                action = "trainer"
            if action == "agent":
                name = rng.choice(names)
                proc = cluster.agents[name]
                proc.signal(signal.SIGKILL)
                proc.wait(10)
                time.sleep(rng.uniform(0.2, 1.5))
                cluster.start_agent(name, concurrency=16, sim_args=sim, wait=False)
            elif action == "engine":
                name = rng.choice(names)
                pids = cluster.engine_pids_of(name)
                if pids:
                    try:
                        os.kill(pids[-1], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            elif action == "coordinator":
                cluster.coordinator.signal(signal.SIGKILL)
                cluster.coordinator.wait(10)
                time.sleep(rng.uniform(0.1, 1.0))
                cluster.start_coordinator()
            elif action == "trainer":
                trainer_killed = True
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait(10)
                trainer = start_trainer(True)
            report.actions.append((round(time.monotonic(), 2), action, n_consumed))
            log(f"chaos: {action} (consumed {n_consumed}/{batches})")
        if trainer.returncode != 0:
            raise AssertionError(f"trainer failed with {trainer.returncode}: {(workdir / 'trainer-first.log').read_text()[-3000:]}")
        # Let the agents finish reconciling their outboxes, then stop everything in order.
        for name in names:
            cluster.wait_agent_registered(name)
        time.sleep(1.0)
    finally:
        if trainer is not None and trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
        cluster.stop_all()
    check(report, cluster, consumed, names, batches)
    return report


def check(report: ChaosReport, cluster: Cluster, consumed_path: Path, names: list[str], batches: int) -> None:
    records = _read_consumed(consumed_path)
    # The consumed stream: a batch id delivered twice (before the trainer's kill and after
    # its resume) counts once, and the two deliveries must be identical.
    by_rid: dict[int, dict] = {}
    for rec in records:
        prev = by_rid.get(rec["rid"])
        if prev is not None and sorted(map(tuple, prev["groups"])) != sorted(map(tuple, rec["groups"])):
            # A batch may legitimately change only if a node was retired (replacements).
            if not rec["replaced"]:
                report.replay_mismatches += 1
                report.problems.append(f"rollout {rec['rid']} replayed with different groups")
        by_rid[rec["rid"]] = rec
        if not rec["lengths_ok"]:
            report.problems.append(f"rollout {rec['rid']}: token/logprob lengths differ")
    report.batches = len(by_rid)
    if sorted(by_rid) != list(range(batches)):
        report.problems.append(f"consumed rollout ids {sorted(by_rid)} != 0..{batches - 1}")
    seen: dict[tuple[int, int], int] = {}
    for rid, rec in sorted(by_rid.items()):
        report.replaced_groups += int(rec["replaced"])
        for epoch, index, _agent in rec["groups"]:
            if (epoch, index) in seen:
                report.duplicated += 1
                report.problems.append(f"prompt {(epoch, index)} consumed in rollouts {seen[(epoch, index)]} and {rid}")
            seen[(epoch, index)] = rid

    ledger = read_ledger(cluster.tmp / "coordinator")
    prompts = ledger.prompts
    consumed_keys = {g.key for batch in ledger.batches.values() for g in batch.groups}
    ready_keys = {st.key for st in prompts.values() if st.ready}
    delivered_keys = {st.key for st in prompts.values() if st.delivered}
    for name in names:
        groups, outbox = _read_store(cluster.tmp / name)
        for key in groups:
            epoch, index, _ = key.split(":")
            accounted = key in ready_keys or key in delivered_keys or key in consumed_keys or key in outbox
            # Groups of closed epochs or behind the checkpoint may remain until trimmed.
            if not accounted and (int(epoch), int(index)) not in seen:
                report.lost += 1
                report.problems.append(
                    f"{name} holds committed group {key} that is neither consumed, ready nor awaiting its receipt"
                )
    for prompt, st in prompts.items():
        if st.filtered and not st.reason:
            report.unaccounted_prompts += 1
            report.problems.append(f"prompt {prompt} filtered without a reason")
        if st.delivered and prompt not in seen and st.key not in consumed_keys:
            report.unaccounted_prompts += 1
            report.problems.append(f"prompt {prompt} marked delivered but in no batch")
    for prompt in seen:
        st = prompts.get(prompt)
        if st is not None and not st.delivered:
            report.unaccounted_prompts += 1
            report.problems.append(f"consumed prompt {prompt} is {st.status_name!r} in the ledger")
