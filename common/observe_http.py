"""The observation HTTP endpoint of a rollfleet process: Prometheus ``/metrics`` and any extra routes.

Served by aiohttp on the process's own event loop (no thread, no second
loop), so a scrape reads the process's state between two of its turns and
never races it: the collector passed in is called at scrape time, on the loop,
and must only read state (``coordinator/observe.py``, ``agent/observe.py``).
A scrape costs the loop the time to format the text (well under a
millisecond for a node, about a millisecond per thousand agents for the
coordinator); nothing is collected between scrapes.

Off unless a port is given; port 0 picks a free one (``url`` tells which,
and the process logs it). A port that cannot be bound fails the start with
a one-line ``ConfigError`` naming the flag, before anything else is served.
"""

from __future__ import annotations

import errno
import logging

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from common.errors import ConfigError

log = logging.getLogger("rollfleet.observe")

METRICS_PATH = "/metrics"


class ObserveServer:
    """``/metrics`` from ``collector`` (an object with ``collect()``), plus ``routes`` (path -> GET handler)."""

    def __init__(self, host: str, port: int, collector, *, routes: dict | None = None, what: str = "--metrics-port"):
        self.host, self.port, self.what = host, port, what
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.app = web.Application()
        self.app.router.add_get(METRICS_PATH, self._metrics)
        for path, handler in (routes or {}).items():
            self.app.router.add_get(path, handler)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> str:
        """Bind and serve; returns the base URL (``http://host:port``)."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            await runner.cleanup()
            why = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise ConfigError(f"{self.what} {self.port}: cannot listen on {self.host}:{self.port}: {why}") from None
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
