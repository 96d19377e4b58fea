"""The prompt dataset the coordinator leases out: a JSONL file, one row a line.

Design: the coordinator may serve a multi-million-row dataset for days, so
its memory must not grow with row content, and a 10-million-row file must
load in seconds. ``Dataset`` reads the file once at load, in a streaming
pass over 1 MiB chunks that

* validates every row (so a bad row fails at start-up, naming file and
  line, not hours into a run),
* computes ``fingerprint`` (sha256 of the file bytes, used to detect that a
  resumed run points at a different file), and
* records a checkpoint, the byte offset and line number of every
  ``block_rows``-th row (``block_rows`` <= 64, chosen so a block is about
  16 KiB), in two ``array('q')``: 16 bytes per block, ~2.5 MB for 10M short
  rows.

``row(i)`` seeks to its block's checkpoint and reads forward to the row,
then parses that one line again.

``index_path`` (the coordinator passes ``<data dir>/dataset.index``) caches
the checkpoints: a later load of the same bytes with the same keys hashes
the file (~0.6 s per GB) and skips validation, which is most of a load
(~0.45 us per row). The cache is keyed by the fingerprint, never trusted for
it, so a changed file is still refused by the ledger.

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
if its size or mtime changed since, or if a line no longer parses.

Shuffling: ``epoch_permutation(n, data_epoch, seed)`` is the order in which
the rows of data epoch ``data_epoch`` are served: ``range(n)``, or a
``ShuffledOrder`` that computes ``order[pos]`` on demand (a keyed Feistel
permutation, O(1) memory), never a list of n indices.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from common.errors import Closed, ConfigError, DatasetError
from common.scan_workers import WorkerFailed, _scan_workers, _spans, _start_worker, _worker_result
from common.shuffle import SHUFFLE_ORDER, ShuffledOrder, epoch_permutation  # noqa: F401  (re-exported)

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency
    orjson = None

log = logging.getLogger(__name__)

__all__ = ["Dataset", "Row", "ShuffledOrder", "epoch_permutation"]

_JSON_TYPE = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


_CHUNK = 1 << 20
"""Bytes read per step of the load scan."""
_BLOCK_BYTES = 16 << 10
"""Rows per checkpoint are chosen so that a block is about this many bytes: what ``row`` re-reads."""
_MAX_BLOCK_ROWS = 64
_INDEX_FORMAT = "rollfleet-dataset-index-2"


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


def parse_line(line: bytes) -> Any:
    """One JSONL line parsed as the load scan parses it (``ValueError`` with a readable message)."""
    return _loads(line)


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


def _scan_span(f, lo: int, hi: int | None, input_key: str, block: int, hasher=None) -> tuple:
    """Validate the lines in ``[lo, hi)`` (``hi`` None: to the end) and checkpoint every ``block``-th row.

    Returns ``(rows, lines, offsets, line numbers, error)``: line numbers count from 1 at ``lo``;
    ``error`` is ``(line, message)`` for the first bad row (the rest is then partial), else None.
    """
    f.seek(lo)
    offsets, line_numbers = array("q"), array("q")
    rows = lineno = 0
    offset = lo  # of the next line
    carry = b""
    while True:
        want = _CHUNK if hi is None else min(_CHUNK, hi - offset - len(carry))
        data = f.read(want) if want > 0 else b""
        if hasher is not None:
            hasher.update(data)
        buf = carry + data if carry else data
        if data:
            cut = buf.rfind(b"\n") + 1
            if not cut:
                carry = buf
                continue
            carry, buf = buf[cut:], buf[:cut]
        elif not buf:
            break
        else:
            carry = b""
        lines = buf.split(b"\n")
        if not lines[-1]:
            lines.pop()
        for line in lines:
            lineno += 1
            if line.strip():
                try:
                    _check_row(_loads(line), input_key)
                except ValueError as e:
                    return rows, lineno, offsets, line_numbers, (lineno, str(e))
                if not rows % block:
                    offsets.append(offset)
                    line_numbers.append(lineno)
                rows += 1
            offset += len(line) + 1
        if not data:
            break
    return rows, lineno, offsets, line_numbers, None


def _scan_span_file(path: str, lo: int, hi: int | None, input_key: str, block: int) -> tuple:
    """``_scan_span`` in a worker process."""
    with open(path, "rb") as f:
        return _scan_span(f, lo, hi, input_key, block)


def _check_row(obj: Any, key: str) -> None:
    """Raise ValueError describing what is wrong with a parsed row, if anything."""
    if not isinstance(obj, dict):
        raise ValueError(f"row is a JSON {_json_type(obj)}, expected an object")
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
        raise ValueError(f"{key!r} must be a non-empty string or a list of messages, got a JSON {_json_type(prompt)}")
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


def _index_check(header: dict, body: bytes) -> str:
    """A digest of an index file's header and checkpoints: a damaged or edited index reads as a miss."""
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + b"\0" + body).hexdigest()


