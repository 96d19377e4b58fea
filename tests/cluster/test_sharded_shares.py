"""A trainer of three processes against a real fleet: each rank pulls its own share straight from the agents.

Three rank processes (harness/rank_puller.py, each a ``RolloutClient(rank=R, world_size=3)``), a coordinator
and two agents with sim engines on loopback. Checked against values recomputed here: shares disjoint and
together the batch, tokens within the documented bound, metrics equal on every rank and to the union's,
each rank's bytes served to that rank by the agents (their debug log), an agent SIGKILLed after two ranks
took their shares losing and doubling nothing, a new run's leader fencing the old members, a checkpoint's
resume giving identical shares.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter

import pytest

from coordinator.ledger import read_ledger
from harness.cluster import ROOT

ROWS, BATCH, N = 36, 6, 4
SIM = "--token-latency-ms 1 --output-len-median 24"


class Rank:
    """A rank process, driven one command at a time."""

    def __init__(self, address: str, rank: int, world: int = 3, run: str = "run-a"):
        self.rank = rank
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "harness.rank_puller", address, str(rank), str(world), run],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.pending = False

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        self.pending = True

    def read(self) -> dict:
        out = self.popen.stdout.readline()
        assert out, f"rank {self.rank} exited with {self.popen.poll()}"
        self.pending = False
        return json.loads(out)

    def call(self, line: str) -> dict:
        self.send(line)
        return self.read()

    def close(self) -> None:
        if self.popen.poll() is None:
            try:
                self.send("close")
                self.popen.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait(5)


@pytest.fixture
def ranks():
    started: list[Rank] = []
    yield started
    for r in started:
        r.close()


def start(ranks: list, address: str, world: int = 3, run: str = "run-a") -> list[Rank]:
    new = [Rank(address, r, world, run) for r in range(world)]
    ranks.extend(new)
    for r in new:
        assert r.read() == {"ready": r.rank}
    return new


def pull(trainer: list[Rank], rollout_id: int, order=None) -> dict[int, dict]:
    """Batch ``rollout_id`` on every rank, all asking at once; each rank's share."""
    for r in trainer:
        r.send(f"generate {rollout_id}")
    got = {r.rank: r.read() for r in trainer}
    for rank, share in got.items():
        assert "error" not in share, f"rank {rank}: {share['error']}"
    return got


LOCAL = ("rollout/wait_seconds", "rollout/fetch_seconds", "rollout/replaced_groups")
"""Metrics of each rank's own call (its waits), and the repair count a rank that asked again sees."""


