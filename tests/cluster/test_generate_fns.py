"""Custom generate functions (``coordinator serve --generate module:function``) on a real fleet.

A multi-turn sample is made by the function in several engine calls with a tool's output inserted
between them; what the trainer receives must say which tokens the model generated (loss mask 1,
the engine's logprobs) and which it did not (0, logprob 0.0), and the usual guarantees hold.
"""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Starved
from common.generation import RolloutTask, Trajectory
from common.tokenizer import ByteTokenizer
from harness.generate_fns import TOOL_TEXT
from harness.polling import wait_for
from tests.cluster.test_weights import running

TOOL = ByteTokenizer().encode(TOOL_TEXT)


def check_two_turn_sample(sample) -> None:
    tokens, mask, logprobs = sample.response_tokens.tolist(), sample.loss_mask.tolist(), sample.response_logprobs
    assert len(tokens) == len(mask) == len(logprobs)
    if sample.metadata["turns"] == 1:
        assert set(mask) == {1}
        return
    # The tool's tokens sit where the first turn ended, masked out, with no logprob of the model's.
    start = next(i for i, m in enumerate(mask) if m == 0)
    assert tokens[start : start + len(TOOL)] == TOOL
    assert mask[start : start + len(TOOL)] == [0] * len(TOOL)
    assert all(lp == 0.0 for lp in logprobs[start : start + len(TOOL)])
    assert set(mask[:start]) == {1} and set(mask[start + len(TOOL) :]) == {1}
    assert all(lp < 0 for lp in logprobs[:start])  # the sim's logprobs are in [-3, 0)
    assert TOOL_TEXT in sample.response_text
    assert sum(mask) <= 64  # max_new_tokens counts the model's tokens only


@pytest.mark.parametrize("fn", ["two_turns", "two_turns_sync"])
def test_multi_turn_samples_mark_tool_tokens_and_are_delivered_once(make_cluster, fn):
    cluster = make_cluster(generate=f"harness.generate_fns:{fn}", dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a0", concurrency=16)
    client = cluster.client()
    seen = set()
    turns = []
    for step in range(3):
        batch = client.generate(step)
        assert len(batch.groups) == 8
        for group in batch.groups:
            assert (group.data_epoch, group.index) not in seen
            seen.add((group.data_epoch, group.index))
            assert len(group.samples) == 4
            for sample in group.samples:
                check_two_turn_sample(sample)
                turns.append(sample.metadata["turns"])
                if fn.endswith("sync"):
                    assert sample.metadata["sync"] is True
    assert turns.count(2) > len(turns) // 2, turns  # most first turns are cut at half the budget


def test_a_function_may_return_a_dict_with_its_own_reward(make_cluster):
    cluster = make_cluster(generate="harness.generate_fns:scored", dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a0")
    batch = cluster.client().generate(0)
    for group in batch.groups:
        assert [s.reward for s in group.samples] == [0.0, 1.0, 2.0, 3.0]
        assert all(set(s.loss_mask.tolist()) == {1} for s in group.samples)


@pytest.mark.parametrize(
    "fn, reason",
    [("raises", "generate_error: generate function raised ValueError: no tool for row"),
     ("mismatched", "they must be equal")],
)  # fmt: skip
def test_a_failing_function_starves_the_rollout_naming_it(make_cluster, fn, reason):
    cluster = make_cluster(generate=f"harness.generate_fns:{fn}")
    cluster.start_coordinator("--starve-after", "8")
    cluster.start_agent("a0")
    with pytest.raises(Starved, match=reason):
        cluster.client(timeout=60).generate(0)


def test_an_unknown_generate_function_is_refused_at_start(tmp_path):
    from common.demo_data import write_arithmetic_dataset
    from tests.cluster.test_cli_errors import assert_one_line, serve

    dataset = write_arithmetic_dataset(tmp_path / "p.jsonl", 10)
    out = serve(dataset, tmp_path / "d", "--generate", "harness.generate_fns:nope")
    assert_one_line(out, "generate 'harness.generate_fns:nope'", "has no attribute 'nope'")
    assert not (tmp_path / "d").exists()


def _versions_of_generated_tokens(sample) -> list:
    """The weight version of each response token (None for inserted ones), from the sample's spans."""
    per_token = [None] * len(sample.response_tokens)
    for version, start, end in sample.weight_versions:
        for i in range(start, end):
            assert per_token[i] is None, sample.weight_versions  # spans do not overlap
            per_token[i] = version
    return per_token


@pytest.mark.timeout(240)
@pytest.mark.parametrize("partial", [True, False])
def test_a_turn_cut_by_a_weight_update_continues_or_restarts_the_sample(make_cluster, tmp_path, partial):
    import threading

    cluster = make_cluster(generate="harness.generate_fns:two_turns", dynamic_filter="none", rollout_batch_size=4)
    cluster.start_coordinator("--partial-rollout" if partial else "--no-partial-rollout")
    cluster.start_agent("a0", concurrency=16, sim_args="--token-latency-ms 25")
    with cluster.client() as client:
        batches, failures = [], []

        def generate():
            try:
                batches.extend(client.generate(i) for i in range(6))
            except Exception as exc:  # reported by the main thread
                failures.append(exc)

        thread = threading.Thread(target=generate)
        thread.start()
        for version in (1, 2, 3, 4, 5):
            # After `version` batches the fleet is mid-stream (prefetched groups generating), so the update
            # cuts turns that already hold tokens; right at the start it would find them with none yet.
            wait_for(lambda: len(batches) >= version and running(cluster) > 0, 60, "samples generating")
            ckpt = tmp_path / f"ckpt{version}"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), version)
        thread.join(180)
        assert not failures, failures
    mixed = 0
    for batch in batches:
        for group in batch.groups:
            for sample in group.samples:
                check_two_turn_sample(sample)
                versions = _versions_of_generated_tokens(sample)
                mask = sample.loss_mask.tolist()
                # Every generated token has a version; no inserted token has one.
                assert all((v is not None) == (m == 1) for v, m in zip(versions, mask, strict=True))
                # Each turn (a run of generated tokens) is one engine call: continued across an update
                # with partial rollout (several versions), restarted without (one version each).
                turns = [set()]
                for v in versions:
                    if v is None:
                        if turns[-1]:
                            turns.append(set())
                    else:
                        turns[-1].add(v)
                mixed += any(len(t) > 1 for t in turns)
                if not partial:
                    assert all(len(t) <= 1 for t in turns), sample.weight_versions
    if partial:
        assert mixed > 0, "no sample saw a weight update mid-rollout: the test did not test it"