class Dataset:
    """A validated JSONL prompt file, indexed by a checkpoint every ``block_rows`` rows."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        input_key: str = "prompt",
        label_key: str = "label",
        index_path: str | os.PathLike | None = None,
    ):
        if not input_key or not isinstance(input_key, str):
            raise ConfigError(f"input_key must be a non-empty string, got {input_key!r}")
        if not isinstance(label_key, str) or label_key == input_key:
            raise ConfigError(f"label_key must be a string different from input_key, got {label_key!r}")
        self.path = os.fspath(path)
        self.input_key = input_key
        self.label_key = label_key
        self._size = 0
        self.block_rows = 1
        self._block_offsets = array("q")  # byte offset of row k * block_rows
        self._block_lines = array("q")  # its 1-based line number
        self._span_rows = array("q")  # first row of each span of the load scan (one span unless parallel)
        self._span_blocks = array("q")  # its first checkpoint
        self._file = None
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise DatasetError("file not found", path=self.path) from None
        except IsADirectoryError:
            raise DatasetError("is a directory, expected a JSONL file", path=self.path) from None
        except OSError as e:
            raise DatasetError(f"cannot open: {e.strerror or e}", path=self.path) from None
        self.index_path = os.fspath(index_path) if index_path is not None else None
        try:
            # Taken first: a change during the scan then shows as a changed file on the first read.
            st = os.fstat(self._file.fileno())
            self._stat = (st.st_size, st.st_mtime_ns)
            self.index_loaded = self._load_index()
            if not self.index_loaded:
                self.fingerprint = self._scan()
                self._save_index()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ load

    def _scan(self) -> str:
        """Validate every row and record the checkpoints; returns the fingerprint.

        A file of ``scan_workers._PARALLEL_BYTES`` or more is cut at line starts into one span per CPU (up to
        ``scan_workers._MAX_WORKERS``), validated by worker processes while this one hashes the whole file;
        each span's checkpoints start at its first row (``_span_rows``, ``_span_blocks``).
        """
        f = self._file
        f.seek(0)  # a missed index may have read it
        head = f.read(_CHUNK)
        lines = head.count(b"\n") or 1
        mean = max(1, (head.rfind(b"\n") + 1 or len(head)) // lines)
        block = self.block_rows = max(1, min(_MAX_BLOCK_ROWS, _BLOCK_BYTES // mean))
        spans = _spans(f, self._stat[0], _scan_workers(self._stat[0]))
        results = None
        if len(spans) > 1:
            try:
                results, fingerprint = self._scan_in_workers(spans, block)
            except (OSError, WorkerFailed) as e:
                log.warning("validating %s in worker processes failed (%s); validating it here", self.path, e)
        if results is None:
            hasher = hashlib.sha256()
            results = [_scan_span(f, 0, None, self.input_key, block, hasher)]
            fingerprint = hasher.hexdigest()
        rows = lines = 0
        for span_rows, span_lines, offsets, line_numbers, error in results:
            if error is not None:
                line, message = error
                raise DatasetError(message, path=self.path, line=lines + line)
            self._span_rows.append(rows)
            self._span_blocks.append(len(self._block_offsets))
            self._block_offsets.extend(offsets)
            self._block_lines.extend(line_numbers if not lines else array("q", (x + lines for x in line_numbers)))
            rows += span_rows
            lines += span_lines
        if not rows:
            what = "is empty" if lines == 0 else "has only blank lines"
            raise DatasetError(f"no rows: the file {what}", path=self.path)
        self._size = rows
        return fingerprint

    def _scan_in_workers(self, spans: list, block: int) -> tuple[list, str]:
        f = self._file
        workers = []
        try:
            workers.extend(_start_worker(self.path, lo, hi, self.input_key, block) for lo, hi in spans)
            hasher = hashlib.sha256()
            f.seek(0)
            while data := f.read(_CHUNK << 3):
                hasher.update(data)
            return [_worker_result(w) for w in workers], hasher.hexdigest()
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                w.wait()
                w.stdout.close()

    def _index_header(self) -> dict:
        return {
            "format": _INDEX_FORMAT,
            "byteorder": sys.byteorder,
            "input_key": self.input_key,
            "label_key": self.label_key,
        }

    def _load_index(self) -> bool:
        """Take the checkpoints from ``index_path`` if it was written for these exact bytes and keys.

        The file is hashed again in any case (~0.6 s per GB): the fingerprint is what the ledger
        compares, so it is never taken from the index. Anything unexpected reads as a miss.
        """
        if self.index_path is None:
            return False
        try:
            with open(self.index_path, "rb") as f:
                header = json.loads(f.readline())
                body = f.read()
        except (OSError, ValueError):
            return False
        if not isinstance(header, dict) or any(header.get(k) != v for k, v in self._index_header().items()):
            return False
        if header.pop("check", None) != _index_check(header, body):
            return False
        try:
            rows, block_rows = int(header["rows"]), int(header["block_rows"])
            blocks, spans = int(header["blocks"]), int(header["spans"])
        except (KeyError, TypeError, ValueError):
            return False
        if rows <= 0 or block_rows <= 0 or spans <= 0 or len(body) != 16 * (blocks + spans):
            return False
        hasher = hashlib.sha256()
        self._file.seek(0)
        while data := self._file.read(_CHUNK << 3):
            hasher.update(data)
        if hasher.hexdigest() != header.get("fingerprint"):
            return False
        parts = (self._block_offsets, self._block_lines, self._span_rows, self._span_blocks)
        for part, size in zip(parts, (blocks, blocks, spans, spans), strict=True):
            part.frombytes(body[: 8 * size])
            body = body[8 * size :]
        self.fingerprint, self._size, self.block_rows = header["fingerprint"], rows, block_rows
        return True

    def _save_index(self) -> None:
        """Write the checkpoints for the next load (atomically; a failure only costs that load a scan)."""
        if self.index_path is None:
            return
        header = {
            **self._index_header(),
            "fingerprint": self.fingerprint,
            "rows": self._size,
            "block_rows": self.block_rows,
            "blocks": len(self._block_offsets),
            "spans": len(self._span_rows),
            "path": self.path,
        }
        body = b"".join(
            a.tobytes() for a in (self._block_offsets, self._block_lines, self._span_rows, self._span_blocks)
        )
        header["check"] = _index_check(header, body)
        tmp = f"{self.index_path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.index_path)), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(json.dumps(header).encode() + b"\n" + body)
            os.replace(tmp, self.index_path)
        except OSError as e:
            log.warning("cannot write the dataset index %s (%s); the next start scans %s again", tmp, e, self.path)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _check_row(self, obj: Any) -> None:
        _check_row(obj, self.input_key)

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return self._size

    def row(self, i: int) -> Row:
        """Row ``i`` (0-based), re-read from disk: its block's checkpoint, then forward to the row."""
        if not 0 <= i < self._size:
            raise IndexError(f"row {i} out of range for {self._size} rows")
        f = self._file
        if f is None:
            raise Closed(f"dataset {self.path} is closed")
        st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != self._stat:
            # Checked before reading: a block's rows are found by counting lines from its checkpoint.
            raise DatasetError(
                f"row {i} cannot be read: the file changed after it was loaded (size or mtime differ)", path=self.path
            )
        span = bisect_right(self._span_rows, i) - 1
        block, skip = divmod(i - self._span_rows[span], self.block_rows)
        block += self._span_blocks[span]
        lineno = self._block_lines[block]
        f.seek(self._block_offsets[block])
        while True:
            line = f.readline()
            if line.strip():
                if not skip:
                    break
                skip -= 1
            elif not line:
                raise DatasetError(
                    f"row {i} is past the end; was the file changed after it was loaded?", path=self.path
                )
            lineno += 1
        try:
            obj = _loads(line)
            self._check_row(obj)
        except ValueError as e:
            raise DatasetError(
                f"row {i} no longer parses ({e}); was the file changed after it was loaded?",
                path=self.path,
                line=lineno,
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
