"""One sample's conversation through the OpenAI endpoint: what each call sends the engine, and the recording.

Pure: no sockets, no event loop. The server (agent/openai_server.py) asks :meth:`Conversation.prepare`
for a call's input ids, runs the generation through the sample's engine handle, and hands the
result to :meth:`Conversation.record`, which returns the assistant message (or completion text).

**The recording** is one token sequence: ``prompt_tokens`` (the first call's rendered prompt) and
the response after it, token by token: what the model generated (loss mask 1, the engine's
logprobs, weight-version spans) and everything else (template tokens, tool results, user turns:
loss mask 0, logprob 0.0). It is the sample (:meth:`trajectory`).

**Prefix reuse.** A call whose messages extend the conversation recorded so far (the earlier
messages as they were sent, the assistant replies as they were returned, then new messages) is
sent as the recorded tokens plus the new ones: the model's own tokens are never re-tokenized. The
new tokens are what the template renders for the new messages: ``render(messages, gen prompt)``
must start with ``render(earlier messages + last reply)`` (else the template renders history
differently once more is added, and the call is refused naming it); what comes after is appended.
Between the model's last token and them goes the rest of its turn as the template writes it: the
template's tokens after the model's own if the model wrote its turn exactly as the template renders
it (e.g. ``\\n`` after EOS), else the template's end of turn less what the model already wrote of
it (a turn cut by ``max_tokens`` gets all of it).

**History rewritten** (a harness that drops, edits or reorders earlier messages, changes ``tools``,
or sends a reply other than the one returned): refused with :class:`ChatError` (HTTP 400) naming
the first message that differs. A sample is one token sequence; a harness that needs a second,
unrelated conversation makes it with ``engine.generate`` or a second sample. Completions
(``/completions``) follow the same rule by text: a prompt must start with the recorded text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from agent.chat_render import ROLES, ChatRenderer, RenderError, content_text
from common.generation import Generation, Trajectory


class ChatError(ValueError):
    """A call the endpoint refuses (HTTP 400): the message says why, naming the field or message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def normalize(messages: Any) -> list[dict]:
    """Messages as the recording compares and renders them: role, content text, tool calls, tool call id."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role {role!r} is not one of {list(ROLES)} (or developer)", "messages")
        try:
            text = content_text(m, i)
        except RenderError as exc:
            raise ChatError(str(exc), "messages") from None
        msg: dict = {"role": role, "content": text}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(m["tool_calls"])]
        elif m.get("content") is None and role != "assistant":
            raise ChatError(f"messages[{i}] ({role}) has no content", "messages")
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
    return out


def _tool_call(call: Any, i: int, j: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(f"messages[{i}].tool_calls[{j}] must be {{type: function, function: {{name, arguments}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise ChatError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
    return {"name": fn["name"], "arguments": args}


def _written(tokens: list[int], end: list[int]) -> int:
    """How much of ``end`` the model already wrote at the end of ``tokens`` (e.g. 1: its EOS)."""
    for k in range(min(len(end), len(tokens)), 0, -1):
        if tokens[len(tokens) - k :] == end[:k]:
            return k
    return 0


def _same(a: dict, b: dict) -> bool:
    """Equal as the conversation goes (tool call ids are ours and not compared)."""
    return {k: v for k, v in a.items() if k != "tool_call_id"} == {k: v for k, v in b.items() if k != "tool_call_id"}


@dataclass
class Prepared:
    """What one call sends: ``input_ids``, of which ``appended`` are new (template) tokens after the recording."""

    input_ids: list[int]
    appended: list[int]
    messages: list[dict] | None = None
    text: str | None = None  # a completion's prompt
    rendered: list[int] = field(default_factory=list)


class Conversation:
    """The recording of one sample's calls (see the module docstring)."""

    def __init__(self, renderer: ChatRenderer | str, parse, budget: int):
        """``renderer``: the agent's, or why it has none (every call is then refused saying so)."""
        self.renderer = renderer
        self.parse = parse
        self.budget = budget
        self.prompt_tokens: list[int] | None = None
        self.traj = Trajectory()
        self.calls = 0
        self._mode: str | None = None
        self._messages: list[dict] = []
        self._tools: list | None = None
        self._rendered: list[int] = []  # the template's ids of self._messages (no generation prompt)
        self._close: list[int] = []  # the template's rest of the last assistant turn
        self._text = ""  # completions: the recorded text

    @property
    def left(self) -> int:
        """Tokens the model may still generate in this sample (``max_new_tokens`` counts its own only)."""
        return self.budget - self.traj.generated

    # ------------------------------------------------------------------ chat

    def prepare_chat(self, messages: Any, tools: list | None) -> Prepared:
        norm = normalize(messages)
        self._check_mode("chat")
        renderer = self._renderer()
        try:
            full = renderer.render(norm, tools, True)
        except RenderError as exc:
            raise ChatError(str(exc), "messages") from None
        if self.prompt_tokens is None:
            return Prepared(full, [], norm, rendered=full)
        n = len(self._messages)
        for i, (old, new) in enumerate(zip(self._messages, norm, strict=False)):
            if not _same(old, new):
                what = "the assistant's reply as it was returned" if old["role"] == "assistant" else "the message sent"
                raise ChatError(
                    f"messages[{i}] ({new['role']}) differs from {what} earlier in this sample: a sample records one "
                    "conversation, so each call repeats the earlier messages unchanged and adds to them",
                    "messages",
                )
        if len(norm) <= n:
            raise ChatError(
                f"messages has {len(norm)} message(s), the conversation recorded so far {n}: add at least one",
                "messages",
            )
        if (tools or None) != self._tools:
            raise ChatError("tools differ from the earlier calls' in this sample; they must stay the same", "tools")
        if full[: len(self._rendered)] != self._rendered:
            raise ChatError(
                f"the chat template renders messages[0:{n}] differently once messages[{n}:] follow, so the recorded "
                "tokens cannot be extended (a template that rewrites history, e.g. one dropping earlier reasoning)",
                "messages",
            )
        appended = self._close + full[len(self._rendered) :]
        return Prepared(self._sequence() + appended, appended, norm, rendered=full)

    def record_chat(self, prepared: Prepared, gen: Generation, tools: list | None, parse_tools: bool) -> dict:
        """Record a chat call's generation; returns ``{content, tool_calls}`` of the assistant's reply."""
        self._record(prepared, gen)
        self._tools = tools or None
        content, calls = self.parse(gen.text) if parse_tools and tools else (gen.text, [])
        reply: dict = {"role": "assistant", "content": content or ""}
        if calls:
            reply["tool_calls"] = calls
        self._messages = [*prepared.messages, reply]
        renderer = self._renderer()
        try:
            rendered = renderer.render(self._messages, tools, False)
        except RenderError as exc:  # the model's reply itself: a template refusing it is a template limit
            raise ChatError(f"the chat template cannot render the model's reply: {exc}") from None
        canonical = (
            rendered[len(prepared.rendered) :] if rendered[: len(prepared.rendered)] == prepared.rendered else []
        )
        if canonical and canonical[: len(gen.tokens)] == gen.tokens:
            self._close = canonical[len(gen.tokens) :]
        else:
            end = renderer.end_of_turn()
            self._close = end[_written(gen.tokens, end) :]
        self._rendered = rendered
        return {"content": content, "tool_calls": calls}

    # ------------------------------------------------------------------ completions

    def prepare_completion(self, prompt: Any) -> Prepared:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ChatError("prompt must be a non-empty string", "prompt")
        self._check_mode("completions")
        renderer = self._renderer()
        if self.prompt_tokens is None:
            ids = renderer.encode(prompt)
            return Prepared(ids, [], text=prompt)
        if not prompt.startswith(self._text) or len(prompt) == len(self._text):
            at = next((i for i, (a, b) in enumerate(zip(self._text, prompt, strict=False)) if a != b), None)
            where = f"at character {at}" if at is not None else "in length"
            raise ChatError(
                f"prompt differs from the text recorded so far in this sample {where}: each call's prompt must start "
                "with the earlier prompt and completions and add to them",
                "prompt",
            )
        appended = renderer.encode(prompt[len(self._text) :])
        return Prepared(self._sequence() + appended, appended, text=prompt)

    def record_completion(self, prepared: Prepared, gen: Generation) -> None:
        self._record(prepared, gen)
        self._text = prepared.text + gen.text

    # ------------------------------------------------------------------ the sample

    def trajectory(self) -> Trajectory:
        """The recording as the sample (``prompt_tokens`` set: the first call's prompt, not the row's)."""
        if self.prompt_tokens is None:
            raise ChatError("no call was made on this sample's OpenAI endpoint: there is nothing to return")
        traj = self.traj
        traj.prompt_tokens = list(self.prompt_tokens)
        traj.metadata.setdefault("openai_calls", self.calls)
        return traj

    def _record(self, prepared: Prepared, gen: Generation) -> None:
        if self.prompt_tokens is None:
            self.prompt_tokens = list(prepared.input_ids)
        else:
            self.traj.insert(prepared.appended, self._renderer().decode(prepared.appended))
        self.traj.add(gen)
        self.calls += 1

    def _sequence(self) -> list[int]:
        return [*self.prompt_tokens, *self.traj.tokens]

    def _check_mode(self, mode: str) -> None:
        if self._mode not in (None, mode):
            raise ChatError(f"this sample's conversation is a {self._mode} one; a sample cannot mix it with {mode}")
        self._mode = mode

    def _renderer(self) -> ChatRenderer:
        if isinstance(self.renderer, str):
            raise ChatError(self.renderer)
        return self.renderer
