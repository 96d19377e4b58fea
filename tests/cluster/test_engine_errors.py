"""Engine errors that are not an engine's death, on real processes (agent/lease_runner.py).

- HTTP 400 (the sim refuses a prompt longer than its ``--context-length``, as SGLang does): the
  group is tried a bounded number of times, then its prompt fails with the engine's message,
  counted by the coordinator like a failing reward; the batch completes from other prompts, or
  ``generate()`` raises ``Starved`` naming the refusal when every prompt is refused.
- HTTP 503 "The request queue is full." (the sim's ``--max-queued-requests``, SGLang's flag):
  backpressure; the engine stays healthy (never reported, never restarted) and every batch completes.
- ``--sampling-params``: a valid object reaches the engines (it changes what they generate).
"""

from __future__ import annotations

import json
import re

import pytest

from common.demo_data import arithmetic_rows
from common.errors import Starved

FIXED = "--output-len-dist fixed --output-len-median 16"
LONG_EVERY = 4  # every 4th prompt is too long for the engine
CONTEXT = "--context-length 200"  # 64 new tokens + a ~60-byte prompt fit; a 300-byte prompt does not


def write_dataset(path, rows: int, long_every: int):
    """Arithmetic prompts; those whose index is a multiple of ``long_every`` padded to 300 bytes."""
    short = arithmetic_rows(rows)
    long = arithmetic_rows(rows, prompt_bytes=300)
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps(long[i] if i % long_every == 0 else short[i]) + "\n")
    return path


def test_prompt_the_engine_refuses_fails_with_its_reason_and_batches_complete_from_the_others(make_cluster, tmp_path):
    """Red if: a 400 is retried forever (no batch, or the same lease refused more than MAX_REJECTED
    times), taken for a dead engine (reported to the supervisor), lost (the prompt neither delivered
    nor filtered), or a batch carries a refused prompt."""
    rows = 64
    dataset = write_dataset(tmp_path / "mixed.jsonl", rows, LONG_EVERY)
    cluster = make_cluster(dataset=dataset, dynamic_filter="none")
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", sim_args=f"{FIXED} {CONTEXT}")
    delivered = set()
    with cluster.client() as client:
        for step in range(5):  # 40 of the 48 short prompts
            batch = client.generate(step)
            assert len(batch.groups) == 8
            delivered |= {g.index for g in batch.groups}
    assert not any(i % LONG_EVERY == 0 for i in delivered), sorted(delivered)
    log = agent.text()
    reason = "longer than the model's context length"
    failed = re.findall(r"lease (\w+) \(index (\d+)\) failed: refused 3 times, last: .*HTTP 400: .*", log)
    assert failed and reason in log, log[-3000:]
    assert all(int(index) % LONG_EVERY == 0 for _, index in failed), failed
    for lease, _ in failed:  # each lease tried at most MAX_REJECTED times
        assert len(re.findall(rf"lease {lease}: .*starting the group over", log)) == 2, lease
    assert "failure reported" not in log and "retrying on another engine" not in log
    assert len(cluster.engine_pids_of("a1")) == 1  # never restarted
    # Every refused prompt is accounted for: failed and retried, then filtered; none is lost or leased forever.
    status = cluster.status()
    prompts = status["prompts"]
    assert sum(prompts.values()) == rows, prompts


def test_engine_that_refuses_every_prompt_starves_generate_with_the_reason(make_cluster):
    """Red if: generate() waits instead of raising, or the error does not say the engine refused the prompt."""
    cluster = make_cluster(rows=200, dynamic_filter="none")
    cluster.start_coordinator("--starve-after", "8")
    cluster.start_agent("a1", sim_args=f"{FIXED} --context-length 80")  # no prompt + 64 tokens fits
    with cluster.client() as client:
        with pytest.raises(Starved) as caught:
            client.generate(0)
    why = str(caught.value)
    assert why.startswith("every group of the last 8 failed: generation_failed: refused 3 times"), why
    assert "HTTP 400" in why and "context length" in why, why


def test_full_request_queue_is_backpressure_the_engine_stays_healthy_and_batches_complete(make_cluster):
    """Two slots, one queue place, 32 samples in flight: most requests are refused with 503 queue full.
    Red if: the engine is reported or taken out of the pool (capacity drops, it is restarted), a prompt
    fails for it, or a batch does not complete."""
    cluster = make_cluster(rows=200, dynamic_filter="none")
    cluster.start_coordinator()
    sim = f"--token-latency-ms 2 {FIXED} --slots 2 --max-queued-requests 1"
    agent = cluster.start_agent("a1", concurrency=32, sim_args=sim)
    with cluster.client() as client:
        for step in range(3):
            batch = client.generate(step)
            assert len(batch.groups) == 8
            assert all(len(g.samples) == 4 for g in batch.groups)
    log = agent.text()
    assert "queue full for" in log, log[-3000:]
    assert "failure reported" not in log and "retrying on another engine" not in log, log[-3000:]
    assert " failed" not in log.replace("failed: 0", ""), log[-3000:]
    assert len(cluster.engine_pids_of("a1")) == 1
    engines = cluster.status()["agents"]["a1"]["engines"]
    assert [e["state"] for e in engines] == ["healthy"], engines


def test_sampling_params_flag_reaches_the_engines(make_cluster):
    """``--sampling-params '{"min_new_tokens": 64}'`` with ``--max-new-tokens 64``: every sample is 64
    tokens long, where the sim alone answers in 16. Red if the object is not sent to the engines."""
    cluster = make_cluster(rows=64, dynamic_filter="none")
    cluster.start_coordinator("--sampling-params", '{"min_new_tokens": 64, "stop": ["</answer>"]}')
    cluster.start_agent("a1", sim_args=FIXED)
    with cluster.client() as client:
        batch = client.generate(0)
    lengths = {len(s.response_tokens) for g in batch.groups for s in g.samples}
    assert lengths == {64}, lengths
