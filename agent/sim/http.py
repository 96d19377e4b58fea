"""The aiohttp application: SGLang's native HTTP endpoints over a :class:`SimEngine`.

Endpoints: ``/generate`` (POST, PUT), ``/abort_request``, ``/health``, ``/health_generate``,
``/ready``, ``/model_info`` (``/get_model_info``), ``/server_info`` (``/get_server_info``),
``/v1/loads``, ``/flush_cache`` (GET, POST, ``?timeout=``), ``/pause_generation``,
``/continue_generation``, ``/tokenize`` and ``/detokenize`` (also under ``/v1/``), and the weight
endpoints of :mod:`agent.sim.weight_routes`
(``/update_weights_from_disk``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/update_weight_version``, ``/begin_weight_update``, ``/end_weight_update``,
``/get_weights_by_name``, ``/weights_checker``). Bodies and error shapes: :mod:`agent.sim.replies`.

The SGLang release imitated is the engine's ``--sglang-version`` (:mod:`agent.sim.versions`):
0.5.15 has no ``/ready``, ``/begin_weight_update`` or ``/end_weight_update`` (404
``{"detail": "Not Found"}``, as for any unknown route). ``--api-key``/``--admin-api-key`` are
enforced by :mod:`agent.sim.auth` (401 ``{"error": "Unauthorized"}``).

Pause and continue (SGLang's ``tokenizer_manager``): an ``abort``-mode ``/pause_generation``
aborts everything the scheduler holds and re-checks every 1.0 s until no request holds the
reader lock; ``/continue_generation`` waits for a pause in progress, then unpauses. Both run to the
end even when their client goes away (SGLang's handlers are not cancelled by a disconnect), so a
client that gives up on a pause and then sends continue leaves the engine unpaused once both are
done. Serve the app with :data:`RUNNER_OPTIONS` (as :func:`agent.sim.cli.serve` does): a client
disconnect cancels its ``/generate`` at once, and an idle keep-alive connection is closed after 5 s
(uvicorn's ``timeout_keep_alive`` in SGLang).

``/tokenize`` (SGLang 0.5.23): ``messages`` with ``add_generation_prompt`` (true or false) on an
engine started with a built-in ``--chat-template`` name is refused with 400 ``{"object": "error",
"message": "add_generation_prompt is supported only with a Jinja chat template.", "type":
"BadRequestError", "param": null, "code": 400}``.

Streams (``"stream": true``) send cumulative SSE chunks every ``stream_interval`` tokens and end
with ``data: [DONE]``; a request error inside a stream is an error chunk, HTTP 200. Stop strings
are not held back from intermediate chunks. A client disconnect aborts the call's samples.
While paused, ``/health`` blocks up to ``--health-timeout`` and then answers 503 (SGLang's
pitfall: its probe goes through the pause gate). ``/flush_cache`` succeeds only when nothing
runs or waits (while paused, waiting requests do not count); a failed flush explains itself in
the 400 text.

Non-SGLang fault hooks: ``POST /rollfleet/crash`` replies 200
``{"status":"crashing","exit_code":17}`` and then exits the process with ``os._exit(17)``
(in-flight requests see dropped connections); ``--crash-after-requests N`` exits with code 17
right after the response to the N-th successful ``/generate`` call has been sent.

``--max-queued-requests N`` is SGLang's: a ``/generate`` whose samples would leave more than N
waiting for a slot is refused with 503 ``The request queue is full.`` (backpressure; the engine
stays healthy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson
from aiohttp import web

from agent.sim import info
from agent.sim.auth import auth_middleware
from agent.sim.config import CRASH_EXIT_CODE
from agent.sim.engine import SimEngine
from agent.sim.output import response_object
from agent.sim.params import RequestError, SchemaError
from agent.sim.replies import http_error, json_response, read_json_body, request_error, schema_error
from agent.sim.sample import Sample
from agent.sim.versions import KEEPALIVE_TIMEOUT_S
from agent.sim.weight_routes import add_weight_routes
from common.tokenizer import ByteTokenizer

__all__ = ["ENGINE_KEY", "RUNNER_OPTIONS", "make_app"]

ENGINE_KEY = web.AppKey("rollfleet_sim_engine", SimEngine)
_BYTES = ByteTokenizer()  # the sim's vocabulary (agent/sim/output.py decodes with it too)
RUNNER_OPTIONS = {"handler_cancellation": True, "access_log": None, "keepalive_timeout": KEEPALIVE_TIMEOUT_S}
"""``web.AppRunner`` options an engine is served with: disconnects cancel handlers (a ``/generate`` is
aborted at once), idle keep-alive connections close after 5 s, as SGLang's uvicorn closes them."""
JINJA_ONLY = "add_generation_prompt is supported only with a Jinja chat template."


