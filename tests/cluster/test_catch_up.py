"""Catch-up updates on a real loopback cluster (docs/weights.md, "Catching up restarted engines").

What must hold: after a broadcast, an engine that restarted (or a node that joined) is brought to
the fleet's current version by ``client.catch_up(tensors, version)`` alone: a group of the trainer
and just the engines behind, while every other engine keeps serving (never paused, its group kept)
and admission goes on; nothing is recorded (the version is the fleet's already); a catch-up with
nothing behind reads no tensor; a catch-up naming another version is refused.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from common.errors import StateError
from common.weight_rows import tensor_checksum
from harness.chaos_evidence import alive_engines as engines
from harness.polling import wait_for

pytestmark = pytest.mark.timeout(90)


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def unread():
    """Named tensors that fail the test if anything reads them."""
    raise AssertionError("catch_up read the tensors though no engine was behind")
    yield  # pragma: no cover


@pytest.mark.parametrize("sglang", ["0.5.23", "0.5.15"])
def test_a_restarted_engine_catches_up_while_the_others_keep_serving(make_cluster, sglang):
    """SIGKILL one of three engines after a broadcast: it restarts ``stale``; ``catch_up`` brings it to the
    fleet's version in a group of its own. Turns red if the catch-up pauses or regroups a serving
    engine (its pause count or group changes), records a new version, leaves the engine out of the
    pool, or if the next broadcast cannot reach all three. Run with engines imitating SGLang 0.5.23 (weight-update
    sessions) and 0.5.15 (none)."""
    torch = pytest.importorskip("torch")
    cluster = make_cluster(rollout_batch_size=4, dynamic_filter="none", max_staleness=0)  # batch t: version t only
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2, sim_args=f"--token-latency-ms 1 --sglang-version {sglang}")
    cluster.start_agent("a2", engines=1, sim_args=f"--token-latency-ms 1 --sglang-version {sglang}")
    tensors = {f"layer{i}.weight": torch.full((256, 64), 1.0 + i) for i in range(4)}
    with cluster.client(timeout=30) as client:
        client.generate(0)
        assert client.catch_up(unread(), 0, backend="gloo").engines == {}  # nothing behind: nothing read
        result = client.update_weights(tensors, 1, backend="gloo", timeout=30)
        assert set(result.engines.values()) == {1} and len(result.engines) == 3
        before = engines(cluster.status())
        victim = cluster.engine_pids_of("a1")[0]
        os.kill(victim, signal.SIGKILL)

        def restarted_stale():
            now = engines(cluster.status())
            e = now.get("a1/sim-0")
            return now if e and e["state"] == "stale" and e["url"] != before["a1/sim-0"]["url"] else None

        now = wait_for(restarted_stale, 30, "a1/sim-0 to restart and wait out of the pool (stale)")
        healthy_at = time.monotonic()
        url = now["a1/sim-0"]["url"]
        assert get(url, "/model_info")["weight_version"] == "default"
        weights = client.stats().weights
        assert weights.behind == ("a1/sim-0",)
        updates = weights.updates
        serving = {k: e["url"] for k, e in now.items() if k != "a1/sim-0"}
        pauses = {k: get(u, "/server_info")["sim"]["pauses"] for k, u in serving.items()}
        groups = {k: get(u, "/server_info")["sim"]["weight_groups"] for k, u in serving.items()}

        with pytest.raises(StateError, match="current version 1"):
            client.catch_up(tensors, 2, backend="gloo")
        result = client.catch_up(tensors, 1, backend="gloo", timeout=30)
        print(f"restart to current: {time.monotonic() - healthy_at:.2f}s after the engine was up (stale)")
        assert result.engines == {"a1/sim-0": 1}, result

        assert get(url, "/model_info")["weight_version"] == "1"
        held = get(url, "/weights_checker")["ranks"][0]["checksums"]["layer3.weight"]  # SGLang's CPU checksum
        assert held == tensor_checksum(tensors["layer3.weight"]), "the caught-up engine holds other weights"
        assert get(url, "/server_info")["sim"]["weight_groups"] == []  # its catch-up group ended with the call
        weights = client.stats().weights
        assert weights.behind == () and weights.version == 1
        assert weights.updates == updates  # nothing recorded: the version was the fleet's
        assert weights.lock is None
        for k, u in serving.items():
            info = get(u, "/server_info")["sim"]
            assert info["pauses"] == pauses[k], f"{k} was paused by the catch-up"
            assert info["weight_groups"] == groups[k], f"{k} lost the fleet's group"
        assert wait_for(lambda: engines(cluster.status())["a1/sim-0"]["state"] == "healthy", 10, "a1/sim-0 to serve")

        batch = client.generate(1)
        assert {s.weight_version for s in batch.samples} == {"1"}
        assert client.catch_up(unread(), 1, backend="gloo").engines == {}
        tensors = {k: v + 1 for k, v in tensors.items()}
        result = client.update_weights(tensors, 2, backend="gloo", timeout=30)
        assert result.engines == {"a1/sim-0": 2, "a1/sim-1": 2, "a2/sim-0": 2}
        assert {s.weight_version for s in client.generate(2).samples} == {"2"}


def test_a_node_that_joins_after_a_broadcast_catches_up(make_cluster):
    """A node joining after a broadcast starts on its launch weights (``stale``, no lease); one
    ``catch_up`` puts it in the pool on the fleet's version. Turns red if the joined engine serves its
    launch weights, or if the catch-up leaves it out."""
    torch = pytest.importorskip("torch")
    cluster = make_cluster(rollout_batch_size=4, dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=1, sim_args="--token-latency-ms 1")
    tensors = {f"layer{i}.weight": torch.full((128,), 2.0 + i) for i in range(3)}
    with cluster.client(timeout=30) as client:
        client.generate(0)
        client.update_weights(tensors, 1, backend="gloo", timeout=30)
        cluster.start_agent("a2", engines=1, sim_args="--token-latency-ms 1")
        wait_for(
            lambda: (engines(cluster.status()).get("a2/sim-0") or {}).get("state") == "stale",
            30,
            "a2's engine to come up stale",
        )
        joined_at = time.monotonic()
        assert {g.agent_id for g in client.generate(1).groups} == {"a1"}  # a2 is out of the pool
        result = client.catch_up(tensors, 1, backend="gloo", timeout=30)
        print(f"join to current: {time.monotonic() - joined_at:.2f}s after the engine was up (stale)")
        assert result.engines == {"a2/sim-0": 1}
        wait_for(lambda: engines(cluster.status())["a2/sim-0"]["state"] == "healthy", 10, "a2/sim-0 to serve")
        seen: set[str] = set()
        for step in range(2, 8):
            batch = client.generate(step)  # a1's groups may have been leased before version 1 (prefetch)
            assert {s.weight_version for g in batch.groups if g.agent_id == "a2" for s in g.samples} <= {"1"}
            seen |= {g.agent_id for g in batch.groups}
            if "a2" in seen:
                break
        assert "a2" in seen, "the caught-up node got no lease"
