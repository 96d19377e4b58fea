"""The serving process's side of the gateways (coordinator/gateway.py): the public listening socket
they share, the private endpoint they relay to, and their supervision.

``GatewayPool`` opens the public ``--bind`` address itself (a plain TCP listening socket, so port 0
resolves here and the address stays held across gateway restarts), starts ``count`` gateway
processes that accept on it, and restarts any that exits while the coordinator serves: at once the
first time, then after a backoff that doubles up to ``MAX_BACKOFF`` while restarts keep failing
within ``STABLE_AFTER`` seconds. One that runs but stops reporting (SIGSTOP, a stuck process) is killed
after ``HUNG_AFTER`` seconds of silence and restarted the same way. Each restart is a new incarnation with a
new routing prefix (``gateway.prefix_of``), so the core never confuses a successor's peers with its
predecessor's.

The statistics each gateway sends every second, on a socket of their own that this supervisor reads
(never behind the core's backlog of messages), are kept per gateway for the status page and the metrics;
a gateway silent for ``STALE_AFTER`` seconds shows as not up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from common.errors import ConfigError
from common.transport import LISTEN_BACKLOG
from coordinator.gateway import prefix_of

log = logging.getLogger("rollfleet.coordinator")

MAX_BACKOFF = 5.0
STABLE_AFTER = 10.0
"""A gateway that ran this long before exiting is restarted at once."""
STALE_AFTER = 3.0
HUNG_AFTER = 10.0
"""A gateway that runs but has not reported for this long (stopped, stuck) is killed and restarted: its peers
have already redialled elsewhere (their connection heartbeats time out in seconds), and a successor restores
the pool's size."""
BIND_RETRY_S = 5.0
"""How long a bind of an address in use is retried: a SIGKILLed predecessor's gateways hold it until
they see their parent gone (well under a second)."""


def auto_gateways(cores: int | None = None) -> int:
    """``--gateways auto``: none below 8 cores (the relay's processes would take the core's CPU), then one
    per 8 cores, at most 4. ``cores``: default, those this process may use (``usable_cores``)."""
    cores = cores or usable_cores()
    return 0 if cores < 8 else min(4, cores // 8)


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a container
    limited to 4 CPUs on a 64-core host has 4, where ``os.cpu_count()`` says 64)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def listen(bind: str) -> tuple[socket.socket, str, str]:
    """A listening TCP socket on ``bind`` (``tcp://host:port``, ``*`` for every address, port 0 for any):
    the socket, the endpoint a gateway binds with its fd, and the endpoint to report."""
    if not bind.startswith("tcp://"):
        raise ConfigError(f"--gateways needs a tcp:// --bind, not {bind!r}")
    head, _, port_text = bind.rpartition(":")
    host = head[len("tcp://") :]
    if not port_text.isdigit():
        raise ConfigError(f"--bind {bind!r}: gateways need a numeric port (0 for any)")
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    address = "" if host in ("*", "0.0.0.0") else host.strip("[]")
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            sock = socket.create_server((address, int(port_text)), family=family, backlog=LISTEN_BACKLOG)
            break
        except OSError as exc:
            if exc.errno == 98 and time.monotonic() < deadline:  # EADDRINUSE
                time.sleep(0.1)
                continue
            raise ConfigError(f"cannot bind {bind}: {exc.strerror}") from None
    # Non-blocking, for every process that shares it: libzmq takes the descriptor as it is (ZMQ_USE_FD), and
    # a gateway whose accept() loses the race for a connection to another one would block its I/O thread in
    # accept() until the next connection, and every socket of that gateway with it.
    sock.setblocking(False)
    port = sock.getsockname()[1]
    zmq_host = "*" if not address else host
    return sock, f"tcp://{zmq_host}:{port}", f"{head}:{port}"


@dataclass
class Slot:
    index: int
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    stats: dict = field(default_factory=dict)
    seen: float | None = None
    """When its current incarnation last reported (time.monotonic()); None: not yet."""


