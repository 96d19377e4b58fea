"""HTTP client for SGLang's native API (the same code path for sim and real engines).

Only what the agent needs: ``/generate`` (one request per sample, n=1, so a
single sample can be aborted by its rid), ``/tokenize`` (when no local tokenizer loads), ``/abort_request``, pause and
continue, ``/flush_cache``, the weight-update endpoints (``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``), ``/model_info`` and
the health probes ``/health_generate`` and ``/health``. Control calls always send a
JSON object body (SGLang answers an empty one with 400).

One client, hence one aiohttp session and connection pool, serves an agent's
request path and its engine supervisor's health probes.  The session is made
on first use, so a client can be built before the event loop runs.

SGLang 0.5.23 differs from older servers in ways the agent detects per engine: distributed updates run
inside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``; a 404 on begin means
an older server that needs none); ``/get_weights_by_name`` exists only for some model classes, and
``/weights_checker`` gives per-tensor checksums for any model. Pooled connections are dropped after
``KEEPALIVE`` seconds, under the 5 s after which SGLang's server (uvicorn) closes an idle one, and the
control calls that are safe to repeat are sent once more when a pooled connection turns out closed.

Errors are split the way the caller must react:
- ``EngineBusy`` (an ``EngineUnavailable``): 503 with SGLang's "The request
  queue is full." — backpressure from ``--max-queued-requests``; the engine is
  healthy, the request is tried again later on it.
- ``EngineUnavailable``: connection refused/reset, other 5xx, timeouts — the
  engine is (maybe) dead; the caller requeues the group and tells the supervisor.
- ``EngineRejected`` (an ``EngineError``): a 4xx — the request itself is wrong;
  retrying elsewhere will not help (the caller gives up after a few tries).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from common.errors import Closed, EngineBusy, EngineError, EngineRejected, EngineUnavailable

KEEPALIVE = 4.0
"""Seconds an idle pooled connection is kept: below SGLang's ``SGLANG_TIMEOUT_KEEP_ALIVE`` (5 s), so the
agent never sends on a connection the server is closing."""

REPEATABLE = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weight_version",
        "/update_weights_from_disk",
        "/get_weights_by_name",
        "/weights_checker",
        "/tokenize",
    }
)
"""Control calls that may be sent again when a pooled connection was closed under them (the same call twice
has the effect of one); ``/generate``, group calls, buckets and session calls are never repeated."""

QUEUE_FULL = b"The request queue is full"
"""SGLang's 503 message when ``--max-queued-requests`` is reached (backpressure, not an engine failure)."""


