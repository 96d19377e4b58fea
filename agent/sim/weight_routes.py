"""The weight endpoints: updates from disk and through a distributed group, sessions, the label, read-backs.

``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``, ``/begin_weight_update`` and
``/end_weight_update`` (SGLang 0.5.23), ``/get_weights_by_name`` and ``/weights_checker``
(:mod:`agent.sim.weight_checker`), with SGLang's bodies, defaults and ``{"success", "message"}``
answers (400 on failure). The weights themselves live in :mod:`agent.sim.weights`. A successful
update given a ``weight_version`` says so: ``"... Weight version updated to V."``.

Weight-update sessions (``--sglang-version 0.5.23``, :mod:`agent.sim.versions`):
``/begin_weight_update {"selector": "all" | "target" | "draft"}`` opens one (200 ``{"success": true,
"message": "Success"}``; 400 "a weight-update session is already open; call end_weight_update()
first"), ``/end_weight_update {}`` closes it (400 "no weight-update session is open; call
begin_weight_update() first"). Outside a session ``/update_weights_from_distributed`` answers 400
"update_weights_from_distributed must run between begin_weight_update() and end_weight_update()" and
does not post its receive (a trainer that broadcasts anyway blocks until its own timeout, as with
SGLang); ``/update_weights_from_disk`` needs none. Sessions live in memory: a restarted engine has
none. ``/server_info`` reports ``rollfleet_weight_update_session`` (not an SGLang field). With
``0.5.15`` both routes answer 404 and broadcasts need no session.

``/get_weights_by_name {name, truncate_size}``: the parameter's first rows, only for the model classes
SGLang implements it for (``--architecture``; the hf engine's own class); any other class, or a name
the engine lacks, answers SGLang's 400 ``{"error": {"message": "Get parameter by name failed"}}``.

Disk loads: a body without ``load_format`` uses the engine's (``--load-format``, default ``auto``);
a format SGLang's default loader does not read (``dummy`` above all) is refused with 400 "Failed to
get model loader: ..." and nothing read; ``safetensors`` and ``pt`` read only their own file. A
successful load sets the engine's ``model_path`` and ``load_format`` (``/model_info``).

Lock semantics, as SGLang's: an update takes the writer lock and waits for in-flight requests
(new ones queue behind it), except while the engine is paused, when it applies at once
(:meth:`~agent.sim.scheduler.Scheduler.update_weights`). ``abort_all_requests`` aborts what the
scheduler holds first. ``weight_version``, when given, becomes the label on success only.
``flush_cache`` (default true) flushes the prefix cache after the update; during an ``in_place``
pause with running requests the flush cannot happen, and the answer is 400 "Weights were
updated, but the cache was not flushed…" although the weights did change (SGLang 0.5.23).
``/init_weights_update_group`` and ``/destroy_weights_update_group`` take no lock. While paused,
``/update_weights_from_distributed`` and the session calls hold the pause lock for the whole call, so
``/continue_generation`` waits for them (SGLang's ``is_pause_cond``); a disk update does not. Session
calls run to the end even if their client goes away.

Testing aids: ``--corrupt-broadcasts`` stores every received tensor with its first element changed,
``--corrupt-tensors NAME,...`` only the named ones (a verification that reads back only some tensors
misses them).
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from aiohttp import web

from agent.sim.replies import json_response, read_json_body, read_optional_json_body, validation_error, weights_reply
from agent.sim.weight_checker import SELECTORS, WeightChecker
from agent.sim.weights import WeightError, load_checkpoint, loader_refusal
from common.weight_rows import leading_rows

if TYPE_CHECKING:
    from agent.sim.engine import SimEngine

NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed: requests are running during an in_place pause. "
    "Flush it after continue_generation, or pause with mode abort or retract."
)
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
GET_WEIGHTS_FAILED = {"error": {"message": "Get parameter by name failed"}}


class WeightHandlers:
    """Request handlers of one engine's weight endpoints."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.checker = WeightChecker(engine)
        self._to_the_end: set[asyncio.Task] = set()

    @property
    def sessions(self) -> bool:
        return self.engine.sglang.weight_update_sessions

    def _finish_update(self, data: dict, message: str) -> web.Response:
        """Apply the label and the flush of a successful update (writer lock held, or paused)."""
        version = data.get("weight_version")
        if version is not None:
            self.scheduler.weight_version = str(version)
        if data.get("flush_cache", True) is not False and not self.scheduler.flush():
            return weights_reply(False, NOT_FLUSHED, num_paused_requests=0)
        if version is not None:
            message += f" Weight version updated to {version}."
        return weights_reply(True, message, num_paused_requests=0)

    async def _run_to_the_end(self, coro) -> web.Response:
        """Await ``coro`` in its own task, which a client that goes away does not cancel (as SGLang's calls)."""
        task = asyncio.ensure_future(coro)
        self._to_the_end.add(task)
        task.add_done_callback(self._to_the_end.discard)
        return await asyncio.shield(task)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            return weights_reply(False, "model_path is required")
        load_format = data.get("load_format") or self.engine.load_format
        if data.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)

        async def load() -> web.Response:
            refusal = loader_refusal(str(load_format))
            if refusal is not None:
                return weights_reply(False, refusal, num_paused_requests=0)
            if not os.path.isdir(path):
                return weights_reply(
                    False,
                    f"Failed to update weights: model path {path!r} is not a directory. The weights were not changed.",
                    num_paused_requests=0,
                )
            try:
                named = await asyncio.to_thread(load_checkpoint, path, str(load_format))
                if named is not None:
                    self.engine.apply_weights(named, replace=True)
            except WeightError as exc:
                return weights_reply(
                    False, f"Failed to update weights: {exc}. The weights were not changed.", num_paused_requests=0
                )
            self.engine.model_path = path
            self.engine.load_format = str(load_format)
            return self._finish_update(data, "Succeeded to update model weights.")

        return await self.scheduler.update_weights(load, hold_pause=False)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        if getattr(self.engine, "init_delay", 0.0):  # the sim's --init-delay (the hf engine has none)
            await asyncio.sleep(self.engine.init_delay)  # --init-delay: late into the rendezvous
        try:
            message = await self.engine.weight_groups.init(data)
        except WeightError as exc:
            return weights_reply(False, str(exc))
        return weights_reply(True, message)

    def _outside_session(self) -> bool:
        return self.sessions and self.scheduler.weight_session is None

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        groups = self.engine.weight_groups
        if not self._outside_session():  # outside a session, SGLang's scheduler refuses before any group check
            try:
                groups.require(data.get("group_name") or "weight_update_group")
            except WeightError as exc:
                return weights_reply(False, str(exc))
        if data.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)

        async def receive() -> web.Response:
            if self._outside_session():
                return weights_reply(False, OUTSIDE_SESSION)  # nothing received: the trainer's broadcast blocks
            try:
                named = await groups.receive(data)
                corrupt = getattr(self.engine, "corrupt_tensors", frozenset())
                if getattr(self.engine, "corrupt_broadcasts", False):
                    named = {name: _corrupted(t) for name, t in named.items()}
                elif corrupt:
                    named = {name: _corrupted(t) if name in corrupt else t for name, t in named.items()}
                self.engine.apply_weights(named, replace=False)
            except WeightError as exc:
                return weights_reply(False, str(exc))
            return self._finish_update(data, "Succeeded to update parameter online.")

        return await self.scheduler.update_weights(receive)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/begin_weight_update {"selector"}``; 404 in 0.5.15."""
        if not self.sessions:
            raise web.HTTPNotFound()
        data = await read_json_body(request)
        selector = data.get("selector", "all")
        if selector not in SELECTORS:
            return validation_error(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")

        async def begin() -> web.Response:
            if self.scheduler.weight_session is not None:
                return weights_reply(False, SESSION_OPEN)
            self.scheduler.weight_session = selector
            return weights_reply(True, "Success")

        return await self._run_to_the_end(self.scheduler.update_weights(begin))

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/end_weight_update {}``; 404 in 0.5.15."""
        if not self.sessions:
            raise web.HTTPNotFound()
        await read_json_body(request)

        async def end() -> web.Response:
            if self.scheduler.weight_session is None:
                return weights_reply(False, NO_SESSION)
            self.scheduler.weight_session = None
            return weights_reply(True, "Success")

        return await self._run_to_the_end(self.scheduler.update_weights(end))

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name {name, truncate_size}``: the parameter's first ``truncate_size``
        rows (first dimension) as nested lists of floats, for the model classes that implement it; else,
        or for a name the engine lacks, 400 ``{"error": {"message": "Get parameter by name failed"}}``."""
        data = await read_json_body(request) if request.method == "POST" else dict(request.query)
        name = data.get("name")
        if not isinstance(name, str):
            return validation_error("name: Field required")
        try:
            size = int(data.get("truncate_size", 100))
        except (TypeError, ValueError):
            return validation_error("truncate_size: Input should be a valid integer")
        architectures = getattr(self.engine, "architectures", None) or [""]
        if architectures[0] not in self.engine.sglang.get_weights_architectures:
            return json_response(GET_WEIGHTS_FAILED, status=400)
        tensor = self.engine.weights.get(name)
        if tensor is None:
            return json_response(GET_WEIGHTS_FAILED, status=400)
        return json_response(leading_rows(tensor, size))

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's ``/weights_checker`` (GET or POST, body optional): see :mod:`agent.sim.weight_checker`."""
        data = await read_optional_json_body(request)
        if self.engine.sglang.checker_roles:
            skip = data.get("skip_tensor_list")
            if skip is not None and not (isinstance(skip, list) and all(isinstance(x, str) for x in skip)):
                return validation_error("skip_tensor_list: Input should be a valid list of strings")
            if data.get("selector", "all") not in SELECTORS:
                return validation_error("selector: Input should be 'target', 'draft' or 'all'")
        if not isinstance(data.get("action", "checksum"), str):
            return validation_error("action: Input should be a valid string")
        success, message, extra = await self.checker.handle(data)
        return json_response({"success": success, "message": message, **extra}, 200 if success else 400)

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
    router.add_post("/begin_weight_update", h.begin_weight_update)
    router.add_post("/end_weight_update", h.end_weight_update)
    router.add_get("/weights_checker", h.weights_checker)
    router.add_post("/weights_checker", h.weights_checker)


def _corrupted(tensor):
    """``tensor`` with its first element changed (``--corrupt-broadcasts``)."""
    out = tensor.clone()
    flat = out.view(-1)
    if flat.numel():
        flat[0] = flat[0] + 1
    return out
