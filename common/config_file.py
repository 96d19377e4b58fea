"""``--config FILE.toml`` for ``coordinator serve`` and ``agent join``: a file of flag values.

A config file is a flat TOML table whose keys are the command's long flags without the leading
``--`` (``max-new-tokens`` or ``max_new_tokens``). Each value goes through the same type check as
the flag itself, so a file can hold nothing the command line would refuse, and every mistake is a
``ConfigError`` naming the file and the key:

- an unknown key (with the closest known one suggested), a nested table, or ``config`` itself;
- a value of the wrong TOML type (a boolean flag takes ``true``/``false``, a repeatable flag such
  as ``engine-url`` takes an array) or one the flag's own check refuses.

Precedence is command line over file over built-in defaults: the file's values become the parser's
defaults, so any flag given on the command line wins. A required flag given in the file is no longer
required on the command line. ``effective_config`` is what the process runs with, printed at start
(the values of ``SECRET_FLAGS`` as ``***``).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from typing import Any

from common.errors import ConfigError

_SKIP_DESTS = ("help", "config")

SECRET_FLAGS = ("engine-api-key",)
"""Flags whose value ``effective_config`` shows as ``REDACTED`` (it is logged at start)."""

REDACTED = "***"


def config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), or None."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def add_config_flag(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="read flag values from a TOML file (keys are flag names without '--'); command-line flags win",
    )


def _flags(sp: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long flag name (without ``--``) -> its action, for every action a file may set."""
    out: dict[str, argparse.Action] = {}
    for action in sp._actions:
        if action.dest in _SKIP_DESTS or not action.option_strings:
            continue
        negated = isinstance(action, argparse.BooleanOptionalAction)
        for opt in action.option_strings:
            if opt.startswith("--") and not (negated and opt.startswith("--no-")):
                out[opt[2:]] = action
    return out


def _given(action: argparse.Action, argv: list[str]) -> bool:
    opts = [o for o in action.option_strings if o.startswith("--")]
    if isinstance(action, argparse.BooleanOptionalAction):
        opts += [f"--no-{o[2:]}" for o in opts]
    return any(a == o or a.startswith(o + "=") for a in argv for o in opts)


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, argparse._StoreFalseAction):
            return not value
        return value
    if isinstance(action, argparse._AppendAction):
        # One value stands for a list of one (``dataset = "/data/p.jsonl"``).
        items = value if isinstance(value, list) else [value] if isinstance(value, (str, int, float)) else None
        if items is None or isinstance(value, bool):
            raise ConfigError(f"{where}: expected an array (the flag may be given several times), got {value!r}")
        return [_scalar(action, v, where) for v in items]
    if not isinstance(action, argparse._StoreAction):
        raise ConfigError(f"{where}: this flag cannot be set from a config file")
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, bool) or isinstance(value, (dict, list)) or value is None:
        raise ConfigError(f"{where}: expected a string or number, got {value!r}")
    text = str(value)
    try:
        out = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ConfigError(f"{where}: invalid choice {value!r} (choose from {choices})")
    return out


def load_config_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None


def apply_config_file(sp: argparse.ArgumentParser, path: str, argv: list[str]) -> dict:
    """Make ``path``'s values the defaults of ``sp``; returns the values set (by dest).

    ``argv`` is the command line: a repeatable flag given there replaces the file's list instead of
    being appended to it.
    """
    table = load_config_file(path)
    flags = _flags(sp)
    applied: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        where = f"{path}: key {key!r}"
        if isinstance(value, dict):
            raise ConfigError(f"{where} is a table; a config file holds flag values at the top level only")
        action = flags.get(name)
        if action is None:
            close = difflib.get_close_matches(name, list(flags), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: not a flag of {sp.prog}{hint}")
        if action.dest in applied:
            raise ConfigError(f"{where}: set twice (as {name!r} and another spelling)")
        converted = _convert(action, value, where)
        applied[action.dest] = converted
        if isinstance(action, argparse._AppendAction) and _given(action, argv):
            continue
        action.required = False
        sp.set_defaults(**{action.dest: converted})
    return applied


def effective_config(sp: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every flag's value as the process will run with it (by long flag name), for the start-up log."""
    out: dict[str, Any] = {}
    for action in sp._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if action.dest in _SKIP_DESTS or not longs or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if longs[0][2:] in SECRET_FLAGS and value:
            value = REDACTED
        out[longs[0][2:]] = value if isinstance(value, (str, int, float, bool, list, type(None))) else str(value)
    return dict(sorted(out.items()))


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, dict | None]:
    """Parse ``argv`` with ``parser``, applying ``--config`` to the sub-command that takes one.

    ``parser.config_commands`` maps sub-command names to their parsers. Returns the parsed args and,
    for those sub-commands, the effective config (None for the others).
    """
    commands: dict = getattr(parser, "config_commands", {})
    sp = commands.get(argv[0]) if argv else None
    path = config_path(argv[1:]) if sp is not None else None
    if path is not None:
        apply_config_file(sp, path, argv[1:])
    args = parser.parse_args(argv)
    return args, (effective_config(sp, args) if sp is not None else None)
