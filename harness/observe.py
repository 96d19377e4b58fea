"""Test helpers for the observation endpoint: where a process serves it, and its parsed metrics."""

from __future__ import annotations

import re
import urllib.request

from harness.polling import wait_for


def metrics_url(proc) -> str:
    """The base URL (``http://host:port``) a coordinator or agent logged for its metrics endpoint."""

    def logged():
        m = re.search(r"metrics on (http://\S+)/metrics", proc.text())
        return m.group(1) if m else None

    return wait_for(logged, 20, f"{proc.name} to log its metrics URL")


def scrape(base: str) -> list:
    """Every sample of ``base``/metrics, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        assert resp.status == 200, resp.status
        assert resp.headers["Content-Type"].startswith("text/plain"), resp.headers["Content-Type"]
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def sample_value(samples: list, name: str, **labels) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``; fails if there is none."""
    hits = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert hits, f"no sample {name}{labels or ''}"
    return sum(hits)