async def two_at_once(task: RolloutTask, engine) -> Trajectory:
    """Two calls of one sample at once (``asyncio.gather``): a best-of-two, the longer answer kept."""
    answers = await asyncio.gather(engine.generate(task.prompt_tokens), engine.generate(task.prompt_tokens))
    best = max(answers, key=lambda g: len(g.tokens))
    return Trajectory(metadata={"calls": len(answers)}).add(best)


def test_a_function_may_run_calls_of_one_sample_concurrently(make_cluster):
    """Red if: the sample's concurrent calls share one rid, which SGLang refuses as a duplicate (400),
    so every group starts over until its prompt fails and the rollout starves."""
    cluster = make_cluster(generate="tests.cluster.test_generate_fns:two_at_once", dynamic_filter="none")
    cluster.start_coordinator("--starve-after", "8")
    cluster.start_agent("a0", concurrency=16, sim_args="--token-latency-ms 2")
    with cluster.client(timeout=60) as client:
        for step in range(2):
            batch = client.generate(step)
            assert len(batch.groups) == 8
            for group in batch.groups:
                for sample in group.samples:
                    assert sample.metadata["calls"] == 2
                    assert len(sample.response_tokens) > 0 and set(sample.loss_mask.tolist()) == {1}
    assert "Duplicate request ID" not in cluster.agents["a0"].text()


def _engine_running(cluster, agent: str) -> int:
    """Requests running on the agent's (one) engine, from the engine's own ``/v1/loads``."""
    import json
    import urllib.request

    url = cluster.status()["agents"][agent]["engines"][0]["url"]
    with urllib.request.urlopen(url + "/v1/loads", timeout=5) as resp:
        return json.loads(resp.read())["loads"][0]["num_running_reqs"]


def test_a_pause_with_abort_reaches_every_concurrent_call_of_a_function(make_cluster):
    """Red if: the agent aborts a sample by its base rid only, which SGLang drops (it holds only the
    calls' ``<base>-c<k>`` rids): the calls run to their end, the groups are committed (ready 8, not 0)
    and the engine is still busy when pause() returns."""
    cluster = make_cluster(
        generate="tests.cluster.test_generate_fns:two_at_once", dynamic_filter="none", max_new_tokens=400
    )
    cluster.start_coordinator()
    # 400 tokens at 50 ms: 20 s a call unless aborted; 8 groups of 4 samples, 2 calls each.
    cluster.start_agent("a1", sim_args="--token-latency-ms 50 --output-len-dist fixed --output-len-median 400")
    with cluster.client(timeout=60) as client:
        wait_for(lambda: _engine_running(cluster, "a1") == 64, 30, "every call of the prefetched groups running")
        client.pause(drain=True, abort=True)
        s = cluster.status()
        assert s["paused"] and s["leased"] == 0 and s["ready"] == 0, s
        assert _engine_running(cluster, "a1") == 0, "aborted calls still run on the engine"
