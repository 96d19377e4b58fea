"""Over-sampling and partial batches on real processes (coordinator/oversampling.py).

A coordinator, one agent with sim engines whose groups take a while (prefill latency, long-tailed
output lengths), and a trainer pulling through the public API. What must hold:
- with ``--over-sampling 2`` and no prefetch, a waiting batch starts twice its size in leases; every
  batch still comes out complete, the groups stopped once it was full are counted in the batch
  metrics, and over the run every prompt of the dataset is delivered exactly once (stopped
  prompts are generated again, none lost, none twice);
- ``generate(rid, deadline=S)`` on engines too slow to fill the batch in time returns a partial
  batch with ``deficit > 0``; the same id asked again (also after the coordinator is SIGKILLed and
  restarted) returns the identical batch, and the prompts it lacks are delivered later.
No assertion on timings: the engines' latencies only make the slow case certain.
"""

from __future__ import annotations

import signal

from harness.observe import metrics_url, sample_value, scrape
from harness.polling import wait_for

ROWS = 24
SIZE = 4
VARIED = (
    "--prefill-latency-ms 150 --token-latency-ms 15 --output-len-dist lognormal --output-len-median 12 "
    "--output-len-sigma 1.2"
)
SLOW = "--prefill-latency-ms 400 --token-latency-ms 5 --output-len-dist fixed --output-len-median 8"


def deliver(batch, seen: dict) -> None:
    for g in batch.groups:
        key = (g.data_epoch, g.index)
        assert key not in seen, f"prompt {key} delivered in batch {seen[key]} and again in batch {batch.rollout_id}"
        seen[key] = batch.rollout_id


def same(batch) -> list:
    """What makes two answers the same batch: its prompts, in order, and every sample's tokens."""
    return [(g.data_epoch, g.index, [s.response_tokens.tolist() for s in g.samples]) for g in batch.groups]


def test_oversampled_batches_are_complete_stopped_groups_counted_and_every_prompt_delivered_once(make_cluster):
    """Red if: over-sampling starts no more than a batch (the factor is ignored); a batch comes out
    short or over-full; a stopped group's prompt is lost (the epoch never completes) or delivered
    twice (a stopped group that was also committed); stops are not counted."""
    cluster = make_cluster(
        rows=ROWS, rollout_batch_size=SIZE, n_samples_per_prompt=2, dynamic_filter="none", prefetch=0
    )
    cluster.start_coordinator("--over-sampling", "2", "--metrics-port", "0")
    cluster.start_agent("a1", concurrency=32, sim_args=VARIED)  # room for 16 groups: admission is the bound
    base = metrics_url(cluster.coordinator)
    seen: dict = {}
    stopped_in_batches = 0.0
    with cluster.client(timeout=60) as client:
        batch = client.generate(0)
        granted = sample_value(scrape(base), "rollfleet_leases_granted_total")
        assert granted >= 2 * SIZE, f"the first batch started {granted} leases, not ceil({SIZE} x 2)"
        rid = 0
        while True:
            assert len(batch) == SIZE and batch.deficit == 0, (len(batch), batch.metrics)
            deliver(batch, seen)
            stopped_in_batches += batch.metrics["rollout/stopped_groups"]
            missing = set(range(ROWS)) - {i for e, i in seen if e == 0}
            if not missing:
                break
            rid += 1
            assert rid < 3 * ROWS // SIZE, f"epoch 0 not delivered after {rid} batches: missing {sorted(missing)}"
            batch = client.generate(rid)
    samples = scrape(base)
    stopped = sample_value(samples, "rollfleet_lease_ends_total", reason="stopped")
    assert stopped >= 1 and sample_value(samples, "rollfleet_stops_sent_total") >= stopped, samples
    assert 1 <= stopped_in_batches <= stopped, (stopped_in_batches, stopped)
    # Nothing in flight is forgotten: once the stops are answered, no lease is left over.
    wait_for(lambda: cluster.status()["leased"] == 0, 30, "the stopped leases to be given back")


def test_a_deadline_returns_a_partial_batch_that_is_replayed_identically_and_loses_no_prompt(make_cluster):
    """Red if: the deadline is ignored (a full batch after waiting for every group); a partial batch
    is not recorded (asked again, or after a restart, it comes back different or fuller); the
    prompts it lacks are lost (never delivered) or delivered twice."""
    rows = 12
    cluster = make_cluster(
        rows=rows, rollout_batch_size=SIZE, n_samples_per_prompt=2, dynamic_filter="none", prefetch=0
    )
    cluster.start_coordinator()
    cluster.start_agent("a1", concurrency=2, sim_args=SLOW)  # one group at a time, each >= 0.4 s
    seen: dict = {}
    with cluster.client(timeout=60) as client:
        partial = client.generate(0, deadline=0.5)
        assert 1 <= len(partial) < SIZE and partial.deficit == SIZE - len(partial), partial.metrics
        assert partial.metrics["rollout/deficit"] == partial.deficit and partial.metrics["rollout/groups"] == len(
            partial
        )
        refs = same(partial)
        again = client.generate(0)
        assert same(again) == refs and again.deficit == partial.deficit
        deliver(partial, seen)
        cluster.coordinator.signal(signal.SIGKILL)
        cluster.coordinator.wait(30)
        cluster.start_coordinator()
        cluster.wait_agent_registered("a1")
        replayed = client.generate(0, deadline=0.5)
        assert same(replayed) == refs, "the ledger keeps the partial batch"
        rid = 1
        while len({i for e, i in seen if e == 0}) < rows:
            assert rid < 2 * rows // SIZE + 2, f"prompts lost: {sorted(set(range(rows)) - {i for _, i in seen})}"
            batch = client.generate(rid)
            assert len(batch) == SIZE and batch.deficit == 0
            deliver(batch, seen)
            rid += 1
