"""Every mistake a newcomer can make on the command line is one line on stderr, fast, and leaves nothing behind.

Each test runs the real command as a subprocess with a short timeout (``subprocess.run`` ends the
process it started if the timeout passes, so a hang fails the test instead of the suite) and
checks: exit status 2, exactly one line on stderr naming the flag and the value, no traceback,
and no state written to the data dir the command was given.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.demo_data import write_arithmetic_dataset
from common.errors import StateError
from coordinator.ledger import read_config_changes, read_ledger
from harness.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = 10.0  # seconds: a refusal needs only Python's start-up


def run_cli(module: str, *argv: str, env: dict | None = None, timeout: float = FAST) -> subprocess.CompletedProcess:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out.seconds = time.monotonic() - started
    return out


def assert_one_line(out: subprocess.CompletedProcess, *names: str, rc: int = 2) -> str:
    """The command failed with ``rc`` and said why in one stderr line that names every one of ``names``."""
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    assert out.returncode == rc, text
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def busy_port():
    """A TCP port bound and listening on 127.0.0.1 for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def dataset(tmp_path) -> Path:
    return write_arithmetic_dataset(tmp_path / "prompts.jsonl", 40)


def serve(dataset: Path, data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("coordinator.cli", "serve", "--dataset", str(dataset), "--data-dir", str(data_dir), *extra)


def join(data_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = ["join", "--coordinator", "tcp://127.0.0.1:9", "--data-dir", str(data_dir), *extra]
    return run_cli("agent.cli", *argv, env=env)


# ------------------------------------------------------------------ addresses: refused, never a hang


def test_status_with_an_address_without_tcp_is_refused_at_once():
    out = run_cli("coordinator.cli", "status", "--coordinator", "127.0.0.1:15560", "--timeout", "3")
    assert_one_line(out, "--coordinator", "127.0.0.1:15560", "tcp://HOST:PORT")
    assert out.seconds < 5


def test_serve_on_a_port_in_use_fails_in_one_line_and_writes_no_ledger(tmp_path, dataset, busy_port):
    data_dir = tmp_path / "coordinator"
    # Lower-case --log-level is accepted: the run gets as far as binding.
    out = serve(dataset, data_dir, "--bind", f"tcp://127.0.0.1:{busy_port}", "--log-level", "debug")
    assert_one_line(out, f"tcp://127.0.0.1:{busy_port}", "in use")
    assert not (data_dir / "ledger").exists()


def test_serve_on_an_address_not_on_this_machine_fails_in_one_line(tmp_path, dataset):
    out = serve(dataset, tmp_path / "coordinator", "--bind", "tcp://192.0.2.1:5555", "--insecure")  # TEST-NET-1
    assert_one_line(out, "tcp://192.0.2.1:5555", "cannot bind")
    assert not (tmp_path / "coordinator" / "ledger").exists()


def test_join_with_a_payload_port_in_use_fails_before_touching_the_data_dir(tmp_path, busy_port):
    out = join(tmp_path / "agent", "--engine", "sim", "--payload-bind", f"tcp://127.0.0.1:{busy_port}",
               "--log-level", "debug")  # fmt: skip
    assert_one_line(out, "--payload-bind", f"tcp://127.0.0.1:{busy_port}", "in use")
    assert not (tmp_path / "agent").exists()


def test_sim_engine_on_a_port_in_use_or_out_of_range(busy_port):
    assert_one_line(run_cli("agent.cli", "sim-engine", "--port", str(busy_port)), "--port", str(busy_port), "in use")
    assert_one_line(run_cli("agent.cli", "sim-engine", "--port", "99999"), "--port", "99999")
    assert_one_line(run_cli("agent.sim", "--port", "99999"), "--port", "99999")


# ------------------------------------------------------------------ values: bounds, units, flag names


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--heartbeat-interval", "nan"], ["--heartbeat-interval", "nan"]),
        (["--agent-ttl", "-1"], ["--agent-ttl", "-1"]),
        (["--max-message-bytes", "0"], ["--max-message-bytes", "'0'"]),
        (["--max-message-bytes", "-5"], ["--max-message-bytes", "-5"]),
        (["--max-message-bytes", "64 parsecs"], ["--max-message-bytes", "64 parsecs"]),
        (["--rollout-batch-size", "0"], ["--rollout-batch-size", "0"]),
        (["--top-p", "0"], ["--top-p", "0"]),
        (["--log-level", "chatty"], ["--log-level", "chatty"]),
        (["--heartbeat-interval", "2", "--agent-ttl", "3"], ["--agent-ttl", "--heartbeat-interval"]),
    ],
)
def test_serve_refuses_bad_values_naming_the_flag(tmp_path, dataset, flags, names):
    assert_one_line(serve(dataset, tmp_path / "coordinator", *flags), *names)
    assert not (tmp_path / "coordinator" / "ledger").exists()


