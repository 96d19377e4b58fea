"""Command line of the sim engine: ``python -m agent.sim`` and ``agent sim-engine``.

The flags are those of :func:`add_arguments`; any other flag, a value out of bounds or a port
that cannot be bound is one line on stderr and exit 2. Once the port
is bound the process prints ``rollfleet-sim listening on http://HOST:PORT`` (the readiness line
the supervisor and the tests wait for) and serves until SIGTERM or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from agent.sim.config import add_arguments
from agent.sim.engine import SimEngine
from agent.sim.http import RUNNER_OPTIONS, make_app
from common.config import ArgumentParser
from common.errors import ConfigError

__all__ = ["add_arguments", "run", "main"]


async def serve(engine: SimEngine, host: str, port: int, name: str = "rollfleet-sim") -> None:
    """Serve ``engine`` on ``host:port`` until SIGTERM/SIGINT; sets ``engine.port`` to the bound port.

    Prints ``{name} listening on http://HOST:PORT`` once bound (the supervisor reads that line).
    Any engine with SimEngine's surface can be served (the hf engine is). Served with
    :data:`~agent.sim.http.RUNNER_OPTIONS`: idle keep-alive connections close after 5 s, as SGLang's.
    """
    runner = web.AppRunner(make_app(engine), shutdown_timeout=2.0, **RUNNER_OPTIONS)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    engine.port = runner.addresses[0][1]
    print(f"{name} listening on http://{host}:{engine.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        engine.shutdown()
        await runner.cleanup()


def run(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT (blocking). ConfigError if the port cannot be bound."""
    engine = SimEngine(args)
    if getattr(args, "preload_torch", False):
        from agent.sim.weights import import_torch

        import_torch()  # before the port opens: up means ready for a weight update, as on SGLang
    asyncio.run(serve(engine, engine.host, engine.port))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m agent.sim", description="CPU engine speaking SGLang's native HTTP API")
    add_arguments(parser)
    args = parser.parse_args(argv)  # unknown flags exit with code 2, as argparse does
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(args)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
