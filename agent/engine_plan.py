"""What engines a node runs and when a broken one may be restarted: pure planning.

Nothing here starts a process, opens a connection or reads a clock; the only
I/O is :func:`plan_engines` binding port 0 to pick free ports for ``sglang``
engines.  :mod:`agent.engine_process` launches what is planned here and
:mod:`agent.supervisor` drives the life cycle.

Engine kinds
------------
``sim``
    The built-in sim engine, ``python -m agent.sim --host H --port 0 ...``.
    It binds a free port itself and prints ``rollfleet-sim listening on
    http://HOST:PORT``; :func:`parse_listen_url` finds that line in the log,
    so there is no port race.  A restarted sim engine may get a new URL.
``sglang``
    ``python -m sglang.launch_server --model-path P --host H --port PORT
    --tp-size K --base-gpu-id 0 --skip-server-warmup ...``, one process per
    tensor-parallel group, on distinct free ports.  Engine *i* gets the GPUs
    ``gpu_ids[i*K:(i+1)*K]`` through ``CUDA_VISIBLE_DEVICES`` (hence
    ``--base-gpu-id 0``); ``PYTORCH_CUDA_ALLOC_CONF`` is dropped from the
    child's environment (expandable segments conflict with SGLang's memory
    saver, slime does the same).  The launched module is a parameter so tests
    can run the sim engine through exactly this path.  The port is kept
    across restarts.
``hf``
    The model-backed engine, ``python -m agent.hf --model-path P --host H
    --port 0 ...``; like ``sim`` it prints ``rollfleet-hf listening on
    http://HOST:PORT`` once its model is loaded and its port bound.
``url``
    An SGLang-API server somebody else runs: no process, health checks only.

Parallel layout (:class:`EngineLayout`): what an engine's ``/server_info`` says of its parallelism
(``tp_size``, ``dp_size``, ``quantization``, ``device``, ``enable_dp_attention``);
:func:`layout_from_server_info` reads it, :func:`planned_layout` is what the plan alone implies
(``sglang``: its GPUs; the rest: 1).

Restart policy (:class:`RestartBudget`): a broken engine is restarted after
0.5 s, doubling per restart still inside the window, capped at 30 s; a restart
that would exceed ``max_restarts`` within ``window`` seconds is refused (the
engine is retired).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from common.errors import ConfigError

__all__ = [
    "KINDS",
    "SIM_MODULE",
    "EngineLayout",
    "EngineSpec",
    "RestartBudget",
    "check_positive",
    "check_specs",
    "fix_listen_url",
    "key_args",
    "layout_from_server_info",
    "parse_listen_url",
    "plan_engines",
    "planned_layout",
    "reprobe_delay",
    "sglang_command",
    "version_args",
]

KINDS = ("sim", "hf", "sglang", "url")
SIM_MODULE = "agent.sim"
HF_MODULE = "agent.hf"

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LISTEN_RE = re.compile(rb"rollfleet-(?:sim|hf) listening on (https?://[^\s]+)")

# Restart / reprobe backoff.
RESTART_DELAY_MIN = 0.5
RESTART_DELAY_MAX = 30.0


@dataclass
class EngineSpec:
    """What to run for one engine.

    ``url`` is known up front for ``sglang`` and ``url`` engines and is None
    for ``sim`` and ``hf`` engines until they are listening (the supervisor's
    ``healthy()`` returns copies with the current URL).  ``argv`` is None for
    ``url`` engines.  ``env`` is the child's complete environment (None:
    inherit ours).
    """

    name: str
    kind: str
    url: str | None
    argv: list[str] | None
    env: dict[str, str] | None = dataclasses.field(repr=False)
    gpu_ids: list[int]


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """An engine's parallel layout, as its ``/server_info`` reports it (or as planned, if it does not).

    ``tp_size`` is the number of consecutive ranks the engine takes in a weight-update group (each TP
    worker joins as ``rank_offset + tp_rank``); SGLang refuses such a group with ``dp_size > 1``
    unless ``enable_dp_attention``.
    """

    tp_size: int = 1
    dp_size: int = 1
    quantization: str | None = None
    device: str | None = None
    enable_dp_attention: bool = False
    from_server: bool = False
    """True if read from the engine's ``/server_info``; False: planned (the engine did not say)."""


