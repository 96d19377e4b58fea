"""``coordinator serve --gateways N``: relay processes that hold the peers' connections, with real processes,
real sockets and real kills.

Peers connect to the one address they always used; each part shows in ``coordinator status``, the status
page's JSON and the metrics; a SIGKILLed gateway costs nothing (its peers redial and land on another or on its
successor, which the coordinator starts at once) and neither does a SIGKILLed coordinator (its gateways exit
with it and the restart binds the same port); bad input through a gateway is answered as without one.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import zmq

from common import protocol as p
from common.errors import RemoteError
from harness.cluster import pid_alive, running_child
from harness.polling import wait_for

AGENTS = ("agent-0", "agent-1", "agent-2")


def _gateways(cluster) -> list[dict]:
    return cluster.status()["gateways"]


def _check_batch(batch, size: int, seen: set) -> None:
    """A full batch, none of whose prompts came before: exactly once per (data epoch, index)."""
    assert len(batch.groups) == size
    for g in batch.groups:
        assert (g.data_epoch, g.index) not in seen, f"prompt {g.index} of data epoch {g.data_epoch} delivered twice"
        seen.add((g.data_epoch, g.index))


def _fleet(make_cluster, *coordinator_flags: str):
    """A coordinator with two gateways and ``AGENTS``."""
    cluster = make_cluster(gateways=2)
    cluster.start_coordinator(*coordinator_flags)
    for name in AGENTS:
        cluster.start_agent(name)
    return cluster


def test_a_fleet_served_through_gateways_shows_each_gateway(make_cluster):
    cluster = _fleet(make_cluster, "--metrics-port", "0")
    size, seen = cluster.config["rollout_batch_size"], set()
    with cluster.client() as client:
        for rollout_id in range(4):
            _check_batch(client.generate(rollout_id), size, seen)
    # Every agent's connection is held by a gateway, none by the coordinator process itself.
    gateways = wait_for(
        lambda: (lambda gs: gs if sum(g["peers"] for g in gs) >= len(AGENTS) else None)(_gateways(cluster)),
        10,
        "the gateways to report the agents as their peers",
    )
    assert [g["gateway"] for g in gateways] == [0, 1]
    for g in gateways:
        assert g["up"] and g["restarts"] == 0 and running_child(g["pid"], cluster.coordinator.pid), g
    assert sum(g["messages_in"] for g in gateways) > 0 and sum(g["messages_out"] for g in gateways) > 0
    # The status page's JSON and the metrics show the same parts.
    url = wait_for(lambda: _metrics_url(cluster), 10, "the metrics address in the log")
    with urllib.request.urlopen(f"{url}/status.json", timeout=5) as r:
        assert [g["gateway"] for g in json.load(r)["gateways"]] == [0, 1]
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'rollfleet_gateway_up{gateway="0"} 1.0' in text and 'rollfleet_gateway_up{gateway="1"} 1.0' in text
    assert 'rollfleet_gateway_messages_total{direction="in",gateway="1"}' in text


def _metrics_url(cluster) -> str | None:
    for line in cluster.coordinator.text().splitlines():
        if "coordinator metrics on " in line:
            return line.split("coordinator metrics on ", 1)[1].split("/metrics", 1)[0]
    return None


def test_a_sigkilled_gateway_loses_and_doubles_nothing(make_cluster):
    cluster = _fleet(make_cluster)
    size, seen = cluster.config["rollout_batch_size"], set()
    with cluster.client() as client:
        for rollout_id in range(3):
            _check_batch(client.generate(rollout_id), size, seen)
        victim = next(g for g in _gateways(cluster) if g["peers"])
        os.kill(victim["pid"], signal.SIGKILL)
        # Batches keep flowing while the peers it held redial, and none is short or repeated.
        for rollout_id in range(3, 9):
            _check_batch(client.generate(rollout_id), size, seen)

    again = cluster.gateway_successor(victim, 10)
    assert again["restarts"] == 1 and again["incarnation"] == victim["incarnation"] + 1
    assert f"gateway {victim['gateway']} (pid {victim['pid']}) exited" in cluster.coordinator.text()
    stats = cluster.status()
    assert {a: s["status"] for a, s in stats["agents"].items()} == dict.fromkeys(AGENTS, "alive")
    assert stats["receipts"]["refused"] == 0  # no group made twice for one prompt


def test_the_gateways_die_with_a_sigkilled_coordinator_and_its_restart_binds_again(make_cluster):
    cluster = make_cluster(gateways=2)
    cluster.start_coordinator()
    cluster.start_agent("agent-0")
    size, seen = cluster.config["rollout_batch_size"], set()
    with cluster.client() as client:
        _check_batch(client.generate(0), size, seen)
        pids = [g["pid"] for g in _gateways(cluster)]
        os.kill(cluster.coordinator.pid, signal.SIGKILL)  # the process alone, not its group
        cluster.coordinator.wait(10)
        wait_for(lambda: not any(pid_alive(pid) for pid in pids), 5, "the gateways to exit with their coordinator")
        cluster.start_coordinator()  # same port, same ledger
        for rollout_id in (1, 2):
            _check_batch(client.generate(rollout_id), size, seen)


def test_bad_input_through_a_gateway_is_answered_as_without_one(make_cluster):
    cluster = make_cluster(gateways=1)
    cluster.start_coordinator("--max-message-bytes", "64KiB")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.address)
    try:
        for frame, code in (
            (b"\xc1 not msgpack", "malformed"),
            (b"x" * (70 << 10), "too_large"),
        ):
            sock.send(frame)
            assert sock.poll(10_000), f"no answer to {frame[:20]!r}"
            msg = p.decode(sock.recv())
            assert isinstance(msg, p.Error) and msg.code == code, msg
        sock.send(p.encode(p.Stats(7)))
        assert sock.poll(10_000)
        assert isinstance(p.decode(sock.recv()), p.Ok)  # and the gateway still serves the same connection
    finally:
        sock.close(linger=0)
        ctx.term()
    assert cluster.coordinator.alive()


def test_curve_keys_and_roles_hold_through_gateways(make_cluster):
    cluster = make_cluster(gateways=2, curve_agents=("agent-0",), curve_trainers=("trainer",))
    cluster.start_coordinator()
    cluster.start_agent("agent-0")
    size, seen = cluster.config["rollout_batch_size"], set()
    with cluster.client() as client:
        _check_batch(client.generate(0), size, seen)
    # An agent's key may not attach as a trainer: the role check sees the key the gateway forwarded.
    from coordinator.client import RolloutClient

    server_key = str(cluster.curve_dir / "coordinator.key")
    agent_secret = str(cluster.curve_dir / "secrets" / "agent-0.key_secret")
    try:
        RolloutClient(cluster.address, timeout=30, curve_secret=agent_secret, curve_server_key=server_key)
    except RemoteError as exc:
        assert "may not send 'attach'" in str(exc)
    else:
        raise AssertionError("an agent's key attached as a trainer through a gateway")


def test_a_stopped_gateway_is_replaced_and_its_peers_move_on(make_cluster):
    """SIGSTOP: the process holds its connections but answers nothing (a stuck gateway, not a dead one)."""
    cluster = _fleet(make_cluster)
    size, seen = cluster.config["rollout_batch_size"], set()
    with cluster.client() as client:
        _check_batch(client.generate(0), size, seen)
        victim = next(g for g in _gateways(cluster) if g["peers"])
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            # Its peers' connection heartbeats time out and they redial: batches keep coming meanwhile.
            for rollout_id in range(1, 5):
                _check_batch(client.generate(rollout_id), size, seen)
            again = cluster.gateway_successor(victim, 30)
        finally:
            try:
                os.kill(victim["pid"], signal.SIGCONT)  # if it was never killed, it ends with the cluster
            except ProcessLookupError:
                pass
    assert again["restarts"] == 1
    assert f"gateway {victim['gateway']} (pid {victim['pid']}) has not reported for" in cluster.coordinator.text()
    assert {a: s["status"] for a, s in cluster.status()["agents"].items()} == dict.fromkeys(AGENTS, "alive")


def test_a_burst_of_connections_is_served_by_every_gateway(make_cluster):
    """Hundreds of peers connecting at once: each gateway races the others for every connection on the shared
    socket; one that loses a race must not block (a blocking accept() once hung a gateway's whole I/O)."""
    cluster = make_cluster(gateways=2)
    cluster.start_coordinator()
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 1024)
    socks = []
    try:
        for i in range(300):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(cluster.address)
            sock.send(p.encode(p.Stats(i + 1)))
            socks.append(sock)
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        answered: set[int] = set()
        deadline = time.monotonic() + 30
        while len(answered) < len(socks) and time.monotonic() < deadline:
            for sock, _ in poller.poll(1000):
                msg = p.decode(sock.recv(), max_bytes=1 << 30)
                answered.add(msg.req)
                poller.unregister(sock)
        assert len(answered) == len(socks), f"{len(socks) - len(answered)} of {len(socks)} peers never answered"
        gateways = wait_for(
            lambda: (lambda gs: gs if all(g["up"] for g in gs) else None)(_gateways(cluster)), 10, "both gateways up"
        )
        assert all(g["restarts"] == 0 for g in gateways), gateways
        assert all(g["messages_in"] > 0 for g in gateways), gateways  # both took connections
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
