"""Engines protected by an API key (SGLang ``--api-key``) and ``agent join --engine-api-key``.

Such a server answers ``/health`` to anyone and 401 to everything else without the key, so an agent
that lacks it would take the engine for healthy and fail later, vaguely. What must hold: the key
from ``$ROLLFLEET_ENGINE_API_KEY`` (or the flag) reaches every call, batches come, the engines the
agent launches are protected with the same key, the key never shows in the agent's log, and an agent
without the key stops at once with one error naming HTTP 401 and the flag.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.request

from harness.cluster import ROOT

KEY = "k-2f9c1e7a"


def _status(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url + "/model_info")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_an_agent_given_the_key_in_its_environment_generates_on_a_protected_server(make_cluster, monkeypatch):
    """Red if: the key does not reach every call (generation, /model_info, /server_info), or it is logged."""
    cluster = make_cluster(rows=64, dynamic_filter="none")
    cluster.start_coordinator()
    _, url = cluster.start_sim_engine("--api-key", KEY, "--tp-size", "2")
    assert _status(url) == 401 and _status(url, KEY) == 200
    monkeypatch.setenv("ROLLFLEET_ENGINE_API_KEY", KEY)
    agent = cluster.start_agent("a1", engine_urls=[url])
    with cluster.client() as client:
        batch = client.generate(0)
    assert len(batch.groups) == 8
    assert '"engine-api-key": "*** (from $ROLLFLEET_ENGINE_API_KEY)"' in agent.text()
    assert KEY not in agent.text()


def test_engines_the_agent_launches_take_its_key(make_cluster):
    """Red if: --engine-api-key protects the calls but leaves the launched engines open to anyone."""
    cluster = make_cluster(rows=64, dynamic_filter="none")
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", "--engine-api-key", KEY)
    with cluster.client() as client:
        assert len(client.generate(0).groups) == 8
    (url,) = set(re.findall(r"engine sim-0 healthy at (http://\S+)", agent.text()))
    assert _status(url) == 401 and _status(url, KEY) == 200
    engine_logs = "".join(p.read_text() for p in (cluster.tmp / "a1" / "logs").glob("*.log"))
    assert "--api-key ***" in engine_logs and KEY not in engine_logs, "the engine's log shows the key"


def test_an_agent_without_the_key_stops_with_one_error_naming_401_and_the_flag(make_cluster):
    """Red if: the agent hangs, prints a traceback, or leaves the operator guessing what to pass."""
    cluster = make_cluster(rows=64)
    cluster.start_coordinator()
    _, url = cluster.start_sim_engine("--api-key", KEY)
    argv = ["join", "--coordinator", cluster.address, "--data-dir", str(cluster.tmp / "a1"), "--engine-url", url]
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text
    errors = [line for line in out.stderr.splitlines() if line.startswith("agent: error:")]
    assert len(errors) == 1, out.stderr
    reason = out.stderr[out.stderr.index("agent: error:") :]
    for part in (url, "HTTP 401", "--engine-api-key", "ROLLFLEET_ENGINE_API_KEY"):
        assert part in reason, (part, reason)
