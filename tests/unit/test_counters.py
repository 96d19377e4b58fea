"""The coordinator's event counters (pure): what /metrics reports for batches and the trainer's wait."""

from __future__ import annotations

from coordinator.counters import LATENCY_BUCKETS, RECENT_BATCHES, CoreCounters


def test_batch_latency_lands_in_cumulative_buckets_with_inf_last():
    c = CoreCounters()
    for wait in (0.005, 0.3, 0.3, 1000.0):
        c.batch(0, 0.0, wait, 8, {"rollout/reward_mean": 0.5, "other": 1.0})
    buckets = dict(c.latency_buckets())
    assert list(buckets)[-1] == "+Inf" and len(buckets) == len(LATENCY_BUCKETS) + 1
    assert buckets["0.01"] == 1 and buckets["0.25"] == 1 and buckets["0.5"] == 3 and buckets["300.0"] == 3
    assert buckets["+Inf"] == c.batches == 4
    assert c.latency_sum == 0.005 + 0.3 + 0.3 + 1000.0
    assert c.recent[-1].metrics == {"rollout/reward_mean": 0.5}  # only what the page draws is kept


def test_trainer_wait_integrates_the_time_a_generate_waited_including_the_open_wait():
    c = CoreCounters()
    c.note_waiting(True, 10.0)
    c.note_waiting(True, 11.0)  # still the same wait
    assert c.trainer_wait_s(12.5) == 2.5
    c.note_waiting(False, 13.0)
    c.note_waiting(False, 20.0)
    assert c.trainer_wait_s(30.0) == 3.0
    c.note_waiting(True, 40.0)
    assert c.trainer_wait_s(41.0) == 4.0


def test_reasons_are_sanitised_and_recent_batches_are_bounded():
    c = CoreCounters()
    c.dropped("zero std 0")
    c.dropped("zero std 0")
    c.lease_ended("expired", 0)  # nothing ended: no series appears
    assert c.drops == {"zero_std_0": 2} and c.lease_ends == {}
    for i in range(RECENT_BATCHES + 5):
        c.batch(i, float(i), 0.1, 8, {})
    assert len(c.recent) == RECENT_BATCHES and c.recent[0].rollout_id == 5