def planned_layout(spec: EngineSpec) -> EngineLayout:
    """What the plan alone implies: an ``sglang`` engine's tp is its GPUs; sim, hf and url engines 1."""
    device = "cpu" if spec.kind == "sim" else ("cuda" if spec.kind == "sglang" else None)
    return EngineLayout(tp_size=max(1, len(spec.gpu_ids)), device=device)


def layout_from_server_info(info: dict, planned: EngineLayout) -> EngineLayout:
    """The layout in a ``/server_info`` answer (SGLang's ServerArgs fields); ``planned`` fills what is absent."""

    def size(key: str, default: int) -> int:
        value = info.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default

    def text(key: str, default: str | None) -> str | None:
        value = info.get(key)
        return value if isinstance(value, str) and value else default

    return EngineLayout(
        tp_size=size("tp_size", planned.tp_size),
        dp_size=size("dp_size", planned.dp_size),
        quantization=text("quantization", planned.quantization),
        device=text("device", planned.device),
        enable_dp_attention=bool(info.get("enable_dp_attention", planned.enable_dp_attention)),
        from_server=True,
    )


def check_specs(specs: Sequence[EngineSpec]) -> None:
    """ConfigError unless ``specs`` is a non-empty list of distinct, runnable engines."""
    if not specs:
        raise ConfigError("the engine supervisor needs at least one engine")
    seen: set[str] = set()
    for spec in specs:
        if not NAME_RE.match(spec.name):
            raise ConfigError(f"engine name {spec.name!r} must match {NAME_RE.pattern}")
        if spec.name in seen:
            raise ConfigError(f"duplicate engine name {spec.name!r}")
        seen.add(spec.name)
        if spec.kind not in KINDS:
            raise ConfigError(f"engine {spec.name!r}: unknown kind {spec.kind!r}")
        if spec.kind == "url" and not spec.url:
            raise ConfigError(f"engine {spec.name!r}: kind 'url' needs a url")
        if spec.kind != "url" and not spec.argv:
            raise ConfigError(f"engine {spec.name!r}: kind {spec.kind!r} needs argv")
        if spec.kind == "sglang" and not spec.url:
            raise ConfigError(f"engine {spec.name!r}: kind 'sglang' needs its url")


def check_positive(**values: float) -> None:
    """ConfigError naming the first of ``values`` (durations in seconds) that is not > 0."""
    for label, value in values.items():
        if not value > 0:
            raise ConfigError(f"{label} must be > 0, got {value}")


# --------------------------------------------------------------------------
# URLs, ports and GPUs
# --------------------------------------------------------------------------


def url_host(host: str) -> str:
    """The host to *connect* to for a server bound to ``host``, URL-ready."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host


def fix_listen_url(url: str) -> str:
    """Turn a wildcard bind address in a printed URL into a connectable one."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::") and parts.port is not None:
        return f"{parts.scheme}://{url_host(host)}:{parts.port}"
    return url.rstrip("/")


def parse_listen_url(log: bytes) -> str | None:
    """The connectable URL from a sim or hf engine's ``listening on`` line in ``log``, if printed yet."""
    m = _LISTEN_RE.search(log)
    if m is None:
        return None
    return fix_listen_url(m.group(1).decode("ascii", errors="replace"))


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports that were free on ``host`` (bound to port 0 together)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            try:
                s.bind((host, 0))
            except OSError as e:
                raise ConfigError(f"cannot bind a free port on host {host!r}: {e}") from e
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def default_gpu_ids(need: int, visible: str | None) -> list[int]:
    """The GPU ids in ``visible`` (a CUDA_VISIBLE_DEVICES value), else ``0..need-1``."""
    if visible is None:
        return list(range(need))
    ids: list[int] = []
    for part in visible.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={visible!r} is not a list of integer GPU ids; "
                "pass gpu_ids explicitly (--gpu-ids)"
            ) from None
    return ids


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------


