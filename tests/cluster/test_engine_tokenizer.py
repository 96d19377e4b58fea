"""An agent attached to a server whose tokenizer it cannot load here (agent/engine_tokenizer.py).

The sim reports ``--tokenizer-path`` in ``/model_info`` as SGLang does; a path that exists only on
the server's machine is what an agent beside a remote SGLang sees. What must hold: the agent
tokenizes through the engine's ``/tokenize`` and batches come; a server that cannot tokenize
either (``--skip-tokenizer-init``) makes the agent exit with one line saying what to pass.
"""

from __future__ import annotations

import subprocess
import sys

from common.tokenizer import ByteTokenizer
from harness.cluster import ROOT

FIXED = "--output-len-dist fixed --output-len-median 16"
ELSEWHERE = "/models/only-on-the-server"


def test_agent_without_a_local_tokenizer_tokenizes_through_the_engines_tokenize(make_cluster):
    """Red if: the agent dies (a traceback, or an error about the path), or the prompt ids are not the engine's."""
    cluster = make_cluster(rows=64, dynamic_filter="none")
    cluster.start_coordinator()
    _, url = cluster.start_sim_engine("--tokenizer-path", ELSEWHERE, *FIXED.split())
    agent = cluster.start_agent("a1", engine_urls=[url])
    with cluster.client() as client:
        batch = client.generate(0)
    assert len(batch.groups) == 8
    for g in batch.groups:
        assert list(g.samples[0].prompt_tokens) == ByteTokenizer().encode(g.metadata["prompt"])
    assert f"tokenizer '{ELSEWHERE}' does not load here" in agent.text()
    assert "tokenizing through the engines' /tokenize" in agent.text()


def test_agent_exits_with_one_line_when_neither_a_local_tokenizer_nor_tokenize_works(make_cluster):
    """Red if: the agent hangs, prints a traceback, or does not say which flag to pass."""
    cluster = make_cluster(rows=64)
    cluster.start_coordinator()
    _, url = cluster.start_sim_engine("--tokenizer-path", ELSEWHERE, "--skip-tokenizer-init")
    argv = ["join", "--coordinator", cluster.address, "--data-dir", str(cluster.tmp / "a1"), "--engine-url", url]
    out = subprocess.run(
        [sys.executable, "-m", "agent.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text, text
    errors = [line for line in out.stderr.splitlines() if line.startswith("agent: error:")]
    assert len(errors) == 1, out.stderr
    for part in (ELSEWHERE, f"{url}/tokenize", "--skip-tokenizer-init", "--tokenizer byte|PATH"):
        assert part in errors[0], (part, errors[0])
