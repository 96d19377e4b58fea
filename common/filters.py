"""Dynamic filters: decide whether a scored group is kept or dropped.

After a group's samples have their rewards set, the agent asks the filter
whether to keep the group. Filters are chosen by a spec string::

    load_filter("nonzero_std")             # the default (alias "check_reward_nonzero_std")
    load_filter("none")                    # keep everything
    load_filter("my_pkg.filters:keep_it")  # custom: "dotted.module:attribute"

``await fn.check(samples)`` returns a ``Verdict(keep, reason)``.

Writing a custom filter
-----------------------
A function of the group's samples (``list[common.types.Sample]``, rewards
set), sync or async, returning any of::

    True / False
    (keep: bool, reason: str)
    Verdict(keep, reason)

A drop without a reason gets the reason ``"dynamic_filter"``. Reasons become
metric names (``rollout/dynamic_filter/drop_<reason>``), so they are
sanitised: every character outside ``[A-Za-z0-9_.-]`` becomes ``_``. Keep
the set of reasons small (don't embed ids or free text in them).

Sync custom filters run in a worker thread (``asyncio.to_thread``), like
custom rewards, so a slow filter does not stall the event loop; built-ins
run inline. A filter that raises or returns something else raises
``FilterError`` naming the spec.

The built-in ``nonzero_std`` drops groups whose rewards are all equal (a
group with zero reward variance gives zero advantage under GRPO-style
normalisation) with the reason ``zero_std_<reward:g>``, e.g. ``zero_std_1``,
``zero_std_0``, ``zero_std_0.5``. Note that a one-sample group always has
zero std and is therefore always dropped by it.

Drop accounting (``DropStats``) lives in ``common.metrics``, shared with the
coordinator, which stores it with each batch.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import RolloutError
from common.metrics import DEFAULT_REASON, DropStats, sanitize_reason
from common.plugins import is_async_callable, resolve_spec
from common.types import Sample

__all__ = [
    "BUILTIN_FILTERS",
    "DEFAULT_REASON",
    "DropStats",
    "FilterError",
    "FilterFn",
    "Verdict",
    "keep_all",
    "load_filter",
    "nonzero_std",
    "sanitize_reason",
]


class FilterError(RolloutError):
    """A filter raised or returned something that is not a verdict."""


@dataclass(frozen=True)
class Verdict:
    """Whether to keep a group and, when dropping, why."""

    keep: bool
    reason: str = ""


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    # numpy.bool_ is not a bool subclass; accept it without importing numpy.
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    return None


def normalize_verdict(result: Any, spec: str = "filter") -> Verdict:
    """Turn what a filter returned into a ``Verdict`` (see module docstring)."""
    if isinstance(result, Verdict):
        keep, reason = _as_bool(result.keep), result.reason
    elif isinstance(result, tuple) and len(result) == 2:
        keep, reason = _as_bool(result[0]), result[1]
    else:
        keep, reason = _as_bool(result), None
    if keep is None:
        raise FilterError(
            f"filter {spec!r} returned {type(result).__name__} {result!r}; expected a bool, (keep, reason) or Verdict"
        )
    if keep:
        # A keep needs no reason; one given is kept (sanitised) for logging.
        has_reason = reason is not None and str(reason).strip() != ""
        return Verdict(True, sanitize_reason(reason) if has_reason else "")
    return Verdict(False, sanitize_reason(reason))


# --------------------------------------------------------------------------
# Built-ins
# --------------------------------------------------------------------------


def nonzero_std(samples: list[Sample]) -> Verdict:
    """Keep the group iff its rewards are not all equal."""
    if not samples:
        return Verdict(False, "empty_group")
    rewards = [s.reward for s in samples]
    # Equality, not a computed std: float noise in a std of equal values
    # must not keep a zero-variance group.
    if min(rewards) != max(rewards):
        return Verdict(True)
    shared = rewards[0] + 0.0  # -0.0 → 0.0, so the reason is never "zero_std_-0"
    return Verdict(False, sanitize_reason(f"zero_std_{shared:g}"))


def keep_all(samples: list[Sample]) -> Verdict:
    return Verdict(True)


BUILTIN_FILTERS: dict[str, Callable[[list[Sample]], Verdict]] = {
    "nonzero_std": nonzero_std,
    "check_reward_nonzero_std": nonzero_std,
    "none": keep_all,
}


class FilterFn:
    """A loaded filter. Use ``load_filter`` to build one."""

    def __init__(self, spec: str, fn: Callable, *, builtin: bool = False):
        self.spec = spec
        self.fn = fn
        self.builtin = builtin
        self.is_async = is_async_callable(fn)

    def __repr__(self) -> str:
        return f"FilterFn({self.spec!r})"

    async def check(self, samples: list[Sample]) -> Verdict:
        """The verdict for one scored group."""
        samples = list(samples)
        try:
            if self.builtin:
                result = self.fn(samples)
            elif self.is_async:
                result = await self.fn(samples)
            else:
                result = await asyncio.to_thread(self.fn, samples)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as e:
            raise FilterError(f"filter {self.spec!r} raised {type(e).__name__}: {e}") from e
        return normalize_verdict(result, self.spec)


def load_filter(spec: str) -> FilterFn:
    """``"nonzero_std"`` (default), ``"check_reward_nonzero_std"``, ``"none"`` or ``"module:function"``."""
    spec, fn, builtin = resolve_spec(spec, BUILTIN_FILTERS, "filter")
    return FilterFn(spec, fn, builtin=builtin)
