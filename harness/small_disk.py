"""A small real filesystem for full-disk tests: a tmpfs mounted for one test, and a filler file.

``small_disk(path)`` mounts a tmpfs of ``size`` at ``path`` (root only: ``mount -t tmpfs``) and
unmounts it at the end, lazily if a process of the test still holds a file there; it raises
``DiskUnavailable`` (the test skips with the reason) where mounting is not permitted.

``fill(path, leave)`` makes the filesystem under ``path`` hold exactly ``leave`` free bytes (a
multiple of the page size, tmpfs's unit) with one filler file, grown or shrunk in place
(``posix_fallocate``, so no byte of it is written twice); ``unfill`` removes it. Which error a
commit then gets from LMDB depends on what is left: none at all and its first new page fails
outright (ENOSPC); a page or two and a commit that needs more new pages runs out part-way, a
short write that LMDB reports as EIO.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

FILLER = ".filler"
PAGE = 4096


class DiskUnavailable(Exception):
    """No small filesystem can be mounted here (not root, no mount, a container without the right)."""


def free_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def small_disk(path: str | os.PathLike, size: str = "4m"):
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise DiskUnavailable("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if out.returncode != 0:
        raise DiskUnavailable(f"mount -t tmpfs refused: {out.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # a process still holds a file


@contextlib.contextmanager
def small_disk_or_skip(path: str | os.PathLike, size: str = "4m"):
    """:func:`small_disk` for a test fixture: the test is skipped, saying why, where none can be mounted."""
    import pytest

    try:
        with small_disk(path, size) as mounted:
            yield mounted
    except DiskUnavailable as exc:
        pytest.skip(f"no small filesystem to fill: {exc}")


def fill(path: str | os.PathLike, leave: int = 0) -> int:
    """Grow or shrink the filler so that ``leave`` bytes stay free under ``path``; returns what is free after."""
    filler = Path(path) / FILLER
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for _ in range(50):  # another writer may take or give pages meanwhile: settle on the target
            size = os.fstat(fd).st_size
            free = free_bytes(path)
            if free == leave:
                break
            if free > leave:
                try:
                    os.posix_fallocate(fd, size, free - leave)
                except OSError:  # someone took pages since the statvfs: measure again
                    continue
            else:
                os.ftruncate(fd, max(0, size - (leave - free)))
    finally:
        os.close(fd)
    return free_bytes(path)


def unfill(path: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(path) / FILLER).unlink()