class GatewayPool:
    def __init__(
        self,
        ctx: zmq.Context,
        count: int,
        bind: str,
        *,
        max_bytes: int,
        curve_dir: str | None = None,
        log_level: str = "INFO",
        log_format: str = "text",
    ):
        self.listener, self._zmq_bind, self.endpoint = listen(bind)
        self._dir = tempfile.mkdtemp(prefix="rollfleet-gw-")  # 0700: only this user may connect
        self.core_endpoint = f"ipc://{self._dir}/core"
        self.stats_endpoint = f"ipc://{self._dir}/stats"
        self._stats = ctx.socket(zmq.PULL)
        self._stats.setsockopt(zmq.LINGER, 0)
        self._stats.setsockopt(zmq.RCVHWM, 1000)
        self._stats.bind(self.stats_endpoint)
        self.slots = [Slot(i) for i in range(count)]
        self._resumed = float("-inf")  # silence before this does not count towards a hang (this process stalled)
        self._by_prefix: dict[bytes, Slot] = {}
        self._args = ["--max-message-bytes", str(max_bytes), "--log-level", log_level, "--log-format", log_format]
        if curve_dir is not None:
            self._args += ["--curve-dir", os.path.abspath(curve_dir)]
        self.stopping = False

    def _spawn(self, slot: Slot) -> None:
        slot.incarnation += 1
        self._by_prefix = {k: s for k, s in self._by_prefix.items() if s is not slot}
        self._by_prefix[prefix_of(slot.index, slot.incarnation)] = slot
        fd = self.listener.fileno()
        cmd = [sys.executable, "-m", "coordinator.gateway", "--core", self.core_endpoint, "--listen-fd", str(fd)]
        cmd += ["--stats", self.stats_endpoint]
        cmd += ["--bind", self._zmq_bind, "--index", str(slot.index), "--incarnation", str(slot.incarnation)]
        cmd += ["--parent", str(os.getpid()), *self._args]
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
        slot.proc = subprocess.Popen(cmd, pass_fds=[fd], env=env)
        slot.started, slot.stats, slot.seen = time.monotonic(), {}, None
        log.info("gateway %d started (pid %d, incarnation %d)", slot.index, slot.proc.pid, slot.incarnation)

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    async def supervise(self) -> None:
        """Restart every gateway that exits, and kill one that stops reporting, until ``stop``."""
        last = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            self._read_reports(now)
            if now - last > 2.0:
                # This process itself did not run for a while: the reports it has not read yet are not silence.
                self._resumed = now - STALE_AFTER
            last = now
            for slot in self.slots:
                if slot.proc is None:  # exited, its restart pending
                    continue
                code = slot.proc.poll()
                if code is None:
                    self._kill_if_hung(slot, now)
                    continue
                ran = time.monotonic() - slot.started
                slot.backoff = 0.0 if ran > STABLE_AFTER else min(MAX_BACKOFF, max(0.2, slot.backoff * 2))
                log.warning(
                    "gateway %d (pid %d) exited with %s after %.1fs; restarting%s",
                    slot.index,
                    slot.proc.pid,
                    code,
                    ran,
                    f" in {slot.backoff:.1f}s" if slot.backoff else "",
                )
                slot.proc = None
                slot.restarts += 1
                asyncio.get_running_loop().call_later(slot.backoff, self._respawn, slot)

    def _kill_if_hung(self, slot: Slot, now: float) -> None:
        silent = now - max(slot.seen if slot.seen is not None else slot.started, self._resumed)
        if silent > HUNG_AFTER:
            log.warning("gateway %d (pid %d) has not reported for %.1fs; killing it", slot.index, slot.proc.pid, silent)
            slot.proc.kill()

    def _respawn(self, slot: Slot) -> None:
        if not self.stopping and slot.proc is None:
            self._spawn(slot)

    def _read_reports(self, now: float) -> None:
        while True:
            try:
                prefix, payload = self._stats.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not two frames: not a gateway's
                continue
            self.on_stats(prefix, msgpack.unpackb(payload), now)

    def on_stats(self, prefix: bytes, stats: dict, now: float) -> None:
        slot = self._by_prefix.get(prefix)
        if slot is not None:
            if slot.seen is None:
                log.info("gateway %d (pid %s) is relaying", slot.index, stats.get("pid"))
            slot.stats, slot.seen = stats, now

    def statistics(self, now: float) -> list[dict]:
        """Each gateway: its number, pid, whether it is up, restarts, peers and counters."""
        out = []
        for slot in self.slots:
            up = slot.proc is not None and slot.seen is not None and now - slot.seen < STALE_AFTER
            out.append(
                {
                    "gateway": slot.index,
                    "pid": slot.proc.pid if slot.proc is not None else None,
                    "up": up,
                    "incarnation": slot.incarnation,
                    "restarts": slot.restarts,
                    **{k: v for k, v in slot.stats.items() if k != "pid"},
                }
            )
        return out

    def stop(self, timeout: float = 3.0) -> None:
        self.stopping = True
        procs = [s.proc for s in self.slots if s.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.listener.close()
        self._stats.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