def sglang_command(
    model_path: str,
    *,
    host: str,
    port: int,
    tp_size: int,
    module: str = "sglang.launch_server",
    extra_args: Sequence[str] = (),
    weight_version: int | None = None,
    api_key: str = "",
) -> list[str]:
    """The argv of one SGLang server (GPUs are chosen via CUDA_VISIBLE_DEVICES).

    ``weight_version`` labels the weights it launches with (``--weight-version``; without it
    SGLang says ``"default"``, which the agent reads as version 0). ``api_key``: ``--api-key``, so
    that every route but ``/health*``, ``/ready`` and ``/metrics`` wants ``Authorization: Bearer KEY``.
    """
    if not model_path:
        raise ConfigError("sglang engines need a model path (--model-path)")
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be in 1..65535, got {port}")
    return [
        sys.executable, "-m", module,
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--base-gpu-id", "0",
        "--skip-server-warmup",
        *version_args(weight_version),
        *key_args(api_key),
        *[str(a) for a in extra_args],
    ]  # fmt: skip


def key_args(api_key: str) -> list[str]:
    """``--api-key KEY`` for an engine the agent launches with ``--engine-api-key`` (none without a key)."""
    return ["--api-key", api_key] if api_key else []


def version_args(weight_version: int | None) -> list[str]:
    """``--weight-version V`` for a launch with weights of version ``V`` (none for the default label)."""
    return [] if weight_version is None else ["--weight-version", str(int(weight_version))]


