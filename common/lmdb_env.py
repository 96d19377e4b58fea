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

from common.config import format_size
from common.errors import ConfigError, StorageFull

MAP_SIZE = 1 << 40


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


def storage_full(exc: BaseException, what: str, path: Path, map_size: int) -> StorageFull | None:
    """``exc`` as a StorageFull naming ``what`` (e.g. "agent store"), its ``path`` and ``--map-size``, if
    it is a full map (``MapFullError``) or a full disk (ENOSPC); None for any other error."""
    if isinstance(exc, lmdb.MapFullError):
        return StorageFull(
            f"{what} {path} is full: --map-size {format_size(map_size)} is used up; nothing acknowledged is lost: "
            "restart with a larger --map-size on the same --data-dir"
        )
    if isinstance(exc, lmdb.DiskError) or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        return StorageFull(
            f"the disk under {what} {path} is full (ENOSPC); nothing acknowledged is lost: free space (or move the "
            "--data-dir) and restart"
        )
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
