"""Weight updates on a real loopback cluster (docs/weights.md): coordinator, agents, sim engines, a trainer."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from common.errors import StateError
from common.weights_digest import weights_digest
from harness.polling import wait_for

pytestmark = pytest.mark.timeout(240)


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=5) as resp:
        return json.loads(resp.read())


def engine_urls(status: dict) -> dict[str, str]:
    return {
        f"{a}/{e['name']}": e["url"]
        for a, entry in status["agents"].items()
        for e in entry["engines"]
        if entry["status"] == "alive" and e.get("state") == "healthy"
    }


def running(cluster) -> int:
    """Requests the engines are generating right now (their own ``/v1/loads``)."""
    total = 0
    for url in engine_urls(cluster.status()).values():
        with urllib.request.urlopen(f"{url}/v1/loads", timeout=5) as resp:
            total += sum(load["num_running_reqs"] for load in json.loads(resp.read())["loads"])
    return total


def check_spans(batch) -> None:
    for s in batch.samples:
        spans = s.weight_versions
        assert spans and spans[0][1] == 0 and spans[-1][2] == len(s.response_tokens), spans
        for (v0, _, e0), (v1, b1, _) in zip(spans, spans[1:], strict=False):
            assert e0 == b1 and _version(v0) <= _version(v1), spans


def test_disk_updates_while_generation_runs_reach_every_engine(make_cluster, tmp_path):
    cluster = make_cluster()
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2)
    cluster.start_agent("a2", engines=2)
    with cluster.client() as client:
        failures = []

        def generate():
            try:
                for rollout_id in range(4):
                    check_spans(client.generate(rollout_id))
            except Exception as exc:  # reported by the main thread
                failures.append(exc)

        thread = threading.Thread(target=generate)
        thread.start()
        for version in (1, 2):
            ckpt = tmp_path / f"ckpt{version}"
            ckpt.mkdir()
            result = client.update_weights_from_disk(str(ckpt), version)
            assert result.version == version and len(result.engines) == 4
            assert set(result.engines.values()) == {version}
        thread.join(120)
        assert not failures, failures
        assert client.weight_version() == 2
        status = cluster.status()
        assert status["weights"]["kind"] == "disk" and status["weights"]["lock"] is None
        for url in engine_urls(status).values():
            assert model_info(url)["weight_version"] == "2"
        with pytest.raises(StateError, match="not greater"):
            client.update_weights_from_disk(str(tmp_path / "ckpt1"), 2)


@pytest.mark.parametrize("sglang", ["0.5.23", "0.5.15"])
def test_gloo_broadcasts_reach_every_engine_with_the_same_digest(make_cluster, sglang):
    """Three ~10 MB broadcasts of five tensors to 2 agents x 2 engines while generation runs: after each,
    every engine serves the version and holds exactly the tensors sent (same digest), and every sample's
    spans cover its response in order. Whether a sample is caught mid-generation here depends on timing;
    tests/integration/test_agent_weights.py shows a caught sample continued with two spans. Run with engines
    imitating SGLang 0.5.23 (weight-update sessions) and 0.5.15 (none)."""
    torch = pytest.importorskip("torch")
    cluster = make_cluster()
    cluster.start_coordinator()
    slow = f"--token-latency-ms 15 --output-len-dist fixed --output-len-median 60 --sglang-version {sglang}"
    cluster.start_agent("a1", engines=2, sim_args=slow)
    cluster.start_agent("a2", engines=2, sim_args=slow)
    with cluster.client() as client:
        batches, failures = [], []

        updated = threading.Event()

        def generate():
            # Until the updates are done, then three batches more: groups in flight at an update are delivered
            # in a batch after it.
            try:
                rollout_id, after = 0, 0
                while after < 3:
                    after += updated.is_set()
                    batches.append(client.generate(rollout_id))
                    rollout_id += 1
            except Exception as exc:  # reported by the main thread
                failures.append(exc)

        thread = threading.Thread(target=generate)
        thread.start()
        for version in (1, 2, 3):
            wait_for(lambda: running(cluster) > 0 or not thread.is_alive(), 60, "samples running on the engines")
            tensors = {f"layer{i}.weight": torch.full((640, 1024), float(version + i)) for i in range(4)}
            tensors["sim.accuracy"] = torch.tensor([0.5])
            result = client.update_weights(tensors, version, backend="gloo", bucket_bytes=4 << 20, timeout=60)
            assert set(result.engines.values()) == {version} and len(result.engines) == 4
            digest = weights_digest(tensors.items())
            for url in engine_urls(cluster.status()).values():
                info = model_info(url)
                assert (info["weight_version"], info["weight_digest"]) == (str(version), digest)
        updated.set()
        thread.join(120)
        assert not failures, failures
        assert cluster.status()["weights"]["updates"] == 3
        for batch in batches:
            check_spans(batch)


def test_staleness_bound_holds_with_an_update_every_step(make_cluster):
    """With ETA = 1 and a prefetch of four batches, demand alone would admit groups three updates ahead;
    the staleness bound must hold them back. Checked on the samples themselves: the version each sample
    began on (its first span) is never older than step - 1. Turns red if admission ignores the bound."""
    cluster = make_cluster(rollout_batch_size=4, max_staleness=1, prefetch=16)
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2, sim_args="--token-latency-ms 2")
    with cluster.client(expect={"max_staleness": 1, "partial_rollout": True}) as client:
        for step in range(20):
            batch = client.generate(step)
            assert batch.metrics["rollout/staleness_max"] <= 1.0, batch.metrics
            assert "rollout/admission_stall_s" in batch.metrics
            started = [_version(s.weight_versions[0][0]) for g in batch.groups for s in g.samples if s.weight_versions]
            assert started and min(started) >= step - 1, (step, sorted(started))
            ckpt = cluster.tmp / f"ckpt{step}"
            ckpt.mkdir(exist_ok=True)
            client.update_weights_from_disk(str(ckpt), step + 1)


def _version(label) -> int:
    return int(label) if str(label).isdigit() else 0  # a fresh engine reports "default": version 0


def test_attaching_with_another_config_is_refused_naming_the_fields(make_cluster):
    cluster = make_cluster(max_staleness=2)
    cluster.start_coordinator()
    with pytest.raises(StateError) as err:
        cluster.client(expect={"max_staleness": 1, "partial_rollout": False, "rollout_batch_size": 8})
    assert "max_staleness" in str(err.value) and "partial_rollout" in str(err.value)
    assert "rollout_batch_size:" not in str(err.value)


def test_a_new_trainer_replaces_one_that_left_an_update_in_flight(make_cluster):
    torch = pytest.importorskip("torch")
    cluster = make_cluster()
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2)
    pids = cluster.engine_pids_of("a1")
    from common import protocol as p

    first = cluster.client()
    # Begin a broadcast and leave it in flight (a trainer that died after its UpdateWeights).
    first._run(
        first._async._request(
            lambda s, req: p.UpdateWeights(s, req, 1, "distributed", "", "127.0.0.1", 1, "gloo", 30.0), "begin"
        )
    )
    assert cluster.status()["weights"]["lock"] is not None
    second = cluster.client()
    wait_for(lambda: cluster.status()["weights"]["lock"] is None, 10, "the abandoned update to be aborted")
    if not torch.cuda.is_available():
        # NCCL (the default) on a trainer without a GPU: refused before anything starts, saying what to use.
        with pytest.raises(ValueError, match="backend='nccl' needs CUDA on the trainer.*backend='gloo'"):
            second.update_weights({"w": torch.ones(8)}, 1, timeout=60)
        assert cluster.status()["weights"]["lock"] is None
    result = second.update_weights({"w": torch.ones(8)}, 1, backend="gloo", timeout=60)
    assert set(result.engines.values()) == {1}
    assert cluster.engine_pids_of("a1") == pids
    first.close()
    second.close()


def test_to_tensors_versions_follow_the_spans_of_partial_rollouts(make_cluster, tmp_path):
    """Samples caught by a disk update mid-generation continue on the new weights (``--partial-rollout``) with two
    spans; ``to_tensors()["versions"]`` gives every response token the version of the span that covers it, -1 on
    prompt and padding, and ``staleness`` is the current version minus it. Turns red if the versions are taken
    from the sample's last version only (the two-span rows would read all one version)."""
    torch = pytest.importorskip("torch")
    # No dynamic filter: a caught group must not be dropped for equal rewards.
    cluster = make_cluster(rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=60, dynamic_filter="none")
    cluster.start_coordinator()
    slow = "--token-latency-ms 15 --output-len-dist fixed --output-len-median 60"  # ~1 s a sample
    cluster.start_agent("a1", engines=1, sim_args=slow)
    caught, rollout_id, version = [], 0, 0
    with cluster.client(expect={"partial_rollout": True}) as client:
        # A deep prefetch keeps samples running between the batches a try takes (with one batch ahead, all of
        # it can be ready and nothing runs until the next generate).
        client.generate(rollout_id, prefetch=64)
        # Each try updates while samples run, after they made some tokens (a sample caught before its first
        # token has one span); the batches of the next few rollouts hold the samples it caught.
        while not caught and version < 4:
            wait_for(lambda: running(cluster) > 0, 60, "samples running on the engine")
            time.sleep(0.2)  # ~13 of the 60 tokens
            version += 1
            ckpt = tmp_path / f"ckpt{version}"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), version)
            for _ in range(20):  # past the prefetched groups to the ones the update caught
                rollout_id += 1
                batch = client.generate(rollout_id)
                check_spans(batch)
                caught += [s for s in batch.samples if len(s.weight_versions) == 2]
                if caught:
                    break
        assert caught, f"no sample was caught mid-generation by {version} updates"
        t = batch.to_tensors(current_version=version)
        for row, s in enumerate(batch.samples):
            lp, lr = len(s.prompt_tokens), len(s.response_tokens)
            expected = [-1] * lp + [None] * lr + [-1] * (t["tokens"].shape[1] - lp - lr)
            for label, start, end in s.weight_versions:
                for i in range(start, end):
                    expected[lp + i] = _version(label)
            assert t["versions"][row].tolist() == expected, s.weight_versions
        two = [row for row, s in enumerate(batch.samples) if len(s.weight_versions) == 2]
        assert two and all(set(t["versions"][row].tolist()) == {-1, version - 1, version} for row in two)
        staleness = t["staleness"]
        known = t["versions"] >= 0
        assert torch.equal(staleness[known], version - t["versions"][known]) and (staleness[~known] == -1).all()
