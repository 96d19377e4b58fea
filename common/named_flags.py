"""Flags of the form ``NAME=PATH[,OPTION=VALUE...]`` (``--dataset`` of a mixture, ``--eval-dataset``).

``parse_named(flag, text, options, usage)`` splits one value into ``(name, path, {option: value})``:
the name is ``[A-Za-z0-9_.-]+``, each option is converted by its type in ``options``, and the
sampling options shared by every such flag are checked (``n_samples`` and ``max_new_tokens`` at
least 1, ``temperature`` in [0, 100], ``top_p`` in (0, 1]). Every mistake is a ConfigError naming
the flag's value and what is wrong.
"""

from __future__ import annotations

import re

from common.errors import ConfigError

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_named(flag: str, text: str, options: dict[str, type], usage: str) -> tuple[str, str, dict]:
    """``(name, path, options)`` of ``text``, one value of ``flag``; ``usage`` is its form, for the error."""
    where = f"{flag} {text!r}"
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"{where}: expected {usage}")
    if not NAME.match(name):
        raise ConfigError(f"{where}: the name {name!r} may hold only letters, digits, '_', '.' and '-'")
    path, *items = rest.split(",")
    if not path:
        raise ConfigError(f"{where}: no PATH after {name}=")
    parsed: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in options:
            raise ConfigError(f"{where}: unknown option {key!r}; options: {', '.join(options)}")
        if not sep or value == "":
            raise ConfigError(f"{where}: option {key} needs a value ({key}=...)")
        if key in parsed:
            raise ConfigError(f"{where}: option {key} given twice")
        try:
            parsed[key] = options[key](value)
        except ValueError:
            raise ConfigError(f"{where}: {key} must be a {options[key].__name__}, got {value!r}") from None
    for key in ("n_samples", "max_new_tokens"):
        if key in parsed and parsed[key] < 1:
            raise ConfigError(f"{where}: {key} must be at least 1, got {parsed[key]}")
    if "temperature" in parsed and not 0 <= parsed["temperature"] <= 100:
        raise ConfigError(f"{where}: temperature must be in [0, 100], got {parsed['temperature']}")
    if "top_p" in parsed and not 0 < parsed["top_p"] <= 1:
        raise ConfigError(f"{where}: top_p must be in (0, 1], got {parsed['top_p']}")
    return name, path, parsed
