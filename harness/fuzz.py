"""Malformed and random frames at a running cluster's coordinator and payload endpoint, then checks.

``frames(rng, kind)`` makes one fuzz message (a list of frames) of a kind: random bytes, truncated
msgpack of a real message, a real message with a wrong version, an unknown type, a field of the
wrong type, a missing or an unknown field, random msgpack objects, oversized frames (over the
coordinator's ``--max-message-bytes``, within its MAXMSGSIZE), multipart garbage. None of them is a
valid message: each is decoded before it is sent, and the rare random one that decodes is replaced
(a fuzzer must not attach, which would fence the trainer, or register).

``fuzz(address, n, ...)`` sends ``n`` of them from one DEALER, non-blocking, and every ``PROBE_EVERY``
frames a harmless valid request (``stats`` at the coordinator, a ``fetch`` of a key nobody holds at
a payload endpoint) whose answer proves the target is alive and has handled everything before it
(one DEALER's frames are handled in order). With a key the target refuses, nothing is delivered:
every ``PROBE_EVERY`` frames the socket waits for its handshake's refusal (a monitor event) and is
reopened, a fresh refused handshake each time.

``check(cluster, client, first_rollout, batches)``: every process alive, no ``Traceback`` in any
log, and the next batches the trainer pulls complete (the configured count, no dataset index or
group key twice).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from common import protocol as p
from common.curve import ClientKeys, make_client

PROBE_EVERY = 500
_MONITORS = itertools.count()
KINDS = (
    "random_bytes",
    "truncated",
    "wrong_version",
    "unknown_type",
    "wrong_field_type",
    "missing_field",
    "unknown_field",
    "random_msgpack",
    "oversized",
    "multipart",
    "empty",
)

_SAMPLES = [
    p.Attach(1, "fuzz", {}),
    p.Register("fuzz", 1, 8, "tcp://127.0.0.1:1", [], [], []),
    p.Heartbeat(1),
    p.Generate(1, 2, 0, -1),
    p.Fetch(3, ["k"]),
    p.Stats(4),
    p.Pause(1, 5, True, False),
    p.Consumed(1, 6, 0),
]


def _random_obj(rng: random.Random, depth: int = 0):
    choice = rng.randrange(9 if depth < 4 else 6)
    if choice == 0:
        return rng.randrange(-(1 << 63), 1 << 64)
    if choice == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if choice == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(20)))
    if choice == 3:
        return rng.randbytes(rng.randrange(40))
    if choice == 4:
        return rng.choice([None, True, False])
    if choice == 5:
        return msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(10)))
    if choice == 6:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randrange(6))]
    if choice == 7:
        return {str(_random_obj(rng, 4))[:10]: _random_obj(rng, depth + 1) for _ in range(rng.randrange(6))}
    return [p.PROTOCOL_VERSION, rng.choice(list(p.message_types())), _random_obj(rng, depth + 1)]


def _wrong(value):
    """A value of another type than ``value``'s."""
    if isinstance(value, str):
        return 17
    if isinstance(value, bool) or isinstance(value, int):
        return "seventeen"
    if isinstance(value, list):
        return {"not": "a list"}
    if isinstance(value, dict):
        return [1, 2]
    return [value]


