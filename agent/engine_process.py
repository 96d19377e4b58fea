"""Engine child processes: launch, watch for exit, kill as a group, read their logs.

Invariants
----------
* Every child runs in its own session / process group (``start_new_session``)
  and is always killed as a group (SIGTERM, then SIGKILL after a grace
  period); nothing is ever killed by name.  SGLang's scheduler processes are
  children of the launched leader and die with the group.
* Every child gets ``PR_SET_PDEATHSIG`` on Linux: the kernel signals it when
  the agent dies, so a SIGKILLed agent never leaves engines holding GPU memory
  beside the ones its restart launches.
* Exit is an event: the event loop's child watcher reports it through a
  subprocess protocol; no task waits on the process.
* Readiness is an event, not a sleep: :func:`wait_ready` polls the engine's
  health (0.1 s backoff growing to 2 s) while watching the process; a child
  that exits during start fails at once with its exit code and log tail, one
  not ready by the deadline is killed.
* Each child's stdout and stderr go to one log file, appended, with one header
  line ``=== rollfleet supervisor <time>: launching <name>: <argv>`` per launch;
  :meth:`EngineProcess.log_tail` and :meth:`EngineProcess.listen_url` read only
  what this launch wrote.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.engine_plan import EngineSpec, parse_listen_url
from common.errors import EngineLogUnwritable, EngineStartError

__all__ = ["EngineProcess", "describe_exit", "killpg", "wait_ready"]

log = logging.getLogger("rollfleet.agent.engine_process")

KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
_LOG_TAIL_LINES = 20
_LISTEN_SCAN_LIMIT = 1 << 20
# Readiness polling backoff.
_READY_DELAY_MIN = 0.1
_READY_DELAY_MAX = 2.0
_READY_DELAY_GROWTH = 1.5


def describe_exit(rc: int | None) -> str:
    """``exit code 2``, ``exit code -9 (killed by SIGKILL)`` or ``is still running``."""
    if rc is None:
        return "is still running"
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
        return f"exit code {rc} (killed by {sig})"
    return f"exit code {rc}"


def log_tail(path: Path, offset: int, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines written to ``path`` since ``offset``, indented."""
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


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group; one that is already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(sig: int) -> Callable[[], None] | None:
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


class _ExitProtocol(asyncio.SubprocessProtocol):
    """Turns the child watcher's exit report into an event (and an optional callback)."""

    def __init__(self, on_exit: Callable[[], None] | None):
        self.exited = asyncio.Event()
        self._on_exit = on_exit

    def process_exited(self) -> None:
        self.exited.set()
        if self._on_exit is not None:
            self._on_exit()


def _unwritable_log(name: str, log_path: Path, exc: OSError) -> EngineLogUnwritable:
    """The engine's log cannot be written (a full disk, a read-only one): its start fails, saying where and why."""
    return EngineLogUnwritable(
        f"engine {name}: cannot write its log {log_path} ({exc.strerror or exc}); free space under the "
        "--data-dir (or move it)"
    )


