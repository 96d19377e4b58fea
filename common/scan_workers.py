"""Validation worker processes for large dataset files (``common.dataset``): one span of the file each.

A file of ``_PARALLEL_BYTES`` or more is split into line-aligned byte spans; each span is
validated by a plain interpreter running ``common.dataset._scan_span_file`` and its result comes
back pickled on stdout. A worker that fails raises ``WorkerFailed``, and the loading process
then validates the file itself.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

_PARALLEL_BYTES = 64 << 20
"""Files this large are validated by worker processes, one span of the file each."""
_MAX_WORKERS = 8


def _scan_workers(size: int) -> int:
    if size < _PARALLEL_BYTES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cpus))


def _spans(f, size: int, workers: int) -> list[tuple[int, int | None]]:
    """``workers`` byte ranges ``[lo, hi)`` of about equal size, each starting at a line start."""
    if workers <= 1:
        return [(0, None)]
    bounds = [0]
    for k in range(1, workers):
        f.seek(size * k // workers)
        f.readline()
        pos = f.tell()
        if bounds[-1] < pos < size:
            bounds.append(pos)
    bounds.append(size)
    return list(zip(bounds, bounds[1:], strict=False))


_WORKER = (
    "import pickle, sys\n"
    "from common.dataset import _scan_span_file\n"
    "path, lo, hi, key, block = sys.argv[1:]\n"
    "sys.stdout.buffer.write(pickle.dumps(_scan_span_file(path, int(lo), int(hi), key, int(block))))\n"
)


def _start_worker(path: str, lo: int, hi: int, input_key: str, block: int) -> subprocess.Popen:
    """A plain interpreter running ``_scan_span_file`` on one span; its result comes back pickled on stdout.

    Not multiprocessing: its spawn and forkserver modes re-import the caller's main module
    (a script building a Dataset at top level would recurse), and fork is unsafe in a process
    with threads.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    argv = [sys.executable, "-c", _WORKER, path, str(lo), str(hi), input_key, str(block)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)


class WorkerFailed(Exception):
    """A validation worker exited without a result; the loading process then validates the file itself."""


def _worker_result(worker: subprocess.Popen) -> tuple:
    out = worker.stdout.read()
    if worker.wait() != 0:
        raise WorkerFailed(f"worker {worker.pid} exited with {worker.returncode}")
    try:
        return pickle.loads(out)
    except Exception as e:
        raise WorkerFailed(f"worker {worker.pid} sent no result ({e})") from None
