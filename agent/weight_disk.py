"""The disk path of the weights executor (docs/weights.md): a disk update's step, and every engine behind
the fleet's weights brought up to them or out of the pool.

- ``step`` (``WeightsFromDisk``): health checks paused; per engine pause, ``/update_weights_from_disk``
  (label ``str(version)``, cache flushed), continue, and ``/model_info`` must say ``str(version)``; an
  engine that died or hung meanwhile is left out (it loads the recorded checkpoint when it restarts);
  then health checks resume with one forced check.
- ``sweep``: after every step that ends an update (and a Welcome), each engine not on the fleet's
  weights (``WeightEngines.fleet``) is re-loaded from their checkpoint when they came from disk, else
  it stays ``stale`` (out of the pool) until an update reaches it. ``bring_up`` does it for one
  engine; the executor's ``prepare`` applies it to every engine that (re)starts, before it serves.
"""

from __future__ import annotations

import asyncio
import logging

from agent.events import WeightsRecord
from agent.supervisor import EngineSupervisor
from agent.weight_calls import EngineCalls, Hung
from agent.weight_engines import WeightEngines
from common import protocol as p
from common.errors import EngineError
from common.weight_step import WeightKind

log = logging.getLogger("rollfleet.agent.weights")


class DiskPath:
    def __init__(self, supervisor: EngineSupervisor, engines: WeightEngines, calls: EngineCalls):
        self.supervisor = supervisor
        self.engines = engines
        self.calls = calls
        self.load_format: dict[str, str | None] = {}  # the load_format its disk loads need (None: its own)

    def restarted(self, name: str, info: dict | None = None) -> None:
        """A (re)started engine, and its ``/model_info`` once read: launched with ``--load-format dummy`` (random
        weights, real ones to come), a disk load in the server's own format would be refused, so it is asked
        for in the checkpoint's."""
        self.load_format.pop(name, None)
        if info is not None:
            self.load_format[name] = "auto" if info.get("load_format") == "dummy" else None

    async def step(self, msg: p.WeightsFromDisk) -> tuple[dict, WeightsRecord | None]:
        engines, calls = self.engines, self.calls
        self.supervisor.pause_health_checks()
        urls = {name: url for name, url in self.supervisor.urls().items() if self.supervisor.alive(name)}
        engines.paused.update(urls)

        async def load(name: str, url: str) -> None:
            await calls.pause(url)
            engines.touched.add(name)  # loading: it may hold part of the checkpoint until the load ends
            try:
                load = calls.client.update_weights_from_disk(
                    url, msg.path, str(msg.version), flush_cache=True, load_format=self.load_format.get(name)
                )
                await calls.watched(url, "/update_weights_from_disk", load)
            finally:
                await calls.unpause(url)
            await engines.verify(name, url, msg.version)
            engines.touched.discard(name)  # a load that completed is whole: the engine holds the version

        errors = await calls.each(urls, load)
        # One that died during its load is left out, not a failure of the update: it restarts and
        # loads the recorded checkpoint on the way up (``prepare``), like any restarted engine.
        dead = await engines.drop_lost(errors, msg.update_id, "loading from disk")
        for name in urls:
            engines.paused.pop(name, None)
            engines.set_serving(name, name not in errors and name not in dead)
        record = None
        if not errors:
            record = engines.land(WeightsRecord(msg.version, WeightKind.DISK.value, msg.path))
            engines.touched.clear()
            await self.sweep()
        self.supervisor.resume_health_checks(force=True)
        return errors, record

    async def sweep(self) -> None:
        """Every engine not on the fleet's weights (or holding partial ones) is brought up to them or left stale."""
        engines = self.engines
        version = engines.fleet().version
        behind = [
            (name, url)
            for name, url in self.supervisor.urls().items()
            if (name in engines.stale or engines.versions.get(name) != version)
            and name not in engines.held
            and name not in engines.lost  # going down: its restart brings it up to date
        ]
        for name in engines.held:
            if name in self.supervisor.urls():
                engines.set_serving(name, False)
        await asyncio.gather(*(self.bring_up(name, url, mark=True) for name, url in behind))

    async def bring_up(self, name: str, url: str, *, mark: bool) -> bool:
        """Re-load the fleet's weights from disk on one engine if they came from disk; True if it holds them.

        ``mark``: move it in the supervisor (``stale`` while it loads); otherwise the caller decides its state.
        """
        engines, calls = self.engines, self.calls
        record = engines.fleet()
        if mark:
            engines.set_serving(name, False)
        else:
            engines.stale.add(name)
        if record.kind != WeightKind.DISK or not record.path:
            log.warning(
                "engine %s is not on weight version %d (%s): out of the pool until an update reaches it",
                name,
                record.version,
                record.kind or "launch weights",
            )
            return False
        try:
            await calls.pause(url)
            try:
                load = calls.client.update_weights_from_disk(
                    url, record.path, str(record.version), load_format=self.load_format.get(name)
                )
                await calls.watched(url, "/update_weights_from_disk", load)
            finally:
                await calls.unpause(url)
            await engines.verify(name, url, record.version)
        except EngineError as exc:
            log.error(
                "engine %s: re-loading weight version %d from %s failed: %s", name, record.version, record.path, exc
            )
            if isinstance(exc, Hung):
                engines.lose(name, str(exc))
            return False
        log.info("engine %s re-loaded weight version %d from %s", name, record.version, record.path)
        if engines.fleet().version != record.version:
            # The fleet moved on while it loaded (an update it was not part of): bring it up to that one instead.
            return await self.bring_up(name, url, mark=mark)
        engines.stale.discard(name)
        if mark:
            engines.set_serving(name, True)
        return True
