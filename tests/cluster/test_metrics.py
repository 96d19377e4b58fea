"""Prometheus ``/metrics`` on the coordinator and the agents, and ``coordinator status`` as a table.

A real cluster (coordinator, two agents with a sim engine each) serves its metrics on ports it
picks (``--metrics-port 0``, read from the logs); a trainer pulls batches; both endpoints are
scraped over HTTP and parsed with prometheus_client's own parser. What must hold is what an
operator reads off a dashboard:
- the coordinator counts every batch it assembled (equal to the batches pulled) and at least one
  accepted receipt per delivered group, at least one granted lease per receipt, both agents alive
  and both engines healthy;
- each agent reports its engine healthy, and the engines' generated tokens cover at least the
  response tokens of every delivered group;
- ``coordinator status`` prints a table naming each agent and engine, and ``--json`` prints the
  statistics a trainer's ``stats()`` returns, key for key;
- a metrics port in use fails ``coordinator serve`` in one line naming the flag.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from harness.cluster import ROOT
from harness.observe import metrics_url, sample_value, scrape

FAST = "--output-len-dist fixed --output-len-median 16"
BATCHES = 3
BATCH_SIZE = 8


def start(make_cluster):
    cluster = make_cluster(rollout_batch_size=BATCH_SIZE, dynamic_filter="none")
    cluster.start_coordinator("--metrics-port", "0")
    for name in ("a1", "a2"):
        cluster.start_agent(name, "--metrics-port", "0", sim_args=FAST)
    return cluster


def test_metrics_of_the_coordinator_and_agents_count_what_the_trainer_pulled(make_cluster):
    cluster = start(make_cluster)
    with cluster.client() as client:
        batches = [client.generate(i) for i in range(BATCHES)]
    delivered = sum(len(b.groups) for b in batches)
    response_tokens = sum(b.metrics["rollout/response_tokens"] for b in batches)
    assert delivered == BATCHES * BATCH_SIZE and response_tokens > 0

    coord = scrape(metrics_url(cluster.coordinator))
    assert sample_value(coord, "rollfleet_batches_total") == BATCHES
    assert sample_value(coord, "rollfleet_batch_latency_seconds_count") == BATCHES
    assert sample_value(coord, "rollfleet_batch_latency_seconds_bucket", le="+Inf") == BATCHES
    receipts = sample_value(coord, "rollfleet_receipts_total", outcome="accepted")
    assert receipts >= delivered
    assert sample_value(coord, "rollfleet_leases_granted_total") >= receipts
    assert sample_value(coord, "rollfleet_lease_ends_total", reason="receipt") >= delivered
    assert sample_value(coord, "rollfleet_agents", status="alive") == 2
    assert sample_value(coord, "rollfleet_agents", status="retired") == 0
    assert sample_value(coord, "rollfleet_engines", state="healthy") == 2
    assert sample_value(coord, "rollfleet_prompts", state="delivered") == delivered
    assert sample_value(coord, "rollfleet_last_rollout_id") == BATCHES - 1
    assert sample_value(coord, "rollfleet_ledger_bytes") > 0
    assert sample_value(coord, "rollfleet_ledger_entries", table="batches") == BATCHES
    assert sample_value(coord, "rollfleet_weight_version") == 0
    # Present and counted; 0 is right when prefetched groups had every batch ready before it was asked for.
    assert sample_value(coord, "rollfleet_trainer_wait_seconds_total") >= 0
    assert sample_value(coord, "rollfleet_trainer_waiting_generates") == 0

    tokens = committed = 0.0
    for name in ("a1", "a2"):
        agent = scrape(metrics_url(cluster.agents[name]))
        assert sample_value(agent, "rollfleet_agent_engine_up", agent=name, engine="sim-0") == 1
        assert sample_value(agent, "rollfleet_agent_engine_state", agent=name, engine="sim-0", state="healthy") == 1
        assert sample_value(agent, "rollfleet_agent_engine_restarts_total", agent=name) == 0
        assert sample_value(agent, "rollfleet_agent_connected", agent=name) == 1
        assert sample_value(agent, "rollfleet_agent_store_bytes", agent=name) > 0
        engine_tokens = sample_value(agent, "rollfleet_agent_engine_generated_tokens_total", agent=name)
        assert sample_value(agent, "rollfleet_agent_generated_tokens_total", agent=name) == engine_tokens
        tokens += engine_tokens
        committed += sample_value(agent, "rollfleet_agent_groups_total", agent=name, outcome="committed")
    assert tokens >= response_tokens
    assert committed >= delivered


def run_status(cluster, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", cluster.address, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_status_prints_a_table_and_json_on_request(make_cluster):
    cluster = make_cluster(rollout_batch_size=BATCH_SIZE, dynamic_filter="none")
    cluster.start_coordinator()
    for name in ("a1", "a2"):
        cluster.start_agent(name, sim_args=FAST)
    with cluster.client() as client:
        for i in range(2):
            client.generate(i)
        expected = client.stats()

    table = run_status(cluster)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("agents: alive 2, dead 0, retired 0"), lines[0]
    header = next(line for line in lines if line.startswith("AGENT"))
    assert header.split() == ["AGENT", "STATUS", "CAPACITY", "LEASES", "ENGINE", "STATE", "IN", "FLIGHT", "VERSION"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("a1 ", "a2 "))}
    assert set(rows) == {"a1", "a2"}
    for row in rows.values():
        assert row[1] == "alive" and row[4] == "sim-0" and row[5] == "healthy", row
    assert any(line.startswith("batches:  last rollout 1,") for line in lines), table.stdout
    assert any(line.startswith("frontier: data epochs 0;") for line in lines), table.stdout
    assert any(line.startswith("drops:") for line in lines), table.stdout

    machine = run_status(cluster, "--json")
    assert machine.returncode == 0, machine.stderr
    stats = json.loads(machine.stdout)
    assert machine.stdout == json.dumps(stats, indent=2, sort_keys=True) + "\n"
    assert set(stats) == set(expected.raw)  # --json prints the answer the client decodes
    assert set(stats["agents"]) == set(expected.agents) == {"a1", "a2"}
    assert stats["last_rollout_id"] == expected.batches.last_rollout_id == 1
    assert stats["prompts"]["delivered"] == expected.prompts.delivered == 2 * BATCH_SIZE


def test_a_metrics_port_in_use_fails_serve_in_one_line(tmp_path):
    from common.demo_data import write_arithmetic_dataset

    dataset = write_arithmetic_dataset(tmp_path / "data.jsonl", 16)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            bind = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        out = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "serve", "--dataset", str(dataset), "--data-dir"]
            + [str(tmp_path / "coordinator"), "--bind", bind, "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("coordinator: error:")]
    assert len(errors) == 1, out.stderr
    assert "--metrics-port" in errors[0] and str(port) in errors[0] and "in use" in errors[0], errors[0]
