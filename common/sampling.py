"""Extra SGLang sampling parameters (``coordinator serve --sampling-params``), checked before use.

SGLang refuses an unknown sampling key on every request (0.5.23: HTTP 400; 0.5.15: a 500
``TypeError``), so a typo in the rollout config would fail every group of the run on every
engine. The coordinator checks the object once at start instead: each key against the field
names of SGLang's ``SamplingParams`` (with a ``difflib`` suggestion for a near miss) and each
value against the field's basic JSON type. Bounds (``top_p`` in (0, 1], penalties in [-2, 2])
stay the engine's to enforce: they differ between SGLang versions.

Keys that have a flag of their own (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``)
are refused here so a value is never set in two places, and ``n`` is refused because rollfleet
sends one request per sample (``--n-samples-per-prompt``): with n > 1 a sample cannot be
aborted by its request id.
"""

from __future__ import annotations

import difflib
from typing import Any

from common.errors import ConfigError

_NUMBER = "a number"
_INT = "an integer"
_BOOL = "true or false"
_STR = "a string"
_STR_OR_LIST = "a string or a list of strings"
_INT_LIST = "a list of integers"
_OBJECT = "an object"

SGLANG_SAMPLING_PARAMS: dict[str, str] = {
    "max_new_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INT,
    "min_p": _NUMBER,
    "stop": _STR_OR_LIST,
    "stop_token_ids": _INT_LIST,
    "stop_regex": _STR_OR_LIST,
    "ignore_eos": _BOOL,
    "min_new_tokens": _INT,
    "n": _INT,
    "no_stop_trim": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "repetition_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "json_schema": _STR,
    "regex": _STR,
    "ebnf": _STR,
    "structural_tag": _STR,
    "logit_bias": _OBJECT,
    "sampling_seed": _INT,
    "stream_interval": _INT,
    "custom_params": _OBJECT,
}
"""SGLang's ``SamplingParams`` fields (docs/operate/engine-errors.md lists them) and the JSON type each takes."""

OWN_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "n": "--n-samples-per-prompt",
}
"""Keys set elsewhere: the flag that sets each."""


def _has_type(value: Any, kind: str) -> bool:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if kind == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _INT:
        return is_int(value)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _STR_OR_LIST:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == _INT_LIST:
        return isinstance(value, list) and all(is_int(v) for v in value)
    if kind == _OBJECT:
        return isinstance(value, dict)
    return True


def check_sampling_params(params: Any, where: str = "extra_sampling_params") -> dict:
    """``params`` if every key is a settable SGLang sampling field of the right type; else ConfigError.

    The error names ``where`` and the key, e.g. ``--sampling-params: unknown sampling parameter
    'temprature' (did you mean 'temperature'? it has its own flag: --temperature)``.
    """
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: expected a JSON object of SGLang sampling parameters, got {params!r}")
    for key, value in params.items():
        if key not in SGLANG_SAMPLING_PARAMS:
            close = difflib.get_close_matches(str(key), SGLANG_SAMPLING_PARAMS, n=1, cutoff=0.6)
            hint = ""
            if close:
                hint = f" (did you mean {close[0]!r}?"
                hint += f" it has its own flag: {OWN_FLAGS[close[0]]})" if close[0] in OWN_FLAGS else ")"
            raise ConfigError(f"{where}: unknown sampling parameter {key!r}{hint}; SGLang would refuse every request")
        if key in OWN_FLAGS:
            raise ConfigError(f"{where}: {key!r} is set by {OWN_FLAGS[key]}, not here")
        kind = SGLANG_SAMPLING_PARAMS[key]
        if value is not None and not _has_type(value, kind):
            raise ConfigError(f"{where}: sampling parameter {key!r} must be {kind}, got {value!r}")
    return params
