"""Typed configuration: the rollout config (coordinator -> agents) and process settings.

The rollout configuration lives on the coordinator and is sent to every agent
in its Welcome, so agents never disagree about sampling or reward. Each field
is validated with bounds; unknown keys are rejected (``from_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.errors import ConfigError


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
        if self.prefetch < -1:
            raise ConfigError(f"prefetch must be >= 0 (or -1 for one batch), got {self.prefetch}")
        for name in ("reward", "dynamic_filter"):
            if not getattr(self, name):
                raise ConfigError(f"{name} must not be empty")

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

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutConfig":
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
        if self.heartbeat_interval <= 0:
            raise ConfigError(f"heartbeat interval must be > 0, got {self.heartbeat_interval}")
        if self.ttl < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"agent TTL ({self.ttl}s) must be at least two heartbeat intervals ({self.heartbeat_interval}s)"
            )
        if self.retire_after < self.ttl:
            raise ConfigError(f"retire-after ({self.retire_after}s) must be >= the TTL ({self.ttl}s)")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
