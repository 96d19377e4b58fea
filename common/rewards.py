"""Reward functions: score the samples of a group.

An agent scores every group it generates with one reward function, chosen
by a spec string::

    load_reward("math")                  # built-in
    load_reward("exact")                 # built-in
    load_reward("my_pkg.rewards:judge")  # custom: "dotted.module:attribute"

The result is a ``RewardFn``; ``await fn.score(samples)`` returns one float
per sample, in order. ``score`` does not modify the samples: the caller
assigns ``sample.reward``.

Writing a custom reward
-----------------------
Per sample (the default): a function of one ``common.types.Sample``::

    def my_reward(sample: Sample) -> float: ...
    async def my_reward(sample: Sample) -> float: ...

Per group: mark the function with ``@per_group``; it receives the whole
group and returns one float per sample, in the same order::

    @per_group
    def my_group_reward(samples: list[Sample]) -> list[float]: ...

Useful ``Sample`` fields: ``response_text``, ``label`` (the dataset row's
label, any JSON value or ``None``), ``status`` (``completed``/``truncated``/
``aborted``), ``prompt_tokens``, ``response_tokens`` and ``metadata``. The
prompt text, when the agent provides it, is ``sample.metadata.get("prompt")``;
the dataset row's extra keys are in ``metadata`` too.

Truncated samples are scored like any other sample: a reward that wants to
penalise truncation checks ``sample.status == "truncated"`` itself.

Execution: built-ins run inline on the event loop (they are cheap and on the
hot path). Sync custom functions run in a worker thread
(``asyncio.to_thread``, one hop per group) so a CPU-heavy reward does not
stall the agent's event loop; they must therefore be thread-safe. Async
functions run on the loop. A sync function may also return an awaitable,
which is awaited on the loop.

Every returned value must be a finite real number (``int``/``float``, not
``bool``); otherwise, or when a per-group function returns the wrong number
of values, or when the function raises, ``score`` raises ``RewardError``
naming the function's spec.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
from collections.abc import Callable
from typing import Any

from common.errors import RolloutError
from common.plugins import import_callable, is_async_callable, resolve_spec
from common.types import Sample

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "exact_reward",
    "import_callable",
    "load_reward",
    "math_reward",
    "per_group",
]


class RewardError(RolloutError):
    """A reward function failed or returned something that is not a reward."""


def per_group(fn: Callable) -> Callable:
    """Mark ``fn`` as a per-group reward: ``fn(samples) -> list[float]``."""
    fn.rollfleet_per_group = True
    return fn


# --------------------------------------------------------------------------
# Answer extraction and comparison (shared by the built-ins)
# --------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (nested braces ok).

    A truncated response may end in an unclosed ``\\boxed{12``; that one is
    skipped in favour of the previous complete box rather than read as "12".
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


# A number in free text: optional sign, thousands groups or plain digits,
# optional decimals/exponent, optional "/denominator". The sign is only taken
# when it cannot be a binary minus ("5-3" ends in the number 3, not -3).
_NUMBER_RE = re.compile(
    r"""
    (?:(?<![\w)\]}])-)?
    (?<![\d.])
    (?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?:[eE][-+]?\d+)?
    (?:\s*/\s*\d+(?:\.\d+)?)?
    """,
    re.VERBOSE,
)

_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LATEX_FRAC_RE = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written ("1,234", "-3/4", "2.5"), or None."""
    found = None
    for m in _NUMBER_RE.finditer(text):
        found = m.group(0)
    return found


def _strip_math(s: str) -> str:
    s = s.strip()
    # Display wrappers that never change the value.
    s = _TEXT_WRAP_RE.sub(r"\1", s)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "{,}", "$"):
        s = s.replace(junk, "," if junk == "{,}" else "")
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    return s.strip()


def _plain_to_float(s: str) -> float | None:
    s = s.replace(" ", "")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _PLAIN_NUMBER_RE.fullmatch(s):
        return float(s)
    return None


