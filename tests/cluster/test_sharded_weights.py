"""Weight pushes from every rank of a sharded trainer (docs/weights.md, "Sharded trainers: weight pushes").

Two real trainer processes (``harness/sharded_trainer.py``: gloo, a small model wrapped with FSDP2's
``fully_shard`` on CPU, plus a plain tensor both ranks pass and one tensor per rank only that rank passes) push
to a real loopback cluster of sim engines. Rank 0 talks to the coordinator; rank 1 (``attach=False``) never does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request

import pytest

from common.weights_digest import weights_digest
from harness.cluster import free_port
from harness.polling import WaitAborted, wait_for

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30.0  # the trainers' update timeout (harness/sharded_trainer.py)


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=5) as resp:
        return json.loads(resp.read())


def engines(cluster) -> dict[str, dict]:
    status = cluster.status()
    return {
        f"{a}/{e['name']}": e
        for a, entry in status["agents"].items()
        if entry["status"] == "alive"
        for e in entry["engines"]
    }


def up_engines(cluster) -> dict[str, dict] | None:
    """Both engines of a1, once each is up (serving, or up behind the fleet's weights)."""
    found = engines(cluster)
    return found if len(found) == 2 and all(e.get("state") in ("healthy", "stale") for e in found.values()) else None


def pid_of(cluster, engine: str) -> int:
    """The pid of the process now running ``agent/engine`` (the last one its agent launched)."""
    agent, name = engine.split("/")
    return int(re.findall(rf"engine {name} launched \(pid (\d+)\)", cluster.agents[agent].text())[-1])


def start_trainers(cluster, scenario: str, *extra: str) -> tuple[list, list]:
    out = cluster.tmp / f"trainers-{scenario}"
    out.mkdir()
    port = free_port()
    argv = lambda r: [  # noqa: E731
        sys.executable,
        "-m",
        "harness.sharded_trainer",
        cluster.address,
        str(r),
        "2",
        str(port),
        str(out),
        scenario,
        *extra,
    ]
    procs = [cluster._spawn(f"trainer{r}-{scenario}", argv(r)) for r in (0, 1)]
    return procs, [out / f"rank{r}.json" for r in (0, 1)]


def records(path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def wait_records(procs, paths, n: int, timeout: float) -> list[list[dict]]:
    """Every rank's first ``n`` outcomes, once each has them."""

    def ready():
        got = [records(p) for p in paths]
        if all(len(g) >= n for g in got):
            return got
        for proc in procs:
            if not proc.alive() and proc.popen.returncode != 0:
                raise WaitAborted(f"{proc.name} exited {proc.popen.returncode}: {proc.text()[-3000:]}")
        return None

    return wait_for(ready, timeout, f"{n} outcome(s) from both ranks")


def expect_digest(cluster, version: int, names=None) -> None:
    from harness.sharded_trainer import reference

    digest = weights_digest(reference(version, 2).items())
    for name, e in engines(cluster).items():
        if names is None or name in names:
            info = model_info(e["url"])
            assert (info["weight_version"], info["weight_digest"]) == (str(version), digest), name


def test_a_broadcast_and_a_disk_push_from_both_ranks_land_as_the_unsharded_model(make_cluster):
    """Both ranks call ``update_weights`` with their shards (FSDP2 DTensors), a tensor both pass and one only each
    passes; every engine then holds exactly the unsharded model's tensors (digest over names, dtypes, shapes,
    values), verified. Then a checkpoint of the full model pushed with ``update_weights_from_disk`` from both
    ranks, and a ``catch_up`` with nothing behind (both return ``{}`` at once); then version 2 again, refused
    with the same ``StateError`` on both ranks. Both ranks return the same results.

    Turns red if a shard, a bucket or a rank's own tensor is lost or misplaced in the gather (digest), if rank 1
    returns or raises anything but rank 0's outcome, or if rank 1 talks to the coordinator (its address is one
    nobody serves: a request would fail after 5 s)."""
    pytest.importorskip("torch")
    cluster = make_cluster()
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2, sim_args="--token-latency-ms 1")
    started = time.monotonic()
    procs, paths = start_trainers(cluster, "push")
    (b0,), (b1,) = wait_records(procs, paths, 1, 60)
    assert "result" in b0, b0
    assert b1["result"] == b0["result"] and b0["result"]["engines"] == {"a1/sim-0": 1, "a1/sim-1": 1}
    expect_digest(cluster, 1)
    (paths[0].parent / "go-2").touch()
    r0, r1 = wait_records(procs, paths, 4, 60)
    assert r0[1]["result"]["engines"] == {"a1/sim-0": 2, "a1/sim-1": 2}, r0
    assert r1[1:] == [{**r, "at": r1[i + 1]["at"], "took": r1[i + 1]["took"]} for i, r in enumerate(r0[1:])], (r0, r1)
    assert r0[2]["result"]["engines"] == {}
    assert r0[3]["kind"] == "StateError" and "not greater" in r0[3]["error"], r0[3]
    expect_digest(cluster, 2)
    assert cluster.status()["weights"]["lock"] is None
    for proc in procs:
        assert proc.wait(30) == 0, proc.text()[-3000:]
    print(f"both ranks pushed a broadcast and a disk checkpoint in {time.monotonic() - started:.1f}s (with startup)")


def test_an_engine_killed_inside_a_push_costs_one_retry_on_both_ranks_then_a_catch_up(make_cluster):
    """An engine SIGKILLed after the group formed with it, just before the first bucket reaches it (rank 0's
    hook): the push fails on rank 0 (code ``weights``) and is retried once, on a new group of the engines
    confirmed then, by both ranks (rank 1 gathers every bucket again): both results say ``retried``, nothing
    hangs. An engine SIGKILLed after the push comes back behind the fleet; a ``catch_up`` from both ranks brings
    it to version 1 (every engine's digest the unsharded model's), and a second one finds nothing behind.

    Turns red if rank 1 misses the retry (it would wait for word that never comes, or gather alone: a hang
    until the timeout), if the result differs between ranks, or if the retry is not transparent."""
    pytest.importorskip("torch")
    cluster = make_cluster()
    cluster.start_coordinator()
    # The other engine waits in the failed broadcast for its bucket until its own timeout (5 s, not SGLang's 60):
    # the abort, and the retry, do not wait out a minute; it is free again, behind the fleet, once the push is done.
    cluster.start_agent("a1", engines=2, sim_args="--token-latency-ms 1 --weight-sync-timeout 5")
    victim = cluster.engine_pids_of("a1")[1]
    started = time.monotonic()
    procs, paths = start_trainers(cluster, "retry", str(victim))
    (b0,), (b1,) = wait_records(procs, paths, 1, 60)
    print(f"the push with a retry took {b0['took']:.2f}s on rank 0: {b0}")
    assert "result" in b0 and b1["result"] == b0["result"], (b0, b1)
    assert b0["result"]["retried"] and b0["result"]["version"] == 1, b0
    assert set(b0["result"]["engines"].values()) == {1}
    # The killed engine restarts, in the retry's group or (when it came up later) behind it. If it made the
    # group, an engine killed now comes back behind the push; then both ranks catch it up.
    wait_for(lambda: len(cluster.engine_pids_of("a1")) == 3, 20, "the killed engine to restart")
    up = wait_for(lambda: up_engines(cluster), 20, "both engines up")
    behind = [name for name, e in up.items() if e["state"] == "stale"]
    if not behind:
        os.kill(pid_of(cluster, "a1/sim-0"), signal.SIGKILL)
        behind = ["a1/sim-0"]
        wait_for(lambda: cluster.status()["weights"]["behind"] == behind, 20, "a1/sim-0 to restart behind")
    (paths[0].parent / "go-2").touch()
    r0, r1 = wait_records(procs, paths, 3, 60)
    assert r0[1]["result"]["engines"] == {behind[0]: 1} and r1[1]["result"] == r0[1]["result"], (r0, r1)
    assert r0[2]["result"]["engines"] == {} == r1[2]["result"]["engines"], (r0, r1)
    wait_for(lambda: engines(cluster)[behind[0]].get("state") == "healthy", 10, f"{behind[0]} serving again")
    expect_digest(cluster, 1)
    for proc in procs:
        assert proc.wait(30) == 0, proc.text()[-3000:]
    print(f"retry and catch-up from both ranks in {time.monotonic() - started:.1f}s (with startup)")


@pytest.mark.parametrize("victim", ["member", "leader"])
def test_a_trainer_rank_killed_inside_a_push_fails_the_other_at_once_and_frees_the_lock(make_cluster, victim):
    """One trainer rank SIGKILLed inside a push: rank 1 before it gathers bucket 1 (rank 0 waits in that
    gather), or rank 0 inside its broadcast of bucket 1 (rank 1 waits for its word). The surviving rank raises
    ``WeightUpdateError`` well within the update's timeout (gloo sees the closed peer at once; nothing waits for
    the timeout), and the coordinator's weight lock is free: at once when rank 0 survives (it aborts the update,
    ``AbortWeights``), at the dead rank 0's session TTL (1.5 s here) otherwise. The next trainer can push.

    Turns red if the survivor waits in a collective the dead rank left (a hang to the timeout or forever), if it
    returns success, or if rank 0 leaves the lock to the deadline."""
    torch = pytest.importorskip("torch")
    cluster = make_cluster()
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=1, sim_args="--token-latency-ms 1")
    procs, paths = start_trainers(cluster, f"kill-{victim}")
    dead, alive = (procs[1], procs[0]) if victim == "member" else (procs[0], procs[1])
    survivor = paths[0] if victim == "member" else paths[1]

    def stalled():
        for proc in procs:
            if not proc.alive():
                raise WaitAborted(f"{proc.name} exited: {proc.text()[-3000:]}")
        return "stalled" in dead.text()

    wait_for(stalled, 60, f"the {victim} to stall inside the push")
    killed_at = time.time()
    dead.signal(signal.SIGKILL)
    dead.wait(10)
    (record,) = wait_for(lambda: records(survivor), TIMEOUT, "the surviving rank's outcome")
    after = record["at"] - killed_at
    print(f"{victim} killed: the other rank raised {after:.2f}s later: {record}")
    assert record["kind"] in ("GroupBroken", "WeightUpdateError"), record
    assert "process group failed" in record["error"], record
    assert after < TIMEOUT / 3, f"raised {after:.1f}s after the kill"
    if victim == "member":
        assert cluster.status()["weights"]["lock"] is None, "rank 0 left the lock to its deadline"
    else:
        wait_for(lambda: cluster.status()["weights"]["lock"] is None, 1.5 + 3, "the dead rank 0's lock to go")
    print(f"lock free {time.time() - killed_at:.2f}s after the kill")
    assert alive.wait(30) == 0, alive.text()[-3000:]
    with cluster.client(timeout=30) as client:
        tensors = {"layer.weight": torch.full((64,), 3.0), "sim.accuracy": torch.tensor([0.5])}
        assert client.update_weights(tensors, 5, backend="gloo", timeout=30).engines == {"a1/sim-0": 5}
