"""Process and /proc helpers shared by the benchmarks: start, watch and stop what a bench runs.

Every process a bench starts goes through ``Procs``: logged to a file in the bench's work dir,
checked for an early exit, and stopped in reverse order (SIGTERM, then SIGKILL), engines that
run in their own sessions included. CPU figures come from ``/proc`` (user + system ticks).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[2]


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1, check=None):
    """Poll ``predicate`` until it returns a truthy value; ``check`` raises if a process died."""
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f}s")
        time.sleep(interval)


# --------------------------------------------------------------------------- /proc


def proc_stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, utime+stime ticks, starttime, state) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15, starttime 22.
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]), fields[0][0]


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        st = proc_stat(pid)
        if st is not None:
            total += st[1]
    return total / CLK_TCK


def busy_cpu_seconds() -> float:
    """Machine-wide non-idle CPU seconds (all cores, all processes) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / CLK_TCK


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[0] == pid:
                out.append(int(entry))
    return out


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    children: list[tuple[int, int]] = field(default_factory=list)  # (pid, starttime) of engines

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def check_alive(self) -> None:
        rc = self.popen.poll()
        if rc is not None:
            tail = "\n".join(self.log_text().splitlines()[-30:])
            raise RuntimeError(f"{self.name} (pid {self.pid}) exited with code {rc}; log tail:\n{tail}")


class Procs:
    """Every process this benchmark starts, stopped in reverse order (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.items: list[Proc] = []

    def start(self, name: str, argv: list[str], **kwargs) -> Proc:
        log = self.workdir / f"{name}.log"
        f = open(log, "wb")
        try:
            popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
        finally:
            f.close()
        proc = Proc(name, popen, log)
        self.items.append(proc)
        return proc

    def check(self) -> None:
        for p in self.items:
            p.check_alive()

    def stop(self, procs: list[Proc] | None = None, grace: float = 15.0) -> None:
        targets = list(reversed(procs if procs is not None else self.items))
        for p in targets:
            # Engines run in their own sessions; note them now in case their agent has to be SIGKILLed.
            if p.popen.poll() is None:
                p.children = [(c, proc_stat(c)[2]) for c in children_of(p.pid) if proc_stat(c)]
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in targets:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                progress(f"{p.name} (pid {p.pid}) ignored SIGTERM; SIGKILL")
                p.popen.kill()
                p.popen.wait()
        for p in targets:
            for pid, start in p.children:
                deadline = time.monotonic() + 5.0
                while (st := proc_stat(pid)) is not None and st[2] == start and st[3] != ord("Z"):
                    if time.monotonic() > deadline:
                        progress(f"engine pid {pid} of {p.name} still running; SIGKILL")
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        break
                    time.sleep(0.05)
            if p in self.items:
                self.items.remove(p)


def venv_script(name: str) -> str:
    path = Path(sys.executable).parent / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"w1: cannot find the {name!r} console script (is rollfleet installed?)")
    return found


def run_ranks(workdir: Path, argvs: list[list[str]], timeout: float = 900) -> str:
    """Run one process per argv (a group's ranks, all at once, logs in ``workdir/floor-rankN.log``) until every
    one exits; rank 0's last output line. RuntimeError with a rank's log tail if it fails."""
    procs = []
    try:
        for rank, argv in enumerate(argvs):
            with open(workdir / f"floor-rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
                )
        for rank, p in enumerate(procs):
            rc = p.wait(timeout=timeout)
            if rc != 0:
                tail = (workdir / f"floor-rank{rank}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"floor rank {rank} exited with {rc}:\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return (workdir / "floor-rank0.log").read_text().strip().splitlines()[-1]


def floor_times(reps: int, tensors, sync=lambda: None) -> list[float]:
    """A floor rank's seconds per repetition of broadcasting every tensor ``tensors()`` yields from rank 0 of
    the default ``torch.distributed`` group: a barrier, the broadcasts, ``sync()``, a barrier. ``tensors()``
    runs inside the window (receiving ranks allocate there). The first of ``reps + 1`` is warm-up, left out."""
    import torch.distributed as dist

    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for tensor in tensors():
            dist.broadcast(tensor, src=0)
        sync()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times[1:]


def end_floor(out: dict, rank: int) -> int:
    """Leave the floor's group; rank 0 prints ``out`` as its last line (what ``run_ranks`` returns)."""
    import json

    import torch.distributed as dist

    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


class RefsOnly:
    """Stands in for a trainer client's payload fetcher (coordinator/payloads.py) in control-plane benches: a
    batch's groups stay the coordinator's refs, and no agent is asked (simulated agents store nothing)."""

    async def fetch(self, wire_refs: list, raw=None) -> list:
        return wire_refs

    async def close(self) -> None:
        return None


def refs_client():
    """``AsyncRolloutClient`` minus the payload fetch from agents (it never reaches the coordinator): ``generate``
    answers with the coordinator's refs. The client makes its fetcher at each ``connect``; this one is replaced
    there."""
    from coordinator.client import AsyncRolloutClient

    class RefsClient(AsyncRolloutClient):
        async def connect(self) -> None:
            await super().connect()
            self._payloads = RefsOnly()

    return RefsClient


def coordinator_endpoint(proc) -> str | None:
    """The address a started ``coordinator serve`` printed it listens on, or None before it has."""
    for line in proc.log_text().splitlines():
        if line.startswith("coordinator listening on "):
            return line.split()[-1]
    return None
