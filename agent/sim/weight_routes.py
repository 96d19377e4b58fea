"""The weight-update endpoints: from disk, through a distributed group, and the version label.

``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group`` and ``/update_weight_version``, with SGLang's bodies, defaults
and ``{"success", "message"}`` answers (400 on failure). The weights themselves live in
:mod:`agent.sim.weights`.

Lock semantics, as SGLang's: an update takes the writer lock and waits for in-flight requests
(new ones queue behind it), except while the engine is paused, when it applies at once
(:meth:`~agent.sim.scheduler.Scheduler.update_weights`). ``abort_all_requests`` aborts what the
scheduler holds first. ``weight_version``, when given, becomes the label on success only.
``flush_cache`` (default true) flushes the prefix cache after the update; during an ``in_place``
pause with running requests the flush cannot happen, and the answer is 400 "Weights were
updated, but the cache was not flushed…" although the weights did change (SGLang 0.5.23).
``/init_weights_update_group`` and ``/destroy_weights_update_group`` take no lock.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from aiohttp import web

from agent.sim.replies import json_response, read_json_body, weights_reply
from agent.sim.weights import WeightError, load_checkpoint
from common.weight_rows import leading_rows

if TYPE_CHECKING:
    from agent.sim.engine import SimEngine

NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed: requests are running during an in_place pause. "
    "Flush it after continue_generation, or pause with mode abort or retract."
)


class WeightHandlers:
    """Request handlers of one engine's weight endpoints."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.scheduler = engine.scheduler

    def _finish_update(self, data: dict, message: str) -> web.Response:
        """Apply the label and the flush of a successful update (writer lock held, or paused)."""
        version = data.get("weight_version")
        if version is not None:
            self.scheduler.weight_version = str(version)
        if data.get("flush_cache", True) is not False and not self.scheduler.flush():
            return weights_reply(False, NOT_FLUSHED, num_paused_requests=0)
        return weights_reply(True, message, num_paused_requests=0)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            return weights_reply(False, "model_path is required")
        if data.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)

        async def load() -> web.Response:
            if not os.path.isdir(path):
                return weights_reply(
                    False,
                    f"Failed to update weights: model path {path!r} is not a directory. The weights were not changed.",
                    num_paused_requests=0,
                )
            try:
                named = await asyncio.to_thread(load_checkpoint, path)
                if named is not None:
                    self.engine.apply_weights(named, replace=True)
            except WeightError as exc:
                return weights_reply(
                    False, f"Failed to update weights: {exc}. The weights were not changed.", num_paused_requests=0
                )
            self.engine.model_path = path
            return self._finish_update(data, "Succeeded to update model weights.")

        return await self.scheduler.update_weights(load)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        if getattr(self.engine, "init_delay", 0.0):  # the sim's --init-delay (the hf engine has none)
            await asyncio.sleep(self.engine.init_delay)  # --init-delay: late into the rendezvous
        try:
            message = await self.engine.weight_groups.init(data)
        except WeightError as exc:
            return weights_reply(False, str(exc))
        return weights_reply(True, message)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        groups = self.engine.weight_groups
        try:
            groups.require(data.get("group_name") or "weight_update_group")
        except WeightError as exc:
            return weights_reply(False, str(exc))
        if data.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)

        async def receive() -> web.Response:
            try:
                named = await groups.receive(data)
                if getattr(self.engine, "corrupt_broadcasts", False):
                    named = {name: _corrupted(t) for name, t in named.items()}
                self.engine.apply_weights(named, replace=False)
            except WeightError as exc:
                return weights_reply(False, str(exc))
            return self._finish_update(data, "Succeeded to update parameter online.")

        return await self.scheduler.update_weights(receive)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name {name, truncate_size}``: the parameter's first
        ``truncate_size`` rows (first dimension) as nested lists of floats; 400 for a name it lacks."""
        data = await read_json_body(request) if request.method == "POST" else dict(request.query)
        name = data.get("name")
        try:
            size = int(data.get("truncate_size", 100))
        except (TypeError, ValueError):
            return json_response({"error": "truncate_size must be an integer"}, status=400)
        tensor = self.engine.weights.get(name) if isinstance(name, str) else None
        if tensor is None:
            return json_response({"error": f"Get parameter by name failed: no parameter {name!r}"}, status=400)
        return json_response(leading_rows(tensor, size))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        try:
            message = await self.engine.weight_groups.destroy(data)
        except WeightError as exc:
            return weights_reply(False, str(exc))
        return weights_reply(True, message)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        new_version = data.get("new_version")
        if not isinstance(new_version, str) or not new_version:
            return weights_reply(False, "new_version is required")
        if data.get("abort_all_requests", True):  # SGLang's default
            self.scheduler.abort(abort_all=True)
        self.scheduler.weight_version = new_version
        return json_response(
            {"success": True, "message": f"Weight version updated to {new_version}.", "new_version": new_version}
        )


def add_weight_routes(router: web.UrlDispatcher, engine: SimEngine) -> None:
    h = WeightHandlers(engine)
    router.add_post("/update_weights_from_disk", h.update_weights_from_disk)
    router.add_post("/init_weights_update_group", h.init_weights_update_group)
    router.add_post("/update_weights_from_distributed", h.update_weights_from_distributed)
    router.add_post("/destroy_weights_update_group", h.destroy_weights_update_group)
    router.add_post("/update_weight_version", h.update_weight_version)
    router.add_get("/get_weights_by_name", h.get_weights_by_name)
    router.add_post("/get_weights_by_name", h.get_weights_by_name)


def _corrupted(tensor):
    """``tensor`` with its first element changed (``--corrupt-broadcasts``)."""
    out = tensor.clone()
    flat = out.view(-1)
    if flat.numel():
        flat[0] = flat[0] + 1
    return out
