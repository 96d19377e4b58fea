"""Training datasets mixed by weight (``--dataset NAME=PATH,weight=W,...``) on a real loopback cluster.

Three sources of different sizes, weights 0.5/0.3/0.2 of a batch of 10 (5/3/2 groups), each with
its own settings: ``math`` the fleet's (the math reward, no filter), ``code`` its own dynamic filter
(nonzero_std: it drops groups whose samples all score alike), ``tool`` its own reward (0.5 for every
sample) and ``max_new_tokens`` (6). Every batch's composition is exact, whatever the filter drops;
per-source metrics equal what the groups give; each source runs through its own epochs, a prompt
delivered once per epoch; ``set_mixture`` takes effect at the rollout id it answers with and holds
across a coordinator SIGKILL, batches recorded before it replayed the same.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from collections import Counter

import pytest

from common.demo_data import write_arithmetic_dataset
from common.errors import RolloutError, Starved

pytestmark = pytest.mark.timeout(300)

SIZES = {"math": 40, "code": 24, "tool": 8}
BATCH = 10
SAMPLES = 4
TOOL_TOKENS = 6


def sources(tmp) -> list[str]:
    paths = {
        name: write_arithmetic_dataset(tmp / f"{name}.jsonl", n, seed=i) for i, (name, n) in enumerate(SIZES.items())
    }
    return [
        f"math={paths['math']},weight=0.5",
        f"code={paths['code']},weight=0.3,filter=nonzero_std",
        f"tool={paths['tool']},weight=0.2,reward=harness.rewards:constant_half,max_new_tokens={TOOL_TOKENS}",
    ]


def composition(batch) -> dict[str, int]:
    return dict(Counter(g.source for g in batch.groups))


def check_source_metrics(batch) -> None:
    """``rollout/source/<NAME>/*`` equal what the batch's groups of that source give."""
    for name in SIZES:
        groups = [g for g in batch.groups if g.source == name]
        samples = [s for g in groups for s in g.samples]
        n = len(samples)
        expected = {
            "groups": float(len(groups)),
            "reward_mean": sum(s.reward for s in samples) / n if n else 0.0,
            "response_len_mean": sum(len(s.response_tokens) for s in samples) / n if n else 0.0,
            "truncated_ratio": sum(s.status == "truncated" for s in samples) / n if n else 0.0,
        }
        for key, value in expected.items():
            got = batch.metrics[f"rollout/source/{name}/{key}"]
            assert math.isclose(got, value, abs_tol=1e-9), f"{name}/{key}: {got} reported, the groups give {value}"
        if name != "code":
            assert batch.metrics[f"rollout/source/{name}/dropped_groups"] == 0.0


def test_three_sources_hold_their_shares_settings_and_epochs_and_set_mixture_survives_a_sigkill(make_cluster, tmp_path):
    cluster = make_cluster(
        datasets=sources(tmp_path), rollout_batch_size=BATCH, n_samples_per_prompt=SAMPLES, dynamic_filter="none"
    )
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args="--output-len-dist lognormal --output-len-median 12 --output-len-sigma 0.6")
    batches = {}
    with cluster.client() as client:
        for rollout_id in range(6):
            batches[rollout_id] = batch = client.generate(rollout_id)
            assert composition(batch) == {"math": 5, "code": 3, "tool": 2}, (rollout_id, composition(batch))
            check_source_metrics(batch)
        dropped = sum(b.metrics["rollout/source/code/dropped_groups"] for b in batches.values())
        assert dropped > 0, "code's own filter dropped nothing: its filter setting did not reach the agent"
        for g in (g for b in batches.values() for g in b.groups if g.source == "tool"):
            assert all(s.reward == 0.5 and len(s.response_tokens) <= TOOL_TOKENS for s in g.samples)
        for g in (g for b in batches.values() for g in b.groups if g.source != "tool"):
            assert {s.reward for s in g.samples} <= {0.0, 1.0}  # the math reward, not tool's
        # Each source runs through its own epochs: 12 tool groups of 8 prompts opened its epoch 1
        # while math (40 prompts, 30 delivered) is still in its first. Once per (source, epoch, index).
        seen = Counter((g.source, g.data_epoch, g.index) for b in batches.values() for g in b.groups)
        assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
        tool_epoch0 = {i for (src, e, i) in seen if src == "tool" and e == 0}
        assert tool_epoch0 == set(range(SIZES["tool"])), sorted(tool_epoch0)
        assert {e for (src, e, _) in seen if src == "tool"} == {0, 1}
        assert {e for (src, e, _) in seen if src == "math"} == {0}
        by_source = client.stats().sources
        assert by_source["tool"].data_epochs[-1] >= 1 and by_source["math"].data_epochs == (0,)
        assert by_source["code"].filtered >= dropped
        table = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", cluster.address],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        for name, weight in (("math", 0.5), ("code", 0.3), ("tool", 0.2)):
            assert f"dataset {name}: weight {weight}, data epochs" in table, table

        # A curriculum: the new weights start at the first rollout id not recorded yet.
        with pytest.raises(RolloutError, match="unknown dataset name"):
            client.set_mixture({"math": 1.0, "poetry": 1.0})
        answer = client.set_mixture({"math": 0.2, "code": 0.3, "tool": 0.5})
        assert answer.from_rollout_id == 6
        batches[6] = client.generate(6)
        assert composition(batches[6]) == {"math": 2, "code": 3, "tool": 5}
        check_source_metrics(batches[6])

        cluster.coordinator.signal(signal.SIGKILL)
        cluster.coordinator.wait(30)
        cluster.start_coordinator("--agent-ttl", "5")
        # Recorded batches, before and after the change, replay the same; the change holds.
        for rollout_id in (5, 6):
            again = client.generate(rollout_id)
            assert [(g.source, g.data_epoch, g.index) for g in again.groups] == [
                (g.source, g.data_epoch, g.index) for g in batches[rollout_id].groups
            ]
        batches[7] = client.generate(7)
        assert composition(batches[7]) == {"math": 2, "code": 3, "tool": 5}
        assert client.stats().sources["tool"].weight == 0.5
        seen = Counter((g.source, g.data_epoch, g.index) for b in batches.values() for g in b.groups)
        assert max(seen.values()) == 1
        client.pause(drain=True)
        assert client.state_dict()["mixture"] == [[0, [0.5, 0.3, 0.2]], [6, [0.2, 0.3, 0.5]]]


def test_mixture_flags_are_checked_at_start_naming_the_value(make_cluster, tmp_path):
    path = write_arithmetic_dataset(tmp_path / "a.jsonl", 8)
    cases = [
        ([f"a={path},weight=-1"], "weight must be a number >= 0"),
        ([f"a={path},weight=1", f"a={path},weight=2"], "'a' is given twice"),
        ([f"a={path},colour=red"], "unknown option 'colour'"),
        ([f"a={path},weight=0"], "must not all be 0"),
        ([f"a={path},reward=no_such_module:f"], "no_such_module"),
    ]
    for datasets, why in cases:
        cluster = make_cluster(datasets=datasets)
        proc = cluster.start_coordinator(wait=False)
        assert proc.wait(60) != 0
        assert why in proc.text(), (datasets, proc.text()[-2000:])


def test_a_dataset_whose_reward_always_fails_starves_the_rollout_naming_it(make_cluster, tmp_path):
    good = write_arithmetic_dataset(tmp_path / "good.jsonl", 40)
    bad = write_arithmetic_dataset(tmp_path / "bad.jsonl", 40, seed=1)
    cluster = make_cluster(
        datasets=[f"good={good},weight=1", f"bad={bad},weight=1,reward=harness.rewards:raises"],
        dynamic_filter="none",
        starve_after=8,
        rollout_batch_size=4,  # good's share (2) and its prefetch fill long before bad's failures starve the rollout
    )
    cluster.start_coordinator()
    cluster.start_agent("a1")
    with cluster.client(timeout=60) as client:
        with pytest.raises(Starved, match="dataset bad: .*this reward always fails"):
            client.generate(0)
        stats = client.stats()
        assert stats.sources["good"].filtered == 0
        # The waiting batch was failed with good's share ready: enough groups in all, none of bad's.
        assert stats.sources["good"].prompts.ready >= 2


def test_weights_changed_at_a_restart_need_allow_config_change_and_apply_from_the_next_batch(make_cluster, tmp_path):
    a = write_arithmetic_dataset(tmp_path / "a.jsonl", 40)
    b = write_arithmetic_dataset(tmp_path / "b.jsonl", 40, seed=1)
    cluster = make_cluster(datasets=[f"a={a},weight=1", f"b={b},weight=1"], rollout_batch_size=4, dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1")
    with cluster.client() as client:
        first = client.generate(0)
        assert composition(first) == {"a": 2, "b": 2}
        cluster.coordinator.signal(signal.SIGTERM)
        cluster.coordinator.wait(30)
        cluster.datasets = [f"a={a},weight=3", f"b={b},weight=1"]
        refused = cluster.start_coordinator(wait=False)
        assert refused.wait(60) != 0 and "--allow-config-change" in refused.text()
        cluster.start_coordinator("--allow-config-change")
        again = client.generate(0)
        assert [(g.source, g.index) for g in again.groups] == [(g.source, g.index) for g in first.groups]
        assert composition(client.generate(1)) == {"a": 3, "b": 1}
        assert client.stats().sources["a"].weight == 3.0


def test_an_agent_with_its_own_dataset_is_refused_by_a_mixture_saying_why(make_cluster, tmp_path):
    a = write_arithmetic_dataset(tmp_path / "a.jsonl", 8)
    b = write_arithmetic_dataset(tmp_path / "b.jsonl", 8, seed=1)
    cluster = make_cluster(datasets=[f"a={a},weight=1", f"b={b},weight=1"])
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", "--dataset", str(a), wait=False)
    assert agent.wait(60) != 0
    assert "mixes several training datasets (a, b): start the agent without --dataset" in agent.text()


def test_a_datasets_own_group_size_and_greedy_sampling_reach_its_groups(make_cluster, tmp_path):
    a = write_arithmetic_dataset(tmp_path / "a.jsonl", 40)
    b = write_arithmetic_dataset(tmp_path / "b.jsonl", 40, seed=1)
    cluster = make_cluster(
        datasets=[f"a={a},weight=1", f"b={b},weight=1,n_samples=2,temperature=0"],
        rollout_batch_size=4,
        dynamic_filter="none",
    )
    cluster.start_coordinator()
    cluster.start_agent("a1")
    with cluster.client() as client:
        for rollout_id in range(2):
            batch = client.generate(rollout_id)
            assert sorted((g.source, len(g.samples)) for g in batch.groups) == [("a", 4), ("a", 4), ("b", 2), ("b", 2)]
            assert batch.metrics["rollout/samples"] == 12.0 and batch.to_tensors()["tokens"].shape[0] == 12
            for g in batch.groups:
                if g.source == "b":  # greedy: the sim answers a prompt the same way every time
                    assert g.samples[0].response_tokens == g.samples[1].response_tokens
