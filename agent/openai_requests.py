"""The OpenAI wire format of the agent's endpoint: requests checked into engine params, answers built.

Pure (no I/O). :func:`chat_request` / :func:`completion_request` turn a request body into a
:class:`Request` or raise :class:`agent.openai_session.ChatError` naming the field (HTTP 400, as
OpenAI answers ``invalid_request_error``); the builders make ``chat.completion``,
``chat.completion.chunk``, ``text_completion`` objects and error bodies.

Served: ``messages`` (system/developer, user, assistant with ``tool_calls``, tool; text content),
``tools`` (functions) with ``tool_choice`` ``auto`` or ``none``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop`` (up to 4 strings), ``seed``,
``presence_penalty``, ``frequency_penalty``, ``n`` = 1, ``logprobs`` (the sampled token's;
``top_logprobs`` 0 only), ``stream`` with ``stream_options.include_usage``. Ignored, as they change
nothing here: ``model``, ``user``, ``metadata``, ``store``, ``parallel_tool_calls``,
``service_tier``. Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.openai_session import ChatError

IGNORED = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier"})
_CHAT = frozenset({
    "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
    "seed", "n", "logprobs", "top_logprobs", "stream", "stream_options", "presence_penalty", "frequency_penalty",
})  # fmt: skip
_COMPLETION = frozenset({
    "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "logprobs", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "echo",
})  # fmt: skip


@dataclass
class Request:
    """One checked call: the engine params it sets, and how to answer."""

    params: dict = field(default_factory=dict)
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    messages: Any = None
    tools: list | None = None
    parse_tools: bool = True
    prompt: Any = None


def _body(body: Any, known: frozenset) -> dict:
    if not isinstance(body, dict):
        raise ChatError("the request body must be a JSON object")
    for key in body:
        if key not in known and key not in IGNORED:
            raise ChatError(f"unrecognized or unserved request argument: {key}", key)
    return body


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        raise ChatError(f"{key} must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _common(body: dict, req: Request) -> None:
    n = body.get("n")
    if n not in (None, 1):
        raise ChatError(f"n must be 1 (one sample is one conversation), got {n!r}", "n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ChatError(f"{key} must be an integer >= 1, got {value!r}", key)
            req.max_tokens = value if req.max_tokens is None else min(req.max_tokens, value)
    for key, low, high in (("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2),
                           ("frequency_penalty", -2, 2)):  # fmt: skip
        value = _number(body, key, low, high)
        if value is not None:
            req.params[key] = value
    if req.params.get("top_p") == 0:
        raise ChatError("top_p must be greater than 0", "top_p")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise ChatError("stop must be a non-empty string or a list of up to 4 of them", "stop")
        req.params["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ChatError(f"seed must be an integer, got {seed!r}", "seed")
        req.params["sampling_seed"] = seed
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ChatError("stream must be a boolean", "stream")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not req.stream or not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ChatError("stream_options is {include_usage: bool}, with stream: true only", "stream_options")
        req.include_usage = bool(options.get("include_usage"))


def chat_request(body: Any) -> Request:
    body = _body(body, _CHAT)
    req = Request(messages=body.get("messages"))
    if req.messages is None:
        raise ChatError("messages is required", "messages")
    _common(body, req)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ChatError("logprobs must be a boolean", "logprobs")
    req.logprobs = bool(logprobs)
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise ChatError(f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
        if top > 0:
            raise ChatError("top_logprobs above 0 is not served: the recording holds the sampled token's logprob "
                            "only (logprobs: true returns it)", "top_logprobs")  # fmt: skip
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ChatError("tools must be a list", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}", "tools")
        req.tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ChatError(f"tool_choice {choice!r} is not served: only 'auto' and 'none' (the model's output is "
                        "parsed, not constrained)", "tool_choice")  # fmt: skip
    req.parse_tools = choice != "none"
    return req


def completion_request(body: Any) -> Request:
    body = _body(body, _COMPLETION)
    req = Request(prompt=body.get("prompt"))
    _common(body, req)
    if body.get("echo"):
        raise ChatError("echo is not served", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 5:
            raise ChatError(f"logprobs must be an integer in [0, 5], got {logprobs!r}", "logprobs")
        if logprobs > 0:
            raise ChatError("logprobs above 0 (top alternatives) is not served; 0 returns the sampled tokens' "
                            "logprobs", "logprobs")  # fmt: skip
        req.logprobs = True
    return req


# ---------------------------------------------------------------------- answers


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(gen_reason: str, tool_calls: list) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if gen_reason in ("length", "abort") else "stop"


def openai_tool_calls(calls: list[dict], prefix: str) -> list[dict]:
    import json

    return [
        {"id": f"call_{prefix}_{i}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for i, c in enumerate(calls)
    ]  # fmt: skip


def token_logprobs(tokens: list[int], logprobs: list[float], decode) -> list[dict]:
    out = []
    for t, lp in zip(tokens, logprobs, strict=True):
        text = decode([t])
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion(rid: str, created: int, model: str, message: dict, reason: str, logprobs, use: dict) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason,
                     "logprobs": {"content": logprobs} if logprobs is not None else None}],
        "usage": use,
    }  # fmt: skip


def chat_chunks(rid: str, created: int, model: str, message: dict, reason: str, logprobs, use: dict | None):
    """The chunks of a streamed chat completion (the turn is generated first, then sent)."""

    def chunk(delta: dict, finish=None, lps=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "logprobs": {"content": lps} if lps is not None else None}]}  # fmt: skip

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]}, lps=logprobs)
    elif logprobs:
        yield chunk({}, lps=logprobs)
    for i, call in enumerate(message.get("tool_calls") or ()):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, finish=reason)
    if use is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": use}  # fmt: skip


def text_completion(rid: str, created: int, model: str, text: str, reason: str, logprobs, use: dict | None,
                    chunk: bool = False) -> dict:  # fmt: skip
    lp = None
    if logprobs is not None:
        lp = {"tokens": [x["token"] for x in logprobs], "token_logprobs": [x["logprob"] for x in logprobs],
              "top_logprobs": None, "text_offset": _offsets([x["token"] for x in logprobs])}  # fmt: skip
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": lp}]}  # fmt: skip
    if use is not None:
        out["usage"] = use
    return out


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out
