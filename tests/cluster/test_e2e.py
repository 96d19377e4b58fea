"""End-to-end: real coordinator, agents, sim engines and a trainer on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from common import protocol as p
from common.errors import StateError
from harness.cluster import ROOT
from harness.polling import wait_for


def _dataset_rows(cluster):
    return [json.loads(line) for line in cluster.dataset.read_text().splitlines() if line.strip()]


def test_sim_agent_and_url_agent_deliver_complete_batches(make_cluster):
    cluster = make_cluster()
    cluster.start_coordinator()
    cluster.start_agent("agent-sim")
    _, url = cluster.start_sim_engine()  # an SGLang-API server rollfleet did not start
    cluster.start_agent("agent-url", engine_urls=[url])
    rows = _dataset_rows(cluster)
    size, n = cluster.config["rollout_batch_size"], cluster.config["n_samples_per_prompt"]

    seen: set[int] = set()
    agents_used: set[str] = set()
    with cluster.client() as client:
        for rollout_id in range(6):
            batch = client.generate(rollout_id)
            assert batch.rollout_id == rollout_id
            assert len(batch.groups) == size
            for group in batch.groups:
                assert group.index not in seen, f"dataset index {group.index} delivered twice"
                seen.add(group.index)
                agents_used.add(group.agent_id)
                assert group.label == rows[group.index]["label"]
                assert len(group.samples) == n
                for s in group.samples:
                    assert len(s.response_tokens) == len(s.response_logprobs) == len(s.loss_mask) > 0
                    assert s.prompt_tokens.tolist() == list(rows[group.index]["prompt"].encode())
                    assert s.reward in (0.0, 1.0)
                    assert s.status in ("completed", "truncated")
                    assert s.label == rows[group.index]["label"]
                    assert s.weight_version == "default"
                    assert all(lp <= 0 for lp in s.response_logprobs)
                # The default filter keeps only groups whose rewards differ.
                assert len(set(group.rewards)) > 1
            m = batch.metrics
            for key in ("dropped_groups", "dropped_ratio", "kept_groups"):
                assert f"rollout/dynamic_filter/{key}" in m
            assert m["rollout/samples"] == size * n
            assert m["rollout/response_tokens"] == sum(len(s.response_tokens) for s in batch.samples)
    assert agents_used == {"agent-sim", "agent-url"}


def test_same_rollout_id_returns_same_groups(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1")
    with cluster.client() as client:
        first = client.generate(0)
        second = client.generate(1)
        again = client.generate(0)
        assert [g.index for g in again.groups] == [g.index for g in first.groups]
        assert [s.response_tokens for s in again.samples] == [s.response_tokens for s in first.samples]
        assert again.metrics["rollout/groups"] == first.metrics["rollout/groups"]
    # A new trainer process asking for an already generated id gets the same batch too.
    with cluster.client() as other:
        assert [g.index for g in other.generate(1).groups] == [g.index for g in second.groups]


def test_trainer_that_stops_pulling_holds_work_at_the_bound(make_cluster):
    prefetch = 6
    cluster = make_cluster(dynamic_filter="none", prefetch=prefetch, rollout_batch_size=4)
    cluster.start_coordinator()
    cluster.start_agent(
        "a1", concurrency=64, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 32"
    )
    cluster.start_agent(
        "a2", concurrency=64, sim_args="--token-latency-ms 1 --output-len-dist fixed --output-len-median 32"
    )
    with cluster.client() as client:
        delivered = {g.index for rid in (0, 1) for g in client.generate(rid).groups}

        # The trainer stops pulling. Admission must stop at demand (0) + prefetch.
        def settled():
            s = cluster.stats()
            return s if s["ready"] == prefetch and s["leased"] == 0 else None

        held = wait_for(settled, 30, "ready groups to reach the prefetch bound")
        admitted = held["prompts"]["ready"] + held["prompts"]["delivered"]
        produced = []
        for _ in range(8):
            s = cluster.stats()
            assert s["leased"] + s["ready"] <= prefetch, s
            produced.append(s["prompts"]["ready"] + s["prompts"]["delivered"] + s["prompts"]["filtered"])
            time.sleep(0.25)
        assert len(set(produced)) == 1, f"admission did not stop: {produced}"
        # ... and memory stays flat while the trainer is away.
        procs = [cluster.coordinator, *cluster.agents.values()]
        before = [rss_kib(proc.pid) for proc in procs]
        time.sleep(2.0)
        after = [rss_kib(proc.pid) for proc in procs]
        assert all(a - b < 8 * 1024 for a, b in zip(after, before, strict=True)), (
            f"RSS grew while idle: {before} -> {after} KiB"
        )
        # Pulling again resumes, and the groups held back are delivered, not dropped: the prompts admitted
        # before the pause (leased in dataset order, no shuffle) all reach the next two batches, none twice.
        for rid in (2, 3):
            batch = client.generate(rid)
            assert len(batch.groups) == 4
            assert not delivered & {g.index for g in batch.groups}, "a prompt delivered twice"
            delivered |= {g.index for g in batch.groups}
        assert set(range(admitted)) <= delivered, f"held-back groups lost: {sorted(set(range(admitted)) - delivered)}"
        assert cluster.stats()["filtered_total"] == 0


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _raw_request(address: str, frame: bytes, timeout_ms: int = 5000) -> p.Message:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(frame)
        assert sock.poll(timeout_ms), "no reply from the coordinator"
        return p.decode(sock.recv())
    finally:
        sock.close()


def test_bad_messages_get_clear_errors_and_coordinator_keeps_serving(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator("--max-message-bytes", "100000")
    cluster.start_agent("a1")

    reply = _raw_request(cluster.address, b"\xc1\xff not msgpack")
    assert isinstance(reply, p.Error) and reply.code == "malformed" and "msgpack" in reply.message

    reply = _raw_request(cluster.address, msgpack.packb([p.PROTOCOL_VERSION, "launch_missiles", {"req": 7}]))
    assert isinstance(reply, p.Error) and "unknown message type 'launch_missiles'" in reply.message and reply.req == 7

    reply = _raw_request(cluster.address, msgpack.packb([99, "attach", {"req": 3, "client_id": "x"}]))
    assert isinstance(reply, p.Error) and reply.code == "version_mismatch" and "99" in reply.message

    reply = _raw_request(
        cluster.address, msgpack.packb([p.PROTOCOL_VERSION, "attach", {"req": 4, "client_id": "x" * 200_000}])
    )
    assert isinstance(reply, p.Error) and reply.code == "too_large" and "100000" in reply.message

    reply = _raw_request(
        cluster.address, msgpack.packb([p.PROTOCOL_VERSION, "generate", {"session": "one", "req": 5, "rollout_id": 0}])
    )
    assert isinstance(reply, p.Error) and "'session'" in reply.message

    reply = _raw_request(cluster.address, p.encode(p.Fetch(req=9, keys=[])))
    assert isinstance(reply, p.Error) and "'fetch'" in reply.message

    assert cluster.coordinator.alive()
    with cluster.client() as client:
        assert len(client.generate(0).groups) == cluster.config["rollout_batch_size"]


def test_bad_dataset_row_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "label": 1}\n{"prompt": "ok"\n')
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--dataset",
            str(data),
            "--data-dir",
            str(tmp_path / "c"),
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert f"{data}:2:" in out.stderr and "invalid JSON" in out.stderr


def test_bad_reward_spec_is_refused_at_start(tmp_path, make_cluster):
    cluster = make_cluster()
    proc = cluster.start_coordinator("--reward", "no_such_module:score", wait=False)
    assert proc.wait(60) == 2
    assert "no_such_module:score" in proc.text()


def test_agent_too_small_for_one_group_gets_clear_error(make_cluster):
    cluster = make_cluster(n_samples_per_prompt=8)
    cluster.start_coordinator()
    proc = cluster.start_agent("tiny", concurrency=4, wait=False)
    assert proc.wait(60) != 0
    assert "smaller than one group" in proc.text()


def test_pause_drain_resume_and_checkpoint_needs_drained(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args="--token-latency-ms 2 --output-len-dist fixed --output-len-median 40")
    with cluster.client() as client:
        client.generate(0)
        with pytest.raises(StateError, match="paused and drained"):
            client.state_dict()
        client.pause(drain=True)
        s = cluster.stats()
        assert s["paused"] and s["leased"] == 0
        state = client.state_dict()
        json.dumps(state)  # plain JSON data
        assert state["rollout_id"] == 0
        client.resume()
        assert len(client.generate(1).groups) == cluster.config["rollout_batch_size"]
