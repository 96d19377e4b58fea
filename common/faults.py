"""Fault injection for tests: make a guarantee's failure happen for real. TEST-ONLY.

Enabled only by the ``ROLLFLEET_FAULTS`` environment variable, read once at
import; a test sets it for the one process it starts. Unset (production),
``INJECTED`` is None and every injection point costs one module-level None
check::

    ROLLFLEET_FAULTS="kill_after_commit=0.25;drop_receipts=3;seed=7"

Points (``key=value``, ``;``-separated; unknown keys are refused):

    kill_after_commit=P  agent: SIGKILL itself with probability P after a
                         group's store commit returned and before its receipt
                         is sent (agent/lease_runner.py)
    kill_before_commit=P agent: SIGKILL itself with probability P once a group
                         is scored, before its commit; it first lets what it
                         already sent leave (a receipt sent too early would)
    drop_receipts=N      agent: the next N outgoing Receipts are lost in
                         flight (agent/link.py)
    hold_file=PATH       agent: while PATH exists, nothing it sends leaves:
                         messages are held, in order, and leave together once
                         PATH is gone (a one-way partition that heals late);
                         a reconnect discards them, as closing the socket does
    drop_grants=N        coordinator: the next N outgoing Grants are lost
                         (coordinator/server.py)
    drop_pauses=N        coordinator: the next N outgoing pause Controls are lost
    no_space_check=1     agent and coordinator: LMDB writes skip the free-space
                         check (common/lmdb_env.py ``check_space``), so a disk
                         filled by a test reaches LMDB's own commit errors
                         (ENOSPC, or EIO after a short write), as a disk filled
                         by someone else between the check and the commit does
    seed=S               the random source of the probabilistic points

Every injected fault is logged at WARNING as ``fault injected: ...`` so a
test can tell that the fault it asked for happened.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path

from common import protocol as p

log = logging.getLogger("rollfleet.faults")

ENV = "ROLLFLEET_FAULTS"

_COUNTS = ("drop_receipts", "drop_grants", "drop_pauses")

SEND_GRACE = 0.1
"""Seconds a ``kill_before_commit`` waits so the messages it already queued leave the process."""


class Faults:
    def __init__(self, spec: str):
        self.kill_after_commit = 0.0
        self.kill_before_commit = 0.0
        self.hold_file: Path | None = None
        self.no_space_check = False
        self.left = dict.fromkeys(_COUNTS, 0)
        seed = None
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"{ENV}: {item!r} is not key=value")
            if key in ("kill_after_commit", "kill_before_commit"):
                setattr(self, key, float(value))
            elif key == "hold_file":
                self.hold_file = Path(value)
            elif key == "seed":
                seed = int(value)
            elif key == "no_space_check":
                self.no_space_check = bool(int(value))
            elif key in self.left:
                self.left[key] = int(value)
            else:
                known = ("kill_after_commit", "kill_before_commit", "hold_file", "seed", "no_space_check", *_COUNTS)
                raise ValueError(f"{ENV}: unknown fault {key!r}; known: {', '.join(known)}")
        self.random = random.Random(seed)
        self._held: list = []

    def _take(self, counter: str) -> bool:
        if self.left[counter] <= 0:
            return False
        self.left[counter] -= 1
        return True

    # ---------------------------------------------------------------- agent

    def before_commit(self, key: str) -> None:
        """A group is scored, not yet committed: maybe die here. Messages already queued leave first."""
        if self.kill_before_commit and self.random.random() < self.kill_before_commit:
            log.warning("fault injected: SIGKILL before committing %s", key)
            time.sleep(SEND_GRACE)  # blocks the loop on purpose: nothing more happens before the kill
            os.kill(os.getpid(), signal.SIGKILL)

    def after_commit(self, key: str) -> None:
        """Between a group's commit and its receipt: maybe die here, as a SIGKILL would."""
        if self.kill_after_commit and self.random.random() < self.kill_after_commit:
            log.warning("fault injected: SIGKILL after committing %s, before its receipt", key)
            os.kill(os.getpid(), signal.SIGKILL)

    def agent_outgoing(self, msg: p.Message) -> list[p.Message]:
        """What leaves the agent instead of ``msg``: nothing (dropped or held), ``msg``, or held ones first."""
        if isinstance(msg, p.Receipt) and self._take("drop_receipts"):
            log.warning("fault injected: dropped Receipt %s", msg.key)
            return []
        if self.hold_file is not None:
            if self.hold_file.exists():
                self._held.append(msg)
                return []
            if self._held:
                held, self._held = self._held, []
                log.warning("fault injected: %d held message(s) leave late", len(held))
                return held + [msg]
        return [msg]

    def link_reopened(self) -> None:
        """A new socket: what was held on the old one is lost with it."""
        if self._held:
            log.warning("fault injected: %d held message(s) discarded at reconnect", len(self._held))
            self._held = []

    # ---------------------------------------------------------------- coordinator

    def coordinator_drops(self, msg: p.Message) -> bool:
        """True if ``msg`` (about to leave the coordinator) is lost instead."""
        if isinstance(msg, p.Grant) and self._take("drop_grants"):
            leases = [[g.lease, g.data_epoch, g.index] for g in msg.leases]
            log.warning("fault injected: dropped Grant (session %x) of leases %s", msg.session, leases)
            return True
        if isinstance(msg, p.Control) and msg.action == "pause" and self._take("drop_pauses"):
            log.warning("fault injected: dropped pause Control")
            return True
        return False


def _from_env() -> Faults | None:
    spec = os.environ.get(ENV, "")
    return Faults(spec) if spec.strip() else None


INJECTED: Faults | None = _from_env()
"""The faults this process injects; None (no cost) unless ``ROLLFLEET_FAULTS`` is set."""
