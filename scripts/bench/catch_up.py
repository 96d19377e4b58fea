#!/usr/bin/env python3
"""Catch-up after a broadcast: seconds from an engine being up (behind the fleet) to it serving the
fleet's version, for an engine restart and for a node that joins, and what it costs the others.

One fleet (2 agents x 2 sim engines, a trainer pulling batches on a thread), tensors of ``--mib``
MiB broadcast over gloo once, then ``--reps`` times each:

    restart   SIGKILL one engine; its supervisor restarts it and it comes up ``stale`` (behind the
              broadcast version). t_up: the coordinator lists it in ``weights.behind``.
    join      start one more agent (1 sim engine); t_up: its engine is listed in ``weights.behind``.

then ``client.catch_up(tensors, version)``. Reported per kind (p50 / max over the reps):
``catch_up_s`` (the call), ``up_to_serving_s`` (t_up until the coordinator sees the engine
``healthy`` again, i.e. in the pool on the current version), and ``pauses_of_serving_engines``
during the catch-up (0: the serving engines never stopped). The floor, in the same run: a full
``update_weights`` of the same tensors to every engine (``full_update_s``), which is what the
engine would otherwise wait for, and which pauses every serving engine.

    .venv/bin/python scripts/bench/catch_up.py --mib 100 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from harness.chaos_evidence import alive_engines as engines  # noqa: E402
from harness.cluster import Cluster, pid_alive  # noqa: E402
from harness.polling import wait_for  # noqa: E402
from scripts.bench.benchlib import progress  # noqa: E402

SIM = "--token-latency-ms 2 --output-len-median 48 --preload-torch"
"""``--preload-torch``: a restarted sim engine comes up with torch loaded, as SGLang does; without it the sim
imports torch inside its first rendezvous (2-3 s that SGLang never pays)."""


def emit(metric: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"bench": "catch_up", "metric": metric, "value": round(value, 4), "unit": unit, **extra}))


def pauses(status: dict, skip: str) -> dict[str, int]:
    out = {}
    for key, e in engines(status).items():
        if key != skip and e.get("state") == "healthy":
            with urllib.request.urlopen(f"{e['url']}/server_info", timeout=5) as resp:
                out[key] = json.loads(resp.read())["sim"]["pauses"]
    return out


class Puller:
    """Pulls batches on a thread, so the fleet is generating while engines catch up."""

    def __init__(self, client):
        self.client, self.n, self.error = client, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                self.client.generate(self.n)
                self.n += 1
        except BaseException as exc:  # noqa: BLE001 (reported by stop())
            self.error = exc

    def stop(self):
        self._stop.set()
        self._thread.join(120)


def one(cluster, client, tensors, version, key: str, t_up: float) -> dict:
    before = pauses(cluster.status(), key)
    started = time.monotonic()
    result = client.catch_up(tensors, version, backend="gloo", timeout=120)
    called = time.monotonic() - started
    assert key in result.engines, result
    wait_for(lambda: engines(cluster.status())[key]["state"] == "healthy", 60, f"{key} to serve", interval=0.02)
    serving = time.monotonic() - t_up
    after = pauses(cluster.status(), key)
    paused = sum(after[k] - before[k] for k in before if k in after)
    return {"catch_up_s": called, "up_to_serving_s": serving, "pauses_of_serving_engines": paused}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=10.0, help="tensor bytes broadcast, in MiB")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch

    n = 4
    per = int(args.mib * (1 << 20) / 4 / n)
    tensors = {f"layer{i}.weight": torch.full((per,), 1.0 + i) for i in range(n)}
    tmp = Path(tempfile.mkdtemp(prefix="rollfleet-bench-catchup-"))
    cluster = Cluster(tmp, rows=20000, rollout_batch_size=4, dynamic_filter="none")
    results: dict[str, list[dict]] = {"restart": [], "join": []}
    full: list[float] = []
    try:
        cluster.start_coordinator()
        for name in ("a1", "a2"):
            cluster.start_agent(name, engines=2, sim_args=SIM)
        with cluster.client(timeout=120) as client:
            client.generate(0)
            version = 1
            started = time.monotonic()
            client.update_weights(tensors, version, backend="gloo", timeout=120)
            full.append(time.monotonic() - started)
            puller = Puller(client)
            try:
                for rep in range(args.reps):
                    before = {k: e["url"] for k, e in engines(cluster.status()).items() if k.startswith("a1/")}
                    live = [pid for pid in cluster.engine_pids_of("a1") if pid_alive(pid)]
                    os.kill(live[rep % len(live)], signal.SIGKILL)

                    def behind(before=before):
                        status = cluster.status()
                        for k, e in engines(status).items():
                            if k in before and e["url"] != before[k] and k in status["weights"]["behind"]:
                                return k
                        return None

                    victim = wait_for(behind, 60, "a1's killed engine to restart behind the fleet", interval=0.02)
                    r = one(cluster, client, tensors, version, victim, time.monotonic())
                    results["restart"].append(r)
                    progress(f"restart {rep}: {r}")
                for rep in range(args.reps):
                    name = f"j{rep}"
                    cluster.start_agent(name, engines=1, sim_args=SIM, wait=False)
                    key = f"{name}/sim-0"
                    wait_for(
                        lambda key=key: key in cluster.status()["weights"]["behind"],
                        120,
                        f"{key} up behind the fleet",
                        interval=0.02,
                    )
                    r = one(cluster, client, tensors, version, key, time.monotonic())
                    results["join"].append(r)
                    progress(f"join {rep}: {r}")
            finally:
                puller.stop()
            if puller.error is not None:
                raise puller.error
            for _ in range(args.reps):  # the floor: a full update reaching every engine
                version += 1
                started = time.monotonic()
                client.update_weights(tensors, version, backend="gloo", timeout=120)
                full.append(time.monotonic() - started)
    finally:
        leaks = cluster.stop_all()
        if leaks:
            progress(f"leaks: {leaks}")
    floor = statistics.median(full)
    emit("full_update_s", floor, "s", mib=args.mib, p_max=max(full), reps=len(full))
    for kind, rows in results.items():
        for metric in ("catch_up_s", "up_to_serving_s", "pauses_of_serving_engines"):
            values = [r[metric] for r in rows]
            emit(
                f"{kind}_{metric}",
                statistics.median(values),
                "count" if metric.startswith("pauses") else "s",
                mib=args.mib,
                max=max(values),
                reps=len(values),
                **(
                    {"ratio_to_full_update": round(statistics.median(values) / floor, 3)}
                    if metric != "pauses_of_serving_engines"
                    else {}
                ),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
