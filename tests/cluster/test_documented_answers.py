"""The documented fields only a real fleet has, each compared with a value computed apart from the code behind it.

Issue 39 part 3 (the pure ones: ``tests/unit/test_documented_fields.py``). One cluster serves 7 batches, the last
a partial one at a deadline: a coordinator and two agents with a sim engine each, all three serving ``/metrics``;
16 prompts, so the data epoch rolls over; groups of 4 samples answered right 30% of the time, so the nonzero-std
filter drops about a quarter of them; ``--prefetch 0`` and a 300 ms prefill then 5 ms a token (lognormal lengths
well inside the budget, other seeds on each agent), so the trainer waits for every batch, groups finish apart and
nothing is leased between batches.
The trainer pushes two disk updates (after batches 0 and 1) and then none, so later batches grow stale by a known
count. Then ``pause(drain=True)``, and what every endpoint reports is compared with:

- what the trainer measured itself (each ``generate``'s wall time; the batches it got, their groups, samples and
  weight-version spans; the updates it pushed; the partial batches it saw), and the dataset it wrote (each group's
  row, label and prompt; each sample's reward recomputed from its text as ``--reward math`` is documented);
- what the *agents* count on their side (groups committed and filtered, samples, their stores), against the
  coordinator's receipts, lease ends, drops, prompts and grants; the ledger read directly from disk.

The staleness of a group is exact here: nothing is in flight when an update is pushed (``--prefetch 0``), so the
updates pushed when its lease was granted are the version its samples were generated on.
"""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from coordinator.client import PauseResult, ResumeResult
from coordinator.client_stats import PromptCounts
from coordinator.ledger import read_ledger
from harness.observe import metrics_url, sample_value, scrape
from harness.polling import wait_for

pytestmark = pytest.mark.timeout(240)

ROWS = 16
SIZE = 4
SAMPLES = 4
CONCURRENCY = 32
BATCHES = 6  # full ones; then one partial
PUSHES = 2  # after batches 0 and 1
SIM = "--prefill-latency-ms 300 --token-latency-ms 5 --output-len-dist lognormal --output-len-median 40 " + (
    "--output-len-sigma 0.3 --accuracy 0.3"
)
BUDGET = 128  # no sample reaches it: a group takes as long as its longest sample, and groups finish apart
AGENTS = ("a1", "a2")


def version_of(label) -> int:
    return 0 if label in ("default", "", None) else int(label)


def latency(samples) -> tuple[float, float]:
    return (
        sample_value(samples, "rollfleet_batch_latency_seconds_sum"),
        sample_value(samples, "rollfleet_batch_latency_seconds_count"),
    )


def check_samples(batch, rows: list[dict]) -> tuple[int, int]:
    """Each group's and sample's fields against the dataset row and the sample's own tokens; (right, wrong)."""
    right = wrong = 0
    for g in batch.groups:
        row = rows[g.index]
        assert g.label == row["label"] and len(g.samples) == SAMPLES and g.agent_id in AGENTS and g.source == "default"
        for s in g.samples:
            assert s.prompt_tokens.tolist() == list(row["prompt"].encode())  # the sim's tokens are bytes
            assert s.metadata["prompt"] == row["prompt"] and s.label == row["label"]
            assert len(s.response_tokens) == len(s.response_logprobs) == len(s.loss_mask)
            assert s.loss_mask.tolist() == [1] * len(s.response_tokens) and all(lp <= 0 for lp in s.response_logprobs)
            text = bytes(t for t in s.response_tokens if t < 256).decode()
            assert s.response_text == text
            assert s.status == ("truncated" if len(s.response_tokens) >= BUDGET else "completed")
            if s.weight_versions:
                assert s.weight_version == s.weight_versions[-1][0] and s.weight_versions[-1][2] == len(
                    s.response_tokens
                )
            # --reward math (README): the last complete \boxed{}, else the last number, compared numerically.
            found = re.findall(r"\\boxed\{([^{}]*)\}", text) or re.findall(r"-?\d+(?:\.\d+)?", text)
            expected = float(bool(found) and float(found[-1]) == float(row["label"]))
            assert s.reward == expected, (text, row["label"], s.reward)
            right += expected == 1.0
            wrong += expected == 0.0
    return right, wrong


