"""Chat-message rows checked against the chat template that will render them, before anything is leased.

A row whose prompt is a list of chat messages reaches the model only through a tokenizer's chat
template, on the agent, hours into a run. A template that cannot render it (a role it does not
know, a missing ``content``, a content part it has no rule for) would fail that prompt on every
try and count it against the run. The coordinator is told the tokenizer (``coordinator serve
--tokenizer``) and refuses such a row at its start, with ``<file>:<line>: <what the template
said>``, as it refuses a malformed row.

Cost: a template's result depends on the messages' structure, not on their words, so each
distinct *shape* (per message: its role, its keys, and whether its content is a string or which
part types its list holds) is rendered once, on the first row that has it; the rows of a typical
dataset share a handful of shapes. The pass reads every line once (about 1 us a row) and is
remembered beside the ledger, keyed by the file's fingerprint, the input key and the template's
digest, so a restart on the same file and template skips it.

What this does not catch: a template whose own code fails on the *text* of a message (rather
than its structure) fails on the agent, naming the template, and the prompt is filtered after its
tries, as any prompt that keeps failing is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from typing import Any

from common.dataset import Dataset, parse_line
from common.errors import DatasetError

log = logging.getLogger(__name__)

_CACHE_FORMAT = "rollfleet-chat-check-1"
_MAX_SHAPES = 100_000
"""Distinct shapes remembered; past that every further chat row is rendered (same cost, no memory growth)."""


def message_shape(messages: list) -> tuple:
    """What a chat template's output depends on, apart from the words: role, keys and content kind of each message."""
    shape = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            kind: Any = tuple(p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content)
        else:
            kind = type(content).__name__
        shape.append((m.get("role"), tuple(sorted(m)), kind))
    return tuple(shape)


def template_digest(tokenizer: Any) -> str:
    """sha256 of the tokenizer's name and chat template: the cache key's part that a new template changes."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(f"{tokenizer.name}\0{template}".encode()).hexdigest()


def check_chat_rows(dataset: Dataset, tokenizer: Any, *, cache_path: str | None = None) -> int:
    """Raise ``DatasetError`` (file and line) for the first chat row ``tokenizer`` cannot render; return chat rows.

    ``tokenizer`` is a :class:`common.tokenizer.Tokenizer`; one without ``render_chat`` (the byte
    tokenizer, which flattens messages to text) renders every structurally valid row, so only
    an HF tokenizer is checked. With ``cache_path``, a pass that found nothing wrong is recorded
    there and not repeated for the same file, input key and template.
    """
    render = getattr(tokenizer, "render_chat", None)
    if render is None:
        return 0
    key = {
        "format": _CACHE_FORMAT,
        "fingerprint": dataset.fingerprint,
        "input_key": dataset.input_key,
        "template": template_digest(tokenizer),
    }
    if cache_path is not None and _cached(cache_path) == key:
        return -1
    started = time.monotonic()
    seen: set[tuple] = set()
    chat_rows = 0
    with open(dataset.path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = parse_line(line).get(dataset.input_key)
            except (ValueError, AttributeError) as exc:  # the file changed after its load scan
                msg = f"cannot be read again for the chat check: {exc}"
                raise DatasetError(msg, path=dataset.path, line=lineno) from None
            if not isinstance(prompt, list):
                continue
            chat_rows += 1
            shape = message_shape(prompt)
            if shape in seen:
                continue
            if len(seen) < _MAX_SHAPES:
                seen.add(shape)
            try:
                render(prompt)
            except ValueError as exc:
                raise DatasetError(str(exc), path=dataset.path, line=lineno) from None
    seconds = time.monotonic() - started
    if chat_rows:
        log.info(
            "%s: %d chat rows (%d shapes) render with the chat template of %s (%.1f s)",
            dataset.path,
            chat_rows,
            len(seen),
            tokenizer.name,
            seconds,
        )
    if cache_path is not None:
        _remember(cache_path, key)
    return chat_rows


def _cached(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remember(path: str, key: dict) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(key, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record the chat check in %s (%s); the next start checks again", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
