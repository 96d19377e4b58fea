"""The output model: what a sample says, its logprobs, and its SGLang response object.

The prompt's bytes are searched for the last ``a + b`` / ``a - b`` / ``a * b``; the reply is
reasoning filler ending in ``The answer is \\boxed{X}.`` (X correct with probability
``--accuracy``, else off by 1-3; a random integer without arithmetic). The length is drawn from
``--output-len-dist``; below ``max_new_tokens`` the sample ends with EOS (257,
``finish_reason {"type":"stop","matched":257}``), else it is cut at ``max_new_tokens``
(``length``), usually before the answer. Logprobs are deterministic pseudo-random floats in
[-3, 0). Temperature 0 is greedy: the same prompt gives the same output; ``sampling_seed`` makes
sampling reproducible; otherwise samples come from the engine's ``--seed``-ed RNG.

The whole output (ids, text, logprobs) is built once, when the sample gets a slot
(:meth:`OutputModel.build`); decoding only moves a position through it, and
:func:`response_object` renders the first ``k`` tokens of it.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from agent.sim.sample import Sample

EOS = ByteTokenizer.EOS

# Text of each token id when ``return_text_in_logprobs`` is set.
TOKEN_TEXT = [bytes((i,)).decode("utf-8", "replace") for i in range(256)] + ["<|bos|>", "<|eos|>", "<|pad|>"]

ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def aborted_running() -> dict:
    """The finish reason of a sample aborted while it held a slot (a fresh dict each time, as SGLang's)."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


_ARITHMETIC = re.compile(rb"(\d{1,12})\s*([-+*])\s*(\d{1,12})")

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


def filler(rng: random.Random, n: int) -> bytes:
    """``n`` bytes of reasoning filler, starting at a sentence drawn from ``rng``."""
    if n <= 0:
        return b""
    if n <= _FILLER_HALF:
        off = rng.choice(_FILLER_STARTS)
        return _FILLER[off : off + n]
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def find_answer(ids: list[int]) -> int | None:
    """The value of the last arithmetic expression in the prompt's tail, or None."""
    try:
        data = bytes(ids[-8192:])
    except ValueError:
        data = bytes(i for i in ids[-8192:] if i < 256)
    last = None
    for match in _ARITHMETIC.finditer(data):
        last = match
    if last is None:
        return None
    a, op, b = int(last.group(1)), last.group(2), int(last.group(3))
    if op == b"+":
        return a + b
    if op == b"-":
        return a - b
    return a * b


def find_tool_call(ids: list[int]) -> bytes | None:
    """The tool call the sim makes for a chat prompt that declares tools, or None (answer as usual).

    The prompt is in the byte chat format (agent/chat_render.py): tools between ``<tools>`` and
    ``</tools>``, one JSON object a line. When the last message is the user's (no tool result yet)
    and it holds an ``a + b`` expression, the sim calls the first tool with it as the tool's first
    parameter: ``<tool_call>{"name": ..., "arguments": {PARAM: "a+b"}}</tool_call>``, then EOS.
    After a tool's result it answers as usual.
    """
    try:
        data = bytes(ids)  # a plain prompt: all bytes, and no tools
    except ValueError:  # specials (a chat prompt's EOS): only the bytes matter
        data = bytes(i for i in ids if 0 <= i < 256)
    start = data.find(b"<tools>\n")
    if start < 0 or data.rfind(b"<|tool|>\n") > data.rfind(b"<|user|>\n"):
        return None
    end = data.find(b"\n</tools>", start)
    try:
        fn = json.loads(data[start + 8 : end].split(b"\n")[0])["function"]
        name = fn["name"]
        param = next(iter((fn.get("parameters") or {}).get("properties") or {"expression": None}))
    except (ValueError, KeyError, TypeError, StopIteration):
        return None
    last = None
    for match in _ARITHMETIC.finditer(data, end):
        last = match
    if last is None:
        return None
    expression = last.group(0).decode()
    return b"<tool_call>" + json.dumps({"name": name, "arguments": {param: expression}}).encode() + b"</tool_call>"


@dataclass(slots=True)
class SampleOutput:
    """The complete output of one sample; ``content[:k]`` and ``ids[:k]`` are what k tokens show."""

    content: bytes = b""
    ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None  # when all of ``ids`` is produced
    text_end: int = 0  # bytes of ``content`` in the final text (stop strings trimmed unless no_stop_trim)
    logprobs: list = field(default_factory=list)  # [logprob, token id, token text or None] per output token
    input_logprobs: list = field(default_factory=list)

    def text_upto(self, k: int) -> str:
        """The text of the first ``k`` output tokens (a stream chunk, or a partial output)."""
        return self.content[:k].decode("utf-8", "replace")

    def final_text(self) -> str:
        """The text of the finished output (stop strings trimmed unless ``no_stop_trim``)."""
        return self.content[: self.text_end].decode("utf-8", "replace")


_NOT_BUILT = SampleOutput()  # what a sample aborted before it got a slot shows


class OutputModel:
    """Draws each sample's output from the engine's seed and the output-length flags."""

    def __init__(self, *, seed: int, len_dist: str, len_median: int, len_sigma: float, len_max: int, accuracy: float):
        self.seed = seed
        self.len_dist = len_dist
        self.len_median = len_median
        self.len_sigma = len_sigma
        self.len_max = len_max
        self.accuracy = accuracy
        self._rng = random.Random(seed)
        self._log_median = math.log(len_median)

    def build(self, sample: Sample) -> SampleOutput:
        prompt, params = sample.prompt, sample.params
        if params.temperature < 1e-6:
            seed = hash((self.seed, prompt.key))
        elif params.sampling_seed is not None:
            seed = hash((self.seed, prompt.key, params.sampling_seed))
        else:
            seed = self._rng.getrandbits(64)
        rng = random.Random(seed)
        max_new = sample.max_new_tokens

        if self.len_dist == "fixed":
            drawn = self.len_median
        else:
            drawn = int(rng.lognormvariate(self._log_median, self.len_sigma))
        drawn = max(1, min(drawn, self.len_max), params.min_new_tokens)

        if prompt.answer is None:
            x = rng.randint(0, 100)
        elif rng.random() < self.accuracy:
            x = prompt.answer
        else:
            x = prompt.answer + rng.choice((-3, -2, -1, 1, 2, 3))
        answer = b" The answer is \\boxed{" + str(x).encode() + b"}."

        body_len = drawn - 1  # tokens before EOS
        eos = not params.ignore_eos and drawn < max_new
        if eos:
            content = (filler(rng, body_len - len(answer)) + answer)[:body_len]
        elif body_len - len(answer) >= max_new:
            content = filler(rng, max_new)
        else:
            content = (filler(rng, body_len - len(answer)) + answer)[:body_len]
            if len(content) < max_new:
                content += b" " + filler(rng, max_new - len(content) - 1)
            content = content[:max_new]

        if prompt.tool_call is not None:
            eos = not params.ignore_eos and len(prompt.tool_call) < max_new
            content = prompt.tool_call[:max_new]

        out = SampleOutput()
        first_stop = None  # (end, start, matched)
        for t in params.stop_token_ids:
            i = content.find(bytes((t,)))
            if i >= 0 and (first_stop is None or i + 1 < first_stop[0]):
                first_stop = (i + 1, i, t)
        for s in params.stop:
            i = content.find(s)
            if i >= 0 and (first_stop is None or i + len(s) < first_stop[0]):
                first_stop = (i + len(s), i, s.decode("utf-8", "replace"))
        if first_stop is not None:
            end, start, matched = first_stop
            content = content[:end]
            out.ids = list(content)
            out.finish_reason = {"type": "stop", "matched": matched}
            out.text_end = end if params.no_stop_trim else start
        elif eos:
            out.ids = list(content)
            out.ids.append(EOS)
            out.finish_reason = {"type": "stop", "matched": EOS}
            out.text_end = len(content)
        else:
            out.ids = list(content)
            out.finish_reason = {"type": "length", "length": max_new}
            out.text_end = len(content)
        out.content = content

        if sample.return_logprob:
            draw = rng.random
            texts = TOKEN_TEXT if sample.return_text_in_logprobs else None
            if texts is not None:
                out.logprobs = [[(draw() - 1.0) * 3.0, t, texts[t]] for t in out.ids]
            else:
                out.logprobs = [[(draw() - 1.0) * 3.0, t, None] for t in out.ids]
            if sample.logprob_start_len >= 0:
                prompt_ids = prompt.ids[sample.logprob_start_len :]
                prompt_draw = random.Random(hash((self.seed, prompt.key, 1))).random
                if texts is not None:
                    lps = [[(prompt_draw() - 1.0) * 3.0, t, TOKEN_TEXT[t]] for t in prompt_ids]
                else:
                    lps = [[(prompt_draw() - 1.0) * 3.0, t, None] for t in prompt_ids]
                if lps:
                    lps[0][0] = None  # the first prompt token has no logprob
                out.input_logprobs = lps
        return out


def _finish_reason(sample: Sample) -> dict:
    if sample.aborted_waiting:
        return ABORTED_WAITING
    out = sample.output
    # An output still being produced (a model-backed engine's) has no finish reason yet.
    if out is not None and out.finish_reason is not None and sample.position >= len(out.ids):
        return out.finish_reason
    return aborted_running()


def response_object(sample: Sample, k: int, final: bool, weight_version: str, index: int | None = None) -> dict:
    """The SGLang response object of ``sample`` after ``k`` output tokens (a stream chunk, or the final answer)."""
    finish = _finish_reason(sample) if final else None
    out = sample.output or _NOT_BUILT
    if sample.aborted_waiting:
        text, ids = "", []
        meta: dict[str, Any] = {
            "id": sample.rid,
            "finish_reason": finish,
            "weight_version": weight_version,
            "completion_tokens": 0,
        }
    else:
        ids = out.ids if k >= len(out.ids) else out.ids[:k]
        if finish is out.finish_reason and finish is not None:
            text = out.final_text()
        else:
            text = out.text_upto(k)
        meta = {
            "id": sample.rid,
            "finish_reason": finish,
            "prompt_tokens": len(sample.prompt.ids),
            "completion_tokens": k,
            "cached_tokens": sample.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": weight_version,
            "num_retractions": 0,
        }
    if sample.return_logprob:
        logprobs = out.logprobs
        meta["output_token_logprobs"] = logprobs if k >= len(logprobs) else logprobs[:k]
        meta["output_token_logprobs_length"] = min(k, len(logprobs))
        meta["input_token_logprobs"] = out.input_logprobs
    if final:
        meta["e2e_latency"] = time.perf_counter() - sample.started_at
        # A sample that produced no token still names the version it finished on (0.5.23).
        meta["weight_versions"] = sample.weight_spans or [{"version": weight_version, "start": 0, "end": 0}]
    obj: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
    if sample.return_prompt_ids:
        obj["prompt_token_ids"] = sample.prompt.ids
    if index is not None:
        obj["index"] = index
    return obj
