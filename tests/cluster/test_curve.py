"""CurveZMQ on every socket, with real keys, real processes and real sockets.

With keys on, a peer holding a key the fleet does not know is refused in the handshake (ZAP): it
cannot attach (and so cannot fence the trainer), cannot register as an agent, cannot fetch
payloads; each refusal is a WARNING naming the key's fingerprint. The real trainer is untouched:
its next generate succeeds on the same session. Off loopback, keys are required unless
``--insecure``; ``rollfleet-keygen`` writes the layout the coordinator reads.
"""

from __future__ import annotations

import os
import re
import stat

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from common import protocol as p
from common.curve import fingerprint, load_pair, load_public
from common.errors import ConfigError, RemoteError, RolloutError
from common.keygen import write_pair
from coordinator.client import RolloutClient
from harness.cluster import free_port
from harness.polling import wait_for
from tests.cluster.test_cli_errors import assert_one_line, join, run_cli, serve

AGENTS = ("agent-0", "agent-1")


def _check_batch(batch, size: int, seen: set) -> None:
    assert len(batch.groups) == size
    for g in batch.groups:
        assert g.index not in seen, f"dataset index {g.index} delivered twice"
        seen.add(g.index)


def _refused(address: str, pair, server_public: bytes, first: bytes) -> int:
    """Connect as a CURVE client with ``pair``, send ``first``; the handshake event the socket reports."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, pair.public, pair.secret
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        sock.send(first)
        assert mon.poll(20_000), "no handshake event in 20 s"
        event = recv_monitor_message(mon)["event"]
        # Nothing the server sends can arrive over a refused connection.
        assert not sock.poll(0)
        return event
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def test_unknown_keys_are_refused_everywhere_and_the_trainer_keeps_working(make_cluster, tmp_path):
    cluster = make_cluster(curve_agents=AGENTS, curve_trainers=("trainer",))
    cluster.start_coordinator()
    for name in AGENTS:
        cluster.start_agent(name)
    size = cluster.config["rollout_batch_size"]
    seen: set[int] = set()
    server_key = str(cluster.curve_dir / "coordinator.key")
    coordinator_public = load_public(server_key, "test")
    _, intruder_file = write_pair(tmp_path / "outsider", "intruder")
    intruder = load_pair(intruder_file, "test")

    trainer = cluster.client()
    session = trainer._async.session
    batch = trainer.generate(0)
    _check_batch(batch, size, seen)
    assert {g.agent_id for g in batch.groups} <= set(AGENTS)

    # 1. An unknown trainer cannot attach: a clear error at once, no session, the real trainer not fenced.
    with pytest.raises(RolloutError, match=r"refused this client's CurveZMQ key"):
        RolloutClient(cluster.address, timeout=30, curve_secret=str(intruder_file), curve_server_key=server_key)
    attach = p.encode(p.Attach(1, "intruder", {}))
    assert _refused(cluster.address, intruder, coordinator_public, attach) == zmq.EVENT_HANDSHAKE_FAILED_AUTH

    # 2. An unknown agent cannot register: it logs the refusal, the coordinator never lists it.
    cluster.start_agent("agent-x", "--curve-secret", str(intruder_file), "--curve-server-key", server_key, wait=False)
    wait_for(lambda: "refused this agent's CurveZMQ key" in cluster.agents["agent-x"].text(), 30, "agent refusal")
    assert "agent-x" not in cluster.status()["agents"]

    # 2b. Roles stay apart: an agent's key cannot attach, a trainer's key cannot register.
    agent_secret = str(cluster.curve_dir / "secrets" / "agent-1.key_secret")
    with pytest.raises(RemoteError, match="forbidden.*may not send 'attach'"):
        RolloutClient(cluster.address, timeout=30, curve_secret=agent_secret, curve_server_key=server_key)
    trainer_secret = str(cluster.curve_dir / "secrets" / "trainer.key_secret")
    cluster.start_agent("agent-t", "--curve-secret", trainer_secret, "--curve-server-key", server_key, wait=False)
    wait_for(lambda: "refused a 'register' message" in cluster.coordinator.text(), 30, "register refused")
    assert "agent-t" not in cluster.status()["agents"]

    # 3. An unknown key cannot fetch payloads from an agent; the trainer's key can.
    address = re.search(r"payloads at (\S+)", cluster.agents["agent-0"].text()).group(1)
    endpoint, _, agent_key = address.partition("#curve=")
    fetch = p.encode(p.Fetch(7, ["any-key"]))
    assert _refused(endpoint, intruder, agent_key.encode(), fetch) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # The agent's own key is allowed at the coordinator, not at payload endpoints: roles stay apart.
    agent_pair = load_pair(cluster.curve_dir / "secrets" / "agent-1.key_secret", "test")
    assert _refused(endpoint, agent_pair, agent_key.encode(), fetch) == zmq.EVENT_HANDSHAKE_FAILED_AUTH

    # The refusals are WARNINGs naming the key's fingerprint.
    fp = re.escape(fingerprint(intruder.public))
    wait_for(lambda: re.search(f"WARNING.*refused a CurveZMQ peer.*{fp}", cluster.coordinator.text()), 10, "log")
    wait_for(lambda: re.search(f"WARNING.*refused a CurveZMQ peer.*{fp}", cluster.agents["agent-0"].text()), 10, "log")

    # The real trainer is untouched: same session, its next batches flow.
    for rollout_id in (1, 2):
        _check_batch(trainer.generate(rollout_id), size, seen)
    assert trainer._async.session == session
    stats = cluster.status()
    assert set(stats["agents"]) == set(AGENTS)
    for proc in cluster.procs:
        if proc.name.startswith(("coordinator", "agent-0-", "agent-1-")):
            assert proc.alive() and "Traceback" not in proc.text(), proc.text()[-3000:]


def test_a_client_without_keys_times_out_with_a_hint(make_cluster):
    cluster = make_cluster(curve_agents=("agent-0",))
    cluster.start_coordinator()
    with pytest.raises(RolloutError, match=r"no answer .*if the fleet uses CurveZMQ keys, give curve_secret"):
        RolloutClient(cluster.address, timeout=3, retry_interval=0.5)
    with pytest.raises(ConfigError, match="curve_secret needs curve_server_key"):
        RolloutClient(cluster.address, curve_secret=str(cluster.curve_dir / "secrets" / "trainer.key_secret"))


def test_off_loopback_needs_keys_or_insecure(make_cluster, tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "1+1=", "label": "2"}\n')
    out = serve(dataset, tmp_path / "coordinator", "--bind", f"tcp://0.0.0.0:{free_port()}")
    assert_one_line(out, "--bind", "tcp://0.0.0.0", "--curve-dir", "--insecure")
    assert not (tmp_path / "coordinator" / "ledger").exists()
    out = join(tmp_path / "agent", "--engine", "sim", "--payload-bind", "tcp://0.0.0.0:0")
    assert_one_line(out, "--payload-bind", "tcp://0.0.0.0:0", "--curve-secret", "--insecure")
    assert not (tmp_path / "agent").exists()

    # --insecure: it runs, and says so in a WARNING; loopback clients keep working without keys.
    cluster = make_cluster()
    cluster.start_coordinator("--bind", f"tcp://0.0.0.0:{cluster.port}", "--insecure")
    cluster.start_agent("agent-0", "--payload-bind", "tcp://0.0.0.0:0", "--insecure")
    with cluster.client() as client:
        assert len(client.generate(0).groups) == cluster.config["rollout_batch_size"]
    assert re.search(r"WARNING.*--bind tcp://0.0.0.0:\d+ is reachable from other hosts", cluster.coordinator.text())
    assert re.search(r"WARNING.*--payload-bind tcp://0.0.0.0:0 is reachable", cluster.agents["agent-0"].text())


def test_keygen_writes_pairs_in_zmq_format_with_private_secrets(tmp_path):
    out = run_cli("common.keygen", "--fleet", str(tmp_path / "curve"), "--agents", "node-0", "--trainers", "t0")
    assert out.returncode == 0, out.stderr
    curve = tmp_path / "curve"
    for secret in (curve / "coordinator.key_secret", curve / "secrets" / "node-0.key_secret"):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
        public, secret_key = zmq.auth.load_certificate(secret)
        assert secret_key is not None and zmq.curve_public(secret_key) == public
    assert (
        zmq.auth.load_certificate(curve / "agents" / "node-0.key")[0]
        == load_pair(curve / "secrets" / "node-0.key_secret", "t").public
    )
    assert (curve / "trainers" / "t0.key").exists() and not list((curve / "agents").glob("*secret*"))
    before = (curve / "coordinator.key_secret").read_bytes()

    # Never overwrites without --force; a bad name writes nothing.
    out = run_cli("common.keygen", "coordinator", "--out", str(curve))
    assert_one_line(out, "coordinator.key", "--force")
    assert (curve / "coordinator.key_secret").read_bytes() == before
    out = run_cli("common.keygen", "../evil", "--out", str(tmp_path / "k"))
    assert_one_line(out, "'../evil'")
    assert not (tmp_path / "k").exists() or not list((tmp_path / "k").iterdir())

    # The coordinator refuses a secret others can read, and names the file.
    os.chmod(curve / "coordinator.key_secret", 0o644)
    out = serve(tmp_path / "none.jsonl", tmp_path / "c", "--curve-dir", str(curve))
    assert_one_line(out, "--curve-dir", "coordinator.key_secret", "chmod 600")


def test_a_keyed_fleet_survives_a_coordinator_sigkill_and_restart(make_cluster):
    """Agents and the trainer reconnect to the restarted coordinator through fresh CURVE handshakes
    (the moment before its authenticator runs fails closed, and they retry), and batches flow again."""
    import signal

    cluster = make_cluster(curve_agents=AGENTS)
    coordinator = cluster.start_coordinator()
    for name in AGENTS:
        cluster.start_agent(name)
    trainer = cluster.client()
    seen: set[int] = set()
    size = cluster.config["rollout_batch_size"]
    _check_batch(trainer.generate(0), size, seen)
    sessions = {name: cluster.status()["agents"][name]["session"] for name in AGENTS}
    coordinator.signal(signal.SIGKILL)
    coordinator.wait(10)
    cluster.start_coordinator()
    for name in AGENTS:
        wait_for(
            lambda n=name: (e := cluster.status()["agents"].get(n)) and e["status"] == "alive"
            and e["session"] != sessions[n],
            60,
            f"{name} to register again",
        )  # fmt: skip
    for rollout_id in (1, 2):
        _check_batch(trainer.generate(rollout_id), size, seen)
