"""SGLang's API keys (``--api-key``, ``--admin-api-key``), as its ``utils/auth.py`` decides.

Routes have a level. The control routes (weights, sessions, checker, pause, continue, abort,
flush) are ``ADMIN_OPTIONAL``: with an admin key they need it (the plain key is not accepted),
else with a plain key they need that one. Every other route, and a path no route matches, is
``NORMAL``: with a plain key it needs that key (an admin key does not open it), else it is open.
Always open: ``OPTIONS`` and the paths starting with ``/health``, ``/metrics`` and (0.5.23)
``/ready``. A request that fails is answered 401 ``{"error": "Unauthorized"}``. The key goes in
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from aiohttp import web

from agent.sim.replies import json_response

ADMIN_OPTIONAL = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/get_weights_by_name",
        "/weights_checker",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    }
)
"""The routes SGLang marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` that the engines serve."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _bearer_matches(header: str | None, key: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], key)


def allowed(
    method: str, path: str, header: str | None, api_key: str | None, admin_api_key: str | None, open_prefixes
) -> bool:
    """SGLang's ``decide_request_auth`` for the routes the engines serve."""
    if method == "OPTIONS" or path.startswith(tuple(open_prefixes)):
        return True
    if path in ADMIN_OPTIONAL:
        if admin_api_key:
            return _bearer_matches(header, admin_api_key)
        return not api_key or _bearer_matches(header, api_key)
    return not api_key or _bearer_matches(header, api_key)


def auth_middleware(api_key: str | None, admin_api_key: str | None, open_prefixes: tuple[str, ...]):
    """An aiohttp middleware enforcing the keys (install it only when one is set, as SGLang does)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        if not allowed(request.method, request.path, header, api_key, admin_api_key, open_prefixes):
            return json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    return middleware
