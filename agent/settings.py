"""The agent's settings: one typed record, checked when it is made (``agent join`` builds it, agent/cli.py).

``AgentSettings`` is everything an :class:`~agent.worker.Agent` is started with; ``SupervisorSettings``
the engine supervisor's part of it. Each field's bound is checked at construction and a bad value is a
``ConfigError`` naming the field and the flag it comes from, so an agent is never built from settings it
cannot run with. The flags themselves are parsed (and their own errors worded) in agent/cli.py; these
checks hold for any caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.engine_plan import EngineSpec, check_positive, check_specs
from common.curve import ClientKeys
from common.errors import ConfigError
from common.lmdb_env import MAP_SIZE
from common.transport import validate_endpoint


def _port(value: int | None, what: str, *, optional: bool = False) -> None:
    if not (optional and value is None or isinstance(value, int) and 0 <= value <= 65535):
        raise ConfigError(f"{what}: a port is 0..65535 (0: any free one), got {value!r}")


@dataclass(frozen=True)
class SupervisorSettings:
    """How the engine supervisor (agent/supervisor.py) watches and restarts the node's engines."""

    start_timeout: float = 600.0
    """Seconds an engine has to get healthy (``--engine-start-timeout``)."""
    health_interval: float = 5.0
    """Seconds between health checks (``--health-interval``)."""
    health_timeout: float = 20.0
    """Seconds a health probe may take before the engine counts as hung (``--health-timeout``)."""
    max_restarts: int = 3
    """Restarts within ``restart_window`` before an engine is retired (``--max-restarts``)."""
    restart_window: float = 600.0
    """Seconds over which ``max_restarts`` counts."""
    api_key: str = ""
    """The engines' API key (``--engine-api-key``): sent by the agent's engine client and the supervisor's probes."""

    def __post_init__(self):
        check_positive(
            start_timeout=self.start_timeout,
            health_interval=self.health_interval,
            health_timeout=self.health_timeout,
            restart_window=self.restart_window,
        )
        if not (isinstance(self.max_restarts, int) and self.max_restarts >= 0):
            raise ConfigError(f"max_restarts (--max-restarts) must be an integer >= 0, got {self.max_restarts!r}")
        bad = sorted({repr(c) for c in self.api_key if not 33 <= ord(c) <= 126})
        if bad:
            raise ConfigError(f"api_key (--engine-api-key) holds {', '.join(bad)}; a key is printable ASCII")


@dataclass(frozen=True)
class AgentSettings:
    """One node's agent: where it joins, what it runs, where it keeps its groups and what it serves."""

    coordinator: str
    """The coordinator's endpoint, ``tcp://HOST:PORT`` (``--coordinator``)."""
    data_dir: Path
    """The node's group store, kept across restarts (``--data-dir``); engine logs go to its ``logs/``."""
    engines: tuple[EngineSpec, ...]
    """The engines to launch or attach to (agent/engine_plan.py), at least one, distinct names."""
    payload_bind: str
    """Where trainers fetch payloads from (``--payload-bind``; port 0: any)."""
    advertise_host: str
    """The address trainers reach this node at (``--advertise-host``)."""
    concurrency: int = 64
    """Samples in flight per engine (``--concurrency``)."""
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    agent_id: str | None = None
    """A stable id (``--agent-id``); None: the one stored in ``data_dir``, else hostname-random."""
    tokenizer: str | None = None
    """``byte`` or an HF path (``--tokenizer``); None: the engines' own."""
    dataset: Any = None
    """The local dataset replica prompts are read from (``--dataset``, a ``common.dataset.Dataset``), or None."""
    sync: bool = True
    """fsync every store commit (off with ``--no-sync``: faster, not crash-safe)."""
    map_size: int = MAP_SIZE
    """The most the LMDB store may hold, in bytes (``--map-size``)."""
    metrics_host: str = "127.0.0.1"
    """The address ``/metrics`` binds (``--metrics-host``)."""
    metrics_port: int | None = None
    """The ``/metrics`` port (``--metrics-port``; 0: any free one); None: no metrics endpoint."""
    curve: ClientKeys | None = None
    """This agent's key pair and the coordinator's public key (``--curve-secret``, ``--curve-server-key``): the
    payload endpoint is then a CURVE server with the same pair, its public key in the address."""
    openai_host: str = "127.0.0.1"
    """The address of generate functions' OpenAI-compatible endpoint (loopback)."""
    openai_port: int = 0
    """Its port (0: any free one)."""

    def __post_init__(self):
        validate_endpoint(self.coordinator, "coordinator (--coordinator)")
        validate_endpoint(self.payload_bind, "payload_bind (--payload-bind)")
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        object.__setattr__(self, "engines", tuple(self.engines))
        check_specs(self.engines)
        if not (isinstance(self.concurrency, int) and self.concurrency >= 1):
            raise ConfigError(f"concurrency (--concurrency) must be an integer >= 1, got {self.concurrency!r}")
        if not (isinstance(self.map_size, int) and self.map_size > 0):
            raise ConfigError(f"map_size (--map-size) must be a positive number of bytes, got {self.map_size!r}")
        if not self.advertise_host:
            raise ConfigError("advertise_host (--advertise-host) is empty: trainers could not reach this node")
        _port(self.metrics_port, "metrics_port (--metrics-port)", optional=True)
        _port(self.openai_port, "openai_port")
