"""A trainer process's session with the coordinator: attach (the leader), join (a member rank), re-attach after
a coordinator restart, and fencing.

``TrainerSession`` owns the session id and the attach answer (the fleet's config, heartbeat interval, dataset).
Every session-bound request of the client goes through ``TrainerSession.request`` (or ``call``, for the whole
answer message): a ``Request``, the one seam the weight senders (coordinator/client_weights.py,
coordinator/sharded_weights.py) are handed to reach the coordinator.

Rank 0 leads: its ``Attach`` opens a session and fences any other trainer's. A rank above 0 joins its leader's
session; until a leader of its run has attached it is answered ``no_leader`` (or ``other_leader``) and waits,
up to ``leader_wait`` seconds. A request answered ``unknown_session`` (the coordinator restarted and forgot the
session) attaches again, once for every call in flight (``attaching`` is held meanwhile), and is asked again; a
member answered ``fenced`` rejoins (its leader attached again, or a new run's leader fences it for good).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from common import protocol as p
from common.errors import Fenced, RolloutError, StateError
from coordinator.endpoint import _Endpoint, _raise_remote

log = logging.getLogger("rollfleet.client")

MAX_REATTACH = 20
"""Re-attaches one call may make (a coordinator restarted that many times while it waited) before it
gives up: a bound against a coordinator that forgets sessions at once, not a limit on restarts."""

Request = Callable[[Callable[[int, int], p.Message], str], Awaitable[dict]]
"""A session-bound coordinator request: ``await request(make, what)`` sends ``make(session, req)``, resent until
answered and asked again after a re-attach, and returns the answer's ``result``; an error answer raises its
``common.errors`` exception. ``what`` names the call in errors and logs. ``TrainerSession.request`` is one."""


def check_rank(rank, world_size) -> tuple[int, int]:
    """``(rank, world_size)`` validated: ints, ``world_size >= 1``, ``0 <= rank < world_size``."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def default_run() -> str:
    """The launch this process belongs to, from the launcher's environment ("" when none says)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"{run_id}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return os.environ.get("ROLLFLEET_RUN", "")


class TrainerSession:
    """The session of one trainer process (rank ``rank`` of ``world_size``) at the coordinator ``endpoint``."""

    def __init__(
        self,
        *,
        client_id: str,
        expect: dict,
        rank: int,
        world_size: int,
        run: str,
        balance: str,
        retry_interval: float,
        timeout: float | None,
        leader_wait: float,
    ):
        self.client_id = client_id
        self.expect = expect
        self.rank = rank
        self.world_size = world_size
        self.run = run
        self.balance = balance
        self.retry_interval = retry_interval
        self.timeout = timeout
        self.leader_wait = leader_wait
        self.endpoint: _Endpoint | None = None
        """The coordinator's socket, set by the client once its ZeroMQ context exists."""
        self.id = 0
        """The session id (0: not attached)."""
        self.config: dict = {}
        """The fleet's rollout config, from the attach answer."""
        self.heartbeat_interval = 1.0
        """Seconds between ``WeightsAlive`` beats while a broadcast runs (the coordinator's, from attach)."""
        self.fleet: dict = {}
        """What a recorded file keeps of the fleet (``rollfleet.fleet``): the attach answer's config and dataset."""
        self.attaching = asyncio.Lock()
        """Held while attaching: concurrent calls that find the coordinator restarted attach once, not each."""

    @property
    def address(self) -> str:
        return self.endpoint.address if self.endpoint is not None else ""

    async def ensure(self) -> None:
        """Attached (or joined), once, whoever else asks meanwhile."""
        if not self.id:
            async with self.attaching:
                if not self.id:
                    await self.attach()

    async def attach(self, rejoin: bool = False) -> None:
        """Open a session (the leader), or join the leader's (a member: waiting up to ``leader_wait`` for a leader
        of its run to attach). ``rejoin``: a member whose session was replaced; a leader of another run having
        attached meanwhile fences it (``Fenced``) instead of being waited for."""
        started = time.monotonic()
        while True:
            msg, _ = await self.endpoint.request(
                lambda req: p.Attach(
                    req, self.client_id, self.expect, self.rank, self.world_size, self.run, self.balance
                ),
                retry_interval=self.retry_interval,
                timeout=self.timeout,
                what="attach" if self.rank == 0 else f"join (rank {self.rank})",
            )
            if not (isinstance(msg, p.Error) and msg.code in ("no_leader", "other_leader")):
                break
            if rejoin and msg.code == "other_leader":
                raise Fenced(f"rank {self.rank}: a new trainer run's leader attached ({msg.message})", code="fenced")
            if time.monotonic() - started > self.leader_wait:
                raise StateError(f"no leader for this rank after {self.leader_wait:.0f}s (leader_wait): {msg.message}")
            await asyncio.sleep(min(0.5, self.retry_interval))
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        self.id = msg.result["session"]
        self.config = msg.result["config"]
        self.heartbeat_interval = float(msg.result.get("heartbeat_interval", 1.0))
        kept = ("config", "dataset_size", "dataset_fingerprint", "weights_version")
        self.fleet = {k: msg.result.get(k) for k in kept}
        if self.rank:
            log.info("joined session %x at %s as rank %d of %d", self.id, self.address, self.rank, self.world_size)
        else:
            log.info("attached to %s as %s (session %x)", self.address, self.client_id, self.id)

    async def call(self, make: Callable[[int, int], p.Message], what: str) -> p.Message:
        """A coordinator request that re-attaches once if the coordinator restarted; the answer message.

        Calls in flight together (a ``generate`` waiting while weights are pushed) share one
        re-attach: the first to hear ``unknown_session`` attaches, the others see the new session
        and ask again with it. A ``fenced`` answer to a session this client has already left
        behind is such a call, asked again too; ``Fenced`` is raised only when another trainer
        replaced this client's current session. A ``generate`` that waits long may span several
        coordinator restarts: each one is attached again, up to ``MAX_REATTACH``."""
        for _ in range(MAX_REATTACH):
            async with self.attaching:
                session = self.id
            msg, _ = await self.endpoint.request(
                lambda req, s=session: make(s, req), retry_interval=self.retry_interval, timeout=self.timeout, what=what
            )
            if isinstance(msg, p.Error) and msg.code == "unknown_session":
                async with self.attaching:
                    if self.id == session:  # nobody attached again meanwhile
                        log.warning("coordinator no longer knows session %x (restarted); attaching again", session)
                        self.id = 0
                        await self.attach()
                continue
            if isinstance(msg, p.Error) and msg.code == "fenced" and session != self.id:
                continue  # answered to the session this client had before it attached again
            if isinstance(msg, p.Error) and msg.code == "fenced" and self.rank:
                # A member: its leader attached again (a coordinator restart) or a new run's leader came.
                async with self.attaching:
                    if self.id == session:
                        self.id = 0
                        await self.attach(rejoin=True)
                continue
            if isinstance(msg, p.Error):
                _raise_remote(msg)
            return msg
        raise RolloutError(f"{what}: could not re-attach to {self.address}")

    async def request(self, make: Callable[[int, int], p.Message], what: str) -> dict:
        """``call``'s answer's result: the ``Request`` seam."""
        return (await self.call(make, what)).result

    async def ask(self, make: Callable[[int], p.Message], what: str, *, timeout: float | None = None) -> dict:
        """A request bound to no session (``Stats``); its result. ``timeout``: this call's (default: the client's,
        else 30 s)."""
        msg, _ = await self.endpoint.request(
            make, retry_interval=self.retry_interval, timeout=timeout or self.timeout or 30, what=what
        )
        if isinstance(msg, p.Error):
            _raise_remote(msg)
        return msg.result

    async def detach(self) -> None:
        """Leave the fleet for the next trainer (the leader's; a member leaves the session to its leader). Best
        effort: a dead coordinator must not block the client's close."""
        if not self.id or self.endpoint is None or self.rank:
            return
        try:
            await self.endpoint.request(
                lambda req: p.Detach(self.id, req), retry_interval=0.5, timeout=1.0, what="detach"
            )
        except RolloutError:
            pass
