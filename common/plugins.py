"""Plugin loading: resolve a ``module:function`` spec (or a built-in name) to a callable.

Rewards, filters and any other user hook named on a command line go through here, on both the
coordinator (which checks a spec once at start, so a typo fails there and not on every agent) and
the agents (which call it). Errors are ``ConfigError`` naming the spec.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from common.errors import ConfigError


def import_callable(spec: str, kind: str = "reward") -> Callable:
    """Resolve ``"dotted.module:attr"`` (``attr`` may be dotted) to a callable.

    Raises ``ConfigError`` naming the spec when the module cannot be
    imported (including errors raised while importing it), the attribute
    is missing, or it is not callable.
    """
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ConfigError(f"{kind} {spec!r}: expected 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # a broken user module must still name the spec
        raise ConfigError(f"{kind} {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ConfigError(f"{kind} {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return obj


def resolve_spec(spec: str, builtins: dict[str, Callable], kind: str) -> tuple[str, Callable, bool]:
    """``(spec, fn, is_builtin)`` for a built-in name or ``module:function``; ConfigError otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{kind} spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in builtins:
        return spec, builtins[spec], True
    if ":" not in spec:
        raise ConfigError(f"unknown {kind} {spec!r}: use one of {', '.join(sorted(builtins))} or 'module:function'")
    return spec, import_callable(spec, kind), False


def is_async_callable(fn: Callable) -> bool:
    """True for coroutine functions, including callable objects with ``async __call__``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004
