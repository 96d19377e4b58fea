"""The coordinator's live status page, rendered by a real browser (headless Chromium).

A cluster serves its status page (``--metrics-port 0``); a trainer pulls batches; Chromium
loads the page with no network beyond loopback, runs its script (which fetches
``/status.json``) and dumps the DOM it built. What must hold: the rendered page lists both
agents with their engines healthy, shows the number of batches assembled, and draws one
sparkline per series with a line in it; ``/status.json`` agrees with the trainer's view; a
screenshot is written (kept under the test's tmp dir; ``ROLLFLEET_STATUS_SCREENSHOT=PATH``
copies it there, e.g. ``docs/img/status.png``).

Skipped, with the reason, where ``/usr/bin/chromium`` is absent (``apt-get install -y chromium``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from common.demo_data import write_arithmetic_dataset
from harness.observe import metrics_url

CHROMIUM = "/usr/bin/chromium"
BATCHES = 4
FAST = "--output-len-dist fixed --output-len-median 16"

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (Debian: apt-get install -y chromium)"
)


def chromium(tmp_path: Path, url: str, *mode: str) -> subprocess.CompletedProcess:
    """One headless Chromium run on ``url``; its process group is ended whatever happens."""
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--virtual-time-budget=5000",
        *mode,
        url,
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its renderer and utility children, by the group we started
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_the_status_page_renders_the_fleet_and_batch_plots_in_a_browser(make_cluster, tmp_path):
    cluster = make_cluster(rollout_batch_size=8, dynamic_filter="none")
    cluster.start_coordinator("--metrics-port", "0")
    for name in ("a1", "a2"):
        cluster.start_agent(name, sim_args=FAST)
    with cluster.client() as client:
        for i in range(BATCHES):
            client.generate(i)
    base = metrics_url(cluster.coordinator)

    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as resp:
        status = json.loads(resp.read())
    assert [a["agent"] for a in status["fleet"]] == ["a1", "a2"]
    assert status["batches"]["assembled"] == BATCHES
    assert [b["rollout_id"] for b in status["batches"]["recent"]] == list(range(BATCHES))
    assert status["frontier"]["epochs"][0]["size"] == status["dataset_size"]

    dom = chromium(tmp_path, f"{base}/", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    html = dom.stdout
    for name in ("a1", "a2"):
        row = re.search(rf'<tr class="agent" data-agent="{name}">(.*?)</tr>', html, re.S)
        assert row, f"agent {name} not rendered:\n{html[:4000]}"
        assert "sim-0: healthy" in row.group(1), row.group(1)
    assert re.search(rf'<span id="batch-count">{BATCHES}</span>', html), html[:4000]
    series = re.findall(r'<svg class="spark" data-series="(\w+)"[^>]*>\s*<polyline points="([^"]+)"', html)
    assert {name for name, _ in series} == {"reward_mean", "response_len_mean", "dropped_ratio", "wait_s"}, series
    for name, points in series:
        assert len(points.split()) == BATCHES, (name, points)
    assert 'id="error"></div>' in html, "the page reported an error refreshing"

    shot = tmp_path / "status.png"
    out = chromium(tmp_path, f"{base}/", f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars")
    assert out.returncode == 0, out.stderr[-3000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("ROLLFLEET_STATUS_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)


def test_the_status_page_lists_each_dataset_of_a_mixture(make_cluster, tmp_path):
    a = write_arithmetic_dataset(tmp_path / "a.jsonl", 40)
    b = write_arithmetic_dataset(tmp_path / "b.jsonl", 20, seed=1)
    cluster = make_cluster(
        datasets=[f"math={a},weight=3", f"code={b},weight=1"], rollout_batch_size=4, dynamic_filter="none"
    )
    cluster.start_coordinator("--metrics-port", "0")
    cluster.start_agent("a1", sim_args=FAST)
    with cluster.client() as client:
        client.generate(0)
    base = metrics_url(cluster.coordinator)
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as resp:
        frontier = json.loads(resp.read())["frontier"]
    assert {e["dataset"] for e in frontier["epochs"]} == {"math", "code"}
    assert {n: d["weight"] for n, d in frontier["datasets"].items()} == {"math": 3.0, "code": 1.0}
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        scraped = resp.read().decode()
    assert 'rollfleet_source_weight{dataset="math"} 3.0' in scraped
    assert 'rollfleet_source_prompts{dataset="code",state="delivered"} 1.0' in scraped  # 3 + 1 of a batch of 4
    dom = chromium(tmp_path, f"{base}/", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    for name, weight in (("math", 3), ("code", 1)):
        assert re.search(rf'<div class="dataset">dataset {name}: weight {weight}, filtered 0, pending', dom.stdout), (
            dom.stdout[:4000]
        )
        assert f"dataset {name}, epoch 0: position" in dom.stdout
    assert 'id="error"></div>' in dom.stdout
