"""Request bodies and error replies of the sim's endpoints, in SGLang 0.5.23's shapes.

- A request that fails type validation (FastAPI's) is 400 ``{"object": "error", "message",
  "type": "Bad Request", "param": null, "code": 400}``; control endpoints need a JSON object body,
  so an empty or ``null`` body is such a 400 with "Field required" (``{}`` takes the defaults).
- A ``/generate`` body that fails the request schema is 400 ``{"error": "<message>"}``.
- A ``/generate`` request error (SGLang's ValueError) is 400 ``{"error": {"message": ...}}``.
- A raised HTTPException is ``{"object": "error", "message", "type", "param": null, "code"}``.
- Weight endpoints answer ``{"success": bool, "message": str}``, 400 when ``success`` is false.
- A route the release does not have is 404 ``{"detail": "Not Found"}`` (FastAPI's).
- Without the API key (``--api-key``/``--admin-api-key``): 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

_STATUS_NAMES = {400: "Bad Request", 404: "Not Found", 503: "Service Unavailable", 500: "Internal Server Error"}


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def http_error(status: int, message: str) -> web.Response:
    """SGLang's HTTPException body."""
    return json_response(
        {
            "object": "error",
            "message": message,
            "type": _STATUS_NAMES.get(status, str(status)),
            "param": None,
            "code": status,
        },
        status,
    )


def schema_error(message: str) -> web.Response:
    """The 400 of a ``/generate`` body that fails the request schema (0.5.23)."""
    return json_response({"error": message}, 400)


def request_error(message: str) -> web.Response:
    """The 400 of a ``/generate`` request the tokenizer manager refuses (a ValueError)."""
    return json_response({"error": {"message": message}}, 400)


def weights_reply(success: bool, message: str, **extra: Any) -> web.Response:
    return json_response({"success": success, "message": message, **extra}, 200 if success else 400)


def validation_error(message: str) -> web.Response:
    """FastAPI's 400 for a body field of the wrong type or value (SGLang's validation handler)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return json_response(body, 400)


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=orjson.dumps(
            {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        ).decode(),
        content_type="application/json",
    )


async def read_json_body(request: web.Request) -> dict:
    """The JSON object body of a control endpoint; raises a 400 for an empty, null or non-object body."""
    raw = await request.read()
    if not raw.strip():
        raise _bad_request("Field required: the request body must be a JSON object ({} takes the defaults).")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad_request(f"Invalid JSON body: {exc}") from exc
    if data is None:
        raise _bad_request("Field required: the request body must be a JSON object ({} takes the defaults).")
    if not isinstance(data, dict):
        raise _bad_request("The request body must be a JSON object.")
    return data


async def read_optional_json_body(request: web.Request) -> dict:
    """The JSON object body of a route whose body is optional (``/weights_checker``): empty or ``null`` is ``{}``."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad_request(f"Invalid JSON body: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _bad_request("The request body must be a JSON object.")
    return data