def check_batch(got: dict[int, dict], repaired: bool = False) -> None:
    prompts = [tuple(g) for share in got.values() for g in share["groups"]]
    assert len(prompts) == len(set(prompts)) == BATCH, "shares overlap or miss groups"
    metrics = [share["metrics"] for share in got.values()]
    whole = {k: v for k, v in metrics[0].items() if k not in LOCAL}
    for m in metrics[1:]:
        assert {k: v for k, v in m.items() if k not in LOCAL} == whole, "metrics differ between ranks"
    rewards = [x for share in got.values() for x in share["rewards"]]
    assert whole["rollout/groups"] == BATCH and whole["rollout/samples"] == len(rewards) == BATCH * N
    lengths = [x for share in got.values() for x in share["lengths"]]
    if not repaired:  # a repaired batch keeps the metrics it was assembled with (plus rollout/replaced_groups)
        assert whole["rollout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert whole["rollout/prompt_tokens"] + whole["rollout/response_tokens"] == sum(lengths)
    # Balanced: ranks at most the largest group's tokens apart; every rank told every rank's true lengths.
    loads = [sum(share["lengths"]) for share in got.values()]
    largest = max(
        sum(share["lengths"][k * N : (k + 1) * N]) for share in got.values() for k in range(len(share["groups"]))
    )
    assert max(loads) - min(loads) <= largest
    for rank, share in got.items():
        assert sorted(share["rank_lengths"][rank]) == sorted(share["lengths"])
        if not repaired:  # a rank's replacements change its lengths after the others took theirs
            assert share["rank_lengths"] == got[0]["rank_lengths"]
            assert share["micro_batches"] == got[0]["micro_batches"]  # the same count on every rank


def test_three_ranks_pull_disjoint_balanced_shares_and_survive_a_lost_node(make_cluster, ranks):
    cluster = make_cluster(dynamic_filter="none", rows=ROWS, rollout_batch_size=BATCH, n_samples_per_prompt=N)
    cluster.start_coordinator("--retire-after", "3", "--agent-ttl", "1.5")
    for name in ("a1", "a2"):
        cluster.start_agent(name, "--log-level", "DEBUG", concurrency=12, sim_args=SIM)
    trainer = start(ranks, cluster.address)
    delivered: Counter = Counter()
    for t in range(2):
        got = pull(trainer, t)
        check_batch(got)
        delivered.update(tuple(g) for share in got.values() for g in share["groups"])
    # Each rank's payloads were served to that rank by the agents themselves.
    logs = cluster.agents["a1"].text() + cluster.agents["a2"].text()
    for r in range(3):
        assert f" rank {r}/3" in logs, f"no agent served rank {r}"

    # The coordinator is SIGKILLed and restarted: the leader attaches again, the members join its new session.
    cluster.coordinator.signal(signal.SIGKILL)
    cluster.coordinator.wait(30)
    cluster.start_coordinator("--retire-after", "3", "--agent-ttl", "1.5")
    again = pull(trainer, 1)
    assert {r: s["groups"] for r, s in again.items()} == {r: s["groups"] for r, s in got.items()}

    # Batch 2: ranks 0 and 1 take their shares; then the node holding rank 2's groups is SIGKILLed.
    for r in trainer[:2]:
        r.send("generate 2")
    first = {r.rank: r.read() for r in trainer[:2]}
    batch = read_ledger(cluster.tmp / "coordinator").batches[2]
    rank2_agents = {g.agent_id for g in batch.share(2)}
    victim = sorted(rank2_agents)[0]
    held_there = {(g.data_epoch, g.index) for g in batch.share(0) + batch.share(1) if g.agent_id == victim}
    cluster.agents[victim].signal(signal.SIGKILL)
    third = trainer[2].call("generate 2")
    assert "error" not in third, third["error"]
    got = {**first, 2: third}
    check_batch(got, repaired=True)
    assert third["metrics"]["rollout/replaced_groups"] >= 1
    # Ranks 0 and 1's groups on the lost node were trained: none of them is generated again.
    delivered.update(tuple(g) for share in got.values() for g in share["groups"])
    t = 3
    while 0 in cluster.status()["data_epochs"] and t < 12:
        got = pull(trainer, t)
        check_batch(got)
        delivered.update(tuple(g) for share in got.values() for g in share["groups"])
        t += 1
    epoch0 = {p: n for p, n in delivered.items() if p[0] == 0}
    assert sorted(i for _, i in epoch0) == list(range(ROWS)), "a prompt of epoch 0 was lost"
    assert all(n == 1 for n in epoch0.values()), f"delivered twice: {[p for p, n in epoch0.items() if n > 1]}"
    assert held_there <= set(epoch0)

    # A checkpoint, two more batches, then a resume from it: every rank gets the same shares again.
    assert "error" not in trainer[0].call("pause")
    state = trainer[0].call("state_dict")
    assert state["rollout_id"] == t - 1
    after = [pull(trainer, t), pull(trainer, t + 1)]
    assert trainer[0].call("load_state_dict " + json.dumps(state)) == {"loaded": True}
    again = [pull(trainer, t), pull(trainer, t + 1)]
    for before, resumed in zip(after, again, strict=True):
        assert {r: s["groups"] for r, s in resumed.items()} == {r: s["groups"] for r, s in before.items()}

    # A new run's leader attaches: the old run's members are fenced, not served.
    new_leader = Rank(cluster.address, 0, 3, "run-b")
    ranks.append(new_leader)
    assert new_leader.read() == {"ready": 0}
    fenced = trainer[1].call(f"generate {t + 2}")
    assert fenced["error"].startswith("Fenced"), fenced