def test_serve_takes_message_sizes_with_units(tmp_path, dataset, busy_port):
    # 64MiB, as docs/operate/configuration.md writes it, passes the flag checks: the start fails only on the busy port.
    out = serve(dataset, tmp_path / "c", "--max-message-bytes", "64MiB", "--bind", f"tcp://127.0.0.1:{busy_port}")
    assert_one_line(out, "cannot bind")


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--engine", "sim", "--tp-size", "0"], ["--tp-size", "0"]),
        (["--engine", "sim", "--tp-size", "2"], ["--tp-size", "--engine sglang"]),
        (["--engine", "sglang"], ["--engine sglang", "--model-path"]),
        (["--engine", "sglang", "--model-path", "/m", "--gpu-ids", "a,b"], ["--gpu-ids", "a,b"]),
        (["--engine", "sim", "--health-interval", "0"], ["--health-interval", "0"]),
        (["--engine", "sim", "--engine-start-timeout", "nan"], ["--engine-start-timeout", "nan"]),
        (["--engine", "sim", "--engines", "0"], ["--engines", "0"]),
        (["--engine", "sim", "--concurrency", "0"], ["--concurrency", "0"]),
        (["--engine", "sim", "--log-level", "LOUD"], ["--log-level", "LOUD"]),
        (["--engine", "sim", "--tokenizer", "/nonexistent/tok"], ["--tokenizer", "/nonexistent/tok"]),
        (["--engine", "sim", "--sim-args", "--seed 'unclosed"], ["--sim-args"]),
        (["--engine", "sim", "--sim-args", "--slots 0"], ["--sim-args", "--slots", "'0'"]),
        (["--sim-args", "--no-such-flag"], ["--sim-args", "--no-such-flag"]),
        (["--engine-url", "localhost:30000"], ["localhost:30000"]),
    ],
)
def test_join_refuses_bad_values_naming_the_flag(tmp_path, flags, names):
    assert_one_line(join(tmp_path / "agent", *flags), *names)
    assert not (tmp_path / "agent").exists()


def test_join_with_an_address_without_tcp_is_refused(tmp_path):
    out = run_cli("agent.cli", "join", "--coordinator", "127.0.0.1:5555", "--data-dir", str(tmp_path / "a"))
    assert_one_line(out, "--coordinator", "127.0.0.1:5555")


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--slots", "0"], "--slots"),
        (["--accuracy", "2"], "--accuracy"),
        (["--token-latency-ms", "-1"], "--token-latency-ms"),
        (["--output-len-median", "0"], "--output-len-median"),
        (["--crash-after-requests", "-3"], "--crash-after-requests"),
    ],
)
def test_sim_engine_refuses_values_out_of_bounds(flags, name):
    assert_one_line(run_cli("agent.cli", "sim-engine", "--port", "0", *flags), name, flags[1])