def check_batch(batch, rollout_id: int, wall: float, lat: float) -> None:
    """The batch's own metrics against its groups and the trainer's clock; ``lat``: the coordinator's latency."""
    m = batch.metrics
    groups = batch.groups
    assert m["rollout/groups"] == len(batch) == len(groups)
    assert m["rollout/deficit"] == SIZE - len(groups) == batch.deficit
    assert m["rollout/data_epoch"] == max(g.data_epoch for g in groups)
    # Staleness: updates between a group's lease and the batch, i.e. rollout id - the version it was made on.
    ages = []
    for g in groups:
        firsts = {version_of(s.weight_versions[0][0] if s.weight_versions else s.weight_version) for s in g.samples}
        assert len(firsts) == 1, "a group is generated on one version (nothing in flight across an update)"
        ages.append(rollout_id - firsts.pop())
    assert math.isclose(m["rollout/staleness_mean"], sum(ages) / len(ages), abs_tol=1e-9), (m, ages)
    assert m["rollout/staleness_max"] == max(ages), (m, ages)
    # The trainer's clock: it waited at least as long as the coordinator held its call, and waiting plus
    # fetching fit inside the call.
    wait, fetch = m["rollout/wait_seconds"], m["rollout/fetch_seconds"]
    assert 0 < fetch and lat <= wait + 1e-3, (lat, wait)
    assert wait + fetch <= wall + 1e-6, (wait, fetch, wall)
    # The filter's counts behind the batch are whole numbers that add up.
    f = "rollout/dynamic_filter/"
    dropped = sum(v for k, v in m.items() if k.startswith(f + "drop_"))
    assert dropped == m[f + "dropped_groups"]
    total = dropped + m[f + "kept_groups"]
    assert m[f + "dropped_ratio"] == pytest.approx(dropped / total if total else 0.0)


