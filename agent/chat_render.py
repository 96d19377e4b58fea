"""Chat messages to token ids, the way the model was trained to read them (the OpenAI endpoint's renderer).

The agent renders every chat call itself (agent/openai_session.py) so that it knows which tokens the
template made and which the model did; engines only ever see ``/generate`` with token ids.

- **The byte vocabulary** (the sim engine, :class:`common.tokenizer.ByteTokenizer`): :func:`render_bytes`,
  the chat format of ``agent make-model``'s template (agent/hf/model.py ``CHAT_TEMPLATE``) in ids:
  ``<|ROLE|>`` and a newline as bytes, the content, then EOS (257) and a newline; the generation prompt
  is ``<|assistant|>`` and a newline. With ``tools``, a first system message lists them between
  ``<tools>`` and ``</tools>`` (one JSON object a line) and says how to call one; an
  assistant message's ``tool_calls`` are rendered after its content as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``json.dumps``), the form
  agent/tool_parsers.py reads back and the sim engine writes.
- **A Hugging Face tokenizer**: its own chat template (``apply_chat_template(..., tools=...)``), the
  text encoded without added special tokens, as SGLang's chat path does.

A tokenizer that renders through the engines' ``/tokenize`` (agent/engine_tokenizer.py) has no
renderer here: the endpoint then answers every call with an error saying so.

:meth:`ChatRenderer.end_of_turn` is what the template writes after an assistant message's content
(``[EOS, 10]`` for the byte format): the recording closes a turn the model cut short with it.
"""

from __future__ import annotations

import json
from typing import Any

from common.tokenizer import ByteTokenizer, HFTokenizer

ROLES = ("system", "user", "assistant", "tool")
TOOLS_PREAMBLE = (
    'You may call the tools below. To call one, reply with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\n'
)
_PROBE = "rollfleet end of turn probe"


class RenderError(ValueError):
    """Messages the template cannot render; the message names the one at fault."""


def content_text(message: dict, i: int) -> str:
    """A message's content as text: a string, or the ``text`` of its text parts (None: "")."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RenderError(f"messages[{i}] has a content part of type {kind!r}; only text parts are served")
            parts.append(part["text"])
        return "".join(parts)
    raise RenderError(f"messages[{i}].content must be a string or a list of text parts")


def tool_call_text(call: dict) -> str:
    """One tool call as the byte format (and the ``hermes`` parser) writes it."""
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return "<tool_call>" + body + "</tool_call>"


def render_bytes(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    """``messages`` (normalized: agent/openai_session.py) in the byte chat format, as token ids."""
    ids: list[int] = []
    messages = list(messages)
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"] + "\n\n"
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        ids += _turn("system", f"{system}{TOOLS_PREAMBLE}<tools>\n{listing}\n</tools>")
    for message in messages:
        text = message["content"]
        for call in message.get("tool_calls") or ():
            text += tool_call_text(call)
        ids += _turn(message["role"], text)
    if add_generation_prompt:
        ids += b"<|assistant|>\n"
    return ids


def _turn(role: str, text: str) -> list[int]:
    return [*f"<|{role}|>\n{text}".encode(), ByteTokenizer.EOS, 10]


class ChatRenderer:
    """Renders normalized messages with a tokenizer's chat format: :meth:`render` -> token ids."""

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, ByteTokenizer):
            self._render = render_bytes
        elif isinstance(tokenizer, HFTokenizer):
            if tokenizer.chat_template is None:
                raise RenderError(f"tokenizer {tokenizer.name!r} has no chat template: chat calls cannot be rendered")
            self._hf = tokenizer
            self._render = self._render_hf
        else:
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
            raise RenderError(
                f"the agent's tokenizer {name} renders no chat template here (it tokenizes through the engines); "
                "start the agent with --tokenizer PATH to serve chat calls"
            )
        self.tokenizer = tokenizer
        self._end: list[int] | None = None

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        return list(self._render(messages, tools, add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, HFTokenizer):
            return [int(i) for i in self.tokenizer._tok.encode(text, add_special_tokens=False)]
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def end_of_turn(self) -> list[int]:
        """The ids the template writes after an assistant message's content (found once, by a probe)."""
        if self._end is None:
            user = [{"role": "user", "content": "x"}]
            prompt = self.render(user, None, True)
            full = self.render([*user, {"role": "assistant", "content": _PROBE}], None, False)
            probe = self.encode(_PROBE)
            tail = full[len(prompt) :] if full[: len(prompt)] == prompt else full
            at = _find(tail, probe)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            self._end = tail[at + len(probe) :] if at >= 0 else ([eos] if isinstance(eos, int) else [])
        return self._end

    def _render_hf(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        hf_messages = []
        for m in messages:
            out = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                out["tool_calls"] = [
                    {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in m["tool_calls"]
                ]
            if m.get("tool_call_id"):
                out["tool_call_id"] = m["tool_call_id"]
            hf_messages.append(out)
        try:
            text = self._hf._tok.apply_chat_template(
                hf_messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja's TemplateError, or the template's own raise_exception
            raise RenderError(f"the chat template of {self._hf.name!r} cannot render these messages: {exc}") from None
        return self.encode(text)


def _find(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1
