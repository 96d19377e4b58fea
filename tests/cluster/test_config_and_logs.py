"""A fleet started from config files, with JSON logs: what an operator's systemd units run."""

from __future__ import annotations

import json

from tests.cluster.test_cli_errors import assert_one_line, run_cli


def test_a_fleet_runs_from_config_files_and_the_command_line_wins(make_cluster, tmp_path):
    cluster = make_cluster()
    cluster.config = {}  # every batch setting below comes from the file or the command line
    coordinator_toml = tmp_path / "coordinator.toml"
    coordinator_toml.write_text(
        "rollout_batch_size = 3\nn-samples-per-prompt = 2\nmax_new_tokens = 16\n"
        'dynamic_filter = "none"\nlog_format = "json"\n'
    )
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f'coordinator = "{cluster.address}"\nmax_restarts = 7\nlog-format = "json"\n')

    cluster.start_coordinator("--config", str(coordinator_toml), "--rollout-batch-size", "5")
    cluster.start_agent("a0", "--config", str(agent_toml))
    client = cluster.client()
    batch = client.generate(0)
    assert len(batch.groups) == 5  # the command line's 5, not the file's 3
    assert {len(g.samples) for g in batch.groups} == {2}  # from the file

    for proc, command in ((cluster.coordinator, "coordinator"), (cluster.agents["a0"], "agent")):
        records = [json.loads(line) for line in proc.text().splitlines() if line.startswith("{")]
        assert records, proc.text()[-2000:]
        assert all({"ts", "level", "logger", "msg", "pid"} <= set(r) for r in records)
        effective = [r for r in records if r["msg"].startswith("effective config: ")]
        assert len(effective) == 1, records[:5]
        values = json.loads(effective[0]["msg"].removeprefix("effective config: "))
        if command == "coordinator":
            assert values["rollout-batch-size"] == 5 and values["n-samples-per-prompt"] == 2
        else:
            assert values["max-restarts"] == 7 and values["coordinator"] == cluster.address
            assert values["concurrency"] == 32  # the harness's flag over the built-in default


def test_a_bad_key_in_a_config_file_is_one_line_naming_file_and_key(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('coordinator = "tcp://127.0.0.1:9"\nconcurency = 8\n')
    out = run_cli("agent.cli", "join", "--config", str(path), "--data-dir", str(tmp_path / "d"))
    assert_one_line(out, str(path), "'concurency'", "did you mean 'concurrency'")
    assert not (tmp_path / "d").exists()