def plan_engines(
    kind: str,
    *,
    count: int = 1,
    urls: Sequence[str] = (),
    model_path: str | None = None,
    tp_size: int = 1,
    gpu_ids: Sequence[int] | None = None,
    host: str = "127.0.0.1",
    sim_args: Sequence[str] = (),
    hf_args: Sequence[str] = (),
    sglang_args: Sequence[str] = (),
    sglang_module: str = "sglang.launch_server",
    weight_version: int | None = None,
    api_key: str = "",
) -> list[EngineSpec]:
    """The engines of one node.  Names are ``<kind>-<i>``; ``weight_version`` labels their launch weights.

    ``api_key`` (``--engine-api-key``) protects the ``sim``, ``hf`` and ``sglang`` engines launched
    here (``--api-key``); ``url`` engines have their own.

    * ``sim``: ``count`` sim engines on ``host``, port chosen by the engine.
    * ``hf``: ``count`` hf engines serving ``model_path`` on ``host``, port chosen by the engine.
    * ``sglang``: ``count`` servers of ``tp_size`` GPUs each, on distinct free
      ports; engine i gets ``gpu_ids[i*tp_size:(i+1)*tp_size]``.  ``gpu_ids``
      defaults to the ids in our CUDA_VISIBLE_DEVICES, else ``0..count*tp_size-1``.
    * ``url``: one engine per entry of ``urls`` (``count`` is ignored).
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown engine kind {kind!r}; expected one of {', '.join(KINDS)}")
    if urls and kind != "url":
        raise ConfigError(f"urls are only used with engine kind 'url', not {kind!r}")
    if kind == "url":
        return _plan_urls(urls)
    if count < 1:
        raise ConfigError(f"--engines must be >= 1, got {count}")
    if kind == "sim":
        argv = [
            sys.executable,
            "-m",
            SIM_MODULE,
            "--host",
            host,
            "--port",
            "0",
            *version_args(weight_version),
            *key_args(api_key),
            *[str(a) for a in sim_args],
        ]
        return [
            EngineSpec(name=f"sim-{i}", kind="sim", url=None, argv=list(argv), env=None, gpu_ids=[])
            for i in range(count)
        ]
    if kind == "hf":
        if not model_path:
            raise ConfigError("--engine hf needs --model-path")
        argv = [
            sys.executable, "-m", HF_MODULE,
            "--model-path", str(model_path),
            "--host", host,
            "--port", "0",
            *version_args(weight_version),
            *key_args(api_key),
            *[str(a) for a in hf_args],
        ]  # fmt: skip
        return [
            EngineSpec(name=f"hf-{i}", kind="hf", url=None, argv=list(argv), env=None, gpu_ids=[]) for i in range(count)
        ]
    return _plan_sglang(count, model_path, tp_size, gpu_ids, host, sglang_args, sglang_module, weight_version, api_key)


def _plan_urls(urls: Sequence[str]) -> list[EngineSpec]:
    if not urls:
        raise ConfigError("engine kind 'url' needs at least one URL")
    specs = []
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"engine URL {url!r} is not an http(s)://host:port URL")
        specs.append(EngineSpec(name=f"url-{i}", kind="url", url=url.rstrip("/"), argv=None, env=None, gpu_ids=[]))
    return specs


def _plan_sglang(
    count: int,
    model_path: str | None,
    tp_size: int,
    gpu_ids: Sequence[int] | None,
    host: str,
    sglang_args: Sequence[str],
    sglang_module: str,
    weight_version: int | None = None,
    api_key: str = "",
) -> list[EngineSpec]:
    if not model_path:
        raise ConfigError("--engine sglang needs --model-path")
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    need = count * tp_size
    if gpu_ids is not None:
        ids = [int(g) for g in gpu_ids]
    else:
        ids = default_gpu_ids(need, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if len(set(ids)) != len(ids):
        raise ConfigError(f"GPU ids must be distinct, got {ids}")
    if len(ids) < need:
        raise ConfigError(
            f"{count} sglang engine(s) with tp_size {tp_size} need {need} GPUs, "
            f"but only {len(ids)} GPU id(s) are available: {ids}"
        )
    ports = free_ports(host, count)
    base_env = dict(os.environ)
    base_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    specs = []
    for i, port in enumerate(ports):
        group = ids[i * tp_size : (i + 1) * tp_size]
        env = dict(base_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in group)
        argv = sglang_command(
            model_path,
            host=host,
            port=port,
            tp_size=tp_size,
            module=sglang_module,
            extra_args=sglang_args,
            weight_version=weight_version,
            api_key=api_key,
        )
        url = f"http://{url_host(host)}:{port}"
        specs.append(EngineSpec(name=f"sglang-{i}", kind="sglang", url=url, argv=argv, env=env, gpu_ids=group))
    return specs


# --------------------------------------------------------------------------
# Restart policy
# --------------------------------------------------------------------------


class RestartBudget:
    """How soon one engine may be restarted, if at all.  Pure: every call takes ``now``.

    Invariant: :meth:`next_delay` returns None exactly when ``max_restarts``
    restarts were recorded within the last ``window`` seconds; otherwise the
    delay is ``delay_min * 2**k`` capped at ``delay_max``, where k is the number
    of those recent restarts.
    """

    def __init__(
        self,
        max_restarts: int,
        window: float,
        *,
        delay_min: float = RESTART_DELAY_MIN,
        delay_max: float = RESTART_DELAY_MAX,
    ):
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
        check_positive(restart_window=window)
        self.max_restarts = int(max_restarts)
        self.window = float(window)
        self._delay_min = delay_min
        self._delay_max = delay_max
        self._times: deque[float] = deque()
        self.total = 0
        """Restarts recorded in all (the agent's metrics; ``recent`` forgets old ones)."""

    def recent(self, now: float) -> int:
        """Restarts recorded within the last ``window`` seconds (older ones are forgotten)."""
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None: the budget is spent, retire."""
        k = self.recent(now)
        if k >= self.max_restarts:
            return None
        return min(self._delay_max, self._delay_min * 2 ** min(k, 64))

    def record(self, now: float) -> None:
        """A restart happened at ``now``."""
        self._times.append(now)
        self.total += 1

    def refund(self) -> None:
        """The last restart recorded never started the engine, for a cause not its own: it no longer counts."""
        self._times.pop()
        self.total -= 1


def reprobe_delay(attempt: int, health_interval: float) -> float:
    """Wait before probe ``attempt`` (0, 1, ...) of a down ``url`` engine: doubling, capped.

    The cap is the health interval, at least 2 s and at most the restart cap,
    so a server that comes back is seen about as soon as a healthy one is checked.
    """
    cap = min(RESTART_DELAY_MAX, max(2.0, health_interval))
    return min(cap, RESTART_DELAY_MIN * 2 ** min(attempt, 64))
