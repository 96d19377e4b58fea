"""Sampling parameters and ``/generate`` request validation, with SGLang's checks and messages.

Validation runs in SGLang 0.5.23's order: the request schema first (:class:`SchemaError`, always
HTTP 400; unknown sampling keys are refused), then the tokenizer manager's checks
(:class:`RequestError`: HTTP 400, or an error chunk inside a stream): empty, out-of-vocabulary
and over-long inputs, duplicate rids, ``SamplingParams.verify()`` bounds.

Batch and ``n > 1`` expansion as in SGLang: a batch with a string rid gets ``"{rid}_{i}"`` rids,
``n > 1`` (or no rid) gets fresh uuids; ``input_embeds`` is refused.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection
from typing import Any

from agent.sim.sample import Prompt, Sample
from common.tokenizer import ByteTokenizer

VOCAB_SIZE = ByteTokenizer.vocab_size
_TOKENIZER = ByteTokenizer()

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_new_tokens",
        "n",
        "no_stop_trim",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "sampling_seed",
        "custom_params",
        "stream_interval",
        "json_schema",
        "regex",
        "ebnf",
        "logit_bias",
        "stop_regex",
        "structural_tag",
        "beam_width",
        "watermark",
        "choice",
    }
)


class SchemaError(Exception):
    """Body fails the request schema (0.5.23 checks it first): always HTTP 400."""


class RequestError(Exception):
    """A ValueError in SGLang's tokenizer manager: 400, or an error chunk in a stream."""


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SamplingParams:
    """Validated sampling parameters of one batch item.

    Penalties, grammars (``structural_tag`` too), ``logit_bias`` and ``beam_width`` are checked
    but not kept; ``watermark`` and ``choice`` are accepted (0.5.23 keys) and ignored. ``top_p``,
    ``top_k``, ``min_p`` and ``all_stop_token_ids`` (every id given) are kept for model-backed
    engines; the sim's output model ignores them and reads ``stop_token_ids`` (byte ids only).
    """

    __slots__ = (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "all_stop_token_ids",
        "stop_token_ids",
        "ignore_eos",
        "min_new_tokens",
        "n",
        "no_stop_trim",
        "sampling_seed",
        "stream_interval",
    )

    def __init__(self, d: Any):
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise SchemaError("sampling_params must be an object")
        unknown = [k for k in d if k not in SAMPLING_KEYS]
        if unknown:
            raise SchemaError(
                f"Unknown sampling parameter(s): {', '.join(sorted(unknown))}. "
                f"Allowed keys: {', '.join(sorted(SAMPLING_KEYS))}"
            )

        def number(key: str, default: float) -> float:
            v = d.get(key)
            if v is None:
                return default
            if not is_number(v):
                raise SchemaError(f"sampling_params.{key} must be a number, got {v!r}")
            return float(v)

        def integer(key: str, default: Any) -> Any:
            v = d.get(key)
            if v is None:
                return default
            if not is_integer(v):
                raise SchemaError(f"sampling_params.{key} must be an integer, got {v!r}")
            return v

        def boolean(key: str, default: bool) -> bool:
            v = d.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise SchemaError(f"sampling_params.{key} must be a boolean, got {v!r}")
            return v

        # An explicit null means "up to the context limit", as in SGLang.
        explicit_null = "max_new_tokens" in d and d["max_new_tokens"] is None
        self.max_new_tokens: int | None = None if explicit_null else integer("max_new_tokens", 128)
        self.temperature = number("temperature", 1.0)
        self.top_p = top_p = number("top_p", 1.0)
        self.top_k = top_k = integer("top_k", -1)
        self.min_p = min_p = number("min_p", 0.0)
        repetition_penalty = number("repetition_penalty", 1.0)
        frequency_penalty = number("frequency_penalty", 0.0)
        presence_penalty = number("presence_penalty", 0.0)
        self.min_new_tokens: int = integer("min_new_tokens", 0)
        self.n: int = integer("n", 1)
        self.sampling_seed: int | None = integer("sampling_seed", None)
        self.stream_interval: int | None = integer("stream_interval", None)
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
            raise SchemaError("sampling_params.stop must be a string or a list of strings")
        self.stop = [s.encode("utf-8") for s in stop if s]
        stop_token_ids = d.get("stop_token_ids")
        if stop_token_ids is None:
            stop_token_ids = []
        elif not (isinstance(stop_token_ids, list) and all(is_integer(t) for t in stop_token_ids)):
            raise SchemaError("sampling_params.stop_token_ids must be a list of integers")
        self.stop_token_ids = sorted({t for t in stop_token_ids if 0 <= t < 256})
        self.all_stop_token_ids = sorted({t for t in stop_token_ids if t >= 0})
        stop_regex = d.get("stop_regex")
        if stop_regex is not None and not isinstance(stop_regex, (str, list)):
            raise SchemaError("sampling_params.stop_regex must be a string or a list of strings")
        integer("beam_width", None)
        for key in ("json_schema", "regex", "ebnf", "structural_tag"):
            if d.get(key) is not None and not isinstance(d[key], str):
                raise SchemaError(f"sampling_params.{key} must be a string")
        for key in ("custom_params", "logit_bias"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise SchemaError(f"sampling_params.{key} must be an object")

        # SamplingParams.verify() messages.
        if self.temperature < 0.0:
            raise RequestError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k < 1 and top_k != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if not -2.0 <= frequency_penalty <= 2.0:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
        if not -2.0 <= presence_penalty <= 2.0:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
        if not 0.0 < repetition_penalty <= 2.0:
            raise RequestError(f"repetition_penalty must be in (0, 2], got {repetition_penalty}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise RequestError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if sum(d.get(k) is not None for k in ("json_schema", "regex", "ebnf")) > 1:
            raise RequestError("Only one of regex, json_schema, or ebnf can be set.")


def _prompt_token_ids(data: dict, encode: Callable[[str], list[int]]) -> tuple[list[Any], bool]:
    """The prompts of a call as token-id lists, and whether the call is a batch."""
    if data.get("input_embeds") is not None:
        raise RequestError("input_embeds is not supported by rollfleet-sim")
    text, ids = data.get("text"), data.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise SchemaError("text must be a string or a list of strings")
    if not isinstance(ids, list):
        raise SchemaError("input_ids must be a list of integers or a list of lists of integers")
    if ids and isinstance(ids[0], list):
        prompts, batch = ids, True
    else:
        prompts, batch = [ids], False
    for p in prompts:
        if not isinstance(p, list) or not all(is_integer(t) for t in p):
            raise SchemaError("input_ids must be a list of integers or a list of lists of integers")
    return prompts, batch


def _sample_rids(data: dict, batch: bool, batch_size: int, n: int, live_rids: Collection[str]) -> list[str]:
    rid = data.get("rid")
    if n > 1 or rid is None:
        rids = [uuid.uuid4().hex for _ in range(batch_size * n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(batch_size)] if batch else [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if not batch or len(rid) != batch_size:
            raise RequestError("The rid should be a list of the same length as the batch.")
        rids = list(rid)
    else:
        raise SchemaError("rid must be a string or a list of strings")
    seen: set[str] = set()
    for r in rids:
        if r in live_rids or r in seen:
            raise RequestError(f"Duplicate request ID detected: {r}")
        seen.add(r)
    return rids


def parse_generate(
    data: dict,
    *,
    live_rids: Collection[str],
    context_length: int,
    default_stream_interval: int,
    vocab_size: int = VOCAB_SIZE,
    encode: Callable[[str], list[int]] = _TOKENIZER.encode,
) -> tuple[list[Sample], bool]:
    """Validate a ``/generate`` body and expand it into samples.

    Returns the samples (batch item major, ``n`` samples per item) and whether the response is a
    list (a batch, or ``n > 1``). Raises :class:`SchemaError` or :class:`RequestError`. The
    caller registers the rids as live; ``live_rids`` is only read. ``vocab_size`` bounds the
    input ids and ``encode`` tokenizes ``text`` prompts (defaults: the byte vocabulary).
    """
    prompts, batch = _prompt_token_ids(data, encode)
    batch_size = len(prompts)
    params_data = data.get("sampling_params")
    if isinstance(params_data, list):
        if not batch or len(params_data) != batch_size:
            raise RequestError("sampling_params must be an object or a list with one object per batch item.")
        params = [SamplingParams(d) for d in params_data]
    else:
        params = [SamplingParams(params_data)] * batch_size
    if not prompts:
        raise RequestError("The batch is empty.")
    for p in prompts:
        if not p:
            raise RequestError("The input_ids cannot be empty.")
        if min(p) < 0 or max(p) >= vocab_size:
            raise RequestError(
                f"The input_ids {[t for t in p if not 0 <= t < vocab_size][:8]} contain token id(s) "
                f"outside the vocabulary [0, {vocab_size})."
            )
    n = params[0].n
    if any(sp.n != n for sp in params):
        raise RequestError("The n parameter must be the same for all requests in a batch.")

    for key in ("stream", "return_logprob", "return_text_in_logprobs", "return_prompt_token_ids"):
        v = data.get(key)
        if v is not None and not isinstance(v, bool):
            raise SchemaError(f"{key} must be a boolean")
    logprob_start_len = data.get("logprob_start_len")
    if logprob_start_len is not None and not is_integer(logprob_start_len):
        raise SchemaError("logprob_start_len must be an integer")

    rids = _sample_rids(data, batch, batch_size, n, live_rids)

    ctx = context_length
    items = []
    for p, sp in zip(prompts, params, strict=True):
        prompt_len = len(p)
        if prompt_len > ctx - 1:
            raise RequestError(
                f"The input ({prompt_len} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        max_new = ctx - prompt_len if sp.max_new_tokens is None else sp.max_new_tokens
        if prompt_len + max_new > ctx:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
                f"input messages or the completion to fit within the limit."
            )
        if data.get("return_logprob") and logprob_start_len is not None and logprob_start_len > prompt_len:
            raise RequestError(
                f"logprob_start_len ({logprob_start_len}) is larger than the prompt length ({prompt_len})."
            )
        items.append((Prompt(p), sp, max_new))

    samples = []
    for prompt, sp, max_new in items:
        stream_interval = sp.stream_interval or default_stream_interval
        for _ in range(n):
            k = len(samples)
            samples.append(Sample(rids[k], k, prompt, sp, max_new, data, stream_interval))
    return samples, batch or n > 1
