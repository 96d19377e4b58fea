"""Agent-side failures (issue 3): agent SIGKILL and restart, engine crash, engine that never
becomes healthy, retirement, replicated datasets, orderly SIGTERM.

Every test runs a real loopback cluster (coordinator, agents, sim engines, a trainer client)
and asserts what a user would notice: complete batches, no dataset index delivered twice,
clear errors, no leftover engine processes. Readiness is always polled, never slept for.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import msgpack
import pytest

from agent.store import GroupStore
from common.errors import NoCapacity
from common.faults import ENV
from common.types import Group
from harness.cluster import pid_alive
from harness.polling import wait_for

SLOW = "--token-latency-ms 10 --output-len-dist fixed --output-len-median 32"
SECOND = "--token-latency-ms 30 --output-len-dist fixed --output-len-median 32"  # about 1 s per group
REGISTERED = re.compile(r"registered \(session \w+, capacity \d+ samples, (\d+) receipts recovered\)")


# ---------------------------------------------------------------------------- helpers


def read_store(data_dir: Path) -> tuple[dict[str, bytes], dict[str, dict]]:
    """An agent's LMDB store, read from outside: (group key -> payload, outbox key -> receipt)."""
    env = lmdb.open(str(data_dir / "store"), readonly=True, max_dbs=4, lock=True)
    try:
        groups_db = env.open_db(b"groups", create=False)
        outbox_db = env.open_db(b"outbox", create=False)
        with env.begin() as txn:
            groups = {k.decode(): bytes(v) for k, v in txn.cursor(db=groups_db)}
            outbox = {k.decode(): msgpack.unpackb(v, raw=False) for k, v in txn.cursor(db=outbox_db)}
    finally:
        env.close()
    return groups, outbox


def engines_of(proc) -> dict[str, tuple[str, int]]:
    """engine name -> (url, pid) of the newest healthy incarnation, from an agent's log."""
    out = {}
    for m in re.finditer(r"engine (\S+) healthy (?:again )?at (\S+) \(pid (\d+)\)", proc.text()):
        out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


