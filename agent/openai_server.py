"""The agent's OpenAI-compatible endpoint: one port, one route prefix per running sample.

A generate function gets ``engine.openai_base_url`` (``http://HOST:PORT/v1/s/<token>``) and
``engine.openai_api_key``; with them an ``openai.OpenAI`` / ``AsyncOpenAI`` client calls
``POST /chat/completions``, ``POST /completions`` and ``GET /models`` (``/models/<id>``) of that
sample. The I/O shell: what a call means is agent/openai_requests.py (the wire format) and
agent/openai_session.py (rendering, prefix reuse, the recording); the generation runs through
the sample's engine handle (agent/custom_rollout.py), so weight updates, retries and aborts act
on it as on ``engine.generate``.

Invariants:

- A session exists exactly while its sample's function runs (:meth:`OpenAIServer.open` when it is
  called, :meth:`OpenAIServer.end` when it returns, raises or is cancelled). After that its token
  answers 404 naming why it ended; an unknown token 404; a wrong key 401; a bad request 400 with
  ``error.message`` (OpenAI's shapes, so the client raises ``NotFoundError``,
  ``AuthenticationError``, ``BadRequestError``, none of which it retries).
- Ending a session cancels its calls in flight (their generations are cancelled on the engine by
  closing their connections, as for a cancelled function) and answers them 404.
- A session's calls run one at a time (one conversation per sample): a second call waits for the
  first, then must extend what it recorded.
- A generation that fails the sample (a restart, an engine error) ends it through ``fail``, which
  the sample's owner (custom_rollout ``_sample``) waits on: the harness is cancelled, never left
  to decide.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from agent import openai_requests as wire
from agent.openai_session import ChatError, Conversation
from common.generation import Generation

log = logging.getLogger("rollfleet.agent")

ENDED_REMEMBERED = 4096
"""Ended tokens whose 404 still says why they ended (older ones are just unknown)."""
MODEL = "rollfleet"
"""The model id ``GET /models`` lists (any ``model`` a request names is served by the sample's engine)."""


class SessionEnded(Exception):
    """The sample's session ended while a call ran: the call answers 404 with the reason."""


class SampleSession:
    """One sample's endpoint: its credentials, its conversation, its calls in flight."""

    def __init__(self, server: OpenAIServer, conversation: Conversation,
                 generate: Callable[[list[int], dict], Awaitable[Generation]]):  # fmt: skip
        self.token = secrets.token_urlsafe(16)
        self.api_key = "rf-" + secrets.token_urlsafe(24)
        self.conversation = conversation
        self._generate = generate
        self._server = server
        self.lock = asyncio.Lock()
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls: set[asyncio.Task] = set()
        self.ended: str | None = None

    @property
    def base_url(self) -> str:
        return f"{self._server.url}/v1/s/{self.token}"

    def fail(self, exc: BaseException) -> None:
        """The sample cannot go on (``exc``: a restart or the prompt's failure): its owner acts on it."""
        if not self.failed.done():
            self.failed.set_result(exc)

    async def generate(self, input_ids: list[int], params: dict) -> Generation:
        """One generation through the sample's handle, cancelled if the session ends meanwhile."""
        if self.ended is not None:
            raise SessionEnded(self.ended)
        call = asyncio.ensure_future(self._generate(input_ids, params))
        self._calls.add(call)
        try:
            await asyncio.wait({call})
        finally:
            if not call.done():
                call.cancel()  # the request handler itself was cancelled
            self._calls.discard(call)
        if call.cancelled():
            raise SessionEnded(self.ended or "the call was cancelled")
        return call.result()

    def end(self, why: str) -> None:
        self.ended = why
        for call in list(self._calls):
            call.cancel()


class OpenAIServer:
    """The aiohttp server; ``open``/``end`` sessions, ``start``/``close`` the port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.url = ""
        self.sessions: dict[str, SampleSession] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._runner: web.AppRunner | None = None

    def open(self, conversation: Conversation, generate) -> SampleSession:
        if not self.url:
            raise RuntimeError("the OpenAI endpoint is not started")
        session = SampleSession(self, conversation, generate)
        self.sessions[session.token] = session
        return session

    def end(self, session: SampleSession, why: str) -> None:
        """The sample's function is over: its token is refused from now on, its calls in flight cancelled."""
        self.sessions.pop(session.token, None)
        session.end(why)
        self._ended[session.token] = why
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    async def start(self) -> str:
        app = web.Application(middlewares=[_json_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/s/{token}/chat/completions", self._chat)
        app.router.add_post("/v1/s/{token}/completions", self._completions)
        app.router.add_get("/v1/s/{token}/models", self._models)
        app.router.add_get("/v1/s/{token}/models/{model}", self._model)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            self.end(session, "the agent is stopping")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ routes

    def _session(self, request: web.Request) -> SampleSession:
        token = request.match_info["token"]
        session = self.sessions.get(token)
        if session is None:
            why = self._ended.get(token)
            message = f"this sample's endpoint has ended: {why}" if why else "no running sample has this endpoint"
            raise _error(404, message, "not_found_error")
        auth = request.headers.get("Authorization", "")
        if not secrets.compare_digest(auth.encode(), f"Bearer {session.api_key}".encode()):
            raise _error(401, "wrong API key for this sample's endpoint (use engine.openai_api_key)",
                         "authentication_error", code="invalid_api_key")  # fmt: skip
        return session

    async def _json(self, request: web.Request):
        try:
            return await request.json()
        except ValueError:
            raise _error(400, "the request body is not valid JSON") from None

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [_model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._session(request)
        if request.match_info["model"] != MODEL:
            raise _error(404, f"model {request.match_info['model']!r} does not exist; this endpoint serves {MODEL!r}",
                         code="model_not_found")  # fmt: skip
        return web.json_response(_model_card())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._json(request)
        try:
            req = wire.chat_request(body)
            async with session.lock:
                conv = session.conversation
                prepared = conv.prepare_chat(req.messages, req.tools)
                gen = await self._run(session, prepared.input_ids, req)
                reply = conv.record_chat(prepared, gen, req.tools, req.parse_tools)
        except ChatError as exc:
            raise _error(400, str(exc), param=exc.param) from None
        rid = f"chatcmpl-{session.token[:8]}-{conv.calls}"
        calls = wire.openai_tool_calls(reply["tool_calls"], f"{session.token[:8]}_{conv.calls}")
        message = {"role": "assistant", "content": reply["content"]}
        if calls:
            message["tool_calls"] = calls
        reason = wire.finish_reason(gen.finish_reason, calls)
        decode = conv.renderer.decode
        lps = wire.token_logprobs(gen.tokens, gen.logprobs, decode) if req.logprobs else None
        use = wire.usage(len(prepared.input_ids), len(gen.tokens))
        created, model = int(time.time()), body.get("model") or MODEL
        if not req.stream:
            return web.json_response(wire.chat_completion(rid, created, model, message, reason, lps, use))
        chunks = wire.chat_chunks(rid, created, model, message, reason, lps, use if req.include_usage else None)
        return await _sse(request, chunks)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._json(request)
        try:
            req = wire.completion_request(body)
            async with session.lock:
                conv = session.conversation
                prepared = conv.prepare_completion(req.prompt)
                gen = await self._run(session, prepared.input_ids, req)
                conv.record_completion(prepared, gen)
        except ChatError as exc:
            raise _error(400, str(exc), param=exc.param) from None
        rid = f"cmpl-{session.token[:8]}-{conv.calls}"
        reason = wire.finish_reason(gen.finish_reason, [])
        lps = wire.token_logprobs(gen.tokens, gen.logprobs, conv.renderer.decode) if req.logprobs else None
        use = wire.usage(len(prepared.input_ids), len(gen.tokens))
        created, model = int(time.time()), body.get("model") or MODEL
        if not req.stream:
            return web.json_response(wire.text_completion(rid, created, model, gen.text, reason, lps, use))
        chunks = [wire.text_completion(rid, created, model, gen.text, reason, lps, None)]
        if req.include_usage:
            chunks.append({**wire.text_completion(rid, created, model, "", None, None, use), "choices": []})
        return await _sse(request, chunks)

    async def _run(self, session: SampleSession, input_ids: list[int], req: wire.Request) -> Generation:
        left = session.conversation.left
        budget = left if req.max_tokens is None else min(req.max_tokens, left)
        if budget <= 0:  # the sample's max_new_tokens is spent: the turn ends at once, as at the length limit
            return Generation(tokens=[], logprobs=[], text="", finish_reason="length")
        try:
            return await session.generate(input_ids, {**req.params, "max_new_tokens": budget})
        except SessionEnded as exc:
            raise _error(404, f"this sample's endpoint has ended: {exc}", "not_found_error") from None


def _model_card() -> dict:
    return {"id": MODEL, "object": "model", "created": 0, "owned_by": "rollfleet"}


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 401: web.HTTPUnauthorized, 404: web.HTTPNotFound}[status]
    body = json.dumps(wire.error_body(message, kind, param, code))
    return cls(text=body, content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own 404/405 (a path or method not served) in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json":
            raise
        message = f"{request.method} {request.path} is not served (chat/completions, completions, models)"
        return web.json_response(wire.error_body(message), status=exc.status)


async def _sse(request: web.Request, chunks) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