class EngineProcess:
    """One launched engine child (the leader of its own process group)."""

    def __init__(
        self,
        name: str,
        transport: asyncio.SubprocessTransport,
        protocol: _ExitProtocol,
        log_path: Path,
        launch_offset: int,
    ):
        self.name = name
        self.log_path = log_path
        self.launch_offset = launch_offset
        self.pid: int = transport.get_pid()
        self._transport = transport
        self._exited = protocol.exited
        self._killed = False

    @classmethod
    async def launch(cls, spec: EngineSpec, log_path: Path, on_exit: Callable[[], None] | None = None) -> EngineProcess:
        """Start ``spec.argv`` with its output appended to ``log_path``; ``on_exit`` runs when it exits.

        Sim engines get SIGKILL on the agent's death, SGLang servers SIGTERM (so
        they can take their scheduler processes down with them).
        """
        assert spec.argv is not None
        env = dict(spec.env) if spec.env is not None else dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # the listening line must reach the log
        loop = asyncio.get_running_loop()
        try:
            f = open(log_path, "ab", buffering=0)  # unbuffered: a failed write is not retried at close
        except OSError as exc:
            raise _unwritable_log(spec.name, log_path, exc) from None
        with f:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                f.write(
                    f"=== rollfleet supervisor {stamp}: launching {spec.name}: "
                    f"{subprocess.list2cmdline(redacted(spec.argv))}\n".encode()
                )
                f.flush()
            except OSError as exc:  # a full disk under the logs: a start that failed, not a crash of the agent
                raise _unwritable_log(spec.name, log_path, exc) from None
            offset = f.tell()
            transport, protocol = await loop.subprocess_exec(
                lambda: _ExitProtocol(on_exit),
                *spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL if spec.kind == "sim" else signal.SIGTERM),
            )
        return cls(spec.name, transport, protocol, log_path, offset)

    @property
    def returncode(self) -> int | None:
        return self._transport.get_returncode()

    @property
    def alive(self) -> bool:
        return self.returncode is None

    @property
    def exited(self) -> bool:
        """True once the exit was reported (the process is reaped)."""
        return self._exited.is_set()

    async def wait_exited(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the exit; True if it has exited."""
        try:
            async with asyncio.timeout(timeout):
                await self._exited.wait()
        except TimeoutError:
            pass
        return self._exited.is_set()

    def describe_exit(self) -> str:
        return describe_exit(self.returncode)

    def log_tail(self) -> str:
        """The last lines this launch wrote to its log."""
        return log_tail(self.log_path, self.launch_offset)

    def listen_url(self) -> str | None:
        """The URL a sim engine printed it listens on, once it has."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.launch_offset)
                data = f.read(_LISTEN_SCAN_LIMIT)
        except OSError:
            return None
        return parse_listen_url(data)

    async def kill(self, grace: float = KILL_GRACE) -> None:
        """Kill the process group: SIGTERM, SIGKILL after ``grace`` seconds; wait until reaped.

        Idempotent: once the leader is reaped its pid may be reused, so the group is
        never signalled again.
        """
        if self._killed:
            return
        pgid = self.pid
        if self.returncode is None:
            killpg(pgid, signal.SIGTERM)
            killpg(pgid, signal.SIGCONT)  # a stopped process must run to act on SIGTERM
            if not await self.wait_exited(grace):
                log.warning("engine %s (pid %d) ignored SIGTERM for %gs, sending SIGKILL", self.name, pgid, grace)
                killpg(pgid, signal.SIGKILL)
                await self._exited.wait()
        # Children of the leader (SGLang's scheduler processes) may outlive it.
        # Only right after reaping the leader: later its pid could be reused.
        killpg(pgid, signal.SIGKILL)
        self._killed = True
        self._transport.close()  # the leader has exited: this only frees the transport

    def kill_now(self) -> None:
        """SIGKILL the group without waiting (last resort when an orderly kill was cancelled)."""
        if self.returncode is None:
            killpg(self.pid, signal.SIGKILL)


async def wait_ready(
    name: str,
    url: str | None,
    proc: EngineProcess | None,
    probe: Callable[[str, float], Awaitable[tuple[bool, str]]],
    *,
    deadline: float,
    start_timeout: float,
    health_timeout: float,
) -> str:
    """Poll ``probe(url, timeout)`` until it answers healthy; return the engine's URL.

    ``proc`` is None for an engine somebody else runs; ``url`` is None for a sim
    engine until its log shows the listening line.  Raises EngineStartError (the
    process killed, its exit code and log tail in the message) when the process
    exits or ``deadline`` (``time.monotonic()``) passes first.
    """
    delay = _READY_DELAY_MIN
    detail = "no answer yet"
    while True:
        if proc is not None and proc.exited:
            raise EngineStartError(
                f"engine {name!r} exited during start with {proc.describe_exit()}; "
                f"log {proc.log_path}, last lines:\n{proc.log_tail()}"
            )
        if url is None and proc is not None:
            url = proc.listen_url()
            if url is None:
                detail = "the engine has not printed its listening line yet"
        remaining = deadline - time.monotonic()
        if url is not None and remaining > 0:
            ok, detail = await probe(url, min(health_timeout, remaining))
            if ok and not (proc is not None and proc.exited):
                return url
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            msg = f"engine {name!r} not healthy at {url or '<unknown url>'} within {start_timeout:g}s ({detail})"
            if proc is not None:
                await proc.kill()
                msg += f"; process killed; log {proc.log_path}, last lines:\n{proc.log_tail()}"
            raise EngineStartError(msg)
        if proc is not None:
            await proc.wait_exited(min(delay, remaining))
        else:
            await asyncio.sleep(min(delay, remaining))
        delay = min(_READY_DELAY_MAX, delay * _READY_DELAY_GROWTH)


SECRET_ARGS = ("--api-key", "--admin-api-key")
"""Launch flags whose value never goes into a log."""


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the values of :data:`SECRET_ARGS` (``--api-key K`` or ``--api-key=K``) shown as ``***``."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg in SECRET_ARGS and i + 1 < len(out):
            out[i + 1] = "***"
        elif arg.split("=", 1)[0] in SECRET_ARGS and "=" in arg:
            out[i] = arg.split("=", 1)[0] + "=***"
    return out