def running_requests(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/loads", timeout=5) as resp:
        return json.loads(resp.read())["loads"][0]["num_running_reqs"]


class TrainerView:
    """What the trainer received: every batch checked as it arrives."""

    def __init__(self, cluster):
        self.size = cluster.config["rollout_batch_size"]
        self.n = cluster.config["n_samples_per_prompt"]
        self.groups: dict[int, Group] = {}  # dataset index -> the group trained on
        self.batches = {}

    def take(self, batch, *, unique_across: bool = True):
        assert len(batch.groups) == self.size, f"short batch {batch.rollout_id}: {len(batch.groups)} groups"
        indices = [g.index for g in batch.groups]
        assert len(set(indices)) == len(indices), f"batch {batch.rollout_id} repeats an index: {indices}"
        for g in batch.groups:
            assert len(g.samples) == self.n
            assert all(s.status in ("completed", "truncated") for s in g.samples)
            if unique_across:
                assert g.index not in self.groups, f"dataset index {g.index} delivered twice (batch {batch.rollout_id})"
            self.groups[g.index] = g
        self.batches[batch.rollout_id] = batch
        return batch


# ---------------------------------------------------------------------------- (2) agent restart


def test_sigkilled_agent_restarts_and_its_unacked_groups_are_delivered_exactly_once(make_cluster, monkeypatch):
    """The agent is SIGKILLed holding committed groups whose receipts the coordinator never answered.

    What keeps the receipts unanswered is the agent's ``hold_file`` fault (common/faults.py): while
    the file exists nothing the agent sends leaves. A group that was not yet in the store when the
    hold had begun sends its receipt after that (commit before receipt), so the receipt is held and
    stays in the outbox until the kill. A prefetch far above what the agent finishes in a few seconds,
    and groups of about a second, keep leases in flight when the hold starts.
    """
    cluster = make_cluster(dynamic_filter="none", prefetch=32)
    cluster.start_coordinator()
    hold = cluster.tmp / "hold-a1"
    monkeypatch.setenv(ENV, f"hold_file={hold}")
    agent = cluster.start_agent("a1", concurrency=32, sim_args=SECOND)
    monkeypatch.delenv(ENV)
    data_dir = cluster.tmp / "a1"
    first_engines = cluster.engine_pids_of("a1")
    assert first_engines
    seen = TrainerView(cluster)
    with cluster.client(fetch_timeout=3) as client:
        seen.take(client.generate(0))
        wait_for(lambda: client.stats().leased > 0, 10, "prefetch leases in flight")
        hold.touch()
        before_hold = set(read_store(data_dir)[0])
        held = wait_for(lambda: set(read_store(data_dir)[1]) - before_hold, 20, "a group committed, its receipt held")
        agent.signal(signal.SIGKILL)
        agent.wait(10)
        hold.unlink()
        groups, unacked = read_store(data_dir)
        assert held <= set(unacked), "no receipt was unacknowledged at the kill"
        # The store never holds a half-written group: every receipt has its group, every group decodes.
        assert set(unacked) <= set(groups)
        committed = {key: Group.from_wire(payload) for key, payload in groups.items()}
        for key, receipt in unacked.items():
            assert committed[key].index == receipt["index"] and len(committed[key].samples) == receipt["n_samples"]
        # Its engines died with it (PR_SET_PDEATHSIG), nothing is left holding the GPU.
        wait_for(lambda: not any(pid_alive(pid) for pid in first_engines), 10, "the killed agent's engines to die")

        agent = cluster.start_agent("a1", concurrency=32, sim_args=SECOND)
        assert "agent a1 joining" in agent.text() and "(incarnation 2)" in agent.text()
        # The agent logs what its Welcome answered once it has it, a moment after the status lists it.
        recovered = wait_for(lambda: REGISTERED.search(agent.text()), 10, "a1 to log its registration")
        assert int(recovered.group(1)) == len(unacked)
        assert set(client.stats().agents) == {"a1"}, "the restarted agent must keep its id"
        assert not set(cluster.engine_pids_of("a1")) & set(first_engines)

        # Everything committed before the kill reaches training exactly once, as committed
        # (recovered, not regenerated); the run keeps producing complete, unique batches.
        rid = 1
        while not {g.index for g in committed.values()} <= set(seen.groups) or rid < 4:
            missing = sorted({g.index for g in committed.values()} - set(seen.groups))
            assert rid < 16, f"committed groups never delivered: {missing}"
            seen.take(client.generate(rid))
            rid += 1
        for key, group in committed.items():
            assert seen.groups[group.index] == group, f"group {key} was regenerated instead of recovered"


# ---------------------------------------------------------------------------- (4) engine crash


def test_engine_sigkilled_mid_rollout_is_restarted_and_its_groups_requeued(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", engines=2, concurrency=16, sim_args=SLOW)
    seen = TrainerView(cluster)
    with cluster.client() as client, ThreadPoolExecutor(1) as trainer:
        seen.take(client.generate(0))
        url, pid = engines_of(agent)["sim-0"]
        # The trainer keeps pulling while sim-0 dies with requests on it.
        pulling = trainer.submit(lambda: [seen.take(client.generate(rid)) for rid in range(1, 6)])
        wait_for(lambda: running_requests(url) > 0, 10, "requests running on sim-0")
        os.kill(pid, signal.SIGKILL)
        pulling.result(timeout=60)

        # The engine comes back as a new process; the groups it held were retried elsewhere. The agent
        # logs each engine's pid (the status has none), and its capacity before it reports it.
        def back_at_full_capacity():
            entry = client.stats().agents["a1"]
            states = {e["name"]: e["state"] for e in entry.engines}
            return entry.capacity == 32 // 4 and states["sim-0"] == "healthy" and engines_of(agent)["sim-0"][1] != pid

        wait_for(back_at_full_capacity, 30, "sim-0 restarted and full capacity back at the coordinator")
        _, new_pid = engines_of(agent)["sim-0"]
        assert pid_alive(new_pid) and not pid_alive(pid)
        healthy_again = "engine sim-0 is healthy (capacity now 32 samples)"
        text = wait_for(lambda: healthy_again in (t := agent.text()) and t, 10, "the agent to log sim-0 healthy")
        assert re.search(r"lease \w+: engine sim-0 failed .*retrying on another engine", text)
        assert "engine sim-0 is down (capacity now 16 samples)" in text
        seen.take(client.generate(6))


def test_all_engines_retired_makes_generate_raise_no_capacity(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", "--max-restarts", "0", concurrency=16, sim_args=SLOW)
    seen = TrainerView(cluster)
    with cluster.client(timeout=30) as client:
        seen.take(client.generate(0))
        url, pid = engines_of(agent)["sim-0"]
        wait_for(lambda: running_requests(url) > 0, 10, "requests running on sim-0")
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(NoCapacity, match="no agent with a live engine"):
            for rid in range(1, 10):  # ready groups may still fill a batch or so
                seen.take(client.generate(rid))
        assert time.monotonic() - started < 25
        assert "engine sim-0 retired" in agent.text()
        # The agent stays up (its committed groups can still be fetched) and gives its
        # unfinished leases back: their prompts are pending again, not stuck.
        assert agent.alive()
        wait_for(lambda: client.stats().leased == 0, 10, "the agent to release the leases it cannot finish")
        assert client.stats().agents["a1"].capacity == 0


def test_agent_whose_only_engine_never_becomes_healthy_exits_with_clear_error(make_cluster):
    cluster = make_cluster()
    cluster.start_coordinator()
    proc = cluster.start_agent("sick", "--engine-start-timeout", "3", "--sim-args=--unhealthy", wait=False)
    assert proc.wait(60) != 0
    text = proc.text()
    assert "agent: error: no engine became healthy" in text, text[-2000:]
    assert re.search(
        r"engine 'sim-0' not healthy at http://\S+ within 3s \(HTTP 503 from \S+/health_generate\); "
        r"process killed; log \S+sim-0.log",
        text,
    ), text[-2000:]
    pids = cluster.engine_pids_of("sick")
    assert pids and not any(pid_alive(p) for p in pids)
    assert "sick" not in cluster.stats()["agents"]


# ---------------------------------------------------------------------------- (6) retirement


def _retirement_cluster(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator("--retire-after", "3")
    cluster.start_agent(
        "a1", concurrency=16, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 16"
    )
    return cluster


def test_retired_agent_leaves_the_pool_and_recorded_batches_are_completed_with_replacements(make_cluster):
    cluster = _retirement_cluster(make_cluster)
    seen = TrainerView(cluster)
    size = cluster.config["rollout_batch_size"]
    with cluster.client(fetch_timeout=2) as client:
        seen.take(client.generate(0))
        # a1 alone fills the prefetch: the next batch will be made of its groups.
        wait_for(lambda: client.stats().batches.ready == size, 20, "a1's groups to fill the prefetch")
        a2 = cluster.start_agent(
            "a2", concurrency=16, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 16"
        )
        cluster.agents["a1"].signal(signal.SIGKILL)
        # Batch 1 is recorded with a1's groups, which can no longer be fetched. Once a1 is
        # retired the batch is completed with replacements, not returned short, not hung.
        batch = seen.take(client.generate(1), unique_across=False)
        assert {g.agent_id for g in batch.groups} == {"a2"}
        assert batch.metrics["rollout/replaced_groups"] == size
        agents = client.stats().agents
        assert agents["a1"].status == "retired" and agents["a2"].status == "alive"
        for rid in (2, 3):
            assert {g.agent_id for g in seen.take(client.generate(rid), unique_across=False).groups} == {"a2"}
        # The last agent goes too: the trainer gets a clear error, not a hang.
        a2.signal(signal.SIGKILL)
        with pytest.raises(NoCapacity, match="no agent"):
            for rid in range(4, 8):
                seen.take(client.generate(rid), unique_across=False)


def test_retirement_does_not_deliver_an_already_trained_prompt_again(make_cluster):
    cluster = _retirement_cluster(make_cluster)
    seen = TrainerView(cluster)
    with cluster.client(fetch_timeout=2) as client:
        seen.take(client.generate(0))  # all a1's groups, fetched: the trainer trained on them
        cluster.start_agent(
            "a2", concurrency=16, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 16"
        )
        cluster.agents["a1"].signal(signal.SIGKILL)
        wait_for(lambda: client.stats().agents["a1"].status == "retired", 20, "a1 to be retired")
        for rid in range(1, 5):
            seen.take(client.generate(rid))  # asserts no dataset index is delivered twice


# ---------------------------------------------------------------------------- (7) replicated datasets


def test_agent_with_its_own_dataset_replica_must_match_the_coordinators(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    rows = [json.loads(line) for line in cluster.dataset.read_text().splitlines() if line.strip()]
    replica = cluster.tmp / "replica.jsonl"
    replica.write_bytes(cluster.dataset.read_bytes())
    cluster.start_agent("good", "--dataset", str(replica))
    with cluster.client() as client:
        batch = TrainerView(cluster).take(client.generate(0))
        for g in batch.groups:  # prompts were read from the agent's replica
            assert g.label == rows[g.index]["label"]
            assert g.samples[0].prompt_tokens.tolist() == list(rows[g.index]["prompt"].encode())

    changed = cluster.tmp / "changed.jsonl"  # same size, one label differs
    edited = [dict(r) for r in rows]
    edited[3]["label"] = "not the label"
    changed.write_text("".join(json.dumps(r) + "\n" for r in edited))
    shorter = cluster.tmp / "shorter.jsonl"
    shorter.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    bad = {
        name: cluster.start_agent(name, "--dataset", str(path), wait=False)
        for name, path in (("changed", changed), ("shorter", shorter))
    }
    for name, proc in bad.items():
        assert proc.wait(60) != 0, f"agent {name} with a mismatched dataset was accepted"
        assert re.search(
            rf"error: .*agent {name}'s dataset \(\d+ rows, fingerprint \w+\) does not match the coordinator's",
            proc.text(),
        )
    assert f"{len(rows) - 1} rows" in bad["shorter"].text()
    assert set(cluster.stats()["agents"]) == {"good"}


# ---------------------------------------------------------------------------- (9) orderly shutdown


def test_sigterm_releases_leases_drains_receipts_and_leaves_no_engine(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    # A long TTL: leases that drop promptly were released by the agent, not expired.
    cluster.start_coordinator("--agent-ttl", "60", "--retire-after", "120")
    agent = cluster.start_agent(
        "a1", concurrency=16, sim_args="--token-latency-ms 30 --output-len-dist fixed --output-len-median 32"
    )
    engines = cluster.engine_pids_of("a1")
    seen = TrainerView(cluster)
    with cluster.client() as client:
        seen.take(client.generate(0))
        wait_for(lambda: client.stats().leased > 0, 10, "leases in flight")
        agent.signal(signal.SIGTERM)
        assert agent.wait(30) == 0, agent.text()[-3000:]
        assert "shutting down" in agent.text()
        # Well inside the 60 s TTL: the agent released its unfinished leases itself.
        wait_for(lambda: client.stats().leased == 0, 20, "the stopped agent's leases to be released")
        assert not any(pid_alive(p) for p in engines), "an engine outlived its agent's orderly shutdown"
        groups, unacked = read_store(cluster.tmp / "a1")
        assert not unacked, f"receipts left unacknowledged at shutdown: {sorted(unacked)}"
        for payload in groups.values():
            Group.from_wire(payload)
        # The same node joins again and the run goes on: no index twice.
        cluster.start_agent(
            "a1", concurrency=16, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 16"
        )
        for rid in (1, 2):
            seen.take(client.generate(rid))


def test_store_commit_cancelled_mid_write_neither_loses_nor_strands_the_writes_behind_it(tmp_path):
    """A lease cancelled while its commit is being written (shutdown, coordinator cancel) must
    not stop the group-commit loop: writes queued behind it still land and their callers return."""

    async def run():
        store = GroupStore(tmp_path, agent_id="n1")
        try:
            first = asyncio.create_task(store.commit("0:1:1", b"one", {"key": "0:1:1", "index": 1}))
            await asyncio.sleep(0)  # the first commit is being written
            second = asyncio.create_task(store.commit("0:2:1", b"two", {"key": "0:2:1", "index": 2}))
            await asyncio.sleep(0)  # the second one waits behind it
            first.cancel()
            await asyncio.wait_for(second, 5)
            await store.drain()
            assert await store.get_many(["0:1:1", "0:2:1"]) == [b"one", b"two"]
            assert sorted(r["index"] for r in store.unacked()) == [1, 2]
        finally:
            store.close()

    asyncio.run(run())