def test_engine_args_take_a_value_that_starts_with_dashes(tmp_path, busy_port):
    """``--sim-args '--unhealthy'`` is parsed as the value it is: the start gets as far as the payload port."""
    busy = ["--payload-bind", f"tcp://127.0.0.1:{busy_port}"]
    assert_one_line(join(tmp_path / "a", "--engine", "sim", "--sim-args", "--unhealthy", *busy), "--payload-bind")
    sglang = ["--engine", "sglang", "--model-path", "/m", "--sglang-args", "--trust-remote-code"]
    assert_one_line(join(tmp_path / "b", *sglang, *busy), "--payload-bind")


def test_a_node_with_gpus_must_ask_for_the_sim_engine(tmp_path, busy_port):
    gpu = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert_one_line(join(tmp_path / "a", env=gpu), "GPUs", "--engine sglang", "--engine sim")
    assert not (tmp_path / "a").exists()
    # Asked for explicitly, the sim engine is fine there (the start then fails on the busy payload port).
    out = join(tmp_path / "a", "--engine", "sim", "--payload-bind", f"tcp://127.0.0.1:{busy_port}", env=gpu)
    assert_one_line(out, "--payload-bind")


# ------------------------------------------------------------------ restarts that change how batches are made


class Coordinator:
    """One ``coordinator serve`` process; its pid is ended by :meth:`stop` (the fixture calls it)."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", *argv],
            cwd=ROOT,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        started = lambda: b"coordinator listening" in log.read_bytes() or self.proc.poll() is not None  # noqa: E731
        wait_for(started, 20, "coordinator start")
        assert self.proc.poll() is None, log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._fh.close()


@pytest.fixture
def coordinators():
    started: list[Coordinator] = []
    yield started
    for c in started:
        c.stop()


def test_restart_with_other_batch_settings_is_refused_unless_recorded(tmp_path, dataset, coordinators):
    data_dir = tmp_path / "coordinator"

    def start(*flags: str) -> Coordinator:
        port = _free_port()
        argv = ["--dataset", str(dataset), "--data-dir", str(data_dir), "--bind", f"tcp://127.0.0.1:{port}", *flags]
        c = Coordinator(argv, tmp_path / f"coordinator-{len(coordinators)}.log")
        coordinators.append(c)
        return c

    first = ["--rollout-batch-size", "4", "--reward", "math", "--shuffle-seed", "1"]
    start(*first).stop()
    generation = read_ledger(data_dir).generation

    out = serve(dataset, data_dir, "--rollout-batch-size", "8", "--reward", "exact", "--shuffle-seed", "1")
    line = assert_one_line(out, "--rollout-batch-size 4 -> 8", "--reward 'math' -> 'exact'", "--allow-config-change")
    assert "shuffle" not in line
    assert read_ledger(data_dir).generation == generation, "a refused start wrote to the ledger"

    start(*first).stop()  # the same settings again: accepted
    start("--rollout-batch-size", "8", "--reward", "exact", "--shuffle-seed", "1", "--allow-config-change").stop()
    changes = read_config_changes(data_dir)
    assert [c["changed"] for c in changes] == [{"rollout_batch_size": [4, 8], "reward": ["math", "exact"]}]
    start("--rollout-batch-size", "8", "--reward", "exact", "--shuffle-seed", "1").stop()  # the new settings hold


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ trainer API: the documented exceptions


def test_refused_checkpoints_raise_state_error(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args="--output-len-dist fixed --output-len-median 8")
    with cluster.client() as client:
        client.generate(0)
        client.pause(drain=True)
        state = client.state_dict()
        with pytest.raises(StateError, match="newer than anything") as info:
            client.load_state_dict({**state, "rollout_id": 99})
        assert info.value.code == "bad_state"
        with pytest.raises(StateError, match="different dataset"):
            client.load_state_dict({**state, "dataset_fingerprint": "0" * 16})
        with pytest.raises(StateError, match="format 1"):
            client.load_state_dict(["not", "a", "state"])
        client.load_state_dict(state)
        client.resume()


# ------------------------------------------------------------------ units


def test_systemd_units_do_not_restart_config_errors():
    for unit in (ROOT / "deploy" / "systemd").glob("*.service"):
        text = unit.read_text()
        assert "Restart=on-failure" in text and "RestartPreventExitStatus=2" in text, unit


@pytest.mark.parametrize(
    "params, names",
    [
        ('{"temprature": 0.5}', ("--sampling-params", "'temprature'", "did you mean 'temperature'", "--temperature")),
        ('{"min_p": "x"}', ("--sampling-params", "'min_p'", "must be a number")),
        ('{"stop_token_ids": [1, "2"]}', ("--sampling-params", "'stop_token_ids'", "a list of integers")),
        ('{"top_k": 5}', ("--sampling-params", "'top_k'", "--top-k")),
        ('{"stop": ["x"]', ("--sampling-params", "not valid JSON")),
        ('["min_p"]', ("--sampling-params", "JSON object")),
    ],
)
def test_sampling_params_mistake_is_refused_at_start_naming_the_key(tmp_path, params, names):
    """Red if a typo in ``--sampling-params`` starts the coordinator (every request would then be refused)."""
    dataset = write_arithmetic_dataset(tmp_path / "d.jsonl", 10)
    data_dir = tmp_path / "coordinator"
    argv = ["serve", "--dataset", str(dataset), "--data-dir", str(data_dir), "--bind", "tcp://127.0.0.1:0"]
    out = run_cli("coordinator.cli", *argv, "--sampling-params", params)
    assert_one_line(out, *names)
    assert not (data_dir / "ledger").exists()


def test_map_size_below_the_minimum_is_refused(tmp_path):
    dataset = write_arithmetic_dataset(tmp_path / "d.jsonl", 10)
    argv = ["serve", "--dataset", str(dataset), "--data-dir", str(tmp_path / "c"), "--map-size", "4KiB"]
    assert_one_line(run_cli("coordinator.cli", *argv), "--map-size", "4KiB")
    argv = ["join", "--coordinator", "tcp://127.0.0.1:1", "--data-dir", str(tmp_path / "a"), "--map-size", "lots"]
    assert_one_line(run_cli("agent.cli", *argv), "--map-size", "lots")


def test_serve_refuses_a_chat_row_the_tokenizers_template_cannot_render_naming_file_and_line(tmp_path, hf_model_dir):
    """Rows of chat messages are rendered by the --tokenizer's chat template at start, the training
    dataset's and every evaluation dataset's: a role the template does not know is refused there."""
    import json

    good = tmp_path / "chat.jsonl"
    good.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}]}) + "\n" for i in range(9)))
    bad = tmp_path / "eval.jsonl"
    bad.write_text(good.read_text() + "\n" + json.dumps({"prompt": [{"role": "wizard", "content": "1+1="}]}) + "\n")
    slow = 60.0  # loading transformers takes most of it
    out = run_cli(
        "coordinator.cli", "serve", "--dataset", str(bad), "--data-dir", str(tmp_path / "c1"),
        "--tokenizer", hf_model_dir, "--bind", "tcp://127.0.0.1:0", timeout=slow,
    )  # fmt: skip
    line = assert_one_line(out, f"{bad}:11:", "role wizard")
    assert "does not know" in line
    out = run_cli(
        "coordinator.cli", "serve", "--dataset", str(good), "--eval-dataset", f"held={bad}",
        "--data-dir", str(tmp_path / "c2"), "--tokenizer", hf_model_dir, "--bind", "tcp://127.0.0.1:0", timeout=slow,
    )  # fmt: skip
    # the training dataset's check passed and says so in a log line; the refusal is the last line
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "9 chat rows" in out.stderr and f"{bad}:11:" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "c2" / "ledger").exists()
