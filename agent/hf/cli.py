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
import sys

from agent.hf.config import add_arguments
from agent.sim.cli import serve
from common.config import ArgumentParser
from common.errors import ConfigError

__all__ = ["add_arguments", "run", "main"]


def run(args: argparse.Namespace) -> None:
    """Load the model and serve until SIGTERM/SIGINT (blocking). ConfigError if it cannot start."""
    from agent.hf.engine import HFEngine

    engine = HFEngine(args)
    asyncio.run(serve(engine, engine.host, engine.port, name="rollfleet-hf"))


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
