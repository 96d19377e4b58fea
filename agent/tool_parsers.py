"""Tool calls read back from what the model wrote (``--tool-parser NAME|module:function``).

A parser is ``parse(text) -> (content, calls)``: the text outside the calls (None when there is
none) and a list of ``{"name": str, "arguments": dict}``. ``([], ...)`` means the model called no
tool. A parser never raises on model output: text it cannot read is plain content, as a model's
malformed call is plain text to the harness (``load`` wraps a custom parser so that holds).

Built in:

- ``hermes`` (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number
  of them, anywhere in the text (Hermes, Qwen 2.5/3 and the sim engine write this form); ``arguments``
  may be an object or a JSON string of one. Any block that is not such JSON makes the whole text
  plain content.
- ``none``: no tool calls, ever.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from common.config import TOOL_PARSERS
from common.errors import ConfigError
from common.plugins import import_callable

log = logging.getLogger("rollfleet.agent")

Parser = Callable[[str], tuple[str | None, list[dict]]]

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes(text: str) -> tuple[str | None, list[dict]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            return text, []
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if not calls or "<tool_call>" in rest:  # an unclosed block: not a call
        return text, []
    rest = rest.strip()
    return (rest or None), calls


def none(text: str) -> tuple[str | None, list[dict]]:
    return text, []


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


BUILT_IN: dict[str, Parser] = {"hermes": hermes, "none": none}
assert tuple(BUILT_IN) == TOOL_PARSERS  # the config checks names against common's list


def check(spec: str) -> None:
    """ConfigError naming ``--tool-parser`` unless ``spec`` names a parser (checked at start)."""
    load(spec)


def load(spec: str) -> Parser:
    """The parser named by ``spec``: a built-in name or ``module:function``."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    if ":" not in spec:
        raise ConfigError(f"--tool-parser {spec!r}: not one of {sorted(BUILT_IN)} and not module:function")
    fn = import_callable(spec, kind="tool-parser")

    def guarded(text: str) -> tuple[str | None, list[dict]]:
        try:
            content, calls = fn(text)
            calls = [{"name": str(c["name"]), "arguments": dict(c["arguments"])} for c in calls]
        except Exception as exc:  # a parser's bug must not fail the sample: the text is plain content
            log.warning("tool parser %s failed on the model's output (%s: %s); returned as content",
                        spec, type(exc).__name__, exc)  # fmt: skip
            return text, []
        return content, calls

    return guarded
