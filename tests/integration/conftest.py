"""Engines for the SGLang-contract tests: the sim engine and the hf engine, in-process, over real HTTP.

``serve_engine(**config)`` is an async context manager yielding ``(engine, session)`` for the
engine kind of the ``engine_kind`` parameter; tests that take it run once per kind. Settings
that only the sim has (its output model and latencies) are dropped for the hf engine, whose
requests keep running by ``ignore_eos`` instead.
"""

from __future__ import annotations

import contextlib
import functools

import aiohttp
import pytest
from aiohttp import web

from agent.sim import make_app
from harness.sim_server import serve as serve_sim

SIM_ONLY = {
    "token_latency_ms",
    "prefill_latency_ms",
    "output_len_dist",
    "output_len_median",
    "output_len_sigma",
    "output_len_max",
    "accuracy",
}


@contextlib.asynccontextmanager
async def serve_hf(model_path: str, **config):
    """An hf engine on 127.0.0.1, port 0, run as ``agent.hf`` runs it; yields it and a session to it."""
    from agent.hf.engine import HFEngine

    config = {k: v for k, v in config.items() if k not in SIM_ONLY}
    engine = HFEngine(model_path=model_path, threads=1, **config)
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


@pytest.fixture(params=["sim", "hf"])
def engine_kind(request) -> str:
    return request.param


@pytest.fixture
def serve_engine(engine_kind, request):
    if engine_kind == "sim":
        return serve_sim
    return functools.partial(serve_hf, request.getfixturevalue("hf_model_dir"))