def parse_number(value: Any) -> float | None:
    """``value`` as a float if it is a number or a numeric string, else None.

    Accepts ints, floats and strings like ``"42"``, ``"-2.5"``, ``"1,234"``,
    ``"3/4"``, ``"\\frac{3}{4}"``, ``"$5$"``, ``"50\\%"``. ``bool`` is not a
    number here.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if not isinstance(value, str):
        return None
    s = _strip_math(value)
    for pct in ("\\%", "%"):
        if s.endswith(pct):
            s = s[: -len(pct)].strip()
            break
    m = _LATEX_FRAC_RE.fullmatch(s)
    if m:
        num, den = _plain_to_float(m.group(2)), _plain_to_float(m.group(3))
        sign = -1.0 if m.group(1) == "-" else 1.0
    elif "/" in s:
        left, _, right = s.partition("/")
        num, den = _plain_to_float(left), _plain_to_float(right)
        sign = 1.0
    else:
        f = _plain_to_float(s)
        return f if f is not None and math.isfinite(f) else None
    if num is None or den is None or den == 0:
        return None
    f = sign * num / den
    return f if math.isfinite(f) else None


def _normalize_text(s: str) -> str:
    return "".join(_strip_math(s).split())


def _numbers_equal(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-6)


# --------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------


def exact_reward(sample: Sample) -> float:
    """1.0 if the stripped response, or its last ``\\boxed{}`` content, equals str(label)."""
    if sample.label is None:
        return 0.0
    label = str(sample.label).strip()
    text = sample.response_text or ""
    if text.strip() == label:
        return 1.0
    boxed = last_boxed(text)
    return 1.0 if boxed is not None and boxed.strip() == label else 0.0


def math_reward(sample: Sample) -> float:
    """1.0 if the response's final answer equals the label, else 0.0.

    The answer is the last complete ``\\boxed{...}``; without one, the last
    number in the text; without either, the whole stripped text. Numbers are
    compared within 1e-6 relative tolerance; when neither side is numeric the
    normalised strings (no ``$``, whitespace, trailing period) are compared.
    A label of ``None`` scores 0.0.
    """
    if sample.label is None:
        return 0.0
    text = sample.response_text or ""
    answer = last_boxed(text)
    if answer is None:
        answer = last_number(text)
    if answer is None:
        answer = text
    want = parse_number(sample.label)
    got = parse_number(answer)
    if want is not None and got is not None:
        return 1.0 if _numbers_equal(got, want) else 0.0
    if want is None and got is None:
        label = sample.label if isinstance(sample.label, str) else str(sample.label)
        norm = _normalize_text(answer)
        return 1.0 if norm and norm == _normalize_text(label) else 0.0
    return 0.0


BUILTIN_REWARDS: dict[str, Callable[[Sample], float]] = {
    "exact": exact_reward,
    "math": math_reward,
}


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def _validate(spec: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward {spec!r} returned {type(value).__name__} {value!r} for {where}; expected a finite int or float"
        )
    f = float(value)
    if not math.isfinite(f):
        raise RewardError(f"reward {spec!r} returned {f!r} for {where}; expected a finite number")
    return f


class RewardFn:
    """A loaded reward function. Use ``load_reward`` to build one."""

    def __init__(self, spec: str, fn: Callable, *, builtin: bool = False):
        self.spec = spec
        self.fn = fn
        self.builtin = builtin
        self.per_group = bool(getattr(fn, "rollfleet_per_group", False))
        self.is_async = is_async_callable(fn)

    def __repr__(self) -> str:
        kind = "per_group" if self.per_group else "per_sample"
        return f"RewardFn({self.spec!r}, {kind})"

    async def score(self, samples: list[Sample]) -> list[float]:
        """One reward per sample, in order. Does not modify ``samples``."""
        samples = list(samples)
        if not samples:
            return []
        try:
            raw = await self._call(samples)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {self.spec!r} raised {type(e).__name__}: {e}") from e
        if self.per_group:
            if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__iter__"):
                raise RewardError(
                    f"per-group reward {self.spec!r} returned {type(raw).__name__}; "
                    f"expected a list of {len(samples)} floats"
                )
            raw = list(raw)
            if len(raw) != len(samples):
                raise RewardError(
                    f"per-group reward {self.spec!r} returned {len(raw)} values for {len(samples)} samples"
                )
        return [_validate(self.spec, v, f"sample {i}") for i, v in enumerate(raw)]

    async def _call(self, samples: list[Sample]) -> list[Any]:
        fn = self.fn
        if self.builtin:
            return [fn(s) for s in samples]
        if self.per_group:
            if self.is_async:
                return await fn(samples)
            result = await asyncio.to_thread(fn, samples)
            return await result if inspect.isawaitable(result) else result
        if self.is_async:
            return list(await asyncio.gather(*(fn(s) for s in samples)))
        # One thread hop for the whole group, not one per sample.
        results = await asyncio.to_thread(lambda: [fn(s) for s in samples])
        pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if pending:
            done = await asyncio.gather(*(results[i] for i in pending))
            for i, value in zip(pending, done, strict=True):
                results[i] = value
        return results


def load_reward(spec: str) -> RewardFn:
    """``"exact"``, ``"math"`` or ``"module:function"`` → ``RewardFn``."""
    spec, fn, builtin = resolve_spec(spec, BUILTIN_REWARDS, "reward")
    return RewardFn(spec, fn, builtin=builtin)