class EngineClient:
    def __init__(self, *, limit: int = 0, request_timeout: float | None = None, api_key: str = ""):
        self._limit = limit
        # SGLang's ``--api-key``/``--admin-api-key``: every route but /health*, /ready and /metrics needs it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._request_timeout = request_timeout
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self._calls: dict[str, set[asyncio.Task]] = {}  # /generate calls in flight, by engine URL
        self._dropped: dict[asyncio.Task, str] = {}  # calls ended by drop(): why

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            if self._closed:
                raise Closed("the engine client was closed")
            # limit=0: the agent's pool bounds concurrency; aiohttp must not add a second queue.
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=KEEPALIVE)
            self._http = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout, connect=10),
                headers=self._headers,
                json_serialize=lambda o: orjson.dumps(o).decode(),
            )
        return self._http

    async def close(self) -> None:
        """Close the session; idempotent.  Later requests raise Closed."""
        self._closed = True
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    async def _post(self, url: str, path: str, body: dict, *, timeout: float | None = None) -> dict | list | None:
        try:
            return await self._post_once(url, path, body, timeout=timeout)
        except EngineUnavailable as exc:
            if path not in REPEATABLE or not exc.__cause__ or not isinstance(exc.__cause__, _STALE):
                raise
            return await self._post_once(url, path, body, timeout=timeout)  # a fresh connection, once

    async def _post_once(self, url: str, path: str, body: dict, *, timeout: float | None = None) -> dict | list | None:
        try:
            async with self._session.post(
                url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout) if timeout else None,
            ) as resp:
                raw = await resp.read()
                if resp.status == 503 and QUEUE_FULL in raw:
                    raise EngineBusy(f"{url}{path}: HTTP 503: the request queue is full")
                if resp.status >= 500:
                    raise EngineUnavailable(f"{url}{path}: HTTP {resp.status}: {raw[:200]!r}")
                if resp.status >= 400:
                    text = raw[:500].decode(errors="replace") + _key_hint(resp.status, self._headers)
                    raise EngineRejected(f"{url}{path}: HTTP {resp.status}: {text}", status=resp.status)
                if not raw:
                    return None
                try:
                    return orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return {"text": raw.decode(errors="replace")}
        except _STALE as exc:
            raise EngineUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from exc
        except (TimeoutError, aiohttp.ClientConnectionError, ConnectionError) as exc:
            raise EngineUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from None

    async def generate(self, url: str, input_ids: list[int], sampling_params: dict, rid: str) -> dict:
        """One sample's ``/generate``. EngineUnavailable if :meth:`drop` ends it (its engine went down)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
        task = asyncio.current_task()
        calls = self._calls.setdefault(url, set())
        calls.add(task)
        try:
            out = await self._post(url, "/generate", body)
        except asyncio.CancelledError:
            why = self._dropped.pop(task, None)
            if why is None or task.uncancel() > 0:
                raise  # cancelled by its owner (too): that wins
            raise EngineUnavailable(f"{url}/generate: {why}") from None
        finally:
            calls.discard(task)
            if not calls:
                self._calls.pop(url, None)
        if not isinstance(out, dict) or "meta_info" not in out:
            raise EngineError(f"{url}/generate: unexpected response shape: {str(out)[:200]}")
        return out

    def drop(self, url: str, why: str) -> int:
        """End every ``/generate`` in flight to ``url`` with EngineUnavailable(``why``): its engine is down or hung,
        and a call to a hung engine would wait forever (no answer, no reset). The number of calls ended."""
        calls = self._calls.get(url, ())
        for task in calls:
            if task not in self._dropped:
                self._dropped[task] = why
                task.cancel()
        return len(calls)

    async def tokenize(self, url: str, prompt) -> list[int]:
        """SGLang's ``POST /tokenize``: a string as ``prompt``, chat messages as ``messages`` (with the
        generation prompt added, as a chat template does); returns the ``tokens``."""
        if isinstance(prompt, list):
            body = {"messages": prompt, "add_generation_prompt": True}
        else:
            body = {"prompt": prompt}
        out = await self._post(url, "/tokenize", body, timeout=60)
        tokens = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineError(f"{url}/tokenize: unexpected response shape: {str(out)[:200]}")
        return tokens

    async def abort(self, url: str, rid: str = "", *, abort_all: bool = False) -> None:
        await self._post(url, "/abort_request", {"abort_all": True} if abort_all else {"rid": rid}, timeout=30)

    async def pause_generation(self, url: str, mode: str = "abort") -> None:
        """``POST /pause_generation``; mode ``abort`` returns once every in-flight generate came back."""
        await self._post(url, "/pause_generation", {"mode": mode}, timeout=600)

    async def continue_generation(self, url: str) -> None:
        await self._post(url, "/continue_generation", {}, timeout=600)

    async def flush_cache(self, url: str, *, deadline: float = 60.0, interval: float = 0.5) -> None:
        """``POST /flush_cache`` until it answers 200 (it refuses while requests run), within ``deadline`` s."""
        end = time.monotonic() + deadline
        while True:
            try:
                await self._post(url, "/flush_cache", {}, timeout=max(1.0, end - time.monotonic()))
                return
            except EngineError as exc:
                if time.monotonic() + interval > end:
                    raise EngineError(f"{url}/flush_cache: not flushed within {deadline:g}s: {exc}") from None
            await asyncio.sleep(interval)

    async def update_weights_from_disk(
        self,
        url: str,
        model_path: str,
        weight_version: str | None,
        *,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict:
        """``load_format`` None: the server's launch format (SGLang's default), which refuses every load
        when the engine was launched with ``--load-format dummy``."""
        body = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._weights_call(url, "/update_weights_from_disk", body)

    async def init_weights_update_group(
        self,
        url: str,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict:
        """Join the trainer's process group; blocks until every rank (the trainer's rank 0 too) joined."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights_call(url, "/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        url: str,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list],
        group_name: str,
        flush_cache: bool = False,
    ) -> dict:
        """Receive one bucket by broadcast from rank 0; returns once the engine loaded it."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        return await self._weights_call(url, "/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, url: str, group_name: str) -> dict:
        return await self._weights_call(url, "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, url: str, new_version: str) -> dict:
        body = {"new_version": new_version, "abort_all_requests": False}
        return await self._weights_call(url, "/update_weight_version", body)

    async def begin_weight_update(self, url: str) -> bool:
        """Open a weight-update session (SGLang 0.5.23: distributed and tensor updates run only inside
        one); False when the engine has no such endpoint (404: an older server that needs none).
        EngineRejected when it refuses, e.g. "a weight-update session is already open"."""
        return await self._session_call(url, "/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self, url: str) -> bool:
        """Close the weight-update session (it re-packs the weights; read-backs come after it); False on 404.
        EngineRejected when it refuses, e.g. "no weight-update session is open"."""
        return await self._session_call(url, "/end_weight_update", {})

    async def _session_call(self, url: str, path: str, body: dict) -> bool:
        try:
            await self._weights_call(url, path, body)
        except EngineRejected as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def weights_checker(self, url: str, action: str = "checksum") -> dict:
        """SGLang's ``/weights_checker``: for ``checksum``, ``{"ranks": [{"checksums": {name: hex}, "parallelism_info":
        {...}}, ...], "per_engine_checksum"}``; EngineRejected (status 404 on servers without it) otherwise."""
        return await self._weights_call(url, "/weights_checker", {"action": action})

    async def server_info(self, url: str) -> dict:
        """``GET /server_info`` (``/get_server_info`` on older servers): the server's launch arguments and more."""
        for path in ("/server_info", "/get_server_info"):
            try:
                async with self._session.get(url + path, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    raw = await resp.read()
                    if resp.status == 404 and path == "/server_info":
                        continue
                    if resp.status >= 400:
                        raise EngineRejected(f"{url}{path}: HTTP {resp.status}: {raw[:200]!r}", status=resp.status)
                    out = orjson.loads(raw)
            except (TimeoutError, aiohttp.ClientConnectionError, orjson.JSONDecodeError) as exc:
                raise EngineUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from None
            if not isinstance(out, dict):
                raise EngineError(f"{url}{path}: unexpected response shape: {str(out)[:200]}")
            return out
        raise EngineRejected(f"{url}: neither /server_info nor /get_server_info exists", status=404)

    async def get_weights_by_name(self, url: str, name: str, truncate_size: int) -> list | float:
        """SGLang's ``/get_weights_by_name``: the first ``truncate_size`` rows of parameter ``name``."""
        try:
            body = {"name": name, "truncate_size": truncate_size}
            return await self._post(url, "/get_weights_by_name", body, timeout=60)
        except EngineRejected as exc:
            message = f"{url}/get_weights_by_name {name!r} failed: {_message(str(exc))}"
            raise EngineRejected(message, status=exc.status) from None
        except EngineError as exc:
            raise type(exc)(f"{url}/get_weights_by_name {name!r} failed: {_message(str(exc))}") from None

    async def _weights_call(self, url: str, path: str, body: dict) -> dict:
        """One weight-update endpoint: ``{"success", "message"}``; EngineError with SGLang's message otherwise
        (``EngineRejected`` for a 4xx answer: the engine refused, e.g. a group that does not exist)."""
        try:
            out = await self._post(url, path, body, timeout=3600)
        except EngineRejected as exc:
            raise EngineRejected(f"{url}{path} failed: {_message(str(exc))}", status=exc.status) from None
        except EngineError as exc:
            raise EngineError(f"{url}{path} failed: {_message(str(exc))}") from None
        if not isinstance(out, dict) or not out.get("success", False):
            message = out.get("message") if isinstance(out, dict) else out
            raise EngineError(f"{url}{path} failed: {message}")
        return out

    async def health(self, url: str, *, timeout: float, generate: bool = True) -> None:
        """One health probe: ``GET /health_generate`` (``generate=False``: ``/health``).

        Returns on HTTP 200; otherwise raises EngineUnavailable saying what
        happened (the status, no answer within ``timeout`` seconds, or the
        connection error).
        """
        path = "/health_generate" if generate else "/health"
        try:
            async with self._session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                if resp.status != 200:
                    raise EngineUnavailable(f"HTTP {resp.status} from {url}{path}")
        except TimeoutError:
            raise EngineUnavailable(f"no answer from {url}{path} within {timeout:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from None

    async def model_info(self, url: str) -> dict:
        try:
            # ``digest=0``: the sim and hf engines skip their weight digest (a hash of every tensor), which
            # the agent never reads; SGLang ignores the parameter.
            async with self._session.get(url + "/model_info?digest=0", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status == 404:
                    async with self._session.get(url + "/get_model_info") as old:
                        return orjson.loads(await old.read())
                if resp.status in (401, 403):
                    raise EngineRejected(
                        f"{url}/model_info: HTTP {resp.status}{_key_hint(resp.status, self._headers)}",
                        status=resp.status,
                    )
                if resp.status != 200:
                    raise EngineUnavailable(f"{url}/model_info: HTTP {resp.status}")
                return orjson.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise EngineUnavailable(f"{url}/model_info: {type(exc).__name__}: {exc}") from None


_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""What sending on a pooled connection the server has just closed raises: worth one more try."""


def _key_hint(status: int, headers: dict) -> str:
    """What to do about a refused key: SGLang answers 401 to a call without the server's ``--api-key``."""
    if status not in (401, 403):
        return ""
    if headers:
        return " (the engine refused the API key given with --engine-api-key)"
    return " (the engine wants an API key: give it with --engine-api-key or ROLLFLEET_ENGINE_API_KEY)"


def parse_version(label) -> int | None:
    """An engine's ``weight_version`` label as the fleet's integer version; None if it is not one."""
    if label is None or label == "default":
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        return None


def _message(text: str) -> str:
    """SGLang's own message out of an error text ``url: HTTP n: {json}``, else the text."""
    _, _, body = text.partition(": HTTP ")
    _, _, raw = body.partition(": ")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return text
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        if "message" in data:
            return str(data["message"])
    return text


def sample_status(finish_reason: dict | None) -> str:
    kind = (finish_reason or {}).get("type")
    if kind == "length":
        return "truncated"
    if kind == "abort":
        return "aborted"
    return "completed"
