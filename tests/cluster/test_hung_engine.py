"""A hung engine (alive, never answering: SIGSTOP of an attached server) does not stop the fleet.

The report this answers: one engine frozen right before ``update_weights_from_disk`` stopped every batch
for ten minutes (the disk step waited on it under a 600 s deadline, its agent's leases waited behind the
update, health checks stayed paused). Now it is an engine lost: the update succeeds on the others within
seconds, batches keep coming while it is frozen, and after SIGCONT it serves the fleet's version.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from harness.chaos_evidence import alive_engines
from harness.polling import wait_for

pytestmark = pytest.mark.timeout(120)


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=5) as resp:
        return json.loads(resp.read())


def test_an_engine_frozen_before_a_disk_update_is_left_out_and_batches_keep_coming(make_cluster):
    cluster = make_cluster(rollout_batch_size=4, dynamic_filter="none", max_staleness=1)
    cluster.start_coordinator()
    sim = ("--token-latency-ms", "1")
    frozen, frozen_url = cluster.start_sim_engine(*sim)
    _, live_url = cluster.start_sim_engine(*sim)
    cluster.start_agent("a1", "--health-interval", "1", "--health-timeout", "3", engine_urls=(live_url, frozen_url))
    ckpt = cluster.tmp / "ckpt1"
    ckpt.mkdir()
    with cluster.client(timeout=60) as client:
        client.generate(0)
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            result = client.update_weights_from_disk(str(ckpt), 1, timeout=60)
            assert result.engines == {"a1/url-0": 1}, result
            client.generate(1)
            # At --max-staleness 1, batch 2 holds only groups started on update 1: the survivor's.
            assert {s.weight_version for s in client.generate(2).samples} == {"1"}
        finally:
            os.kill(frozen.pid, signal.SIGCONT)

        def serving_again():
            e = alive_engines(cluster.status()).get("a1/url-1")
            return e if e and e["state"] == "healthy" else None

        wait_for(serving_again, 60, "the thawed engine to serve again")
        assert model_info(frozen_url)["weight_version"] == "1", "it serves the fleet's version"
        ckpt2 = cluster.tmp / "ckpt2"
        ckpt2.mkdir()
        result = client.update_weights_from_disk(str(ckpt2), 2, timeout=60)
        assert result.engines == {"a1/url-0": 2, "a1/url-1": 2}, "the next update reaches it"
        assert {s.weight_version for s in client.generate(3).samples} == {"2"}
