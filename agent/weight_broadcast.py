"""The broadcast path of the weights executor (docs/weights.md): a distributed update's or a catch-up's
steps on this agent's engines, their process group and their weight-update sessions.

- ``begin``: health checks paused; every engine (a catch-up: every engine behind its version) is
  confirmed for the group: its process is alive, an earlier group it still holds is destroyed, it
  is paused (mode ``abort``: in-flight samples come back partial) and its weight-update session is
  opened (SGLang 0.5.23 refuses broadcasts outside one), each within ``confirm_deadline``. The
  engines confirmed are the report's ``members``; one that fails is left out (a dead one goes
  ``down`` at once, one still blocked in a failed update's broadcast stays ``stale``) and the
  update goes on without it. An engine with data parallelism but no DP attention never joins.
- ``init``: each engine named in ``rank_offsets`` joins the group (the call blocks until the
  trainer's rank 0 joins too). The fleet's group is kept for later updates until an abort or a
  restart; a catch-up's group is its own (``side``) and ends with it.
- ``bucket``: each engine of the group receives the bucket (``flush_cache`` false).
- ``finish``: each engine of the group gets the label, its session closed, a cache flush, the
  read-back when verified (agent/weight_verify.py), continue, and the label check; engines left
  out of the update are behind (the disk path's sweep).
- ``leave``/``close_sessions``: an abort's part here, each engine within ``confirm_deadline``: one
  that does not answer (blocked in the failed broadcast until its own timeout) is remembered as
  holding the group (``held``) and is confirmed for no update until a later ``begin`` destroys it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from agent.engine_client import EngineClient
from agent.events import WeightsRecord
from agent.supervisor import EngineSupervisor
from agent.weight_calls import EngineCalls
from agent.weight_checks import Reading
from agent.weight_engines import WeightEngines
from agent.weight_verify import Verifier
from common import protocol as p
from common.errors import EngineError, EngineRejected
from common.weight_step import WeightKind

log = logging.getLogger("rollfleet.agent.weights")


class BroadcastPath:
    def __init__(
        self,
        supervisor: EngineSupervisor,
        engines: WeightEngines,
        calls: EngineCalls,
        verifier: Verifier,
        sweep: Callable[[], Awaitable[None]],
        *,
        agent_id: str,
        confirm_deadline: float,
        flush_deadline: float,
    ):
        self.supervisor = supervisor
        self.engines = engines
        self.calls = calls
        self.client: EngineClient = calls.client
        self.verifier = verifier
        self._sweep = sweep
        self.agent_id = agent_id
        self.confirm_deadline = confirm_deadline
        self.flush_deadline = flush_deadline
        self.group_name = ""
        self.side: dict[str, str] = {}  # engines in the open catch-up's group (its own, ended with it)
        self.side_name = ""
        self.side_update = 0  # the catch-up update the last ``begin`` was for
        self.members: list[str] = []  # engines the last ``begin`` confirmed
        self.sessionless: set[str] = set()  # engines without session endpoints (SGLang before 0.5.23)
        self._warned: set[str] = set()  # engines whose data parallelism keeps them out was said (once)

    def restarted(self, name: str) -> None:
        """A new process: in no catch-up's group; whether it has sessions and data parallelism is learnt again."""
        self.side.pop(name, None)
        self.sessionless.discard(name)
        self._warned.discard(name)

    async def begin(self, msg: p.WeightsBegin) -> tuple[dict, None]:
        """Confirm every engine for the group (a catch-up: every engine behind ``version``); the ones
        that fail are left out, not an error."""
        engines, calls = self.engines, self.calls
        urls = self.supervisor.urls()
        engines.touched.clear()
        self.members = []
        if msg.catch_up:
            self.side_update = msg.update_id
            urls = {
                name: url
                for name, url in urls.items()
                if name in engines.stale or engines.versions.get(name) != msg.version
            }
            if not urls:
                return {}, None  # all current: the serving engines were never paused
        for name in [n for n in urls if not self._joinable(n)]:
            del urls[name]  # never paused nor confirmed: it serves until the update's end finds it behind
        self.supervisor.pause_health_checks()
        pause_sent: set[str] = set()

        async def confirm(name: str, url: str) -> None:
            if not self.supervisor.alive(name):
                raise EngineError(f"{url}: its process exited")
            held = engines.held.get(name)
            if held:
                try:
                    await self.client.destroy_weights_update_group(url, held)
                except EngineRejected:
                    pass  # 400: the group is gone already (its broadcast failed and cleaned up)
                engines.held.pop(name, None)
            pause_sent.add(name)
            await calls.pause(url)
            await self._open_session(name, url)

        failed = await calls.each(urls, confirm, deadline=self.confirm_deadline)
        for name in failed.keys() & pause_sent:
            calls.continue_later(name, urls[name])  # left out: it must not stay paused
        for name, why in failed.items():
            log.warning("engine %s left out of weight update %#x: %s", name, msg.update_id, why)
            if name in engines.held:
                engines.set_serving(name, False)  # still in the failed broadcast: out of the pool
            else:
                self.supervisor.report_failure(name, f"not confirmed for a weight update: {why}")
        confirmed = {name: url for name, url in urls.items() if name not in failed}
        engines.paused.update(confirmed)
        self.members = list(confirmed)
        if msg.catch_up and not confirmed:
            self.supervisor.resume_health_checks(force=True)
        return {}, None

    def _joinable(self, name: str) -> bool:
        """Whether the engine can join a weight-update group: SGLang refuses one (an assert, HTTP 500) on a
        server with data parallelism unless it runs DP attention. Said once per engine."""
        if self.supervisor.dp(name) <= 1 or self.supervisor.server_info(name).get("enable_dp_attention"):
            return True
        if name not in self._warned:
            self._warned.add(name)
            log.warning(
                "engine %s has dp_size %d without DP attention: SGLang cannot take broadcasts there; it is left out "
                "of distributed updates and out of the pool after one (update it from disk, or run it with tp only)",
                name,
                self.supervisor.dp(name),
            )
        return False

    async def init(self, msg: p.WeightsInitGroup) -> tuple[dict, None]:
        urls = self.supervisor.urls()
        offsets = {}
        for name in urls:
            offset = msg.rank_offsets.get(f"{self.agent_id}/{name}", msg.rank_offsets.get(name))
            if offset is not None:
                offsets[name] = int(offset)
        members = {name: urls[name] for name in offsets}
        if msg.update_id == self.side_update:
            self.side, self.side_name = {}, msg.group_name
            group = self.side
        else:
            await self.leave(self.engines.group, self.group_name)  # a new group replaces the fleet's old one
            self.engines.group, self.group_name = {}, msg.group_name
            group = self.engines.group

        async def join(name: str, url: str) -> None:
            await self.client.init_weights_update_group(
                url,
                master_address=msg.master_address,
                master_port=msg.master_port,
                rank_offset=offsets[name],
                world_size=msg.world_size,
                group_name=msg.group_name,
                backend=msg.backend,
            )
            group[name] = url

        errors = await self.calls.each(members, join)
        if not members:
            errors = {"*": "none of this agent's engines is in rank_offsets"}
        return errors, None

    async def bucket(self, msg: p.WeightsBucket) -> tuple[dict, None]:
        group = self.side if msg.update_id == self.side_update else self.engines.group
        if not group:
            return {"*": "no update group on this agent (no init step succeeded)"}, None
        self.engines.touched.update(group)
        return await self.calls.each(
            dict(group),
            lambda name, url: self.client.update_weights_from_distributed(
                url, names=msg.names, dtypes=msg.dtypes, shapes=msg.shapes, group_name=msg.group_name
            ),
        ), None

    async def finish(self, msg: p.WeightsFinish) -> tuple[dict, WeightsRecord | None]:
        engines, calls = self.engines, self.calls
        catch_up = msg.update_id == self.side_update
        updated = dict(self.side if catch_up else engines.group)
        readings: dict[str, Reading] = {}

        async def end(name: str, url: str) -> None:
            await calls.bounded(url, "/update_weight_version", self.client.update_weight_version(url, str(msg.version)))
            # Closing the session re-packs the weights: read-backs come after it.
            await calls.watched(url, "/end_weight_update", self._close_session(name, url))
            await calls.watched(url, "/flush_cache", self.client.flush_cache(url, deadline=self.flush_deadline))
            if msg.verify:
                got = await calls.watched(url, "the read-back", self.verifier.read_back(name, url, msg.verify))
                if got is not None:
                    readings[name] = got

        async def serve(name: str, url: str) -> None:
            await calls.unpause(url)
            await engines.verify(name, url, msg.version)

        errors = await calls.each(updated, end)
        errors.update(self.verifier.compare(readings, msg.verify))
        errors.update(await calls.each({n: u for n, u in updated.items() if n not in errors}, serve))
        dead = await engines.drop_lost(errors, msg.update_id, "finishing")
        for name in updated:
            engines.paused.pop(name, None)
            engines.set_serving(name, name not in errors and name not in dead)
        if catch_up:
            return await self.end_catch_up(errors), None
        continued = await engines.continue_paused()
        await engines.drop_lost(continued, msg.update_id, "continuing")
        errors.update(continued)
        record = None
        if not errors:
            record = engines.land(WeightsRecord(msg.version, WeightKind.DISTRIBUTED.value, ""))
            engines.touched.clear()
            await self._sweep()  # engines left out of the update are behind it now
        self.supervisor.resume_health_checks(force=True)
        return errors, record

    async def end_catch_up(self, errors: dict[str, str]) -> dict[str, str]:
        """A catch-up ends: its group goes (the fleet's stays), every engine it paused continues."""
        side, self.side, self.side_update = self.side, {}, 0
        await self.close_sessions()
        for name in await self.leave(side, self.side_name):
            self.engines.stale.add(name)
            self.engines.set_serving(name, False)
        errors.update(await self.engines.continue_paused(deadline=self.confirm_deadline))
        self.supervisor.resume_health_checks(force=True)
        return errors

    async def leave(self, group: dict[str, str], group_name: str) -> dict[str, str]:
        """Each engine of ``group`` destroys it, within ``confirm_deadline``; those that did not answer
        (still blocked in a failed broadcast) are remembered as holding it: ``{name: why}``."""
        if not group:
            return {}

        async def leave(name: str, url: str) -> None:
            try:
                await self.client.destroy_weights_update_group(url, group_name)
            except EngineRejected as exc:
                log.info("engine %s: destroying the update group: %s", name, exc)  # 400 when it never formed

        stuck = await self.calls.each(group, leave, deadline=self.confirm_deadline)
        for name, why in stuck.items():
            log.warning("engine %s still holds weight-update group %s: %s", name, group_name, why)
            self.engines.held[name] = group_name
        return stuck

    async def _open_session(self, name: str, url: str) -> None:
        """Open the engine's weight-update session (SGLang 0.5.23 refuses broadcasts outside one); nothing on
        an engine without the endpoints. One left open (an update whose end never reached it) is closed first."""
        if name in self.sessionless:
            return
        try:
            opened = await self.client.begin_weight_update(url)
        except EngineRejected as exc:
            if "already open" not in str(exc):
                raise
            log.warning("engine %s had a weight-update session open: closing it before this update", name)
            await self.client.end_weight_update(url)
            opened = await self.client.begin_weight_update(url)
        if opened:
            self.engines.sessions[name] = url
        else:
            self.sessionless.add(name)
            log.info("engine %s has no weight-update sessions (SGLang before 0.5.23): updates run without", name)

    async def _close_session(self, name: str, url: str) -> None:
        if self.engines.sessions.get(name) != url:
            return
        try:
            await self.client.end_weight_update(url)
        except EngineRejected as exc:
            if "no weight-update session" not in str(exc):
                raise
        self.engines.sessions.pop(name, None)

    async def close_sessions(self) -> None:
        """Every session this agent opened is closed, each within ``confirm_deadline``; one that cannot be (an
        engine still blocked in a failed broadcast) is closed by the next update's begin."""
        sessions = dict(self.engines.sessions)
        stuck = await self.calls.each(sessions, self._close_session, deadline=self.confirm_deadline)
        for name, why in stuck.items():
            log.warning("engine %s: its weight-update session is still open (%s): the next update closes it", name, why)
