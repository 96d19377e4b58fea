"""A sample's response from one or several ``/generate`` answers: tokens, logprobs, weight-version spans.

Pure helpers of agent/lease_runner.py (docs/weights.md, partial rollouts). A weight update that
pauses an engine with mode ``abort`` cuts samples short; with partial rollout on, the runner sends
``/generate`` again with ``input_ids = prompt + the tokens so far`` (``continuation``), and the
sample's response is the concatenation of every answer (``join``).

Spans: ``weight_versions`` is a list of ``[version, start, end)`` over the response tokens, versions
being the engines' labels. Each answer contributes its own: SGLang's ``meta_info.weight_versions``
(0.5.23) shifted by the tokens already held, else one span ``[weight_version, start, end]``.
Adjacent spans of one version are merged; empty spans are dropped unless nothing else is left.
The sample's ``weight_version`` is the last span's version.

Per-token work is C-level ``map(itemgetter)`` only; the one-answer case makes no extra pass.
"""

from __future__ import annotations

from operator import itemgetter

from common.errors import EngineError

_first, _second = itemgetter(0), itemgetter(1)


def answer_tokens(out: dict) -> list[int]:
    """The output token ids of one ``/generate`` answer."""
    tokens = out.get("output_ids")
    if tokens is None:
        tokens = list(map(_second, out["meta_info"].get("output_token_logprobs") or []))
    return tokens


def answer_spans(meta: dict, offset: int, n_tokens: int) -> list[list]:
    """The spans one answer of ``n_tokens`` tokens contributes when ``offset`` tokens were held before it."""
    raw = meta.get("weight_versions")
    if raw:
        return [
            [s.get("version"), s.get("start", 0) + offset, s.get("end", 0) + offset] for s in raw if isinstance(s, dict)
        ]
    return [[meta.get("weight_version", ""), offset, offset + n_tokens]]


def merge_spans(spans: list[list]) -> list[list]:
    """Adjacent spans of one version become one; empty ones go (one is kept if all are empty)."""
    merged: list[list] = []
    for version, start, end in spans:
        if end <= start and (merged or any(e > s for _, s, e in spans)):
            continue
        if merged and merged[-1][0] == version and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([version, start, end])
    return merged


def join(answers: list[dict]) -> tuple[list[int], list[float], str, list[list]]:
    """``(tokens, logprobs, text, spans)`` of a response made of ``answers``, in order.

    EngineError if an answer's token and logprob counts differ.
    """
    if len(answers) == 1:
        out = answers[0]
        tokens = answer_tokens(out)
        logprobs = list(map(_first, out["meta_info"].get("output_token_logprobs") or []))
        _check(tokens, logprobs)
        return tokens, logprobs, out.get("text", ""), merge_spans(answer_spans(out["meta_info"], 0, len(tokens)))
    tokens, logprobs, texts, spans = [], [], [], []
    for out in answers:
        ids = answer_tokens(out)
        lps = list(map(_first, out["meta_info"].get("output_token_logprobs") or []))
        _check(ids, lps)
        spans += answer_spans(out["meta_info"], len(tokens), len(ids))
        tokens += ids
        logprobs += lps
        texts.append(out.get("text", ""))
    return tokens, logprobs, "".join(texts), merge_spans(spans)


def continuation(input_ids: list[int], answers: list[dict], params: dict) -> tuple[list[int], dict]:
    """The ``input_ids`` and sampling params that continue a sample from ``answers`` (none: the prompt)."""
    if not answers:
        return input_ids, params
    held = [t for out in answers for t in answer_tokens(out)]
    budget = dict(params)
    budget["max_new_tokens"] = params["max_new_tokens"] - len(held)
    return input_ids + held, budget


def held_tokens(answers: list[dict]) -> int:
    return sum(len(answer_tokens(out)) for out in answers)


def _check(tokens: list, logprobs: list) -> None:
    if len(tokens) != len(logprobs):
        raise EngineError(f"engine returned {len(tokens)} tokens but {len(logprobs)} logprobs")
