"""Opening rollfleet's LMDB environments (the coordinator's ledger, each agent's store).

Settings, and why:
- ``map_size`` 1 TiB by default (``--map-size`` on both commands): only
  address space on 64-bit (the file is sparse), so the map rarely fills, and
  it is never resized at run time (resizing invalidates readers and has a
  history of bugs). When it does fill, or the disk under it does, a write
  raises ``StorageFull`` (:func:`storage_full`) naming the data dir and the
  flag: the transaction that hit it is aborted whole, so nothing it would
  have acknowledged was acknowledged, and its owner stops; a restart on the
  same data dir with a larger ``--map-size`` carries on from the last commit;
- a full disk is a full disk however it shows: LMDB reports ENOSPC when a
  page write fails outright, but EIO when it runs out part-way (a short
  write: mdb_page_flush has no better code), so an EIO while the disk has
  less than ``MIN_FREE`` left is a full disk too (an EIO on a disk with room
  is a real I/O error and stays one). And a commit is not tried when the disk
  cannot hold it: ``check_space`` (one statvfs) refuses a write that would
  leave less than ``MIN_FREE`` free, before LMDB sees it;
- ``sync``/``metasync`` on by default with ``writemap`` off: a commit that
  returned survives a crash (``--no-sync`` trades that for speed);
- ``metasync=False`` (the agent store): a commit flushes its data pages but
  only writes its meta page, which the next commit's flush (or an
  ``env.sync(True)``) makes durable; integrity is kept, and an OS crash can
  undo only the last commit, so its owner must not treat that commit as
  durable until the next flush returned (agent/store.py does exactly that);
- ``reader_check()`` at open clears reader slots left by killed processes,
  which would otherwise pin old pages and grow the file.
Local disks only: LMDB's locking and mmap break on NFS.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import lmdb

from common import faults
from common.config import format_size
from common.errors import ConfigError, StorageFull

MAP_SIZE = 1 << 40

MIN_FREE = 1 << 20
"""Bytes a write must leave free on the disk under an environment, beyond its own keys and values: room for
LMDB's page rounding and copy-on-write tree pages. A write that would leave less is refused as a full disk
(``check_space``); an EIO from LMDB with less than this left is a full disk (``storage_full``)."""


def open_env(
    path: Path,
    *,
    sync: bool = True,
    metasync: bool | None = None,
    max_readers: int = 256,
    max_dbs: int = 4,
    map_size: int = MAP_SIZE,
) -> lmdb.Environment:
    """Open (creating) the environment at ``path``; ``metasync`` defaults to ``sync``."""
    path.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(
        str(path),
        map_size=map_size,
        max_dbs=max_dbs,
        max_readers=max_readers,
        sync=sync,
        metasync=sync if metasync is None else metasync,
        writemap=False,
    )
    env.reader_check()
    return env


def free_bytes(path: Path) -> int | None:
    """Bytes of the filesystem under ``path`` (or its nearest existing parent) that a write may still use
    (statvfs ``f_bavail``, ``df``'s Avail), or None if it cannot be read."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _disk_full(what: str, path: Path, how: str) -> StorageFull:
    return StorageFull(
        f"the disk under {what} {path} is full ({how}); nothing acknowledged is lost: free space (or move the "
        "--data-dir) and restart"
    )


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def check_space(path: Path, need: int, what: str) -> None:
    """Raise StorageFull (naming ``what`` and its ``path``) if the disk under ``path`` has less than ``need``
    bytes (a write's keys and values) plus ``MIN_FREE`` left: the commit would fail part-way (EIO) or outright
    (ENOSPC). One statvfs call (about a microsecond), before the commit; a disk that cannot be read is let be."""
    if faults.INJECTED is not None and faults.INJECTED.no_space_check:  # tests only: reach LMDB's own errors
        return
    free = free_bytes(path)
    if free is not None and free < need + MIN_FREE:
        if need:
            how = f"{_size(free)} left, a write of {_size(need)} needs {_size(need + MIN_FREE)} with the reserve"
        else:
            how = f"{_size(free)} left, less than the {_size(MIN_FREE)} reserve"
        raise _disk_full(what, path, how)


def _errno(exc: BaseException) -> int | None:
    """The system error code of an OSError or an lmdb.Error (py-lmdb sets ``code``; the message is a fallback)."""
    if isinstance(exc, OSError):
        return exc.errno
    if not isinstance(exc, lmdb.Error):
        return None
    code = getattr(exc, "code", None)
    if isinstance(code, int) and code:
        return code
    text = str(exc)
    return next((c for c in (errno.ENOSPC, errno.EDQUOT, errno.EIO) if text.endswith(os.strerror(c))), None)


def storage_full(exc: BaseException, what: str, path: Path, map_size: int) -> StorageFull | None:
    """``exc`` as a StorageFull naming ``what`` (e.g. "agent store"), its ``path`` and ``--map-size``, if
    it is a full map (``MapFullError``) or a full disk: ENOSPC or EDQUOT (a page write failed outright), or
    EIO while the disk has less than ``MIN_FREE`` left (LMDB's code for a page write that ran out of space
    part-way); None for any other error."""
    if isinstance(exc, lmdb.MapFullError):
        return StorageFull(
            f"{what} {path} is full: --map-size {format_size(map_size)} is used up; nothing acknowledged is lost: "
            "restart with a larger --map-size on the same --data-dir"
        )
    code = _errno(exc)
    if isinstance(exc, lmdb.DiskError) or code == errno.ENOSPC:
        return _disk_full(what, path, "ENOSPC")
    if code == errno.EDQUOT:
        return _disk_full(what, path, "EDQUOT: the disk quota is used up")
    if code == errno.EIO:
        free = free_bytes(path)
        if free is not None and free < MIN_FREE:
            return _disk_full(what, path, f"EIO: a write ran out of space part-way, {_size(free)} left")
    return None


def lock_dir(path: Path, what: str):
    """Take ``path``'s exclusive lock for this process's lifetime, or fail clearly.

    Two coordinators (or agents) on one data dir would both write its LMDB
    and break every guarantee. The kernel drops the lock when the process
    dies, so a SIGKILLed predecessor never blocks a restart.
    """
    path.mkdir(parents=True, exist_ok=True)
    fh = open(path / "rollfleet.lock", "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise ConfigError(f"{what} {path} is in use by {holder}; stop it first or use another --data-dir") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}")
    fh.flush()
    return fh
