"""A reward or filter that raises on every group, on real processes.

The user's scoring code is broken (it raises at runtime, after the coordinator imported it
fine). What must hold:
- ``generate()`` raises ``Starved`` within a bounded time, naming the spec and the exception,
  instead of waiting until a timeout that blames the network;
- the dataset is not burned: no prompt is filtered for the failures, every prompt is pending
  again once the leases in flight came back, and the status says why the rollout is starved;
- a later ``generate()`` starts over: with the agent restarted on fixed code, batches come.
"""

from __future__ import annotations

import signal
import textwrap
import time

import pytest

from common.errors import Starved
from harness.polling import wait_for

ROWS = 400
FAST = "--output-len-dist fixed --output-len-median 16"
MODULE = "rollfleet_failing_support"

BROKEN = textwrap.dedent(
    """
    def boom(sample):
        raise RuntimeError("boom")

    def explode(samples):
        return {}["verdict"]
    """
)

FIXED = textwrap.dedent(
    """
    import random

    def boom(sample):  # rewards that differ within a group, so the default filter keeps it
        return random.random()

    def explode(samples):
        return True
    """
)


def settled_status(cluster) -> dict:
    """The status once the leases in flight when the rollout starved have come back."""
    return wait_for(lambda: (s := cluster.status())["leased"] == 0 and s, 30, "in-flight leases to come back")


def assert_nothing_burned(status: dict) -> None:
    prompts = status["prompts"]
    assert prompts["filtered"] == 0 and status["filtered_total"] == 0, f"prompts were burned: {status}"
    assert prompts["pending"] == ROWS and status["data_epochs"] == [0], status


@pytest.fixture
def support(tmp_path, monkeypatch):
    """The user's module, importable by the coordinator and the agents; returns a rewriter."""
    path = tmp_path / f"{MODULE}.py"
    path.write_text(BROKEN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return path


def test_reward_that_raises_starves_generate_with_its_name_and_burns_no_prompt(make_cluster, support):
    """Red if: generate() waits (the client's timeout fires instead, blaming the network), the error
    does not name the spec and the exception, prompts end up filtered, or a new generate() after the
    fix does not resume admission."""
    cluster = make_cluster(rows=ROWS, reward=f"{MODULE}:boom")
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", sim_args=FAST)
    with cluster.client(timeout=60) as client:
        started = time.monotonic()
        with pytest.raises(Starved) as caught:
            client.generate(0)
        elapsed = time.monotonic() - started
        why = str(caught.value)
        assert why.startswith("every group of the last 64 failed: "), why  # the default: max(64, 2 x 8)
        assert f"reward_error: reward '{MODULE}:boom' raised RuntimeError: boom" in why
        assert elapsed < 30, f"Starved took {elapsed:.1f}s"
        status = settled_status(cluster)
        assert status["starved"] == why
        assert_nothing_burned(status)

        # The user fixes the reward and restarts the agent; the next generate() starts over.
        support.write_text(FIXED)
        agent.signal(signal.SIGTERM)
        agent.wait(30)
        cluster.start_agent("a1", sim_args=FAST)
        batch = client.generate(0)
        assert len(batch.groups) == 8
        assert cluster.status()["starved"] is None


def test_filter_that_raises_starves_generate_too(make_cluster, support):
    """Red if: a filter that raises is taken for a filter verdict (prompts filtered, generate waits),
    or ``--starve-after`` is not honoured."""
    cluster = make_cluster(rows=ROWS, dynamic_filter=f"{MODULE}:explode")
    cluster.start_coordinator("--starve-after", "16")
    cluster.start_agent("a1", sim_args=FAST)
    with cluster.client(timeout=60) as client:
        with pytest.raises(Starved) as caught:
            client.generate(0)
        why = str(caught.value)
        assert why.startswith("every group of the last 16 failed: "), why
        assert f"filter_error: filter '{MODULE}:explode' raised KeyError: 'verdict'" in why
        assert_nothing_burned(settled_status(cluster))
        # Still broken: the next call starts over and is told again, after a fresh window.
        with pytest.raises(Starved):
            client.generate(0)
        assert_nothing_burned(settled_status(cluster))


def test_filter_that_drops_every_group_warns_then_starves_generate_with_the_counts(make_cluster):
    """The stall a newcomer hit: ``--max-new-tokens 8`` truncates every sim answer before its
    ``\\boxed{}``, so every reward is 0 and the default filter (``nonzero_std``) drops every group.
    Red if: generate() keeps waiting while the dataset burns (the default is one data epoch of
    drops, here 200 rows), the coordinator says nothing, or the error lacks the counts by reason."""
    cluster = make_cluster(rows=200, max_new_tokens=8)
    coordinator = cluster.start_coordinator("--starve-after", "16")
    cluster.start_agent("a1", sim_args=FAST)
    with cluster.client(timeout=60) as client:
        with pytest.raises(Starved) as caught:
            client.generate(0)
        why = str(caught.value)
        assert why.startswith("the filter dropped every group of the last 200 (none kept): zero_std_0="), why
        status = settled_status(cluster)
        assert status["starved"] == why and status["last_rollout_id"] == -1
        # Dropped prompts stay filtered (the filter's verdict), counted: one epoch's worth, not ten.
        assert ROWS > status["filtered_total"] >= 200 and status["prompts"]["filtered"] >= 1, status
    warning = "the filter dropped every group of the last 16 (none kept): zero_std_0=16"
    assert warning in coordinator.text(), "no WARNING while the groups were being dropped"
