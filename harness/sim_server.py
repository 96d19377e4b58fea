"""An in-process sim engine for tests that talk to one engine over real HTTP (no child process)."""

from __future__ import annotations

import contextlib

import aiohttp
from aiohttp import web

from agent.sim import SimEngine, make_app


@contextlib.asynccontextmanager
async def serve(**config):
    """A sim engine on 127.0.0.1, port 0, run as ``agent.sim`` runs it; yields it and a session to it."""
    engine = SimEngine(**config)
    runner = web.AppRunner(make_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine.port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{engine.port}") as session:
            yield engine, session
    finally:
        engine.shutdown()
        await runner.cleanup()
