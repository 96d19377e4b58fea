"""Typed configuration: the rollout config (coordinator -> agents) and process settings.

The rollout configuration lives on the coordinator and is sent to every agent
in its Welcome, so agents never disagree about sampling or reward. Each field
is validated with bounds; unknown keys are rejected (``from_dict``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field

from common.errors import ConfigError
from common.sampling import check_sampling_params

TOOL_PARSERS = ("hermes", "none")
"""The built-in tool-call parsers of the agent's OpenAI endpoint (agent/tool_parsers.py)."""


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int = 32
    """Groups (prompts) per trainer batch."""
    n_samples_per_prompt: int = 8
    """Samples generated per prompt; a group holds this many."""
    max_new_tokens: int = 1024
    """Generation budget per sample (SGLang defaults to 128, so it is always sent)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    reward: str = "math"
    """Built-in name (``math``, ``exact``) or ``module:function``."""
    dynamic_filter: str = "nonzero_std"
    """Built-in name, ``module:function``, or ``none``."""
    prefetch: int = -1
    """Ready groups kept beyond current demand; -1 means one batch."""
    extra_sampling_params: dict = field(default_factory=dict)
    partial_rollout: bool = True
    """A sample a weight update interrupts continues from its partial output (else it is generated again)."""
    max_staleness: int | None = None
    """Most weight updates a batch's groups may lag behind it (docs/weights.md); None: unbounded."""
    generate: str = ""
    """``module:function`` making each sample (multi-turn, tools: common/generation.py); "": one ``/generate``."""
    tool_parser: str = "hermes"
    """How the OpenAI endpoint reads tool calls from the model's output: ``hermes``, ``none`` or ``module:function``."""
    mixture: list = field(default_factory=list)
    """The training datasets mixed by weight (common/mixture.py ``SourceSpec.to_dict()`` each, in order);
    empty: the one dataset ``default`` with the settings above."""

    def __post_init__(self):
        _positive("rollout_batch_size", self.rollout_batch_size)
        _positive("n_samples_per_prompt", self.n_samples_per_prompt)
        _positive("max_new_tokens", self.max_new_tokens)
        if not (0.0 <= self.temperature <= 100.0):
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            raise ConfigError(f"max_staleness must be an integer >= 0 or None, got {self.max_staleness!r}")
        if self.prefetch < -1:
            raise ConfigError(f"prefetch must be >= 0 (or -1 for one batch), got {self.prefetch}")
        if self.tool_parser not in TOOL_PARSERS and ":" not in self.tool_parser:
            raise ConfigError(
                f"tool_parser must be one of {list(TOOL_PARSERS)} or module:function, got {self.tool_parser!r}"
            )
        for name in ("reward", "dynamic_filter"):
            if not getattr(self, name):
                raise ConfigError(f"{name} must not be empty")
        check_sampling_params(self.extra_sampling_params)
        if self.mixture:
            from common.mixture import SourceSpec, check_sources

            check_sources([SourceSpec.from_dict(d) if isinstance(d, dict) else d for d in self.mixture])

    @property
    def effective_prefetch(self) -> int:
        return self.rollout_batch_size if self.prefetch == -1 else self.prefetch

    def sampling_params(self) -> dict:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.top_k != -1:
            params["top_k"] = self.top_k
        params.update(self.extra_sampling_params)
        return params

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def batch_shape(self) -> dict:
        """The fields that decide how batches are made (everything but ``prefetch``).

        A coordinator restarted on the same data dir must keep these, or record the change
        (``coordinator/ledger.py``), since recorded batches and open epochs were built with them.
        """
        shape = self.to_dict()
        del shape["prefetch"]
        return shape

    @classmethod
    def from_dict(cls, d: dict) -> RolloutConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown rollout config key(s): {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"bad rollout config: {exc}") from None


@dataclass(frozen=True)
class Liveness:
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats in each direction."""
    ttl: float = 5.0
    """Silence after which a peer is presumed dead (several intervals)."""
    retire_after: float = 60.0
    """Silence after which a presumed-dead agent is retired for good."""

    def __post_init__(self):
        for flag, value in (
            ("--heartbeat-interval", self.heartbeat_interval),
            ("--agent-ttl", self.ttl),
            ("--retire-after", self.retire_after),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a number of seconds > 0, got {value!r}")
        if self.ttl < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"--agent-ttl ({self.ttl}s) must be at least two --heartbeat-interval ({self.heartbeat_interval}s)"
            )
        if self.retire_after < self.ttl:
            raise ConfigError(f"--retire-after ({self.retire_after}s) must be >= --agent-ttl ({self.ttl}s)")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


# --------------------------------------------------------------------------
# Flag types: a bad value is an argparse error naming the flag (exit 2, one line after the usage)
# --------------------------------------------------------------------------

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_MESSAGE_BYTES = 64 << 10
"""The smallest ``--max-message-bytes``: below it ordinary control messages would be refused."""

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
               "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one line per mistake: ``prog: error: argument --flag: why (see --help)``, exit 2.

    Sub-commands made with ``add_subparsers().add_parser`` are of this class too.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def log_level(text: str) -> str:
    """``--log-level``: one of :data:`LOG_LEVELS`, any case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS or not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; expected one of {', '.join(LOG_LEVELS)}")
    return level


def parse_size(text: str) -> int:
    """A byte count: ``65536``, ``64KiB``, ``64MiB``, ``1GiB`` (also ``KB``/``MB``/``GB`` = powers of 1000)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 65536, 512KiB or 64MiB, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def message_bytes(text: str) -> int:
    """``--max-message-bytes``: a size of at least :data:`MIN_MESSAGE_BYTES`."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_MESSAGE_BYTES} bytes (64KiB), got {text!r}")
    return size


MIN_MAP_SIZE = 64 << 10
"""The smallest ``--map-size``: LMDB needs a few pages for its meta pages and database roots."""


def map_size(text: str) -> int:
    """``--map-size``: the most an LMDB environment may hold (address space reserved, not disk used)."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_MAP_SIZE:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_MAP_SIZE} bytes (64KiB), got {text!r}")
    return size


def format_size(size: int) -> str:
    """A byte count as the largest binary unit that divides it: ``1TiB``, ``64MiB``, ``1536KiB``."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def number(kind: type = float, *, min: float | None = None, max: float | None = None, above: float | None = None):
    """An argparse type: a finite ``kind`` (int or float) within the bounds given.

    ``min``/``max`` are inclusive, ``above`` is exclusive. The error names the bound, and argparse
    prefixes the flag: ``argument --slots: must be an integer >= 1, got '0'``.
    """
    what = "an integer" if kind is int else "a number"
    bounds = []
    if above is not None:
        bounds.append(f"> {above:g}")
    if min is not None:
        bounds.append(f">= {min:g}")
    if max is not None:
        bounds.append(f"<= {max:g}")
    expected = f"{what} {' and '.join(bounds)}".strip()

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        ok = math.isfinite(value)
        ok = ok and (above is None or value > above) and (min is None or value >= min) and (max is None or value <= max)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    convert.__name__ = f"{kind.__name__}_in_bounds"
    return convert


seconds = number(float, above=0)
"""A duration flag: a finite number of seconds > 0."""