@web.middleware
async def _not_found_as_fastapi(request: web.Request, handler) -> web.StreamResponse:
    """A route that does not exist answers FastAPI's 404 ``{"detail": "Not Found"}``."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)


def _client_gone(request: web.Request) -> Callable[[], bool]:
    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


def _event_stream() -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
    resp.content_type = "text/event-stream"
    return resp


class _Handlers:
    """Request handlers of one engine."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self.scheduler = engine.scheduler
        self._to_the_end: set[asyncio.Task] = set()

    async def _run_to_the_end(self, coro) -> None:
        """Await ``coro`` in its own task, which a client that goes away does not cancel."""
        task = asyncio.ensure_future(coro)
        self._to_the_end.add(task)
        task.add_done_callback(self._to_the_end.discard)
        await asyncio.shield(task)

    async def _drive_all(self, samples: list[Sample]) -> None:
        try:
            if len(samples) == 1:
                await self.scheduler.drive(samples[0])
            else:
                await asyncio.gather(*(self.scheduler.drive(s) for s in samples))
        finally:
            for s in samples:
                self.scheduler.finish(s)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        if not engine.is_ready():
            return http_error(503, f"The server is not ready (status: {engine.status}).")
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return schema_error(f"Invalid JSON body: {exc}")
        if not isinstance(data, dict):
            return schema_error("The request body must be a JSON object.")
        stream = data.get("stream") is True
        try:
            samples, multi = engine.new_samples(data)
        except SchemaError as exc:
            return schema_error(str(exc))
        except RequestError as exc:
            if stream:
                return await self._stream_error(request, str(exc))
            return request_error(str(exc))
        max_queued = getattr(engine, "max_queued", None)  # the hf engine has no such flag
        if max_queued is not None and self.scheduler.queue_full(len(samples), max_queued):
            for s in samples:
                self.scheduler.finish(s)  # gives the rids back
            return http_error(503, "The request queue is full.")

        if stream:
            resp = await self._stream(request, samples, multi)
            if resp is None:
                return web.Response(status=200)
        else:
            gone = _client_gone(request)
            for s in samples:
                s.client_gone = gone
            await self._drive_all(samples)
            version = self.scheduler.weight_version
            objs = [response_object(s, s.position, True, version) for s in samples]
            resp = web.Response(body=orjson.dumps(objs if multi else objs[0]), content_type="application/json")
            if engine.crash_after:
                await resp.prepare(request)
                await resp.write_eof()
        engine.ok_generate_calls += 1
        if engine.crash_after and engine.ok_generate_calls >= engine.crash_after:
            asyncio.get_running_loop().call_soon(engine.crash, f"--crash-after-requests {engine.crash_after}")
        return resp

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        resp = _event_stream()
        await resp.prepare(request)
        err = {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}
        try:
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def _stream(self, request: web.Request, samples: list[Sample], multi: bool) -> web.StreamResponse | None:
        """Stream the samples' chunks; None if the client left before the response started."""
        resp = _event_stream()
        dead = False
        write_lock = asyncio.Lock() if len(samples) > 1 else None  # chunks of a batch must not interleave

        def client_left() -> None:
            nonlocal dead
            dead = True
            self.scheduler.abort_samples(samples)

        async def emit(sample: Sample, k: int, final: bool) -> None:
            if dead:
                return
            obj = response_object(sample, k, final, self.scheduler.weight_version, sample.index if multi else None)
            chunk = b"data: " + orjson.dumps(obj) + b"\n\n"
            try:
                if write_lock is None:
                    await resp.write(chunk)
                else:
                    async with write_lock:
                        await resp.write(chunk)
            except (ConnectionError, RuntimeError):
                client_left()

        gone = _client_gone(request)
        for s in samples:
            s.emit = emit
            s.client_gone = gone
        try:
            try:
                await resp.prepare(request)
            except (ConnectionError, RuntimeError):
                client_left()
            if len(samples) == 1:
                await self.scheduler.drive(samples[0])
            else:
                await asyncio.gather(*(self.scheduler.drive(s) for s in samples))
        finally:
            for s in samples:
                self.scheduler.finish(s)
        if dead:
            return resp if resp.prepared else None
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        rid = data.get("rid") or ""
        self.scheduler.abort(rid if isinstance(rid, str) else "", bool(data.get("abort_all")))
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_ready():
            return web.Response(status=503)
        if self.scheduler.paused:
            try:
                await asyncio.wait_for(self.scheduler.wait_unpaused(), self.engine.health_timeout)
            except TimeoutError:
                return web.Response(status=503)
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        if not self.engine.sglang.ready_route:
            raise web.HTTPNotFound()  # 0.5.23's
        return web.Response(status=200 if self.engine.is_ready() and not self.scheduler.paused else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(info.model_info(self.engine, digest=request.query.get("digest") != "0"))

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response(info.server_info(self.engine))

    async def loads(self, request: web.Request) -> web.Response:
        return json_response(info.loads_response(self.engine))

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout") or 0.0)
        except ValueError:
            return http_error(400, "timeout must be a number")
        scheduler = self.scheduler
        deadline = time.monotonic() + timeout
        while not scheduler.can_flush() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if scheduler.flush():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(
            status=400,
            text=f"Cache not flushed: {scheduler.num_running} running and {scheduler.num_waiting} waiting requests.\n",
        )

    async def pause(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        mode = data.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return http_error(400, f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
        await self._run_to_the_end(self.scheduler.pause(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json_body(request)
        await self._run_to_the_end(self.scheduler.continue_generation())
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang's ``/tokenize``: ``{prompt | messages}`` -> ``{tokens, count, max_model_len}`` (byte tokens here)."""
        data = await read_json_body(request)
        if self.engine.config.get("skip_tokenizer_init"):  # SGLang has no tokenizer to use then
            return http_error(400, "This server was started with --skip-tokenizer-init: it has no tokenizer.")
        if (
            self.engine.sglang.tokenize_needs_jinja
            and data.get("messages") is not None
            and data.get("add_generation_prompt") is not None
            and self.engine.chat_template_name is not None
        ):
            return json_response(
                {"object": "error", "message": JINJA_ONLY, "type": "BadRequestError", "param": None, "code": 400}, 400
            )
        prompt = data.get("messages") if data.get("messages") is not None else data.get("prompt")
        if prompt is None:
            return http_error(400, "Either 'prompt' or 'messages' must be given.")
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            tokens = [_BYTES.encode(p) for p in prompt]  # a batch of prompts
            count = [len(t) for t in tokens]
        elif isinstance(prompt, (str, list)):
            tokens = _BYTES.encode(prompt)
            count = len(tokens)
        else:
            return http_error(400, f"'prompt' must be a string or a list of strings, got {type(prompt).__name__}")
        return json_response({"tokens": tokens, "count": count, "max_model_len": self.engine.context_length})

    async def detokenize(self, request: web.Request) -> web.Response:
        data = await read_json_body(request)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return http_error(400, "'tokens' must be a list of integers")
        return json_response({"text": _BYTES.decode(tokens)})

    async def crash(self, request: web.Request) -> web.Response:
        resp = json_response({"status": "crashing", "exit_code": CRASH_EXIT_CODE})
        await resp.prepare(request)
        await resp.write_eof()
        asyncio.get_running_loop().call_soon(self.engine.crash, "POST /rollfleet/crash")
        return resp


def make_app(engine: SimEngine) -> web.Application:
    """The aiohttp application serving ``engine``.

    Run it with ``web.AppRunner(app, **RUNNER_OPTIONS)`` (as :func:`agent.sim.cli.serve` does) so a
    client disconnect cancels its request at once (without it the engine notices disconnects at its
    next chunk boundary) and idle keep-alive connections close after 5 s. Set ``engine.port`` to
    the bound port if ``/server_info`` should report it.
    """
    middlewares = [_not_found_as_fastapi]
    if engine.api_key or engine.admin_api_key:  # as SGLang, only then
        middlewares.insert(0, auth_middleware(engine.api_key, engine.admin_api_key, engine.sglang.open_prefixes))
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
    app[ENGINE_KEY] = engine
    h = _Handlers(engine)
    r = app.router
    r.add_post("/generate", h.generate)
    r.add_put("/generate", h.generate)
    r.add_post("/abort_request", h.abort)
    for path in ("/health", "/health_generate"):
        r.add_get(path, h.health)
    r.add_get("/ready", h.ready)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, h.model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, h.server_info)
    r.add_get("/v1/loads", h.loads)
    r.add_get("/flush_cache", h.flush_cache)
    r.add_post("/flush_cache", h.flush_cache)
    r.add_post("/pause_generation", h.pause)
    r.add_post("/continue_generation", h.continue_generation)
    for path in ("/tokenize", "/v1/tokenize"):
        r.add_post(path, h.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        r.add_post(path, h.detokenize)
    add_weight_routes(r, engine)
    r.add_post("/rollfleet/crash", h.crash)
    return app
