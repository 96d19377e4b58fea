"""Command line of the hf engine: ``python -m agent.hf`` and ``agent hf-engine``.

The flags are those of :func:`agent.hf.config.add_arguments`; any other flag, a value out of
bounds, a model directory that does not load or a port that cannot be bound is one line on
stderr and exit 2. The model is loaded first; once the port is bound the process prints
``rollfleet-hf listening on http://HOST:PORT`` (the readiness line the supervisor waits for, as
for the sim) and serves until SIGTERM or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from agent.hf.config import add_arguments
from agent.sim.http import make_app
from common.config import ArgumentParser
from common.errors import ConfigError

__all__ = ["add_arguments", "run", "main"]


async def serve(engine, host: str, port: int) -> None:
    """Serve ``engine`` on ``host:port`` until SIGTERM/SIGINT; sets ``engine.port`` to the bound port."""
    runner = web.AppRunner(make_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    engine.port = runner.addresses[0][1]
    print(f"rollfleet-hf listening on http://{host}:{engine.port}", flush=True)
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
    """Load the model and serve until SIGTERM/SIGINT (blocking). ConfigError if it cannot start."""
    from agent.hf.engine import HFEngine

    engine = HFEngine(args)
    asyncio.run(serve(engine, engine.host, engine.port))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m agent.hf", description="torch causal LM speaking SGLang's native HTTP API")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(args)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
