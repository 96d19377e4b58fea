"""A real rollfleet cluster on loopback for tests: processes, ports, data dirs, cleanup.

Every process is started with Popen in its own session and tracked by pid:
coordinators, agents, standalone sim engines, and the engines agents launch
(read from the agents' logs). ``stop_all`` ends them all (SIGTERM, then
SIGKILL) and returns what it found leaked: a process still alive, a port still
bound, a client thread still running. Nothing is ever killed by name.

With ``curve_agents``/``curve_trainers`` the cluster runs with CurveZMQ keys: ``rollfleet-keygen
--fleet`` layout in ``tmp/curve``; the coordinator gets ``--curve-dir``, each agent named there its
own pair, and clients and status probes the first trainer's pair (``client_keys``).

Readiness comes from the coordinator's status (the same call as ``coordinator
status``): the coordinator is up when it answers; an agent has joined when the
status lists it alive under a session it did not have before.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.demo_data import write_arithmetic_dataset
from harness.polling import WaitAborted, wait_for

ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None):
        self.name = name
        self.argv = argv
        self.log = log
        self._fh = open(log, "ab")
        self.popen = subprocess.Popen(
            argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=ROOT,
            env=env,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def text(self) -> str:
        if not self._fh.closed:  # closed by an earlier stop_all (a test may stop a cluster before teardown)
            self._fh.flush()
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        self._fh.close()


class Cluster:
    def __init__(
        self,
        tmp: Path,
        *,
        rows: int = 400,
        dataset: Path | None = None,
        datasets: list[str] | None = None,
        curve_agents: tuple[str, ...] = (),
        curve_trainers: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        gateways: int | None = None,
        **config,
    ):
        """``host``: the address the coordinator binds (e.g. a ``harness.netfault`` link's; default loopback).
        ``datasets``: ``--dataset`` values of a mixture (``NAME=PATH,weight=W,...``), in place of ``dataset``."""
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.curve_dir: Path | None = None
        if curve_agents or curve_trainers:
            from common.keygen import write_fleet

            self.curve_dir = self.tmp / "curve"
            write_fleet(self.curve_dir, curve_agents, curve_trainers or ("trainer",))
            self._trainer_key = (curve_trainers or ("trainer",))[0]
        self.dataset = dataset or (None if datasets else write_arithmetic_dataset(self.tmp / "data.jsonl", rows))
        self.datasets = list(datasets or [])
        self.host = host
        self.gateways = gateways if gateways is not None else os.environ.get("ROLLFLEET_TEST_GATEWAYS")
        """``coordinator serve --gateways``; None: its default. ``ROLLFLEET_TEST_GATEWAYS`` sets it for every
        cluster (a whole suite through gateways)."""
        self.port = free_port(host)
        self.address = f"tcp://{host}:{self.port}"
        self.config = {"rollout_batch_size": 8, "n_samples_per_prompt": 4, "max_new_tokens": 64, **config}
        self.procs: list[Proc] = []
        self.engine_pids: set[int] = set()
        self.coordinator: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self._clients = []
        self._sessions_seen: dict[str, set[int]] = {}  # agent -> every session a status showed
        self._stale: dict[str, set[int]] = {}  # agent -> sessions that predate its current process

    # ------------------------------------------------------------ processes

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc

    def start_coordinator(self, *extra: str, wait: bool = True) -> Proc:
        argv = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            *[x for value in self.datasets or [str(self.dataset)] for x in ("--dataset", value)],
            "--data-dir",
            str(self.tmp / "coordinator"),
            "--bind",
            self.address,
            "--heartbeat-interval",
            "0.25",
            "--agent-ttl",
            "1.5",
            "--retire-after",
            "30",
        ]
        for key, value in self.config.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        if self.curve_dir is not None:
            argv += ["--curve-dir", str(self.curve_dir)]
        if self.gateways is not None and "--gateways" not in extra:
            argv += ["--gateways", str(self.gateways)]
        argv += list(extra)
        self.coordinator = self._spawn(f"coordinator-{len(self.procs)}", argv)
        if wait:
            self.wait_coordinator_ready()
        return self.coordinator

    def start_replay(self, directory: str | Path, *extra: str, wait: bool = True) -> Proc:
        """``coordinator replay --from DIR`` on this cluster's address, in the coordinator's place (no agents)."""
        argv = [sys.executable, "-m", "coordinator.cli", "replay", "--from", str(directory), "--bind", self.address]
        self.coordinator = self._spawn(f"replay-{len(self.procs)}", [*argv, *extra])
        if wait:
            self.wait_coordinator_ready()
        return self.coordinator

    def wait_coordinator_ready(self, timeout: float = 30) -> dict:
        proc = self.coordinator

        def answering():
            if not proc.alive():
                raise WaitAborted(f"coordinator exited: {proc.text()[-3000:]}")
            return self.status(timeout=2)

        return wait_for(answering, timeout, "the coordinator to answer status")

    def start_agent(
        self,
        name: str,
        *extra: str,
        engines: int = 1,
        concurrency: int = 32,
        sim_args: str = "",
        engine_urls=(),
        wait: bool = True,
        coordinator: str | None = None,
        engine: str = "sim",
        wrap=None,
    ) -> Proc:
        """``coordinator``: the address it joins (default the cluster's; e.g. a ``TcpProxy`` in front of it).

        ``engine``: the kind ``agent join --engine`` launches (``sim``, or ``hf`` with ``--model-path`` in ``extra``).
        ``wrap(argv)``: the command that runs it (e.g. ``NetFault.agent_argv``: inside a network namespace).
        """
        argv = [
            sys.executable,
            "-m",
            "agent.cli",
            "join",
            "--coordinator",
            coordinator or self.address,
            "--data-dir",
            str(self.tmp / name),
            "--agent-id",
            name,
            "--concurrency",
            str(concurrency),
            "--health-interval",
            "1",
        ]
        if engine_urls:
            for url in engine_urls:
                argv += ["--engine-url", url]
        else:
            argv += ["--engine", engine, "--engines", str(engines)]
            if sim_args:
                argv.append(f"--sim-args={sim_args}")  # '=' form: the value may start with '--'
        if self.curve_dir is not None and (self.curve_dir / "secrets" / f"{name}.key_secret").exists():
            argv += ["--curve-secret", str(self.curve_dir / "secrets" / f"{name}.key_secret")]
            argv += ["--curve-server-key", str(self.curve_dir / "coordinator.key")]
        argv += list(extra)
        if wrap is not None:
            argv = wrap(argv)
        if wait:
            self._agent_entry(name)  # learn the session a previous process of this agent holds
        self._stale[name] = set(self._sessions_seen.get(name, ()))
        proc = self._spawn(f"{name}-{len(self.procs)}", argv)
        self.agents[name] = proc
        if wait:
            self.wait_agent_registered(name)
        return proc

    def wait_agent_registered(self, name: str, timeout: float = 90) -> dict:
        """Wait until the status lists ``name`` alive under a session its current process registered.

        Sessions a status showed before this process was started belong to an earlier process of the
        same agent (which the coordinator may still count as alive until its TTL): they do not count.
        """
        proc = self.agents[name]

        def registered():
            self._collect_engine_pids(proc.text())
            if not proc.alive():
                raise WaitAborted(f"agent {name} exited: {proc.text()[-3000:]}")
            entry = self.status(timeout=2)["agents"].get(name)
            if entry and entry["status"] == "alive" and entry["session"] not in self._stale.get(name, ()):
                return entry
            return None

        return wait_for(registered, timeout, f"agent {name} to register")

    def _agent_entry(self, name: str) -> dict | None:
        try:
            return self.status(timeout=2)["agents"].get(name)
        except Exception:  # the coordinator is not up (yet): nothing earlier to tell apart
            return None

    def _collect_engine_pids(self, text: str) -> None:
        for m in re.finditer(r"launched \(pid (\d+)\)", text):
            self.engine_pids.add(int(m.group(1)))

    def engine_pids_of(self, name: str) -> list[int]:
        return [int(m.group(1)) for m in re.finditer(r"launched \(pid (\d+)\)", self.agents[name].text())]

    def start_sim_engine(self, *extra: str) -> tuple[Proc, str]:
        proc = self._spawn(
            f"sim-engine-{len(self.procs)}", [sys.executable, "-m", "agent.cli", "sim-engine", "--port", "0", *extra]
        )

        def url():
            m = re.search(r"listening on (http://\S+)", proc.text())
            return m.group(1) if m else None

        return proc, wait_for(url, 20, "standalone sim engine to listen")

    # ------------------------------------------------------------ trainer side

    def client_keys(self, name: str | None = None) -> dict:
        """The ``RolloutClient`` keyword arguments of trainer key ``name`` (default: the first); {} without keys."""
        if self.curve_dir is None:
            return {}
        return {
            "curve_secret": str(self.curve_dir / "secrets" / f"{name or self._trainer_key}.key_secret"),
            "curve_server_key": str(self.curve_dir / "coordinator.key"),
        }

    def client(self, **kwargs):
        from coordinator.client import RolloutClient

        for key, value in self.client_keys().items():
            kwargs.setdefault(key, value)
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("retry_interval", 0.5)
        c = RolloutClient(self.address, **kwargs)
        self._clients.append(c)
        return c

    def stats(self) -> dict:
        """``coordinator status`` run as a user runs it (a subprocess printing JSON)."""
        keys = [f"--{k.replace('_', '-')}={v}" for k, v in self.client_keys().items()]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "status",
                "--json",
                "--coordinator",
                self.address,
                "--timeout",
                "5",
                *keys,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return json.loads(out.stdout)

    def status(self, timeout: float = 5) -> dict:
        """The same status (the dict ``coordinator status --json`` prints: ``FleetStats.raw``), in-process: what
        readiness polls (a subprocess per poll is slow on 2 cores)."""
        from coordinator.client import RolloutClient

        with RolloutClient(self.address, timeout=timeout, attach=False, **self.client_keys()) as probe:
            stats = probe.stats().raw
        for agent_id, entry in stats["agents"].items():
            if entry.get("session"):
                self._sessions_seen.setdefault(agent_id, set()).add(entry["session"])
        return stats

    # ------------------------------------------------------------ teardown

    def gateway_successor(self, victim: dict, timeout: float) -> dict:
        """The gateway that took ``victim``'s place (its ``status()["gateways"]`` entry), once it reports."""

        def replaced():
            g = next(x for x in self.status(timeout=2)["gateways"] if x["gateway"] == victim["gateway"])
            return g if g["up"] and g["pid"] != victim["pid"] else None

        return wait_for(replaced, timeout, f"the coordinator to replace gateway {victim['gateway']}")

    def stop_all(self) -> list[str]:
        """End every process this cluster started; return the leaks found afterwards (empty when clean)."""
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        for proc in self.procs:
            self._collect_engine_pids(proc.text())
        for proc in reversed(self.procs):
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
                proc.wait(5)
            proc.close()
        for pid in self.engine_pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self._leaks()

    def _leaks(self) -> list[str]:
        leaks = [f"process {p.name} (pid {p.pid}) still running" for p in self.procs if p.alive()]
        # Engines die with their agent (PR_SET_PDEATHSIG); give the kernel a moment to reap them.
        alive = lambda: [pid for pid in self.engine_pids if pid_alive(pid)]  # noqa: E731
        try:
            wait_for(lambda: not alive(), 5, "engines to exit")
        except AssertionError:
            leaks += [f"engine pid {pid} still running after its agent stopped" for pid in alive()]
        try:
            wait_for(lambda: port_free(self.port, self.host), 5, f"port {self.port} to be released")
        except AssertionError:
            leaks.append(f"coordinator port {self.port} still bound")
        return leaks


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped, or a dying ``X``, counts as exited)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def running_child(pid: int, parent: int) -> bool:
    """``pid`` runs (not exited, not a zombie) and is ``parent``'s child: not a stranger that reused the pid."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and int(fields[1]) == parent


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            # The address itself is gone (a harness link removed): nothing can hold the port on it.
            return exc.errno == errno.EADDRNOTAVAIL
        return True


def client_threads() -> set[int]:
    """Idents of live client loop threads (a client a test forgot to close leaks one)."""
    import threading

    return {t.ident for t in threading.enumerate() if t.name == "rollfleet-client" and t.is_alive()}


def run_group(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` (e.g. a torchrun launch and the ranks it starts) in a process group of its own, output captured;
    the whole group is killed if it outlives ``timeout`` or the caller is interrupted (a test's timeout), so no
    rank is left behind."""
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
