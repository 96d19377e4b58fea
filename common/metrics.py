"""Drop accounting and batch metrics, shared by the agents (which record filter verdicts) and the
coordinator (which stores them with each batch and reports them as metrics).

``DropStats`` counts kept and dropped groups, dropped ones per reason. Reasons become metric names
(``rollout/dynamic_filter/drop_<reason>``), so they are sanitised to ``[A-Za-z0-9_.-]+``. It
serialises to plain JSON types. ``batch_metrics`` computes a trainer batch's ``rollout/*`` metrics from
its groups' statistics.
"""

from __future__ import annotations

import re
from typing import Any

DEFAULT_REASON = "dynamic_filter"
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]")


def sanitize_reason(reason: Any) -> str:
    """A non-empty, metric-name-safe version of ``reason`` (``[A-Za-z0-9_.-]+``)."""
    if reason is None:
        return DEFAULT_REASON
    cleaned = _UNSAFE_RE.sub("_", str(reason).strip())
    return cleaned or DEFAULT_REASON


class DropStats:
    """Kept/dropped group counts, dropped ones broken down by reason."""

    def __init__(self, kept: int = 0, dropped: dict[str, int] | None = None):
        self.kept = int(kept)
        self.dropped: dict[str, int] = {}
        for reason, n in (dropped or {}).items():
            self.record_dropped(reason, n)

    def record(self, verdict) -> None:
        """Count a filter verdict (anything with ``keep`` and ``reason``)."""
        if verdict.keep:
            self.kept += 1
        else:
            self.record_dropped(verdict.reason)

    def record_kept(self, n: int = 1) -> None:
        self.kept += n

    def record_dropped(self, reason: str, n: int = 1) -> None:
        reason = sanitize_reason(reason)
        self.dropped[reason] = self.dropped.get(reason, 0) + int(n)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def metrics(self, prefix: str = "rollout/dynamic_filter") -> dict[str, float]:
        dropped = self.dropped_total
        total = self.kept + dropped
        out: dict[str, float] = {f"{prefix}/drop_{r}": n for r, n in sorted(self.dropped.items())}
        out[f"{prefix}/dropped_groups"] = dropped
        out[f"{prefix}/kept_groups"] = self.kept
        out[f"{prefix}/dropped_ratio"] = dropped / total if total else 0.0
        return out

    def merge(self, other: DropStats) -> DropStats:
        """Add ``other``'s counts into this one; returns self."""
        self.kept += other.kept
        for reason, n in other.dropped.items():
            self.record_dropped(reason, n)
        return self

    def to_dict(self) -> dict:
        return {"kept": self.kept, "dropped": dict(self.dropped)}

    @classmethod
    def from_dict(cls, d: dict) -> DropStats:
        if not isinstance(d, dict) or not isinstance(d.get("dropped", {}), dict):
            raise ValueError(f"not a DropStats dict: {d!r}")
        return cls(kept=d.get("kept", 0), dropped=d.get("dropped", {}))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DropStats):
            return NotImplemented
        return self.kept == other.kept and self.dropped == other.dropped

    def __repr__(self) -> str:
        return f"DropStats(kept={self.kept}, dropped={self.dropped})"


FILTER_PREFIX = "rollout/dynamic_filter"


def batch_metrics(
    stats: list[dict],
    data_epochs: list[int],
    drops: DropStats,
    prefix: str = FILTER_PREFIX,
    *,
    sources: list[str] | None = None,
    source_drops: dict[str, int] | None = None,
) -> dict[str, float]:
    """The metrics of one trainer batch, from its groups' statistics and the filter drops behind it.

    ``stats`` are the per-group statistics an agent reports with each receipt
    (``n_samples``, ``prompt_tokens``, ``response_tokens``, ``reward_sum``,
    ``truncated``, ``aborted``, ``gen_seconds``); ``data_epochs`` are the
    groups' data epochs. Every value is a float.
    """
    n = len(stats)
    m = {k: float(v) for k, v in drops.metrics(prefix).items()}

    def total(k):
        return float(sum(s.get(k, 0) for s in stats))

    samples = total("n_samples")
    m["rollout/groups"] = float(n)
    m["rollout/samples"] = samples
    m["rollout/prompt_tokens"] = total("prompt_tokens")
    m["rollout/response_tokens"] = total("response_tokens")
    m["rollout/response_len_mean"] = m["rollout/response_tokens"] / samples if samples else 0.0
    m["rollout/reward_mean"] = total("reward_sum") / samples if samples else 0.0
    m["rollout/truncated_ratio"] = total("truncated") / samples if samples else 0.0
    m["rollout/aborted_ratio"] = total("aborted") / samples if samples else 0.0
    gen = [s.get("gen_seconds", 0.0) for s in stats]
    m["rollout/gen_seconds_mean"] = sum(gen) / n if n else 0.0
    m["rollout/gen_seconds_max"] = float(max(gen)) if gen else 0.0
    m["rollout/data_epoch"] = float(max(data_epochs) if data_epochs else 0)
    if sources is not None:
        m.update(source_metrics(stats, sources, source_drops or {}))
    return m


SOURCE_PREFIX = "rollout/source"


def source_metrics(stats: list[dict], sources: list[str], drops: dict[str, int]) -> dict[str, float]:
    """Per training source of a mixture (``sources``: each group's source name; ``drops``: groups the filter
    dropped since the last batch, by source, every source named): ``rollout/source/<NAME>/groups``,
    ``reward_mean``, ``response_len_mean`` and ``truncated_ratio`` (over its samples), ``dropped_groups``."""
    m: dict[str, float] = {}
    for name in sorted(set(sources) | set(drops)):
        mine = [st for st, src in zip(stats, sources, strict=True) if src == name]
        samples = float(sum(st.get("n_samples", 0) for st in mine))

        def per_sample(key: str, mine=mine, samples=samples) -> float:
            return float(sum(st.get(key, 0) for st in mine)) / samples if samples else 0.0

        at = f"{SOURCE_PREFIX}/{name}"
        m[f"{at}/groups"] = float(len(mine))
        m[f"{at}/reward_mean"] = per_sample("reward_sum")
        m[f"{at}/response_len_mean"] = per_sample("response_tokens")
        m[f"{at}/truncated_ratio"] = per_sample("truncated")
        m[f"{at}/dropped_groups"] = float(drops.get(name, 0))
    return m