def frames(rng: random.Random, kind: str, *, oversize: int) -> list[bytes]:
    """One fuzz message of ``kind`` (never a valid message); ``oversize``: bytes of an oversized frame."""
    msg = rng.choice(_SAMPLES)
    body = msg.to_body()
    if kind == "random_bytes":
        return [rng.randbytes(rng.randrange(1, 2048))]
    if kind == "truncated":
        raw = p.encode(msg)
        return [raw[: rng.randrange(1, len(raw))]]
    if kind == "wrong_version":
        version = rng.choice([0, p.PROTOCOL_VERSION + 1, -1, 1 << 40, "1", 1.0, None])
        return [msgpack.packb([version, msg.TYPE, body])]
    if kind == "unknown_type":
        return [msgpack.packb([p.PROTOCOL_VERSION, rng.choice(["", "ATTACH", "attach ", "x" * 300, 7]), body])]
    if kind == "wrong_field_type":
        name = rng.choice(list(body))
        return [msgpack.packb([p.PROTOCOL_VERSION, msg.TYPE, {**body, name: _wrong(body[name])}])]
    if kind == "missing_field":
        required = [name for name, (_, req) in type(msg)._FIELDS.items() if req]
        body.pop(rng.choice(required))
        return [msgpack.packb([p.PROTOCOL_VERSION, msg.TYPE, body])]
    if kind == "unknown_field":
        return [msgpack.packb([p.PROTOCOL_VERSION, msg.TYPE, {**body, f"extra_{rng.randrange(99)}": 1}])]
    if kind == "random_msgpack":
        obj = _random_obj(rng)
        return [msgpack.packb(obj)]
    if kind == "oversized":
        return [b"\x93\x01\xa5stats" + rng.randbytes(16) * (oversize // 16)]
    if kind == "multipart":
        return [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(2, 6))]
    return [b""]


def _is_valid(parts: list[bytes]) -> bool:
    if len(parts) != 1:
        return False
    try:
        p.decode(parts[0])
    except Exception:
        return False
    return True


@dataclass
class FuzzResult:
    target: str
    sent: int = 0
    not_delivered: int = 0
    made_valid: int = 0
    probes_answered: int = 0
    handshakes_refused: int = 0
    replies: int = 0
    by_kind: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "frames_per_s": round(self.sent / self.seconds) if self.seconds else 0}


def fuzz(
    address: str,
    n: int,
    *,
    target: str,
    probe: p.Message,
    keys: ClientKeys | None = None,
    server_public: bytes | None = None,
    refused: bool = False,
    seed: int = 0,
    oversize: int = 0,
    probe_timeout: float = 60.0,
    progress=None,
) -> FuzzResult:
    """Send ``n`` fuzz messages to ``address`` (module docstring); raises AssertionError if a probe goes unanswered."""
    rng = random.Random(seed)
    result = FuzzResult(target)
    ctx = zmq.Context()
    sock = mon = None
    started = time.monotonic()

    def open_socket():
        nonlocal mon
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        if keys is not None:
            make_client(s, keys, server_public)
        if refused:
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH, addr=f"inproc://fuzz-monitor-{next(_MONITORS)}")
        s.connect(address)
        return s

    def close_socket():
        nonlocal mon
        if mon is not None:
            sock.disable_monitor()
            mon.close(linger=0)
            mon = None
        sock.close(linger=0)

    try:
        sock = open_socket()
        for i in range(n):
            kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
            if kind == "oversized" and (not oversize or rng.random() > 0.05):
                kind = "random_bytes"  # large frames are few: each costs the target a full decode attempt
            parts = frames(rng, kind, oversize=oversize)
            if _is_valid(parts):  # random_msgpack may, rarely, form a real message: never send one
                parts = [b"\xc1"]  # the one byte msgpack never uses
                result.made_valid += 1
            try:
                sock.send_multipart(parts, flags=zmq.NOBLOCK)
                result.sent += 1
            except zmq.Again:
                result.not_delivered += 1
            result.by_kind[kind] = result.by_kind.get(kind, 0) + 1
            while sock.poll(0):
                sock.recv_multipart()
                result.replies += 1
            if (i + 1) % PROBE_EVERY == 0 or i + 1 == n:
                if refused:
                    # This connection's handshake must be refused before the next one is tried.
                    if not mon.poll(int(probe_timeout * 1000)):
                        raise AssertionError(f"{target}: an unknown key's handshake was not refused")
                    mon.recv_multipart()
                    result.handshakes_refused += 1
                    close_socket()
                    sock = open_socket()
                else:
                    _probe(sock, probe, probe_timeout, result)
                if progress is not None:
                    progress(i + 1, result)
    finally:
        if sock is not None:
            close_socket()
        ctx.term()
    result.seconds = time.monotonic() - started
    return result


def _probe(sock, probe: p.Message, timeout: float, result: FuzzResult) -> None:
    sock.send(p.encode(probe))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
            break
        reply = sock.recv_multipart()
        result.replies += 1
        try:
            msg = p.decode(reply[0])
        except Exception:
            continue
        if getattr(msg, "req", None) == probe.req and not isinstance(msg, p.Error):
            result.probes_answered += 1
            return
    raise AssertionError(f"{result.target}: no answer to a valid {probe.TYPE} within {timeout}s after fuzzing")


