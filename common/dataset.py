"""The prompt dataset the coordinator leases out: a JSONL file, one row a line.

Design: the coordinator may serve a multi-million-row dataset for days, so
its memory must not grow with row content. ``Dataset`` reads the file once
at load, in a single streaming pass that

* validates every row (so a bad row fails at start-up, naming file and
  line, not hours into a run),
* computes ``fingerprint`` (sha256 of the file bytes, used to detect that a
  resumed run points at a different file), and
* records only each row's byte offset, in an ``array('q')`` (8 bytes/row).

``row(i)`` seeks to the offset and parses that one line again.

Row format: a JSON object with

* ``input_key`` (default ``"prompt"``): a non-empty string, or a non-empty
  list of chat messages ``{"role": str, "content": str | list, ...}``;
* ``label_key`` (default ``"label"``): any JSON value, optional (``None``
  when missing);
* any other keys: passed through as ``Row.metadata``.

Blank lines are skipped and do not count as rows; line numbers in errors
are the real 1-based file line numbers. Every problem raises
``DatasetError`` whose message reads ``<path>:<line>: <what is wrong>``.

The file must not change while it is loaded; ``row`` raises ``DatasetError``
if a line no longer parses.

Shuffling: ``epoch_permutation(n, data_epoch, seed)`` is the order in which
the rows of data epoch ``data_epoch`` are served.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.errors import Closed, ConfigError, DatasetError

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency
    orjson = None

__all__ = ["Dataset", "Row", "epoch_permutation"]

_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _json_type(value: Any) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def _loads(line: bytes) -> Any:
    """Parse one JSONL line, raising ``ValueError`` with a readable message.

    orjson is the fast path. It is stricter than json (no NaN/Infinity,
    no BOM, no integers beyond 64 bits), so on failure the line is retried
    with json: a row is accepted iff either parser accepts it, and the
    error message is json's, which names the column.
    """
    if orjson is not None:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"invalid UTF-8 at byte {e.start + 1} of the line") from None


@dataclass
class Row:
    """One dataset row."""

    index: int
    """0-based row index (blank lines are not rows)."""
    prompt: str | list
    """The ``input_key`` value: a string or a list of chat messages."""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    """The row's other keys."""


class Dataset:
    """A validated JSONL prompt file, indexed by byte offset."""

    def __init__(self, path: str | os.PathLike, *, input_key: str = "prompt", label_key: str = "label"):
        if not input_key or not isinstance(input_key, str):
            raise ConfigError(f"input_key must be a non-empty string, got {input_key!r}")
        if not isinstance(label_key, str) or label_key == input_key:
            raise ConfigError(f"label_key must be a string different from input_key, got {label_key!r}")
        self.path = os.fspath(path)
        self.input_key = input_key
        self.label_key = label_key
        self._offsets = array("q")
        self._file = None
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise DatasetError("file not found", path=self.path) from None
        except IsADirectoryError:
            raise DatasetError("is a directory, expected a JSONL file", path=self.path) from None
        except OSError as e:
            raise DatasetError(f"cannot open: {e.strerror or e}", path=self.path) from None
        try:
            self.fingerprint = self._scan()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ load

    def _scan(self) -> str:
        f = self._file
        hasher = hashlib.sha256()
        offsets = self._offsets
        check = self._check_row
        offset = 0
        lineno = 0
        for line in f:  # binary line iteration; the buffer is reused
            lineno += 1
            hasher.update(line)
            if line.strip():
                try:
                    check(_loads(line))
                except ValueError as e:
                    raise DatasetError(str(e), path=self.path, line=lineno) from None
                offsets.append(offset)
            offset += len(line)
        if not offsets:
            what = "is empty" if lineno == 0 else "has only blank lines"
            raise DatasetError(f"no rows: the file {what}", path=self.path)
        return hasher.hexdigest()

    def _check_row(self, obj: Any) -> None:
        """Raise ValueError describing what is wrong with a parsed row, if anything."""
        if not isinstance(obj, dict):
            raise ValueError(f"row is a JSON {_json_type(obj)}, expected an object")
        key = self.input_key
        if key not in obj:
            keys = list(obj)
            shown = ", ".join(str(k) for k in keys[:10]) + (", ..." if len(keys) > 10 else "")
            raise ValueError(f"missing key {key!r} (keys: {shown or 'none'})")
        prompt = obj[key]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"{key!r} is an empty string")
            return
        if not isinstance(prompt, list):
            raise ValueError(
                f"{key!r} must be a non-empty string or a list of messages, got a JSON {_json_type(prompt)}"
            )
        if not prompt:
            raise ValueError(f"{key!r} is an empty list of messages")
        for i, message in enumerate(prompt):
            where = f"{key!r} message {i}"
            if not isinstance(message, dict):
                raise ValueError(f"{where} is a JSON {_json_type(message)}, expected an object")
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise ValueError(f"{where} needs a non-empty string 'role'")
            if "content" not in message:
                raise ValueError(f"{where} is missing 'content'")
            if not isinstance(message["content"], (str, list)):
                raise ValueError(
                    f"{where} 'content' must be a string or a list, got a JSON {_json_type(message['content'])}"
                )

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return len(self._offsets)

    def row(self, i: int) -> Row:
        """Row ``i`` (0-based), re-read from disk."""
        if not 0 <= i < len(self._offsets):
            raise IndexError(f"row {i} out of range for {len(self._offsets)} rows")
        if self._file is None:
            raise Closed(f"dataset {self.path} is closed")
        offset = self._offsets[i]
        self._file.seek(offset)
        line = self._file.readline()
        try:
            obj = _loads(line)
            self._check_row(obj)
        except ValueError as e:
            raise DatasetError(
                f"row {i} at byte {offset} no longer parses ({e}); was the file changed after it was loaded?",
                path=self.path,
            ) from None
        label = obj.pop(self.label_key, None)
        prompt = obj.pop(self.input_key)
        return Row(index=i, prompt=prompt, label=label, metadata=obj)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Dataset({self.path!r}, rows={len(self)}, fingerprint={self.fingerprint[:12]})"


def epoch_permutation(n: int, data_epoch: int, seed: int | None) -> Sequence[int]:
    """The order in which rows are served in data epoch ``data_epoch``.

    ``seed is None`` → ``range(n)`` (file order every epoch). Otherwise a
    permutation of ``range(n)`` as ``array('q')``, a pure function of
    ``(n, seed, data_epoch)``: every epoch is shuffled differently, and the
    same epoch is shuffled identically in every process and after a restart
    (the RNG is seeded from a sha256 of the pair, not from ``hash()``, which
    varies per process).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seed is None:
        return range(n)
    digest = hashlib.sha256(f"rollfleet-epoch:{int(seed)}:{int(data_epoch)}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:16], "big"))
    order = list(range(n))
    rng.shuffle(order)
    return array("q", order)
