"""Reward functions the cluster tests name by spec (``harness.rewards:NAME``)."""

from __future__ import annotations


def constant_half(sample) -> float:
    """0.5 for every sample: a source scored by it shows a reward mean of exactly 0.5."""
    return 0.5


def raises(sample) -> float:
    """Fails on every sample: a source scored by it starves the rollout."""
    raise ValueError("this reward always fails")