def check(cluster, client, first_rollout: int, batches: int) -> dict:
    """Processes alive, no Traceback in any log, and the next ``batches`` batches complete and unique."""
    for proc in cluster.procs:
        text = proc.text()
        assert proc.alive(), f"{proc.name} exited: {text[-2000:]}"
        assert "Traceback" not in text, f"Traceback in {proc.name}'s log: {text[text.index('Traceback') :][:2000]}"
    size = cluster.config["rollout_batch_size"]
    indices, keys = set(), set()
    for rollout_id in range(first_rollout, first_rollout + batches):
        batch = client.generate(rollout_id)
        assert len(batch.groups) == size, f"batch {rollout_id}: {len(batch.groups)} groups, expected {size}"
        for g in batch.groups:
            ident = (g.data_epoch, g.index)
            assert ident not in indices, f"batch {rollout_id}: prompt {ident} delivered twice"
            indices.add(ident)
            key = (g.agent_id, g.data_epoch, g.index)
            assert key not in keys
            keys.add(key)
    return {"batches": batches, "groups": len(indices)}


def _rejections(cluster) -> int:
    return cluster.coordinator.text().count("rejected message from")


def campaign(cluster, n: int, *, keyed: bool, seed: int = 0, batches: int = 4, progress=None) -> dict:
    """One whole run on a fresh ``cluster`` (keyed: made with curve keys for agent-0, agent-1, trainer).

    Starts the coordinator and two agents, pulls two batches, fuzzes the coordinator and agent-0's
    payload endpoint with ``n`` messages each (keyed: with the trainer's key, then with a key the
    fleet does not know, which must deliver nothing), then ``check``s. The figures, as a dict.
    """
    from common.curve import ClientKeys, load_pair, load_public, split_address
    from common.keygen import write_pair

    cluster.start_coordinator("--max-message-bytes", "256KiB")
    for name in ("agent-0", "agent-1"):
        cluster.start_agent(name)
    client = cluster.client()
    check(cluster, client, 0, 2)
    payload = next(line for line in cluster.agents["agent-0"].text().splitlines() if "payloads at " in line)
    endpoint, agent_key = split_address(payload.rsplit("payloads at ", 1)[1].strip())
    keys = None
    if keyed:
        kw = cluster.client_keys()
        keys = ClientKeys(load_pair(kw["curve_secret"], "trainer"), load_public(kw["curve_server_key"], "coordinator"))
    targets = [
        ("coordinator", cluster.address, p.Stats(1 << 50), None, 300_000),
        ("payload", endpoint, p.Fetch(1 << 50, ["fuzz-missing-key"]), agent_key, 200_000),
    ]
    out: dict = {"mode": "keys" if keyed else "no keys", "frames_per_target": n, "runs": []}
    for i, (target, address, probe, server_public, oversize) in enumerate(targets):
        r = fuzz(address, n, target=target, probe=probe, keys=keys, server_public=server_public, seed=seed + i,
                 oversize=oversize, progress=progress)  # fmt: skip
        out["runs"].append({"key": "known" if keyed else "none", **r.as_dict()})
    if keyed:
        _, secret = write_pair(cluster.tmp / "outsider", "intruder", force=True)
        intruder = ClientKeys(load_pair(secret, "intruder"), keys.server_public)
        before = _rejections(cluster)
        for i, (target, address, probe, server_public, oversize) in enumerate(targets):
            r = fuzz(address, n, target=target, probe=probe, keys=intruder, server_public=server_public,
                     refused=True, seed=seed + 10 + i, oversize=oversize, progress=progress)  # fmt: skip
            out["runs"].append({"key": "unknown", **r.as_dict()})
        reached = _rejections(cluster) - before
        assert reached == 0, f"{reached} frame(s) from an unknown key reached the coordinator's decoder"
        for proc in (cluster.coordinator, cluster.agents["agent-0"]):
            assert "refused a CurveZMQ peer" in proc.text(), f"{proc.name} logged no refusal"
        out["unknown_key_frames_reaching_the_core"] = reached
    out["coordinator_rejections_logged"] = _rejections(cluster)
    out["after"] = check(cluster, client, 2, batches)
    return out
