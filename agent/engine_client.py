"""HTTP client for SGLang's native API (the same code path for sim and real engines).

Only what the agent needs: ``/generate`` (one request per sample, n=1, so a
single sample can be aborted by its rid), ``/abort_request``, pause and
continue, ``/flush_cache``, ``/update_weights_from_disk``, ``/model_info`` and
the health probes ``/health_generate`` and ``/health``.

One client, hence one aiohttp session and connection pool, serves an agent's
request path and its engine supervisor's health probes.  The session is made
on first use, so a client can be built before the event loop runs.

Errors are split the way the caller must react:
- ``EngineUnavailable``: connection refused/reset, 5xx, timeouts — the engine
  is (maybe) dead; the caller requeues the group and tells the supervisor.
- ``EngineError``: a 4xx — the request itself is wrong; retrying elsewhere
  will not help.
"""

from __future__ import annotations

import aiohttp
import orjson

from common.errors import Closed, EngineError, EngineUnavailable


class EngineClient:
    def __init__(self, *, limit: int = 0, request_timeout: float | None = None):
        self._limit = limit
        self._request_timeout = request_timeout
        self._http: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            if self._closed:
                raise Closed("the engine client was closed")
            # limit=0: the agent's pool bounds concurrency; aiohttp must not add a second queue.
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=60)
            self._http = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout, connect=10),
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
            async with self._session.post(
                url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout) if timeout else None,
            ) as resp:
                raw = await resp.read()
                if resp.status >= 500:
                    raise EngineUnavailable(f"{url}{path}: HTTP {resp.status}: {raw[:200]!r}")
                if resp.status >= 400:
                    raise EngineError(f"{url}{path}: HTTP {resp.status}: {raw[:500].decode(errors='replace')}")
                if not raw:
                    return None
                try:
                    return orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return {"text": raw.decode(errors="replace")}
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError, ConnectionError) as exc:
            raise EngineUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from None

    async def generate(self, url: str, input_ids: list[int], sampling_params: dict, rid: str) -> dict:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
        out = await self._post(url, "/generate", body)
        if not isinstance(out, dict) or "meta_info" not in out:
            raise EngineError(f"{url}/generate: unexpected response shape: {str(out)[:200]}")
        return out

    async def abort(self, url: str, rid: str = "", *, abort_all: bool = False) -> None:
        await self._post(url, "/abort_request", {"abort_all": True} if abort_all else {"rid": rid}, timeout=30)

    async def pause(self, url: str, mode: str = "abort") -> None:
        await self._post(url, "/pause_generation", {"mode": mode}, timeout=600)

    async def resume(self, url: str) -> None:
        await self._post(url, "/continue_generation", {}, timeout=600)

    async def update_weights_from_disk(self, url: str, model_path: str, weight_version: str | None) -> dict:
        body = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        out = await self._post(url, "/update_weights_from_disk", body, timeout=3600)
        if not isinstance(out, dict) or not out.get("success", False):
            raise EngineError(f"{url}: weight update failed: {out}")
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
            async with self._session.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status == 404:
                    async with self._session.get(url + "/get_model_info") as old:
                        return orjson.loads(await old.read())
                if resp.status != 200:
                    raise EngineUnavailable(f"{url}/model_info: HTTP {resp.status}")
                return orjson.loads(await resp.read())
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise EngineUnavailable(f"{url}/model_info: {type(exc).__name__}: {exc}") from None


def sample_status(finish_reason: dict | None) -> str:
    kind = (finish_reason or {}).get("type")
    if kind == "length":
        return "truncated"
    if kind == "abort":
        return "aborted"
    return "completed"
