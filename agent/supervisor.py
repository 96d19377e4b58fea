"""The node agent's engine supervisor: plan, launch, health-check and restart engines.

A node agent drives the inference engines of one GPU node.  This module owns
their life cycle; the agent's request path only asks it which engines are
usable (:meth:`EngineSupervisor.healthy`) and tells it when a request saw a
broken connection (:meth:`EngineSupervisor.report_failure`).

Engine kinds
------------
``sim``
    The built-in sim engine, a child process
    ``python -m agent.sim_engine --host H --port 0 ...``.  It binds a free port
    itself and prints ``rollfleet-sim listening on http://HOST:PORT``; the
    supervisor reads that line from the engine's log file to learn the URL, so
    there is no port race.  A restarted sim engine may get a new URL.
``sglang``
    ``python -m sglang.launch_server --model-path P --host H --port PORT
    --tp-size K --base-gpu-id 0 --skip-server-warmup ...``, one process per
    tensor-parallel group.  :func:`plan_engines` picks distinct free ports and
    gives engine *i* the GPUs ``gpu_ids[i*K:(i+1)*K]`` through
    ``CUDA_VISIBLE_DEVICES`` (hence ``--base-gpu-id 0``); it drops
    ``PYTORCH_CUDA_ALLOC_CONF`` from the child's environment (expandable
    segments conflict with SGLang's memory saver, slime does the same).  The
    launched module is a parameter so tests can run the sim engine through
    exactly this code path.  The port is kept across restarts.
``url``
    An SGLang-API server somebody else runs.  No process: health checks only.
    When it is down it is probed (with backoff) until it answers again; it is
    never retired by the restart budget.

Design and invariants
---------------------
* Every engine is in exactly one state: ``starting`` (only before its first
  readiness outcome), ``healthy``, ``down`` (broken, being restarted or probed)
  or ``retired`` (given up on, never touched again).  ``on_change(name, state)``
  is called on every transition into ``healthy``, ``down`` and ``retired``.
* The capacity callers see follows :meth:`healthy`: an engine is listed there
  exactly while its state is ``healthy``, with its *current* URL.  A restarted
  engine is a fresh process with its launch-time weights; the agent must bring
  it up to date when it sees ``on_change(name, "healthy")`` after a ``down``.
* Readiness is an event, not a sleep: ``GET /health_generate`` is polled with
  a short backoff (0.1 s growing to 2 s) while the process is watched; a child
  that exits during start fails at once with its exit code and log tail.
* An engine whose *first* start fails (exit, or not healthy within
  ``start_timeout``) is retired; :meth:`start` raises
  :class:`~common.errors.EngineStartError` only when no engine became healthy
  (a ``url`` engine that is not up yet is marked ``down`` and probed).
* A healthy engine goes ``down`` when its process exits or a health check
  fails (non-200 or no answer within ``health_timeout``).  Its process group
  is killed and it is restarted after an exponential backoff (0.5 s doubling,
  capped at 30 s).  A restart that would exceed ``max_restarts`` restarts
  within ``restart_window`` seconds retires the engine instead.
* Children run in their own session / process group (``start_new_session``)
  and are always killed as a group (SIGTERM, SIGKILL after a grace period);
  nothing is ever killed by name.  Each child's stdout and stderr go to
  ``log_dir/<name>.log`` (appended, one header line per launch).
* Structured concurrency: one task per engine, named ``engine-<name>``, owned
  by the supervisor; :meth:`stop` cancels and awaits them, then kills every
  process group.  Cancellation is always re-raised.  All timing uses
  ``time.monotonic()``.
* Health checks can be paused around weight updates (a paused SGLang server
  fails ``/health_generate``); results of checks that overlapped a pause are
  discarded.  Process-exit detection keeps running while paused.

All methods must be called from the event loop thread that ran :meth:`start`.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

import aiohttp

from common.errors import Closed, ConfigError, EngineStartError, StateError

__all__ = [
    "EngineSpec",
    "EngineSupervisor",
    "KINDS",
    "plan_engines",
    "sglang_command",
]

log = logging.getLogger("rollfleet.agent.supervisor")

KINDS = ("sim", "sglang", "url")
STATES = ("starting", "healthy", "down", "retired")

SIM_MODULE = "agent.sim_engine"
HEALTH_PATH = "/health_generate"

_LISTEN_RE = re.compile(rb"rollfleet-sim listening on (https?://[^\s]+)")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Readiness polling backoff.
_READY_DELAY_MIN = 0.1
_READY_DELAY_MAX = 2.0
_READY_DELAY_GROWTH = 1.5
# Restart / reprobe backoff.
_RESTART_DELAY_MIN = 0.5
_RESTART_DELAY_MAX = 30.0
# Grace between SIGTERM and SIGKILL when killing a broken engine.
_KILL_GRACE = 5.0
_LOG_TAIL_LINES = 20
_LISTEN_SCAN_LIMIT = 1 << 20


@dataclass
class EngineSpec:
    """What to run for one engine.

    ``url`` is known up front for ``sglang`` and ``url`` engines and is None
    for ``sim`` engines until they are listening (see
    :meth:`EngineSupervisor.healthy`, which returns copies with the current
    URL).  ``argv`` is None for ``url`` engines.  ``env`` is the child's
    complete environment (None: inherit ours).
    """

    name: str
    kind: str
    url: str | None
    argv: list[str] | None
    env: dict[str, str] | None = dataclasses.field(repr=False)
    gpu_ids: list[int]


# --------------------------------------------------------------------------
# Planning (pure)
# --------------------------------------------------------------------------


def _url_host(host: str) -> str:
    """The host to *connect* to for a server bound to ``host``, URL-ready."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host