def test_every_endpoint_reports_what_the_trainer_and_the_agents_saw(make_cluster, tmp_path):
    cluster = make_cluster(
        rows=ROWS,
        rollout_batch_size=SIZE,
        n_samples_per_prompt=SAMPLES,
        max_new_tokens=BUDGET,
        dynamic_filter="nonzero_std",
        prefetch=0,
    )
    cluster.start_coordinator("--metrics-port", "0", "--starve-after-drops", "1000")  # 16 rows: a drop streak
    for seed, name in enumerate(AGENTS):
        cluster.start_agent(name, "--metrics-port", "0", concurrency=CONCURRENCY, sim_args=f"{SIM} --seed {seed}")
    coord = metrics_url(cluster.coordinator)
    agents = {name: metrics_url(cluster.agents[name]) for name in AGENTS}
    rows = [json.loads(line) for line in cluster.dataset.read_text().splitlines() if line.strip()]
    batches, walls, updates = [], [], []
    answers = [0, 0]  # samples right, wrong
    latencies = []
    with cluster.client() as client:
        for rollout_id in range(BATCHES + 1):
            before = latency(scrape(coord))
            started = time.monotonic()
            if rollout_id < BATCHES:
                batch = client.generate(rollout_id)
            else:
                batch = client.generate(rollout_id, deadline=0.1)  # 300 ms prefill: a partial batch
            wall = time.monotonic() - started
            after = latency(scrape(coord))
            assert after[1] == before[1] + 1, "one batch recorded per generate"
            latencies.append(after[0] - before[0])
            check_batch(batch, rollout_id, wall, latencies[-1])
            right, wrong = check_samples(batch, rows)
            answers[0] += right
            answers[1] += wrong
            batches.append(batch)
            walls.append(wall)
            if rollout_id < PUSHES:
                ckpt = tmp_path / f"ckpt{rollout_id + 1}"
                ckpt.mkdir()
                result = client.update_weights_from_disk(str(ckpt), rollout_id + 1)
                assert result.version == rollout_id + 1
                assert result.engines == {f"{a}/sim-0": rollout_id + 1 for a in AGENTS}
                updates.append((result.update_id, str(ckpt)))
        partials = sum(1 for b in batches if len(b) < SIZE)
        assert partials == 1 and 1 <= len(batches[-1]) < SIZE, [len(b) for b in batches]
        assert len({uid for uid, _ in updates}) == PUSHES
        assert client.pause(drain=True) == PauseResult(leased=0)
        stats = client.stats()
        c = scrape(coord)
        a = {name: scrape(base) for name, base in agents.items()}
        state = client.state_dict()
        assert client.resume() == ResumeResult()
        assert sample_value(scrape(coord), "rollfleet_paused") == 0
        assert client.weight_version() == PUSHES

    delivered = [g for b in batches for g in b.groups]
    by_agent = {name: [g for g in delivered if g.agent_id == name] for name in AGENTS}
    assert all(by_agent.values()), "both agents' groups were delivered"
    assert max(g.data_epoch for g in delivered) >= 1, "the data epoch rolled over"
    assert any(b.metrics["rollout/staleness_max"] >= 2 for b in batches)
    assert min(answers) > 0, answers  # rewards of both values were checked

    def agents_total(name: str, **labels) -> float:
        return sum(sample_value(a[n], name, agent=n, **labels) for n in AGENTS)

    committed = agents_total("rollfleet_agent_groups_total", outcome="committed")
    filtered = agents_total("rollfleet_agent_groups_total", outcome="filtered")
    released = agents_total("rollfleet_agent_groups_total", outcome="released")
    assert agents_total("rollfleet_agent_groups_total", outcome="evaluated") == 0
    assert filtered > 0, "the filter dropped nothing: the drop counts compare zeros"

    # --- the coordinator's /metrics against the agents' own counts and the trainer's batches
    assert sample_value(c, "rollfleet_receipts_total", outcome="accepted") == committed
    assert sample_value(c, "rollfleet_receipts_total", outcome="refused") == 0
    assert sample_value(c, "rollfleet_lease_ends_total", reason="receipt") == committed
    assert sample_value(c, "rollfleet_lease_ends_total", reason="filtered") == filtered
    assert sample_value(c, "rollfleet_groups_dropped_total") == filtered
    granted = sample_value(c, "rollfleet_leases_granted_total")
    assert granted == committed + filtered + released, "every lease an agent got ended one of these ways"
    assert sample_value(c, "rollfleet_lease_ends_total") == granted, "nothing in flight after the drain"
    drop_metrics = {}
    for b in batches:
        for k, v in b.metrics.items():
            if k.startswith("rollout/dynamic_filter/drop_"):
                drop_metrics[k.rsplit("drop_", 1)[1]] = drop_metrics.get(k.rsplit("drop_", 1)[1], 0) + v
    for reason, n in drop_metrics.items():  # drops after the last batch (the drain's) are in no batch yet
        assert n <= sample_value(c, "rollfleet_groups_dropped_total", reason=reason), reason
    kept = sum(b.metrics["rollout/dynamic_filter/kept_groups"] for b in batches)
    assert len(delivered) <= kept <= committed, (len(delivered), kept, committed)
    assert sum(b.metrics["rollout/dynamic_filter/dropped_groups"] for b in batches) <= filtered
    assert sample_value(c, "rollfleet_batches_total") == len(batches)
    assert sample_value(c, "rollfleet_partial_batches_total") == partials
    assert sample_value(c, "rollfleet_batch_latency_seconds_count") == len(batches)
    assert sample_value(c, "rollfleet_batch_latency_seconds_sum") == pytest.approx(sum(latencies))
    for le in ("0.5", "1.0", "2.5", "5.0"):  # a batch the trainer waited <= le for took the coordinator <= le
        waited = sum(1 for b in batches if b.metrics["rollout/wait_seconds"] <= float(le))
        assert sample_value(c, "rollfleet_batch_latency_seconds_bucket", le=le) >= waited, le
    assert sample_value(c, "rollfleet_batch_latency_seconds_bucket", le="+Inf") == len(batches)
    wait_total = sample_value(c, "rollfleet_trainer_wait_seconds_total")
    assert sum(latencies) - 0.05 <= wait_total <= sum(walls) + 0.05, (sum(latencies), wait_total, sum(walls))
    assert sample_value(c, "rollfleet_trainer_waiting_generates") == 0
    assert sample_value(c, "rollfleet_leases_in_flight") == 0 and sample_value(c, "rollfleet_leases_held") == 0
    stored = agents_total("rollfleet_agent_store_groups")
    ready = stored - len(delivered)  # the stores keep every committed group (no checkpoint trimmed yet)
    assert sample_value(c, "rollfleet_groups_ready") == ready == stats.batches.ready
    assert sample_value(c, "rollfleet_fleet_capacity_groups") == len(AGENTS) * (CONCURRENCY // SAMPLES)
    assert sample_value(c, "rollfleet_dataset_prompts") == ROWS
    open_epochs = stats.data_epochs
    assert sample_value(c, "rollfleet_data_epoch") == max(open_epochs) >= max(g.data_epoch for g in delivered)
    prompts = {s.labels["state"]: s.value for s in c if s.name == "rollfleet_prompts"}
    assert sum(prompts.values()) == ROWS * len(open_epochs), "every row of an open epoch is in one state"
    assert prompts["delivered"] == sum(1 for g in delivered if g.data_epoch in open_epochs)
    assert prompts["leased"] == 0 and prompts["ready"] == ready

    # The ledger's tables, read from disk by the test: once its group commit has caught up (the drain is answered
    # when no lease is in flight, not when the last receipts' records are on disk), they hold what the frontier
    # does, one record per prompt ready, delivered or filtered in an open epoch, and every batch.
    def ledger_settled():
        ledger, now = read_ledger(cluster.tmp / "coordinator"), scrape(coord)
        entries = sample_value(now, "rollfleet_ledger_entries", table="prompts")
        return (entries, len(ledger.prompts)) if entries == len(ledger.prompts) else None

    entries, records = wait_for(ledger_settled, 10, "the ledger's entries to match its records")
    assert entries == prompts["ready"] + prompts["delivered"] + prompts["filtered"]
    ledger = read_ledger(cluster.tmp / "coordinator")
    assert sample_value(c, "rollfleet_ledger_entries", table="batches") == len(ledger.batches) == len(batches)
    assert sample_value(c, "rollfleet_weight_version") == PUSHES
    assert sample_value(c, "rollfleet_weight_updates_total") == PUSHES
    assert sample_value(c, "rollfleet_batch_staleness_mean") == batches[-1].metrics["rollout/staleness_mean"]
    assert sample_value(c, "rollfleet_batch_staleness_max") == batches[-1].metrics["rollout/staleness_max"]
    assert sample_value(c, "rollfleet_last_rollout_id") == len(batches) - 1
    assert sample_value(c, "rollfleet_paused") == 1 and sample_value(c, "rollfleet_starved") == 0

    # --- each agent's /metrics against what the trainer got from it and the agent's own other counters
    for name in AGENTS:
        mine = a[name]
        committed_here = sample_value(mine, "rollfleet_agent_groups_total", agent=name, outcome="committed")
        filtered_here = sample_value(mine, "rollfleet_agent_groups_total", agent=name, outcome="filtered")
        assert committed_here >= len(by_agent[name])
        assert sample_value(mine, "rollfleet_agent_store_groups", agent=name) == committed_here
        assert sample_value(mine, "rollfleet_agent_samples_total", agent=name) == SAMPLES * (
            committed_here + filtered_here
        )
        tokens = sample_value(mine, "rollfleet_agent_engine_generated_tokens_total", agent=name, engine="sim-0")
        assert tokens >= sum(len(s.response_tokens) for g in by_agent[name] for s in g.samples)
        assert sample_value(mine, "rollfleet_agent_engine_retries_total", agent=name) == 0
        assert sample_value(mine, "rollfleet_agent_leases_in_flight", agent=name) == 0
        assert sample_value(mine, "rollfleet_agent_engine_in_flight_samples", agent=name, engine="sim-0") == 0
        assert sample_value(mine, "rollfleet_agent_capacity_samples", agent=name) == CONCURRENCY
        assert sample_value(mine, "rollfleet_agent_weight_version", agent=name) == PUSHES
        assert sample_value(mine, "rollfleet_agent_engine_weight_version", agent=name, engine="sim-0") == PUSHES

    # --- stats() and the answers against what the trainer did
    assert stats.receipts == {"accepted": committed, "refused": 0}
    assert stats.filtered_total == filtered and stats.leased == 0 and stats.held == 0
    assert stats.paused is True and stats.batches.pending_generates == 0 and stats.batches.prefetch == 0
    assert stats.batches.last_rollout_id == stats.batches.consumed_upto == len(batches) - 1
    assert {n: (e.status, e.capacity, e.leases) for n, e in stats.agents.items()} == {
        n: ("alive", CONCURRENCY // SAMPLES, 0) for n in AGENTS
    }
    weights = stats.weights
    assert (weights.version, weights.updates, weights.kind, weights.path, weights.lock) == (
        PUSHES,
        PUSHES,
        "disk",
        updates[-1][1],
        None,
    )
    assert weights.engines == {f"{n}/sim-0": PUSHES for n in AGENTS} and weights.behind == ()
    assert stats.sources["default"].weight == 1.0
    assert stats.sources["default"].prompts == stats.prompts == PromptCounts(**prompts)
    assert state["rollout_id"] == len(batches) - 1 and state["dataset_size"] == ROWS
    assert state["config"]["rollout_batch_size"] == SIZE and state["config"]["n_samples_per_prompt"] == SAMPLES
    assert state["mixture"] == [[0, [1.0]]]
