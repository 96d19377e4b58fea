"""rollfleet-sim: a CPU engine that speaks SGLang's native HTTP API.

It is a real aiohttp server, not a mock: the agent, coordinator and benchmarks
drive it exactly as they drive ``sglang.launch_server`` (the contract is
SGLang 0.5.15.post1's native HTTP API, plus the 0.5.23 details named
below). It uses the byte
vocabulary of :class:`common.tokenizer.ByteTokenizer` and reports
``tokenizer_path == BYTE_TOKENIZER_NAME`` so clients pick the same tokenizer.

Design
------
Every ``/generate`` call expands into *samples* (batch items x ``n``). A
sample passes four stages, the same ones SGLang has:

1. **Pause gate.** While the engine is paused (any mode) new samples wait
   here. Like SGLang's tokenizer manager, ``/abort_request`` does not reach a
   sample held at the gate (only a client disconnect does).
2. **Reader lock.** In-flight samples hold a reader lock. An unpaused weight
   update takes the writer lock: it waits for the readers to drain and new
   samples queue behind it. While paused, weight updates skip the lock.
3. **Scheduler.** ``--slots`` (``max_running_requests``) samples decode at
   once; the rest sit in a FIFO waiting queue. An abort of a queued sample
   finishes it at once with ``{"type":"abort","message":"Abort in waiting
   queue"}`` and no ``prompt_tokens``; an abort of a running sample finishes
   it with ``{"type":"abort","message":"Aborted","status_code":null,
   "err_type":null}`` and the partial output. Both are HTTP 200.
4. **Decode.** The whole output (ids, text, logprobs) is built once when the
   sample gets a slot; "decoding" only moves a position through it. With
   ``--token-latency-ms 0`` (the default, "instant" mode) there is no sleep
   at all. Otherwise a sample sleeps once per chunk of tokens (a stream
   chunk, or >= 20 ms of tokens, or <= 0.5 s for non-stream requests); an
   abort or pause interrupts the sleep and credits the tokens produced so far.

Abort semantics (``/abort_request``), as in SGLang: an empty rid without
``abort_all`` is ignored; a rid that is not exactly a live request id is
ignored (tokenizer-manager check); otherwise every scheduler-held request whose
rid *starts with* it is aborted (scheduler prefix match), so aborting
``req-1`` also aborts ``req-10``. ``abort_all`` reaches the waiting queue and
the running slots, not the pause gate. A client disconnect aborts its samples.

Pause: ``abort`` mode aborts everything in the scheduler (repeating until no
generate call holds the reader lock) and holds new requests at the gate;
``retract`` and ``in_place`` freeze running samples where they are (they stop
producing tokens) and hold new ones, until ``/continue_generation``. While
paused, ``/health`` blocks up to ``--health-timeout`` and then answers 503
(SGLang's pitfall: its probe goes through the pause gate).

Output model: the prompt's bytes are searched for the last ``a + b`` /
``a - b`` / ``a * b``; the reply is reasoning filler ending in ``The answer
is \\boxed{X}.`` (X correct with probability ``--accuracy``, else off by 1-3;
a random integer without arithmetic). The length is drawn from
``--output-len-dist``; below ``max_new_tokens`` the sample ends with EOS (257,
``finish_reason {"type":"stop","matched":257}``), else it is cut at
``max_new_tokens`` (``length``), usually before the answer. Logprobs are
deterministic pseudo-random floats in [-3, 0). Temperature 0 is greedy: the
same prompt gives the same output; ``sampling_seed`` makes sampling
reproducible; otherwise samples come from the engine's ``--seed``-ed RNG.

Faithful to SGLang: request/response fields and ``finish_reason`` shapes,
batch and ``n > 1`` expansion (``"{rid}_{i}"`` rids for batches, fresh uuids
for ``n > 1``), cumulative SSE chunks every ``stream_interval`` tokens ending
with ``data: [DONE]``, error chunks inside a stream for request errors,
duplicate-rid / empty / out-of-vocabulary / over-long input 400s, unknown
sampling keys 400 (0.5.23 behaviour), stop strings and ``stop_token_ids``
(with ``no_stop_trim``), ``min_new_tokens``, ``ignore_eos``,
``logprob_start_len``, ``return_text_in_logprobs``, ``return_prompt_token_ids``,
``weight_versions`` spans (0.5.23; half-open ``[start, end)`` output-token
ranges), pause modes, reader/writer lock of weight updates, ``/flush_cache``
only when idle, ``/health`` while paused, endpoint aliases.

Simplified: one DP rank, no real KV pool (``cached_tokens`` comes from an
exact-prompt cache that flush/weight updates clear; ``max_total_num_tokens`` is
nominal); ``retract`` behaves like ``in_place``; an abort of a frozen
(paused) running sample finishes it at once instead of after ``continue``;
abort credits the tokens produced so far rather than "one more step";
``top_p``/``top_k``/penalties/grammars/``logit_bias`` are validated but do not
change the output; stop strings are not held back from intermediate stream
chunks; ``top_logprobs_num``, ``token_ids_logprob``, hidden states, routed
experts and multimodal inputs are not produced (the fields are ignored,
except ``input_embeds``, which is refused); ``/generate`` answers 503 while
the engine is starting (``--startup-delay``) or ``--unhealthy`` (SGLang opens
its port only once ready); a failed ``/flush_cache`` explains itself in the 400 text; the
``/v1/loads`` ``include``/``format`` parameters are ignored (JSON, core fields).

Endpoints: ``/generate`` (POST, PUT), ``/abort_request``, ``/health``,
``/health_generate``, ``/ready``, ``/model_info`` (``/get_model_info``),
``/server_info`` (``/get_server_info``), ``/v1/loads``, ``/flush_cache`` (GET,
POST, ``?timeout=``), ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``, ``/update_weight_version`` (its
``abort_all_requests`` defaults to true, as in SGLang).

Command line: the flags of :func:`add_arguments`; the common
``sglang.launch_server`` flags are accepted too (``--max-running-requests``,
``--model``, ``--random-seed`` are aliases; ``--tp-size``/``--dp-size`` are
only reported, the rest have no effect); any other flag is an error (exit 2).

Non-SGLang fault hooks: ``POST /rollfleet/crash`` replies 200
``{"status":"crashing","exit_code":17}`` and then exits the process with
``os._exit(17)`` (in-flight requests see dropped connections);
``--crash-after-requests N`` exits with code 17 right after the response to the
N-th successful ``/generate`` call has been sent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import deque
from datetime import datetime, timezone
from typing import Any, Callable

import orjson
from aiohttp import web

from common.tokenizer import BYTE_TOKENIZER_NAME, ByteTokenizer

__all__ = ["SimEngine", "make_app", "add_arguments", "run", "main", "VERSION", "CRASH_EXIT_CODE"]

log = logging.getLogger("rollfleet.sim_engine")

VERSION = "rollfleet-sim"
CRASH_EXIT_CODE = 17

_TOK = ByteTokenizer()
EOS = ByteTokenizer.EOS
VOCAB_SIZE = ByteTokenizer.vocab_size

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
        "ignore_eos", "min_new_tokens", "n", "no_stop_trim", "skip_special_tokens",
        "spaces_between_special_tokens", "repetition_penalty", "frequency_penalty",
        "presence_penalty", "sampling_seed", "custom_params", "stream_interval", "json_schema",
        "regex", "ebnf", "logit_bias", "stop_regex",
    }
)

# Text of each token id when ``return_text_in_logprobs`` is set.
_TOKEN_TEXT = [bytes((i,)).decode("utf-8", "replace") for i in range(256)] + ["<|bos|>", "<|eos|>", "<|pad|>"]

_ARITH = re.compile(rb"(\d{1,12})\s*([-+*])\s*(\d{1,12})")

_FILLER_SENTENCES = (
    "Let me think about this step by step. ",
    "First, I restate the problem in my own words. ",
    "Now I check the arithmetic carefully. ",
    "Let me verify this intermediate result once more. ",
    "Hmm, wait, I should double-check that step. ",
    "Carrying the digits over gives the next partial result. ",
    "This approach is consistent with the question. ",
    "So far everything adds up. ",
    "Next, I combine the partial results. ",
    "The usual rules of arithmetic apply here directly. ",
    "I write the numbers one under the other. ",
    "Breaking the numbers into tens and ones makes this easier. ",
)


def _build_filler(size: int = 1 << 16) -> bytes:
    rng = random.Random(20240611)
    parts, n = [], 0
    while n < size:
        s = rng.choice(_FILLER_SENTENCES)
        parts.append(s)
        n += len(s)
    return "".join(parts).encode("ascii")[:size]


_FILLER = _build_filler()
_FILLER_HALF = len(_FILLER) // 2
_FILLER_STARTS = [m.end() for m in re.finditer(rb"\. ", _FILLER[:_FILLER_HALF])]

# Request states.
_GATE, _WAITING, _RUNNING, _WAIT_ABORTED, _DONE = range(5)

_ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def _abort_running() -> dict:
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class _SchemaError(Exception):
    """Body fails the request schema (0.5.23 checks it first): always HTTP 400."""


class _ReqError(Exception):
    """A ValueError in SGLang's tokenizer manager: 400, or an error chunk in a stream."""