def _fix_listen_url(url: str) -> str:
    """Turn a wildcard bind address in a printed URL into a connectable one."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::") and parts.port is not None:
        return f"{parts.scheme}://{_url_host(host)}:{parts.port}"
    return url.rstrip("/")


def _free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports that were free on ``host`` (bound to port 0 together)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((host, 0))
            except OSError as e:
                raise ConfigError(f"cannot bind a free port on host {host!r}: {e}") from e
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _default_gpu_ids(need: int) -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(need))
    ids: list[int] = []
    for part in visible.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={visible!r} is not a list of integer GPU ids; "
                "pass gpu_ids explicitly"
            ) from None
    return ids


def sglang_command(
    model_path: str,
    *,
    host: str,
    port: int,
    tp_size: int,
    module: str = "sglang.launch_server",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of one SGLang server (GPUs are chosen via CUDA_VISIBLE_DEVICES)."""
    if not model_path:
        raise ConfigError("sglang engines need a model path")
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be in 1..65535, got {port}")
    return [
        sys.executable, "-m", module,
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--base-gpu-id", "0",
        "--skip-server-warmup",
        *[str(a) for a in extra_args],
    ]


def plan_engines(
    kind: str,
    *,
    count: int = 1,
    urls: Sequence[str] = (),
    model_path: str | None = None,
    tp_size: int = 1,
    gpu_ids: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    sim_args: Sequence[str] = (),
    sglang_args: Sequence[str] = (),
    sglang_module: str = "sglang.launch_server",
) -> list[EngineSpec]:
    """The engines of one node.  Names are ``<kind>-<i>``.

    * ``sim``: ``count`` sim engines on ``host``, port chosen by the engine.
    * ``sglang``: ``count`` servers of ``tp_size`` GPUs each, on distinct free
      ports; engine i gets ``gpu_ids[i*tp_size:(i+1)*tp_size]``.  ``gpu_ids``
      defaults to the ids in our CUDA_VISIBLE_DEVICES, else ``0..count*tp_size-1``.
    * ``url``: one engine per entry of ``urls`` (``count`` is ignored).
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown engine kind {kind!r}; expected one of {', '.join(KINDS)}")
    if urls and kind != "url":
        raise ConfigError(f"urls are only used with engine kind 'url', not {kind!r}")

    if kind == "url":
        if not urls:
            raise ConfigError("engine kind 'url' needs at least one URL")
        specs = []
        for i, url in enumerate(urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"engine URL {url!r} is not an http(s)://host:port URL")
            specs.append(EngineSpec(name=f"url-{i}", kind="url", url=url.rstrip("/"),
                                    argv=None, env=None, gpu_ids=[]))
        return specs

    if count < 1:
        raise ConfigError(f"engine count must be >= 1, got {count}")

    if kind == "sim":
        return [
            EngineSpec(
                name=f"sim-{i}",
                kind="sim",
                url=None,
                argv=[sys.executable, "-m", SIM_MODULE, "--host", host, "--port", "0",
                      *[str(a) for a in sim_args]],
                env=None,
                gpu_ids=[],
            )
            for i in range(count)
        ]

    # sglang
    if not model_path:
        raise ConfigError("engine kind 'sglang' needs model_path")
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
    need = count * tp_size
    ids = [int(g) for g in gpu_ids] if gpu_ids is not None else _default_gpu_ids(need)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"GPU ids must be distinct, got {ids}")
    if len(ids) < need:
        raise ConfigError(
            f"{count} sglang engine(s) with tp_size {tp_size} need {need} GPUs, "
            f"but only {len(ids)} GPU id(s) are available: {ids}"
        )
    ports = _free_ports(host, count)
    base_env = dict(os.environ)
    base_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    specs = []
    for i, port in enumerate(ports):
        group = ids[i * tp_size:(i + 1) * tp_size]
        env = dict(base_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in group)
        specs.append(
            EngineSpec(
                name=f"sglang-{i}",
                kind="sglang",
                url=f"http://{_url_host(host)}:{port}",
                argv=sglang_command(model_path, host=host, port=port, tp_size=tp_size,
                                    module=sglang_module, extra_args=sglang_args),
                env=env,
                gpu_ids=group,
            )
        )
    return specs


# --------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "is still running"
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return f"exit code {rc} (killed by {sig})"
    return f"exit code {rc}"


def _log_tail(path: Path, offset: int, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines written to ``path`` since ``offset``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            start = max(offset, end - 64 * 1024)
            f.seek(start)
            data = f.read(end - start)
    except OSError as e:
        return f"<cannot read log {path}: {e}>"
    text = data.decode("utf-8", errors="replace").splitlines()[-lines:]
    if not text:
        return "<log is empty>"
    return "\n".join("    " + line for line in text)


@dataclass(eq=False)
class _Engine:
    spec: EngineSpec
    log_path: Path
    state: str = "starting"
    url: str | None = None
    proc: asyncio.subprocess.Process | None = None
    exit_task: asyncio.Task | None = None
    launch_offset: int = 0
    task: asyncio.Task | None = None
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    report: str | None = None
    restarts: deque = dataclasses.field(default_factory=deque)
    error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class EngineSupervisor:
    """Launches, health-checks and restarts the engines of one node.

    Usage::

        sup = EngineSupervisor(plan_engines("sim", count=2), log_dir=Path("logs"))
        try:
            await sup.start()          # raises EngineStartError if none came up
            await sup.run()            # until stop(); engines are watched from start()
        finally:
            await sup.stop()
    """

    def __init__(
        self,
        specs: Sequence[EngineSpec],
        *,
        log_dir: Path,
        start_timeout: float = 600.0,
        health_interval: float = 5.0,
        health_timeout: float = 20.0,
        max_restarts: int = 3,
        restart_window: float = 600.0,
        on_change: Callable[[str, str], None] | None = None,
    ):
        specs = list(specs)
        if not specs:
            raise ConfigError("the engine supervisor needs at least one engine")
        seen: set[str] = set()
        for spec in specs:
            if not _NAME_RE.match(spec.name):
                raise ConfigError(f"engine name {spec.name!r} must match {_NAME_RE.pattern}")
            if spec.name in seen:
                raise ConfigError(f"duplicate engine name {spec.name!r}")
            seen.add(spec.name)
            if spec.kind not in KINDS:
                raise ConfigError(f"engine {spec.name!r}: unknown kind {spec.kind!r}")
            if spec.kind == "url" and not spec.url:
                raise ConfigError(f"engine {spec.name!r}: kind 'url' needs a url")
            if spec.kind != "url" and not spec.argv:
                raise ConfigError(f"engine {spec.name!r}: kind {spec.kind!r} needs argv")
            if spec.kind == "sglang" and not spec.url:
                raise ConfigError(f"engine {spec.name!r}: kind 'sglang' needs its url")
        for label, value in (("start_timeout", start_timeout), ("health_interval", health_interval),
                             ("health_timeout", health_timeout), ("restart_window", restart_window)):
            if not value > 0:
                raise ConfigError(f"{label} must be > 0, got {value}")
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")

        self._log_dir = Path(log_dir)
        self._start_timeout = float(start_timeout)
        self._health_interval = float(health_interval)
        self._health_timeout = float(health_timeout)
        self._max_restarts = int(max_restarts)
        self._restart_window = float(restart_window)
        self._on_change = on_change
        self._engines: dict[str, _Engine] = {
            s.name: _Engine(spec=s, log_path=self._log_dir / f"{s.name}.log") for s in specs
        }
        self._session: aiohttp.ClientSession | None = None
        self._started = False
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._run_wake: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._paused = False
        self._pause_epoch = 0

    # ---------------------------------------------------------------- public

    async def start(self) -> None:
        """Launch every engine and wait (in parallel) for each one's first outcome.

        Engines that fail to start are retired (``url`` engines: marked down
        and probed).  Raises EngineStartError, after cleaning up, only if no
        engine at all became healthy.
        """
        if self._stopping:
            raise Closed("the engine supervisor was stopped")
        if self._started:
            raise StateError("EngineSupervisor.start() was already called")
        self._started = True
        self._stopped = asyncio.Event()
        self._run_wake = asyncio.Event()
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
        )
        for eng in self._engines.values():
            eng.url = eng.spec.url if eng.spec.kind != "sim" else None
            eng.task = asyncio.create_task(self._engine_main(eng), name=f"engine-{eng.name}")
            eng.task.add_done_callback(self._task_done)
        await asyncio.gather(*(eng.settled.wait() for eng in self._engines.values()))
        if self._stopping:
            raise Closed("the engine supervisor was stopped during start()")
        if self._failure is not None:
            raise self._failure
        if not any(eng.state == "healthy" for eng in self._engines.values()):
            errors = "\n".join(
                f"- {eng.error or f'engine {eng.name!r} is {eng.state}'}"
                for eng in self._engines.values()
            )
            await self.stop()
            raise EngineStartError(f"no engine became healthy:\n{errors}")
        log.info("engines up: %s",
                 ", ".join(f"{e.name}={e.state}" for e in self._engines.values()))

    async def run(self) -> None:
        """Supervise until :meth:`stop`.

        Engines are already watched from :meth:`start` on; this is the
        supervisor's lifetime for the agent's task group.  It re-raises an
        unexpected failure of an engine task (a bug), after logging it.
        """
        if not self._started:
            raise StateError("EngineSupervisor.run() before start()")
        assert self._run_wake is not None
        while not self._stopping:
            if self._failure is not None:
                raise self._failure
            self._run_wake.clear()
            await self._run_wake.wait()
        if self._failure is not None:
            raise self._failure

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel the engine tasks, then SIGTERM every process group and SIGKILL
        it after ``timeout`` seconds.  Idempotent; concurrent calls wait for
        the first.  No on_change callbacks are made; every engine that is not
        retired reads as ``down`` afterwards."""
        if self._stopping:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._stopping = True
        if self._stopped is None:  # never started
            return
        assert self._run_wake is not None
        self._run_wake.set()
        try:
            tasks = [e.task for e in self._engines.values() if e.task is not None]
            current = asyncio.current_task()
            for t in tasks:
                if t is not current:
                    t.cancel()
            results = await asyncio.gather(
                *(t for t in tasks if t is not current), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    log.error("engine task failed: %r", r)
            await asyncio.gather(*(self._kill(e, grace=timeout) for e in self._engines.values()))
            for eng in self._engines.values():
                if eng.state != "retired":
                    eng.state = "down"
        finally:
            for eng in self._engines.values():
                if eng.alive:  # only if this stop() was itself cancelled midway
                    _killpg(eng.proc.pid, signal.SIGKILL)
            self._stopped.set()
            if self._session is not None:
                await self._session.close()
        log.info("engine supervisor stopped")

    def report_failure(self, name: str, reason: str) -> None:
        """The request path saw a connection error on ``name``: check it now."""
        eng = self._engines[name]
        if eng.state != "healthy" or self._stopping:
            return
        log.info("engine %s: failure reported (%s), checking it", name, reason)
        eng.report = reason
        eng.wake.set()

    def pause_health_checks(self) -> None:
        """Stop health probes (e.g. during a weight update).  Idempotent."""
        self._paused = True
        self._pause_epoch += 1

    def resume_health_checks(self) -> None:
        """Resume health probes; overdue or reported checks run at once.  Idempotent."""
        if not self._paused:
            return
        self._paused = False
        self._pause_epoch += 1
        for eng in self._engines.values():
            eng.wake.set()

    def healthy(self) -> list[EngineSpec]:
        """Engines usable now, in plan order, as copies carrying their current url."""
        if self._stopping:
            return []
        return [dataclasses.replace(e.spec, url=e.url, gpu_ids=list(e.spec.gpu_ids))
                for e in self._engines.values() if e.state == "healthy"]

    def state(self, name: str) -> str:
        """``starting``, ``healthy``, ``down`` or ``retired``; KeyError for unknown names."""
        return self._engines[name].state

    def all_retired(self) -> bool:
        """True once every engine is retired: nothing here will ever generate again."""
        return all(e.state == "retired" for e in self._engines.values())

    def pids(self) -> dict[str, int]:
        """Pids of the live child processes (also their process group ids)."""
        return {e.name: e.proc.pid for e in self._engines.values() if e.alive}

    # ------------------------------------------------------------- internals

    def _task_done(self, task: asyncio.Task) -> None:
        for eng in self._engines.values():
            if eng.task is task:
                eng.settled.set()  # also when cancelled before it ever ran
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("engine task %s crashed", task.get_name(), exc_info=exc)
            if self._failure is None:
                self._failure = exc
            if self._run_wake is not None:
                self._run_wake.set()

    def _set_state(self, eng: _Engine, state: str) -> None:
        if eng.state == state:
            return
        eng.state = state
        self._notify(eng, state)

    def _notify(self, eng: _Engine, state: str) -> None:
        if self._on_change is not None:
            try:
                self._on_change(eng.name, state)
            except Exception:
                log.exception("on_change(%r, %r) callback failed", eng.name, state)

    def _retire(self, eng: _Engine, why: str) -> None:
        eng.error = why
        log.error("engine %s retired, it will not be restarted: %s", eng.name, why)
        self._set_state(eng, "retired")

    async def _engine_main(self, eng: _Engine) -> None:
        try:
            if eng.spec.kind == "url":
                await self._run_url(eng)
            else:
                await self._run_process(eng)
        finally:
            eng.settled.set()

    async def _run_process(self, eng: _Engine) -> None:
        try:
            await self._launch_and_wait(eng)
        except EngineStartError as e:
            await self._kill(eng)
            self._retire(eng, str(e))
            return
        self._set_state(eng, "healthy")
        eng.settled.set()
        log.info("engine %s healthy at %s (pid %d)", eng.name, eng.url, eng.proc.pid)
        while True:
            reason = await self._watch(eng)
            log.warning("engine %s down: %s (log: %s)", eng.name, reason, eng.log_path)
            eng.error = reason
            self._set_state(eng, "down")
            await self._kill(eng)
            while True:
                now = time.monotonic()
                while eng.restarts and now - eng.restarts[0] > self._restart_window:
                    eng.restarts.popleft()
                if len(eng.restarts) >= self._max_restarts:
                    self._retire(
                        eng,
                        f"{len(eng.restarts)} restart(s) within the last "
                        f"{self._restart_window:g}s already (max_restarts={self._max_restarts}); "
                        f"last failure: {eng.error}; log: {eng.log_path}")
                    return
                delay = min(_RESTART_DELAY_MAX, _RESTART_DELAY_MIN * 2 ** len(eng.restarts))
                log.info("engine %s: restarting in %.1fs", eng.name, delay)
                await asyncio.sleep(delay)
                eng.restarts.append(time.monotonic())
                try:
                    await self._launch_and_wait(eng)
                except EngineStartError as e:
                    eng.error = str(e)
                    log.warning("engine %s: restart failed: %s", eng.name, e)
                    await self._kill(eng)
                    continue
                break
            log.info("engine %s healthy again at %s (pid %d)", eng.name, eng.url, eng.proc.pid)
            self._set_state(eng, "healthy")

    async def _run_url(self, eng: _Engine) -> None:
        try:
            await self._wait_ready(eng, time.monotonic() + self._start_timeout)
        except EngineStartError as e:
            eng.error = str(e)
            log.error("%s; it will be probed until it answers", e)
            self._set_state(eng, "down")
            eng.settled.set()
            await self._probe_until_up(eng)
        else:
            eng.settled.set()
        self._set_state(eng, "healthy")
        log.info("engine %s healthy at %s", eng.name, eng.url)
        while True:
            reason = await self._watch(eng)
            eng.error = reason
            log.warning("engine %s down: %s", eng.name, reason)
            self._set_state(eng, "down")
            await self._probe_until_up(eng)
            log.info("engine %s healthy again at %s", eng.name, eng.url)
            self._set_state(eng, "healthy")

    async def _probe_until_up(self, eng: _Engine) -> None:
        assert eng.url is not None
        cap = min(_RESTART_DELAY_MAX, max(2.0, self._health_interval))
        attempt = 0
        while True:
            await asyncio.sleep(min(cap, _RESTART_DELAY_MIN * 2 ** attempt))
            attempt += 1
            if self._paused:
                continue
            epoch = self._pause_epoch
            ok, _ = await self._probe(eng.url, self._health_timeout)
            if ok and epoch == self._pause_epoch:
                return

    async def _launch(self, eng: _Engine) -> None:
        spec = eng.spec
        assert spec.argv is not None
        env = dict(spec.env) if spec.env is not None else dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # the listening line must reach the log
        eng.url = spec.url if spec.kind != "sim" else None
        with open(eng.log_path, "ab") as f:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            f.write(f"=== rollfleet supervisor {stamp}: launching {spec.name}: "
                    f"{subprocess.list2cmdline(spec.argv)}\n".encode())
            f.flush()
            eng.launch_offset = f.tell()
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent(signal.SIGKILL if spec.kind == "sim" else signal.SIGTERM),
            )
        eng.proc = proc
        eng.exit_task = asyncio.create_task(proc.wait(), name=f"engine-{spec.name}-exit")
        wake = eng.wake
        eng.exit_task.add_done_callback(lambda _t: wake.set())
        log.info("engine %s launched (pid %d), log %s", spec.name, proc.pid, eng.log_path)

    async def _launch_and_wait(self, eng: _Engine) -> None:
        deadline = time.monotonic() + self._start_timeout
        await self._launch(eng)
        await self._wait_ready(eng, deadline)

    def _scan_listen_url(self, eng: _Engine) -> str | None:
        try:
            with open(eng.log_path, "rb") as f:
                f.seek(eng.launch_offset)
                data = f.read(_LISTEN_SCAN_LIMIT)
        except OSError:
            return None
        m = _LISTEN_RE.search(data)
        if m is None:
            return None
        return _fix_listen_url(m.group(1).decode("ascii", errors="replace"))

    async def _wait_ready(self, eng: _Engine, deadline: float) -> None:
        """Poll /health_generate until 200, watching the process; EngineStartError otherwise."""
        delay = _READY_DELAY_MIN
        detail = "no answer yet"
        while True:
            if eng.exit_task is not None and eng.exit_task.done():
                raise EngineStartError(
                    f"engine {eng.name!r} exited during start with "
                    f"{_describe_exit(eng.proc.returncode)}; log {eng.log_path}, last lines:\n"
                    f"{_log_tail(eng.log_path, eng.launch_offset)}")
            if eng.url is None:
                eng.url = self._scan_listen_url(eng)
                if eng.url is None:
                    detail = "the engine has not printed its listening line yet"
            remaining = deadline - time.monotonic()
            if eng.url is not None and remaining > 0:
                ok, detail = await self._probe(eng.url, min(self._health_timeout, remaining))
                if ok and not (eng.exit_task is not None and eng.exit_task.done()):
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                where = eng.url or "<unknown url>"
                msg = (f"engine {eng.name!r} not healthy at {where} within "
                       f"{self._start_timeout:g}s ({detail})")
                if eng.proc is not None:
                    await self._kill(eng)
                    msg += (f"; process killed; log {eng.log_path}, last lines:\n"
                            f"{_log_tail(eng.log_path, eng.launch_offset)}")
                raise EngineStartError(msg)
            wait = min(delay, remaining)
            if eng.exit_task is not None:
                await asyncio.wait({eng.exit_task}, timeout=wait)
            else:
                await asyncio.sleep(wait)
            delay = min(_READY_DELAY_MAX, delay * _READY_DELAY_GROWTH)

    async def _watch(self, eng: _Engine) -> str:
        """Return (a reason) when the healthy engine ``eng`` is found broken."""
        next_check = time.monotonic() + self._health_interval
        while True:
            if eng.exit_task is not None and eng.exit_task.done():
                return f"process exited with {_describe_exit(eng.proc.returncode)}"
            now = time.monotonic()
            if not self._paused and (eng.report is not None or now >= next_check):
                reported, eng.report = eng.report, None
                epoch = self._pause_epoch
                assert eng.url is not None
                ok, detail = await self._probe(eng.url, self._health_timeout)
                next_check = time.monotonic() + self._health_interval
                if eng.exit_task is not None and eng.exit_task.done():
                    continue
                if self._paused or epoch != self._pause_epoch:
                    continue  # overlapped a pause: the answer means nothing
                if not ok:
                    why = f"health check failed: {detail}"
                    if reported:
                        why += f" (after a reported failure: {reported})"
                    return why
                if reported:
                    log.info("engine %s passed its health check after a reported failure (%s)",
                             eng.name, reported)
                    # The reporter may have stopped using it meanwhile: say it is fine.
                    self._notify(eng, "healthy")
                continue
            eng.wake.clear()
            timeout = None if self._paused else max(0.0, next_check - now)
            try:
                async with asyncio.timeout(timeout):
                    await eng.wake.wait()
            except TimeoutError:
                pass

    async def _probe(self, url: str, timeout: float) -> tuple[bool, str]:
        """One GET /health_generate: (healthy, what happened)."""
        assert self._session is not None
        try:
            async with self._session.get(
                url + HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    return True, "HTTP 200"
                return False, f"HTTP {resp.status} from {url}{HEALTH_PATH}"
        except asyncio.TimeoutError:
            return False, f"no answer from {url}{HEALTH_PATH} within {timeout:g}s"
        except (aiohttp.ClientError, OSError) as e:
            return False, f"{url}{HEALTH_PATH}: {type(e).__name__}: {e}"

    async def _kill(self, eng: _Engine, grace: float = _KILL_GRACE) -> None:
        """Kill the engine's process group: SIGTERM, SIGKILL after ``grace``; reap it."""
        proc = eng.proc
        if proc is None:
            return
        pgid = proc.pid
        if proc.returncode is None:
            _killpg(pgid, signal.SIGTERM)
            _killpg(pgid, signal.SIGCONT)  # a stopped process must run to act on SIGTERM
            done, _ = await asyncio.wait({eng.exit_task}, timeout=grace)
            if not done:
                log.warning("engine %s (pid %d) ignored SIGTERM for %gs, sending SIGKILL",
                            eng.name, pgid, grace)
                _killpg(pgid, signal.SIGKILL)
                await asyncio.shield(eng.exit_task)
        # Children of the leader (SGLang's scheduler processes) may outlive it.
        # Only right after reaping the leader: later its pid could be reused.
        _killpg(pgid, signal.SIGKILL)
        if eng.proc is proc:
            eng.proc = None
            eng.exit_task = None


def _die_with_parent(sig: int):
    """A child-side hook: the kernel sends ``sig`` to the engine when the agent dies.

    Without it a SIGKILLed agent leaves its engines running (holding GPU
    memory), and the restarted agent launches a second set beside them.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)

    return hook


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
