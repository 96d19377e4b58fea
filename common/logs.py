"""Process logging for ``coordinator serve`` and ``agent join``: text (the default) or JSON lines.

``--log-format json`` writes one JSON object per record on stderr, for log shippers:
``{"ts": "2026-12-01T22:41:07.123Z", "level": "WARNING", "logger": "coordinator.server", "pid": 123,
"msg": "...", "exc": "Traceback ..."}`` (``exc`` only when the record carries an exception). Every
record is one line: newlines inside a message are escaped by the JSON encoding.
"""

from __future__ import annotations

import json
import logging
import os
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET_CLIENT_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": os.getpid(),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once, on stderr, in ``fmt`` (one of :data:`LOG_FORMATS`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if logging.getLogger().level > logging.DEBUG:
        # Generate functions' HTTP clients (the openai package on the agent's OpenAI endpoint) log every
        # request at INFO: one line per call would drown the agent's own log. --log-level DEBUG keeps them.
        for name in QUIET_CLIENT_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def add_log_flags(sp, default_level: str = "INFO") -> None:
    from common.config import log_level

    sp.add_argument(
        "--log-level", type=log_level, default=default_level, help="DEBUG, INFO, WARNING or ERROR (any case)"
    )
    sp.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="text (default) or json: one JSON object per line"
    )