def _filler(rng: random.Random, n: int) -> bytes:
    if n <= 0:
        return b""
    if n <= _FILLER_HALF:
        off = rng.choice(_FILLER_STARTS)
        return _FILLER[off : off + n]
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def _wake(fut: asyncio.Future, value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


# --------------------------------------------------------------------------- params


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _SP:
    """Validated sampling parameters of one batch item."""

    __slots__ = (
        "max_new_tokens", "temperature", "stop", "stop_token_ids", "ignore_eos", "min_new_tokens",
        "n", "no_stop_trim", "sampling_seed", "stream_interval",
    )

    def __init__(self, d: Any):
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise _SchemaError("sampling_params must be an object")
        unknown = [k for k in d if k not in SAMPLING_KEYS]
        if unknown:
            raise _SchemaError(
                f"Unknown sampling parameter(s): {', '.join(sorted(unknown))}. "
                f"Allowed keys: {', '.join(sorted(SAMPLING_KEYS))}"
            )

        def num(key: str, default: float) -> float:
            v = d.get(key)
            if v is None:
                return default
            if not _is_num(v):
                raise _SchemaError(f"sampling_params.{key} must be a number, got {v!r}")
            return float(v)

        def integer(key: str, default: Any) -> Any:
            v = d.get(key)
            if v is None:
                return default
            if not _is_int(v):
                raise _SchemaError(f"sampling_params.{key} must be an integer, got {v!r}")
            return v

        def boolean(key: str, default: bool) -> bool:
            v = d.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise _SchemaError(f"sampling_params.{key} must be a boolean, got {v!r}")
            return v

        # An explicit null means "up to the context limit", as in SGLang.
        self.max_new_tokens = None if "max_new_tokens" in d and d["max_new_tokens"] is None else integer(
            "max_new_tokens", 128
        )
        self.temperature = num("temperature", 1.0)
        top_p = num("top_p", 1.0)
        top_k = integer("top_k", -1)
        min_p = num("min_p", 0.0)
        rep = num("repetition_penalty", 1.0)
        freq = num("frequency_penalty", 0.0)
        pres = num("presence_penalty", 0.0)
        self.min_new_tokens = integer("min_new_tokens", 0)
        self.n = integer("n", 1)
        self.sampling_seed = integer("sampling_seed", None)
        self.stream_interval = integer("stream_interval", None)
        self.ignore_eos = boolean("ignore_eos", False)
        self.no_stop_trim = boolean("no_stop_trim", False)
        boolean("skip_special_tokens", True)
        boolean("spaces_between_special_tokens", True)

        stop = d.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise _SchemaError("sampling_params.stop must be a string or a list of strings")
        self.stop = [s.encode("utf-8") for s in stop if s]
        sti = d.get("stop_token_ids")
        if sti is None:
            sti = []
        elif not (isinstance(sti, list) and all(_is_int(t) for t in sti)):
            raise _SchemaError("sampling_params.stop_token_ids must be a list of integers")
        self.stop_token_ids = sorted({t for t in sti if 0 <= t < 256})
        stop_regex = d.get("stop_regex")
        if stop_regex is not None and not isinstance(stop_regex, (str, list)):
            raise _SchemaError("sampling_params.stop_regex must be a string or a list of strings")
        for key in ("json_schema", "regex", "ebnf"):
            if d.get(key) is not None and not isinstance(d[key], str):
                raise _SchemaError(f"sampling_params.{key} must be a string")
        for key in ("custom_params", "logit_bias"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise _SchemaError(f"sampling_params.{key} must be an object")

        # SamplingParams.verify() messages.
        if self.temperature < 0.0:
            raise _ReqError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise _ReqError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise _ReqError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k < 1 and top_k != -1:
            raise _ReqError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if not -2.0 <= freq <= 2.0:
            raise _ReqError(f"frequency_penalty must be in [-2, 2], got {freq}.")
        if not -2.0 <= pres <= 2.0:
            raise _ReqError(f"presence_penalty must be in [-2, 2], got {pres}.")
        if not 0.0 < rep <= 2.0:
            raise _ReqError(f"repetition_penalty must be in (0, 2], got {rep}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise _ReqError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0 or (
            self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens
        ):
            raise _ReqError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.n < 1:
            raise _ReqError(f"n must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise _ReqError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if sum(d.get(k) is not None for k in ("json_schema", "regex", "ebnf")) > 1:
            raise _ReqError("Only one of regex, json_schema, or ebnf can be set.")


class _Prompt:
    __slots__ = ("ids", "key", "answer")

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.key = hash(tuple(ids))  # ints only: stable across processes
        self.answer = _find_answer(ids)


def _find_answer(ids: list[int]) -> int | None:
    try:
        data = bytes(ids[-8192:])
    except ValueError:
        data = bytes(i for i in ids[-8192:] if i < 256)
    last = None
    for last in _ARITH.finditer(data):
        pass
    if last is None:
        return None
    a, op, b = int(last.group(1)), last.group(2), int(last.group(3))
    if op == b"+":
        return a + b
    if op == b"-":
        return a - b
    return a * b


class _Req:
    """One sample: a single output sequence with its own rid."""

    __slots__ = (
        "rid", "index", "prompt", "sp", "max_new", "want_lp", "lp_text", "lp_start", "want_prompt_ids",
        "t0", "state", "reader", "admit", "wake", "aborted", "wait_aborted", "prepared", "pos", "total",
        "content", "out_ids", "finish", "text_end", "triples", "input_lps", "cached", "spans", "si",
        "emit", "request",
    )

    def __init__(self, rid: str, index: int, prompt: _Prompt, sp: _SP, max_new: int, data: dict, si: int):
        self.rid = rid
        self.index = index
        self.prompt = prompt
        self.sp = sp
        self.max_new = max_new
        self.want_lp = bool(data.get("return_logprob"))
        self.lp_text = bool(data.get("return_text_in_logprobs"))
        lsl = data.get("logprob_start_len")
        self.lp_start = -1 if lsl is None else lsl
        self.want_prompt_ids = bool(data.get("return_prompt_token_ids"))
        self.t0 = time.perf_counter()
        self.state = _GATE
        self.reader = False
        self.admit: asyncio.Future | None = None
        self.wake: asyncio.Future | None = None
        self.aborted = False
        self.wait_aborted = False
        self.prepared = False
        self.pos = 0
        self.total = 0
        self.content = b""
        self.out_ids: list[int] = []
        self.finish: dict | None = None
        self.text_end = 0
        self.triples: list = []
        self.input_lps: list = []
        self.cached = 0
        self.spans: list[dict] = []
        self.si = si
        self.emit: Callable | None = None
        self.request: web.Request | None = None


# --------------------------------------------------------------------------- locks


class _RWLock:
    """Writer-preferring reader/writer lock (SGLang's model_update_lock)."""

    def __init__(self) -> None:
        self.readers = 0
        self.writer = False
        self._no_writer = asyncio.Event()
        self._no_writer.set()
        self.drained = asyncio.Event()
        self.drained.set()

    async def acquire_read(self) -> None:
        while self.writer:
            await self._no_writer.wait()
        self.readers += 1
        self.drained.clear()

    def release_read(self) -> None:
        self.readers -= 1
        if self.readers <= 0:
            self.readers = 0
            self.drained.set()

    async def acquire_write(self) -> None:
        while self.writer:
            await self._no_writer.wait()
        self.writer = True
        self._no_writer.clear()
        try:
            while self.readers:
                await self.drained.wait()
        except BaseException:
            self.release_write()
            raise

    def release_write(self) -> None:
        self.writer = False
        self._no_writer.set()


# --------------------------------------------------------------------------- engine


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _http_error(status: int, message: str) -> web.Response:
    """SGLang's HTTPException body."""
    names = {400: "Bad Request", 404: "Not Found", 503: "Service Unavailable", 500: "Internal Server Error"}
    return _json(
        {"object": "error", "message": message, "type": names.get(status, str(status)), "param": None, "code": status},
        status,
    )


def _error_400(message: str) -> web.Response:
    return _json({"error": {"message": message}}, 400)


class SimEngine:
    """State of one simulated engine (slots, queues, pause gate, weights)."""

    def __init__(self, args: argparse.Namespace | None = None, **overrides: Any):
        parser = argparse.ArgumentParser(add_help=False)
        add_arguments(parser)
        cfg = vars(parser.parse_args(["--port", "0"]))
        unknown = set(overrides) - set(cfg)
        if unknown:
            raise TypeError(f"unknown SimEngine option(s): {sorted(unknown)}")
        if args is not None:
            cfg.update(vars(args))
        cfg.update(overrides)
        self.config = cfg
        self.host: str = cfg["host"]
        self.port: int = cfg["port"]
        self.slots: int = max(1, int(cfg["slots"]))
        self.token_s: float = max(0.0, float(cfg["token_latency_ms"])) / 1000.0
        self.prefill_s: float = max(0.0, float(cfg["prefill_latency_ms"])) / 1000.0
        self.stream_interval: int = max(1, int(cfg["stream_interval"]))
        self.len_dist: str = cfg["output_len_dist"]
        self.len_median: int = max(1, int(cfg["output_len_median"]))
        self.len_sigma: float = float(cfg["output_len_sigma"])
        self.len_max: int = max(1, int(cfg["output_len_max"]))
        self.accuracy: float = float(cfg["accuracy"])
        self.seed: int = int(cfg["seed"])
        self.context_length: int = int(cfg["context_length"])
        self.weight_version: str = str(cfg["weight_version"])
        self.model_path: str = str(cfg["model_path"])
        self.startup_delay: float = float(cfg["startup_delay"])
        self.unhealthy: bool = bool(cfg["unhealthy"])
        self.health_timeout: float = float(cfg["health_timeout"])
        self.crash_after: int = int(cfg["crash_after_requests"] or 0)
        self.crash_fn: Callable[[int], Any] = os._exit
        self.max_total_num_tokens = max(self.context_length, self.slots * 4096)
        self.max_req_input_len = self.context_length - 1

        self._rng = random.Random(self.seed)
        self._log_median = math.log(self.len_median)
        self._min_batch = max(1, math.ceil(0.02 / self.token_s)) if self.token_s else 1
        self._nonstream_chunk = max(1, int(0.5 / self.token_s)) if self.token_s else 1
        self._ready_at = time.monotonic() + max(0.0, self.startup_delay)

        self._rids: set[str] = set()  # every in-flight rid (duplicate check)
        self._sched: dict[str, _Req] = {}  # waiting + running
        self._waitq: deque[_Req] = deque()
        self._free = self.slots
        self.n_running = 0
        self._paused = False
        self._pause_mode = ""
        self._frozen = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._rw = _RWLock()
        self._prefix_cache: set[int] = set()
        self._gen_tokens = 0
        self._prompt_tokens = 0
        self._cached_tokens_total = 0
        self._tp_mark = (time.monotonic(), 0)
        self._gen_throughput = 0.0
        self._ok_calls = 0

    # ------------------------------------------------------------ status

    def is_ready(self) -> bool:
        return not self.unhealthy and time.monotonic() >= self._ready_at

    @property
    def status(self) -> str:
        if self.unhealthy:
            return "UnHealthy"
        return "Up" if self.is_ready() else "Starting"

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_waiting(self) -> int:
        return len(self._waitq)

    def _idle(self) -> bool:
        return self.n_running == 0 and not self._waitq

    def crash(self, why: str) -> None:
        log.error("rollfleet-sim crashing on purpose (%s): exit %d", why, CRASH_EXIT_CODE)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            self.crash_fn(CRASH_EXIT_CODE)

    # ------------------------------------------------------------ request building

    def _build(self, data: dict) -> tuple[list[_Req], bool]:
        if data.get("input_embeds") is not None:
            raise _ReqError("input_embeds is not supported by rollfleet-sim")
        text, ids = data.get("text"), data.get("input_ids")
        if (text is None) == (ids is None):
            raise _ReqError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            if isinstance(text, str):
                raw, batch = [_TOK.encode(text)], False
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                raw, batch = [_TOK.encode(t) for t in text], True
            else:
                raise _SchemaError("text must be a string or a list of strings")
        else:
            if not isinstance(ids, list):
                raise _SchemaError("input_ids must be a list of integers or a list of lists of integers")
            if ids and isinstance(ids[0], list):
                raw, batch = ids, True
            else:
                raw, batch = [ids], False
            for p in raw:
                if not isinstance(p, list) or not all(_is_int(t) for t in p):
                    raise _SchemaError("input_ids must be a list of integers or a list of lists of integers")
        B = len(raw)
        spd = data.get("sampling_params")
        if isinstance(spd, list):
            if not batch or len(spd) != B:
                raise _ReqError("sampling_params must be an object or a list with one object per batch item.")
            sps = [_SP(d) for d in spd]
        else:
            sp = _SP(spd)
            sps = [sp] * B
        if not raw:
            raise _ReqError("The batch is empty.")
        for p in raw:
            if not p:
                raise _ReqError("The input_ids cannot be empty.")
            if min(p) < 0 or max(p) >= VOCAB_SIZE:
                raise _ReqError(
                    f"The input_ids {[t for t in p if not 0 <= t < VOCAB_SIZE][:8]} contain token id(s) "
                    f"outside the vocabulary [0, {VOCAB_SIZE})."
                )
        n = sps[0].n
        if any(sp.n != n for sp in sps):
            raise _ReqError("The n parameter must be the same for all requests in a batch.")

        for key in ("stream", "return_logprob", "return_text_in_logprobs", "return_prompt_token_ids"):
            v = data.get(key)
            if v is not None and not isinstance(v, bool):
                raise _SchemaError(f"{key} must be a boolean")
        lsl = data.get("logprob_start_len")
        if lsl is not None and not _is_int(lsl):
            raise _SchemaError("logprob_start_len must be an integer")

        rid = data.get("rid")
        if n > 1 or rid is None:
            rids = [uuid.uuid4().hex for _ in range(B * n)]
        elif isinstance(rid, str):
            rids = [f"{rid}_{i}" for i in range(B)] if batch else [rid]
        elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
            if not batch or len(rid) != B:
                raise _ReqError("The rid should be a list of the same length as the batch.")
            rids = list(rid)
        else:
            raise _SchemaError("rid must be a string or a list of strings")
        seen: set[str] = set()
        for r in rids:
            if r in self._rids or r in seen:
                raise _ReqError(f"Duplicate request ID detected: {r}")
            seen.add(r)

        ctx = self.context_length
        prompts = []
        for p, sp in zip(raw, sps):
            L = len(p)
            if L > self.max_req_input_len:
                raise _ReqError(f"The input ({L} tokens) is longer than the model's context length ({ctx} tokens).")
            max_new = ctx - L if sp.max_new_tokens is None else sp.max_new_tokens
            if L + max_new > ctx:
                raise _ReqError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                    f"You requested a total of {L + max_new} tokens: {L} tokens from the input messages and "
                    f"{max_new} tokens for the completion. Please reduce the number of tokens in the input "
                    f"messages or the completion to fit within the limit."
                )
            if data.get("return_logprob") and lsl is not None and lsl > L:
                raise _ReqError(f"logprob_start_len ({lsl}) is larger than the prompt length ({L}).")
            prompts.append((_Prompt(p), sp, max_new))

        reqs = []
        k = 0
        for prompt, sp, max_new in prompts:
            si = sp.stream_interval or self.stream_interval
            for _ in range(n):
                reqs.append(_Req(rids[k], k, prompt, sp, max_new, data, si))
                k += 1
        self._rids.update(rids)
        return reqs, batch or n > 1

    def _prepare(self, req: _Req) -> None:
        """Build the sample's whole output once, when it gets a slot."""
        prompt, sp = req.prompt, req.sp
        if sp.temperature < 1e-6:
            seed = hash((self.seed, prompt.key))
        elif sp.sampling_seed is not None:
            seed = hash((self.seed, prompt.key, sp.sampling_seed))
        else:
            seed = self._rng.getrandbits(64)
        rng = random.Random(seed)
        max_new = req.max_new

        if self.len_dist == "fixed":
            drawn = self.len_median
        else:
            drawn = int(rng.lognormvariate(self._log_median, self.len_sigma))
        drawn = max(1, min(drawn, self.len_max), sp.min_new_tokens)

        if prompt.answer is None:
            x = rng.randint(0, 100)
        elif rng.random() < self.accuracy:
            x = prompt.answer
        else:
            x = prompt.answer + rng.choice((-3, -2, -1, 1, 2, 3))
        ans = b" The answer is \\boxed{" + str(x).encode() + b"}."

        body_len = drawn - 1  # tokens before EOS
        eos = not sp.ignore_eos and drawn < max_new
        if eos:
            content = (_filler(rng, body_len - len(ans)) + ans)[:body_len]
        else:
            if body_len - len(ans) >= max_new:
                content = _filler(rng, max_new)
            else:
                content = (_filler(rng, body_len - len(ans)) + ans)[:body_len]
                if len(content) < max_new:
                    content += b" " + _filler(rng, max_new - len(content) - 1)
                content = content[:max_new]

        best = None  # (end, start, matched)
        for t in sp.stop_token_ids:
            i = content.find(bytes((t,)))
            if i >= 0 and (best is None or i + 1 < best[0]):
                best = (i + 1, i, t)
        for s in sp.stop:
            i = content.find(s)
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s.decode("utf-8", "replace"))
        if best is not None:
            end, start, matched = best
            content = content[:end]
            req.out_ids = list(content)
            req.finish = {"type": "stop", "matched": matched}
            req.text_end = end if sp.no_stop_trim else start
        elif eos:
            req.out_ids = list(content)
            req.out_ids.append(EOS)
            req.finish = {"type": "stop", "matched": EOS}
            req.text_end = len(content)
        else:
            req.out_ids = list(content)
            req.finish = {"type": "length", "length": max_new}
            req.text_end = len(content)
        req.content = content
        req.total = len(req.out_ids)

        if req.want_lp:
            r = rng.random
            ids = req.out_ids
            if req.lp_text:
                tt = _TOKEN_TEXT
                req.triples = [[(r() - 1.0) * 3.0, t, tt[t]] for t in ids]
            else:
                req.triples = [[(r() - 1.0) * 3.0, t, None] for t in ids]
            if req.lp_start >= 0:
                pids = prompt.ids[req.lp_start :]
                pr = random.Random(hash((self.seed, prompt.key, 1))).random
                tt = _TOKEN_TEXT
                if req.lp_text:
                    lps = [[(pr() - 1.0) * 3.0, t, tt[t]] for t in pids]
                else:
                    lps = [[(pr() - 1.0) * 3.0, t, None] for t in pids]
                if lps:
                    lps[0][0] = None
                req.input_lps = lps

        plen = len(prompt.ids)
        if prompt.key in self._prefix_cache:
            req.cached = plen - 1
        else:
            if len(self._prefix_cache) > 100_000:
                self._prefix_cache.clear()
            self._prefix_cache.add(prompt.key)
        self._prompt_tokens += plen
        self._cached_tokens_total += req.cached
        req.prepared = True

    # ------------------------------------------------------------ results

    def _finish_reason(self, req: _Req) -> dict:
        if req.wait_aborted:
            return _ABORT_WAITING
        if req.prepared and req.pos >= req.total:
            return req.finish  # type: ignore[return-value]
        return _abort_running()

    def result(self, req: _Req, k: int, final: bool, index: int | None = None) -> dict:
        """The SGLang response object of ``req`` after ``k`` output tokens."""
        fr = self._finish_reason(req) if final else None
        if req.wait_aborted:
            text, ids = "", []
            meta: dict[str, Any] = {
                "id": req.rid, "finish_reason": fr, "weight_version": self.weight_version, "completion_tokens": 0,
            }
        else:
            out = req.out_ids
            ids = out if k >= len(out) else out[:k]
            if fr is req.finish and fr is not None:
                text = req.content[: req.text_end].decode("utf-8", "replace")
            else:
                text = req.content[:k].decode("utf-8", "replace")
            meta = {
                "id": req.rid,
                "finish_reason": fr,
                "prompt_tokens": len(req.prompt.ids),
                "completion_tokens": k,
                "cached_tokens": req.cached,
                "reasoning_tokens": 0,
                "weight_version": self.weight_version,
                "num_retractions": 0,
            }
        if req.want_lp:
            trip = req.triples
            meta["output_token_logprobs"] = trip if k >= len(trip) else trip[:k]
            meta["output_token_logprobs_length"] = min(k, len(trip))
            meta["input_token_logprobs"] = req.input_lps
        if final:
            meta["e2e_latency"] = time.perf_counter() - req.t0
            meta["weight_versions"] = req.spans
        obj: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if req.want_prompt_ids:
            obj["prompt_token_ids"] = req.prompt.ids
        if index is not None:
            obj["index"] = index
        return obj

    # ------------------------------------------------------------ scheduling

    def _advance(self, req: _Req, new_pos: int) -> None:
        old = req.pos
        if new_pos <= old:
            return
        wv = self.weight_version
        spans = req.spans
        if spans and spans[-1]["version"] == wv:
            spans[-1]["end"] = new_pos
        else:
            spans.append({"version": wv, "start": old, "end": new_pos})
        self._gen_tokens += new_pos - old
        req.pos = new_pos

    async def _nap(self, req: _Req, secs: float) -> bool:
        """Sleep ``secs``; True if it ran out, False if interrupted (abort, pause, continue)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        handle = loop.call_later(secs, _wake, fut, True)
        req.wake = fut
        try:
            return await fut
        finally:
            handle.cancel()
            req.wake = None

    @staticmethod
    def _interrupt(req: _Req) -> None:
        w = req.wake
        if w is not None and not w.done():
            w.set_result(False)

    @staticmethod
    def _conn_gone(req: _Req) -> bool:
        r = req.request
        if r is None:
            return False
        tr = r.transport
        return tr is None or tr.is_closing()

    def _release_slot(self) -> None:
        q = self._waitq
        while q:
            nxt = q.popleft()
            if nxt.admit is None or nxt.admit.done():
                continue
            nxt.state = _RUNNING
            self.n_running += 1
            nxt.admit.set_result(True)
            return
        self._free += 1

    def _cleanup(self, req: _Req) -> None:
        st = req.state
        if st == _DONE:
            return
        if st == _WAITING:
            try:
                self._waitq.remove(req)
            except ValueError:
                pass
        elif st == _RUNNING:
            self.n_running -= 1
            self._release_slot()
        req.state = _DONE
        if self._sched.get(req.rid) is req:
            del self._sched[req.rid]
        self._rids.discard(req.rid)
        if req.reader:
            req.reader = False
            self._rw.release_read()

    def _abort_one(self, req: _Req) -> None:
        req.aborted = True
        if req.state == _WAITING:
            try:
                self._waitq.remove(req)
            except ValueError:
                pass
            req.state = _WAIT_ABORTED
            req.wait_aborted = True
            if req.admit is not None and not req.admit.done():
                req.admit.set_result(False)
        elif req.state == _RUNNING:
            self._interrupt(req)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's abort: exact-rid check, then prefix match in the scheduler."""
        if not abort_all:
            if not rid or rid not in self._sched:
                return 0
        n = 0
        for req in list(self._sched.values()):
            if abort_all or req.rid.startswith(rid):
                if req.state in (_WAITING, _RUNNING):
                    self._abort_one(req)
                    n += 1
        return n

    async def drive(self, req: _Req) -> None:
        """Run one sample through gate, lock, scheduler and decode; stream its final chunk."""
        try:
            await self._run(req)
        finally:
            self._cleanup(req)
        if req.emit is not None:
            await req.emit(req, req.pos, True)

    async def _run(self, req: _Req) -> None:
        while self._paused and not req.aborted:
            await self._unpaused.wait()
        if req.aborted:
            return
        if self._rw.writer:
            await self._rw.acquire_read()
        else:
            self._rw.readers += 1
            self._rw.drained.clear()
        req.reader = True
        self._sched[req.rid] = req
        if self._free > 0 and not self._waitq:
            self._free -= 1
            self.n_running += 1
            req.state = _RUNNING
        else:
            req.admit = asyncio.get_running_loop().create_future()
            req.state = _WAITING
            self._waitq.append(req)
            if not await req.admit:
                return
        self._prepare(req)
        if self.prefill_s > 0 and not req.aborted:
            await self._nap(req, self.prefill_s)
        if not req.aborted:
            await self._decode(req)

    async def _decode(self, req: _Req) -> None:
        total = req.total
        lat = self.token_s
        emit = req.emit
        si = req.si
        if lat <= 0.0:
            while self._frozen and not req.aborted:
                await self._nap(req, 1.0)
                if self._conn_gone(req):
                    req.aborted = True
            if req.aborted:
                return
            if emit is not None:
                for b in range(si, total, si):
                    self._advance(req, b)
                    await emit(req, b, False)
                    if req.aborted:
                        return
            self._advance(req, total)
            return

        loop = asyncio.get_running_loop()
        min_batch = self._min_batch
        chunk = self._nonstream_chunk
        while req.pos < total:
            if req.aborted:
                return
            if self._frozen:
                await self._nap(req, 1.0)
                if self._conn_gone(req):
                    req.aborted = True
                continue
            pos = req.pos
            if emit is not None:
                target = pos + min_batch
                if target < total and target % si:
                    target = (target // si + 1) * si
                if target > total:
                    target = total
            else:
                target = min(total, pos + chunk)
            t0 = loop.time()
            if await self._nap(req, (target - pos) * lat):
                new = target
            else:
                new = min(target, pos + int((loop.time() - t0) / lat))
            self._advance(req, new)
            if emit is not None:
                last = min(new, total - 1)
                for b in range((pos // si + 1) * si, last + 1, si):
                    await emit(req, b, False)
                    if req.aborted:
                        return
            elif self._conn_gone(req):
                req.aborted = True

    # ------------------------------------------------------------ control

    async def pause(self, mode: str) -> None:
        self._paused = True
        self._pause_mode = mode
        self._unpaused.clear()
        if mode == "abort":
            self._frozen = False
            while True:
                self.abort(abort_all=True)
                if self._rw.readers == 0:
                    break
                try:
                    await asyncio.wait_for(self._rw.drained.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
        else:
            self._frozen = True
            for req in list(self._sched.values()):
                if req.state == _RUNNING:
                    self._interrupt(req)

    def resume(self) -> None:
        self._paused = False
        self._pause_mode = ""
        self._frozen = False
        self._unpaused.set()
        for req in list(self._sched.values()):
            if req.state == _RUNNING:
                self._interrupt(req)

    def flush(self) -> bool:
        if not self._idle():
            return False
        self._prefix_cache.clear()
        return True

    def shutdown(self) -> None:
        self.abort(abort_all=True)
        self.resume()

    def loads(self) -> dict:
        now = time.monotonic()
        t, tok = self._tp_mark
        if now - t >= 1.0:
            self._gen_throughput = (self._gen_tokens - tok) / (now - t)
            self._tp_mark = (now, self._gen_tokens)
        used = 0
        for req in self._sched.values():
            if req.state == _RUNNING:
                used += len(req.prompt.ids) + req.pos
        waiting_tokens = sum(len(r.prompt.ids) for r in self._waitq)
        return {
            "dp_rank": 0,
            "num_running_reqs": self.n_running,
            "num_waiting_reqs": len(self._waitq),
            "num_waiting_uncached_tokens": waiting_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_tokens,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.slots,
            "token_usage": used / self.max_total_num_tokens,
            "gen_throughput": self._gen_throughput,
            "cache_hit_rate": (self._cached_tokens_total / self._prompt_tokens) if self._prompt_tokens else 0.0,
            "utilization": self.n_running / self.slots,
        }

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": BYTE_TOKENIZER_NAME,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "rollfleet-sim",
            "architectures": ["RollfleetSim"],
        }

    def server_info(self) -> dict:
        ld = self.loads()
        return {
            "model_path": self.model_path,
            "tokenizer_path": BYTE_TOKENIZER_NAME,
            "served_model_name": self.model_path,
            "tp_size": self.config["tp_size"],
            "dp_size": self.config["dp_size"],
            "base_gpu_id": self.config["base_gpu_id"],
            "mem_fraction_static": self.config["mem_fraction_static"],
            "load_format": self.config["load_format"],
            "pp_size": 1,
            "ep_size": 1,
            "port": self.port,
            "host": self.host,
            "weight_version": self.weight_version,
            "max_running_requests": self.slots,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "context_length": self.context_length,
            "stream_interval": self.stream_interval,
            "random_seed": self.seed,
            "skip_server_warmup": self.config["skip_server_warmup"],
            "enable_metrics": self.config["enable_metrics"],
            "disaggregation_mode": "null",
            "status": self.status,
            "version": VERSION,
            "kv_events": None,
            "internal_states": [
                {
                    "dp_rank": 0,
                    "last_gen_throughput": ld["gen_throughput"],
                    "memory_usage": {
                        "weight": 0.0, "kvcache": 0.0, "token_capacity": self.max_total_num_tokens, "graph": 0.0,
                    },
                    "paused": self._paused,
                    "pause_mode": self._pause_mode or None,
                }
            ],
            "sim": {
                "token_latency_ms": self.token_s * 1000.0,
                "prefill_latency_ms": self.prefill_s * 1000.0,
                "output_len_dist": self.len_dist,
                "output_len_median": self.len_median,
                "output_len_sigma": self.len_sigma,
                "output_len_max": self.len_max,
                "accuracy": self.accuracy,
            },
        }

    # ------------------------------------------------------------ HTTP handlers

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        if not self.is_ready():
            return _http_error(503, f"The server is not ready (status: {self.status}).")
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _error_400(f"Invalid JSON body: {exc}")
        if not isinstance(data, dict):
            return _error_400("The request body must be a JSON object.")
        stream = data.get("stream") is True
        try:
            reqs, multi = self._build(data)
        except _SchemaError as exc:
            return _error_400(str(exc))
        except _ReqError as exc:
            if stream:
                return await self._stream_error(request, str(exc))
            return _error_400(str(exc))

        if stream:
            resp = await self._stream(request, reqs, multi)
            if resp is None:
                return web.Response(status=200)
        else:
            for r in reqs:
                r.request = request
            try:
                if len(reqs) == 1:
                    await self.drive(reqs[0])
                else:
                    await asyncio.gather(*(self.drive(r) for r in reqs))
            finally:
                for r in reqs:
                    self._cleanup(r)
            objs = [self.result(r, r.pos, True) for r in reqs]
            resp = web.Response(body=orjson.dumps(objs if multi else objs[0]), content_type="application/json")
            if self.crash_after:
                await resp.prepare(request)
                await resp.write_eof()
        self._ok_calls += 1
        if self.crash_after and self._ok_calls >= self.crash_after:
            asyncio.get_running_loop().call_soon(self.crash, f"--crash-after-requests {self.crash_after}")
        return resp

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        err = {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}
        try:
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def _stream(self, request: web.Request, reqs: list[_Req], multi: bool) -> web.StreamResponse | None:
        resp = web.StreamResponse(status=200, headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        dead = False
        lock = asyncio.Lock() if len(reqs) > 1 else None

        def gone() -> None:
            nonlocal dead
            dead = True
            for r in reqs:
                self._abort_one(r)

        async def emit(req: _Req, k: int, final: bool) -> None:
            if dead:
                return
            obj = self.result(req, k, final, req.index if multi else None)
            data = b"data: " + orjson.dumps(obj) + b"\n\n"
            try:
                if lock is None:
                    await resp.write(data)
                else:
                    async with lock:
                        await resp.write(data)
            except (ConnectionError, RuntimeError):
                gone()

        for r in reqs:
            r.emit = emit
            r.request = request
        try:
            try:
                await resp.prepare(request)
            except (ConnectionError, RuntimeError):
                gone()
            if len(reqs) == 1:
                await self.drive(reqs[0])
            else:
                await asyncio.gather(*(self.drive(r) for r in reqs))
        finally:
            for r in reqs:
                self._cleanup(r)
        if dead:
            return resp if resp.prepared else None
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise web.HTTPBadRequest(
                body=orjson.dumps(
                    {"object": "error", "message": f"Invalid JSON body: {exc}", "type": "Bad Request",
                     "param": None, "code": 400}
                ),
                content_type="application/json",
            )
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(
                body=orjson.dumps(
                    {"object": "error", "message": "The request body must be a JSON object.",
                     "type": "Bad Request", "param": None, "code": 400}
                ),
                content_type="application/json",
            )
        return data

    async def h_abort(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        rid = data.get("rid") or ""
        self.abort(rid if isinstance(rid, str) else "", bool(data.get("abort_all")))
        return web.Response(status=200)

    async def h_health(self, request: web.Request) -> web.Response:
        if not self.is_ready():
            return web.Response(status=503)
        if self._paused:
            try:
                await asyncio.wait_for(self._unpaused.wait(), self.health_timeout)
            except asyncio.TimeoutError:
                return web.Response(status=503)
        return web.Response(status=200)

    async def h_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.is_ready() and not self._paused else 503)

    async def h_model_info(self, request: web.Request) -> web.Response:
        return _json(self.model_info())

    async def h_server_info(self, request: web.Request) -> web.Response:
        return _json(self.server_info())

    async def h_loads(self, request: web.Request) -> web.Response:
        return _json(
            {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION, "loads": [self.loads()]}
        )

    async def h_flush(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout") or 0.0)
        except ValueError:
            return _http_error(400, "timeout must be a number")
        deadline = time.monotonic() + timeout
        while not self._idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.flush():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(
            status=400,
            text=f"Cache not flushed: {self.n_running} running and {len(self._waitq)} waiting requests.\n",
        )

    async def h_pause(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        mode = data.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _http_error(400, f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
        await self.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def h_continue(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def h_update_disk(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            return _json({"success": False, "message": "model_path is required"}, 400)
        wv = data.get("weight_version")
        if data.get("abort_all_requests"):
            self.abort(abort_all=True)
        if self._paused:
            return self._apply_disk(path, wv, data.get("flush_cache", True))
        await self._rw.acquire_write()
        try:
            return self._apply_disk(path, wv, data.get("flush_cache", True))
        finally:
            self._rw.release_write()

    def _apply_disk(self, path: str, wv: Any, flush_cache: Any) -> web.Response:
        if not os.path.isdir(path):
            return _json(
                {"success": False, "message": f"Failed to update weights: model path {path!r} is not a directory."
                 " The weights were not changed.", "num_paused_requests": 0},
                400,
            )
        self.model_path = path
        if wv is not None:
            self.weight_version = str(wv)
        if flush_cache is not False:
            self._prefix_cache.clear()
        return _json({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    async def h_update_version(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        nv = data.get("new_version")
        if not isinstance(nv, str) or not nv:
            return _json({"success": False, "message": "new_version is required"}, 400)
        if data.get("abort_all_requests", True):
            self.abort(abort_all=True)
        self.weight_version = nv
        return _json({"success": True, "message": f"Weight version updated to {nv}.", "new_version": nv})

    async def h_crash(self, request: web.Request) -> web.Response:
        resp = _json({"status": "crashing", "exit_code": CRASH_EXIT_CODE})
        await resp.prepare(request)
        await resp.write_eof()
        asyncio.get_running_loop().call_soon(self.crash, "POST /rollfleet/crash")
        return resp


ENGINE_KEY = web.AppKey("rollfleet_sim_engine", SimEngine)


def make_app(engine: SimEngine) -> web.Application:
    """The aiohttp application serving ``engine``.

    Run it with ``web.AppRunner(app, handler_cancellation=True)`` (as :func:`run`
    does) so a client disconnect cancels its request at once; without it the
    engine notices disconnects at its next chunk boundary. Set ``engine.port``
    to the bound port if ``/server_info`` should report it.
    """
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    e = engine
    r = app.router
    r.add_post("/generate", e.h_generate)
    r.add_put("/generate", e.h_generate)
    r.add_post("/abort_request", e.h_abort)
    for path in ("/health", "/health_generate"):
        r.add_get(path, e.h_health)
    r.add_get("/ready", e.h_ready)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, e.h_model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, e.h_server_info)
    r.add_get("/v1/loads", e.h_loads)
    r.add_get("/flush_cache", e.h_flush)
    r.add_post("/flush_cache", e.h_flush)
    r.add_post("/pause_generation", e.h_pause)
    r.add_post("/continue_generation", e.h_continue)
    r.add_post("/update_weights_from_disk", e.h_update_disk)
    r.add_post("/update_weight_version", e.h_update_version)
    r.add_post("/rollfleet/crash", e.h_crash)
    return app


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sim engine's flags to ``parser``."""
    g = parser.add_argument_group("rollfleet-sim engine")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, required=True, help="HTTP port; 0 picks a free one")
    g.add_argument("--slots", "--max-running-requests", dest="slots", type=int, default=256,
                   help="max running requests (default 256)")
    g.add_argument("--token-latency-ms", type=float, default=0.0,
                   help="decode time per token per request; 0 = instant (default)")
    g.add_argument("--prefill-latency-ms", type=float, default=0.0, help="time before the first token (default 0)")
    g.add_argument("--stream-interval", type=int, default=1, help="tokens per streamed chunk (default 1)")
    g.add_argument("--output-len-dist", choices=("fixed", "lognormal"), default="lognormal",
                   help="distribution of the natural output length (default lognormal)")
    g.add_argument("--output-len-median", type=int, default=256, help="median output length (default 256)")
    g.add_argument("--output-len-sigma", type=float, default=1.0, help="lognormal sigma (default 1.0)")
    g.add_argument("--output-len-max", type=int, default=8192, help="cap on the drawn output length (default 8192)")
    g.add_argument("--accuracy", type=float, default=0.5,
                   help="probability that an arithmetic answer is correct (default 0.5)")
    g.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0, help="RNG seed (default 0)")
    g.add_argument("--context-length", type=int, default=32768, help="context length (default 32768)")
    g.add_argument("--weight-version", default="default", help="initial weight_version label")
    g.add_argument("--model-path", "--model", dest="model_path", default="rollfleet-sim", help="reported model_path")
    g.add_argument("--startup-delay", type=float, default=0.0,
                   help="seconds the port is open but /health answers 503 (default 0)")
    g.add_argument("--unhealthy", action="store_true", help="never become healthy (/health always 503)")
    g.add_argument("--health-timeout", type=float, default=20.0,
                   help="seconds /health blocks while paused before answering 503 (default 20)")
    g.add_argument("--crash-after-requests", type=int, default=0,
                   help=f"exit with code {CRASH_EXIT_CODE} after answering N /generate calls (0 = never)")
    c = parser.add_argument_group(
        "sglang.launch_server compatibility",
        "accepted so the sim runs from an SGLang command line; tp/dp sizes are only reported in /server_info",
    )
    c.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    c.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    c.add_argument("--base-gpu-id", type=int, default=0)
    c.add_argument("--gpu-id-step", type=int, default=1)
    c.add_argument("--mem-fraction-static", type=float, default=None)
    c.add_argument("--load-format", default="auto")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--tokenizer-path", default=None)
    c.add_argument("--log-level", default=None)
    for flag in ("--skip-server-warmup", "--enable-metrics", "--enable-memory-saver", "--trust-remote-code",
                 "--disable-radix-cache", "--skip-tokenizer-init"):
        c.add_argument(flag, action="store_true")


async def _serve(engine: SimEngine, host: str, port: int) -> None:
    runner = web.AppRunner(make_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    engine.port = runner.addresses[0][1]
    print(f"rollfleet-sim listening on http://{host}:{engine.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        engine.shutdown()
        await runner.cleanup()


def run(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT (blocking)."""
    engine = SimEngine(args)
    asyncio.run(_serve(engine, engine.host, engine.port))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agent.sim_engine", description="CPU engine speaking SGLang's native HTTP API"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)  # unknown flags exit with code 2, as argparse does
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args)


if __name__ == "__main__":
    main()
