"""What a trainer sees around pauses, a second trainer, and payloads a live node no longer has.

Real loopback clusters (coordinator, agents, sim engines), driven through the public trainer API
(``RolloutClient``) and ``coordinator status``. Each test names, in its docstring, the bug that
turns it red. Nothing is slept for: every wait polls a positive signal with a deadline.

Semantics under test (docs/guides/trainer.md; ``coordinator/core.py``):
- ``pause(drain=True)`` stops admission and returns once no lease is in flight: groups already
  on an engine finish and are committed (they become ready).
- ``pause(drain=True, abort=True)`` aborts the engine requests of the groups in flight; their
  leases are given back and their prompts are pending again (first in line), nothing of them is
  committed. After ``resume()`` they are generated again, and nothing is lost or repeated.
- A second trainer attaching replaces the first: the first's waiting ``generate()`` and every
  later call raise ``Fenced``; the second is served.
- One trainer's calls in flight together across a coordinator restart (a ``generate`` waiting
  while weights are pushed) attach again once, and none of them is fenced by the others.
- A payload missing on a live node: the trainer reports it, the coordinator drops the group from
  the batch and completes it with a replacement (``rollout/replaced_groups``); a prompt never
  trained on is generated again, one already trained on is not.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import lmdb
import pytest

from common.errors import Fenced
from coordinator.client import AsyncRolloutClient
from harness.polling import wait_for

# 48 tokens at 50 ms: a group stays on its engine for ~2.4 s, long enough to pause it mid-flight.
SLOW = "--token-latency-ms 50 --output-len-dist fixed --output-len-median 48"
FAST = "--output-len-dist fixed --output-len-median 16"


# --------------------------------------------------------------------------- helpers


def engine_running(cluster, agent: str) -> int:
    """Requests running on the agent's (one) engine, from the engine's own SGLang ``/v1/loads``."""
    url = cluster.status()["agents"][agent]["engines"][0]["url"]
    with urllib.request.urlopen(url + "/v1/loads", timeout=5) as resp:
        return json.loads(resp.read())["loads"][0]["num_running_reqs"]


def check_batch(cluster, batch, seen: dict) -> set[int]:
    """A complete batch of whole groups, no prompt seen before; returns its dataset indices."""
    size, n = cluster.config["rollout_batch_size"], cluster.config["n_samples_per_prompt"]
    assert len(batch.groups) == size, f"batch {batch.rollout_id} has {len(batch.groups)} groups"
    for g in batch.groups:
        key = (g.data_epoch, g.index)
        assert key not in seen, f"prompt {key} delivered in batch {seen[key]} and again in batch {batch.rollout_id}"
        seen[key] = batch.rollout_id
        assert len(g.samples) == n
        assert all(s.status == "completed" and s.response_tokens for s in g.samples), "a partial (aborted) sample"
    return {g.index for g in batch.groups}


def _store_env(cluster, agent: str) -> lmdb.Environment:
    # The agent keeps its store open; LMDB's lock file makes a second process's transaction safe.
    return lmdb.open(str(cluster.tmp / agent / "store"), map_size=1 << 40, max_dbs=4, create=False)


def stored_keys(cluster, agent: str) -> set[str]:
    env = _store_env(cluster, agent)
    try:
        with env.begin() as txn:
            return {k.decode() for k, _ in txn.cursor(db=env.open_db(b"groups", txn=txn, create=False))}
    finally:
        env.close()


def lose_stored_group(cluster, agent: str, key: str) -> None:
    """The node is up but no longer has this payload (a wiped or damaged disk)."""
    env = _store_env(cluster, agent)
    try:
        with env.begin(write=True) as txn:
            assert txn.delete(key.encode(), db=env.open_db(b"groups", txn=txn, create=False)), f"{key} not stored"
    finally:
        env.close()


def prompt_of(key: str) -> tuple[int, int]:
    epoch, index, _ = key.split(":")
    return int(epoch), int(index)


# --------------------------------------------------------------------------- pause


def test_pause_drain_commits_groups_in_flight_and_abort_gives_them_back(make_cluster):
    """Drain: the groups on the engine finish and are ready when pause() returns. Abort: their
    engine requests are aborted, their prompts are pending again and, after resume(), are the
    next ones generated; every later batch is complete and no prompt comes twice.

    Red if: abort is ignored (the aborted groups finish and are committed: ready 8, not 0); the
    agent keeps an aborted lease (the drain never completes: pause times out); a released prompt
    is lost (batch 1 is not prompts 8..15) or committed half-generated (aborted samples); drain
    aborts instead of waiting (ready 0 after the drain).
    """
    cluster = make_cluster(dynamic_filter="none")  # no shuffle: prompts are leased in file order
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args=SLOW)  # 32 slots: 8 groups of 4 at once
    seen: dict = {}
    with cluster.client(timeout=30) as client:
        # The prefetch (one batch) puts prompts 0..7 on the engine before any generate().
        wait_for(
            lambda: engine_running(cluster, "a1") == 32 and cluster.status()["leased"] == 8,
            30,
            "prompts 0..7 to be generating on the engine",
        )
        client.pause(drain=True)
        s = cluster.status()
        assert s["paused"] and s["leased"] == 0
        assert s["ready"] == 8 and s["prompts"]["ready"] == 8, f"drain must let groups in flight finish: {s}"
        assert engine_running(cluster, "a1") == 0
        client.resume()
        assert check_batch(cluster, client.generate(0), seen) == set(range(8))

        # generate(0) took the prefetched groups, so prompts 8..15 are on the engine now.
        wait_for(
            lambda: engine_running(cluster, "a1") == 32 and cluster.status()["leased"] == 8,
            30,
            "prompts 8..15 to be generating on the engine",
        )
        assert cluster.status()["ready"] == 0
        client.pause(drain=True, abort=True)
        s = cluster.status()
        assert s["paused"] and s["leased"] == 0
        assert s["ready"] == 0, f"abort must not let the groups in flight finish: {s}"
        assert s["prompts"]["pending"] == 400 - 8 and s["prompts"]["delivered"] == 8, s["prompts"]
        assert engine_running(cluster, "a1") == 0, "aborted requests still run on the engine"

        client.resume()
        # The aborted prompts are first in line: they are the next batch, generated in full.
        assert check_batch(cluster, client.generate(1), seen) == set(range(8, 16))
        assert check_batch(cluster, client.generate(2), seen) == set(range(16, 24))
    s = cluster.status()
    assert s["prompts"]["delivered"] == 24 and s["filtered_total"] == 0


# --------------------------------------------------------------------------- a second trainer


def test_second_trainer_fences_the_first_whose_generate_was_waiting(make_cluster):
    """A trainer's generate() waits (no agent yet); a second trainer attaches. The first's waiting
    call raises ``Fenced``; it stays fenced (later calls too, and its close() does not detach the
    second), and the second gets every batch; no batch reaches the first.

    Red if: the waiting call is dropped (it hangs: ``result`` times out) or served; the fenced
    client re-attaches transparently and steals the session back; a fenced detach clears the
    second trainer's session; the first's demand stays queued (a second pending generate).
    """
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    first = cluster.client(client_id="trainer-a")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(first.generate, 0)
        wait_for(lambda: cluster.status()["pending_generates"] == 1, 30, "generate(0) of trainer-a to wait")
        second = cluster.client(client_id="trainer-b")
        with pytest.raises(Fenced):
            waiting.result(timeout=30)
    s = cluster.status()
    assert s["trainer"] == "trainer-b" and s["pending_generates"] == 0, s

    cluster.start_agent("a1", sim_args=FAST)
    seen: dict = {}
    check_batch(cluster, second.generate(0), seen)
    with pytest.raises(Fenced):
        first.generate(1)
    with pytest.raises(Fenced):
        first.generate(0)  # even a recorded batch is not handed to a replaced trainer
    first.close()
    assert cluster.status()["trainer"] == "trainer-b", "the fenced trainer's close() detached the new one"
    check_batch(cluster, second.generate(1), seen)
    assert cluster.status()["trainer"] == "trainer-b"


# --------------------------------------------------------------------------- missing payloads


def test_payload_missing_on_a_live_node_is_replaced_and_regenerated_once(make_cluster):
    """A live agent no longer has a ready group's payload. The trainer's generate() still returns
    a complete batch (one replacement, ``rollout/replaced_groups`` = 1); the lost prompt, never
    trained on, is generated again and delivered exactly once. A payload lost from a batch the
    trainer already fetched is replaced by a fresh prompt on replay; that prompt is not repeated.

    Red if: generate() hangs or raises on a missing payload (FetchFailed not reported to the
    coordinator, or the batch never repaired); the batch comes back short; the lost prompt is
    forgotten (never delivered) or delivered twice; a replay re-delivers a trained prompt.
    """
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args=FAST)
    seen: dict = {}
    with cluster.client(timeout=30) as client:
        first = client.generate(0)
        batch0 = check_batch(cluster, first, seen)
        # Settled at the prefetch bound: the 8 ready groups are exactly the next batch.
        wait_for(
            lambda: (lambda s: s["ready"] == 8 and s["leased"] == 0)(cluster.status()), 30, "the prefetch to be ready"
        )
        ready = sorted(k for k in stored_keys(cluster, "a1") if prompt_of(k)[1] not in batch0)
        assert len(ready) == 8, ready
        lost = ready[0]
        lose_stored_group(cluster, "a1", lost)

        batch = client.generate(1)
        check_batch(cluster, batch, seen)
        assert batch.metrics["rollout/replaced_groups"] == 1.0
        rid = 2
        while prompt_of(lost) not in seen:
            assert rid < 5, f"lost prompt {prompt_of(lost)} was never generated again"
            check_batch(cluster, client.generate(rid), seen)
            rid += 1
        assert cluster.status()["batches_in_repair"] == []

        # Now a payload of batch 0, which the trainer fetched (trained on), goes missing: a replay
        # of batch 0 keeps the other 7 groups and fills the gap with a prompt never delivered.
        gone = next(k for k in stored_keys(cluster, "a1") if prompt_of(k)[1] == first.groups[0].index)
        lose_stored_group(cluster, "a1", gone)
        again = client.generate(0)
        assert len(again.groups) == 8
        assert again.metrics["rollout/replaced_groups"] == 1.0
        kept = [(g.data_epoch, g.index) for g in first.groups[1:]]
        assert [(g.data_epoch, g.index) for g in again.groups if (g.data_epoch, g.index) in kept] == kept
        fresh = [(g.data_epoch, g.index) for g in again.groups if (g.data_epoch, g.index) not in kept]
        assert len(fresh) == 1 and fresh[0] not in seen, f"replay re-delivered a trained prompt: {fresh}"
        seen[fresh[0]] = 0
        # The trained prompt is not generated again: the next batches hold only new prompts.
        for later in (rid, rid + 1):
            check_batch(cluster, client.generate(later), seen)


async def test_calls_in_flight_across_a_coordinator_restart_attach_once_and_none_is_fenced(make_cluster, caplog):
    """Red if: each call that finds the coordinator restarted attaches on its own, so the sessions
    they make fence one another and all but the last raise ``Fenced`` (seen in the chaos run: a
    generate waiting while the trainer pushed a rescue update)."""
    cluster = make_cluster(dynamic_filter="none")
    coordinator = cluster.start_coordinator()
    async with AsyncRolloutClient(cluster.address, timeout=60, retry_interval=0.2) as client:
        before = client.session
        coordinator.signal(signal.SIGKILL)
        coordinator.wait(30)
        cluster.start_coordinator()
        with caplog.at_level("WARNING", logger="rollfleet.client"):
            results = await asyncio.gather(*(client.pause(drain=False) for _ in range(4)), return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
        attaches = [r for r in caplog.records if "attaching again" in r.getMessage()]
        assert len(attaches) == 1, [r.getMessage() for r in attaches]
        assert client.session not in (0, before)
        assert (await client.resume()) is not None, "the session the calls share is the current one"
        assert cluster.status()["trainer"] == client.client_id
