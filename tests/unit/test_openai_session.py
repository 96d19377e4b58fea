"""The OpenAI endpoint's pure core: chat rendering, prefix reuse, the recording, tool-call parsing, requests.

No sockets: a conversation is fed the generations a sim engine would make (agent/sim/output.py's
tool call for a chat prompt that declares tools) and its recording is checked token by token
against the byte chat format rendered independently.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

from agent import openai_requests, tool_parsers
from agent.chat_render import ChatRenderer, RenderError, render_bytes
from agent.openai_session import ChatError, Conversation
from agent.sim.output import find_tool_call
from common.errors import ConfigError
from common.generation import Generation
from common.tokenizer import ByteTokenizer

EOS = ByteTokenizer.EOS
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip


def model(text: str, *, eos: bool = True, lp: float = -0.25) -> Generation:
    """What an engine answers: ``text``'s bytes (then EOS), each with logprob ``lp``."""
    ids = [*text.encode(), *([EOS] if eos else [])]
    return Generation(ids, [lp] * len(ids), text, "stop" if eos else "length")


def conversation(budget: int = 1000, parser: str = "hermes") -> Conversation:
    return Conversation(ChatRenderer(ByteTokenizer()), tool_parsers.load(parser), budget)


def tool_loop(conv: Conversation) -> tuple[list[dict], list[Generation]]:
    """A harness's tool loop: the user asks, the model calls the tool, the tool answers, the model answers."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 23+48?"}]
    first = conv.prepare_chat(messages, TOOLS)
    call = find_tool_call(first.input_ids)  # the sim engine's output for this prompt
    assert call is not None
    gen1 = model(call.decode())
    reply = conv.record_chat(first, gen1, TOOLS, True)
    assert reply == {"content": None, "tool_calls": [{"name": "calc", "arguments": {"expression": "23+48"}}]}
    wire_calls = openai_requests.openai_tool_calls(reply["tool_calls"], "t")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": wire_calls, "refusal": None},
        {"role": "tool", "tool_call_id": wire_calls[0]["id"], "content": "71"},
    ]
    second = conv.prepare_chat(messages, TOOLS)
    assert find_tool_call(second.input_ids) is None  # after the tool's result the sim answers
    gen2 = model("The answer is \\boxed{71}.")
    conv.record_chat(second, gen2, TOOLS, True)
    messages.append({"role": "assistant", "content": "The answer is \\boxed{71}."})
    return messages, [gen1, gen2]


def test_a_tool_loop_records_the_model_tokens_under_mask_1_and_the_rest_under_mask_0():
    conv = conversation()
    messages, (gen1, gen2) = tool_loop(conv)
    traj = conv.trajectory()
    # The recording is the whole conversation as the byte chat format renders it (the model wrote
    # its turns exactly as the template renders them), less the newline after the last EOS.
    rendered = render_bytes(_normalized(messages), TOOLS, False)
    assert traj.prompt_tokens + traj.tokens == rendered[:-1]
    assert traj.prompt_tokens == render_bytes(_normalized(messages[:2]), TOOLS, True)
    between = [10, *b"<|tool|>\n71", EOS, 10, *b"<|assistant|>\n"]
    assert traj.tokens == gen1.tokens + between + gen2.tokens
    assert traj.loss_mask == [1] * len(gen1.tokens) + [0] * len(between) + [1] * len(gen2.tokens)
    assert traj.logprobs == gen1.logprobs + [0.0] * len(between) + gen2.logprobs
    assert traj.generated == len(gen1.tokens) + len(gen2.tokens)
    assert traj.metadata == {"openai_calls": 2} and traj.status == "completed"


def test_a_turn_the_model_wrote_otherwise_than_the_template_is_kept_as_written_and_closed_by_the_template():
    conv = conversation()
    messages = [{"role": "user", "content": "23+48?"}]
    first = conv.prepare_chat(messages, TOOLS)
    odd = '<tool_call>{"name":"calc","arguments":{"expression":"23+48"}}</tool_call>'  # no spaces: not json.dumps'
    reply = conv.record_chat(first, model(odd), TOOLS, True)
    assert reply["tool_calls"] == [{"name": "calc", "arguments": {"expression": "23+48"}}]
    messages += [{"role": "assistant", "content": "", "tool_calls": openai_requests.openai_tool_calls(
        reply["tool_calls"], "a")}, {"role": "tool", "content": "71"}]  # fmt: skip
    second = conv.prepare_chat(messages, TOOLS)
    # The model's own bytes stay; after its EOS comes the rest of the template's end of turn (a newline).
    assert second.input_ids[: len(first.input_ids) + len(odd) + 1] == [*first.input_ids, *odd.encode(), EOS]
    assert second.appended[:1] == [10]
    # A turn cut by max_tokens (no EOS) is closed with the whole end of turn.
    conv.record_chat(second, model("The answer is", eos=False), TOOLS, True)
    messages += [{"role": "assistant", "content": "The answer is"}, {"role": "user", "content": "go on"}]
    third = conv.prepare_chat(messages, TOOLS)
    assert third.appended[:2] == [EOS, 10]
    assert conv.traj.status == "truncated"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.__setitem__(0, {"role": "user", "content": "what is 1+1?"}), r"messages\[0\] \(user\) differs"),
        (lambda m: m[1].__setitem__("tool_calls", []), r"messages\[1\] \(assistant\) differs from the assistant's"),
        (lambda m: m.pop(), r"add at least one"),
    ],
    ids=["user edited", "reply edited", "nothing added"],
)  # fmt: skip
def test_a_rewritten_history_is_refused_naming_the_message(edit, match):
    conv = conversation()
    first = conv.prepare_chat([{"role": "user", "content": "23+48?"}], TOOLS)
    reply = conv.record_chat(first, model(find_tool_call(first.input_ids).decode()), TOOLS, True)
    calls = openai_requests.openai_tool_calls(reply["tool_calls"], "a")
    messages = [{"role": "user", "content": "23+48?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "71"}]  # fmt: skip
    edit(messages)
    recorded = list(conv.traj.tokens)
    with pytest.raises(ChatError, match=match):
        conv.prepare_chat(messages, TOOLS)
    assert conv.traj.tokens == recorded  # a refused call records nothing


def test_changed_tools_and_a_template_that_rewrites_history_are_refused():
    conv = conversation()
    first = conv.prepare_chat([{"role": "user", "content": "hi"}], None)
    conv.record_chat(first, model("hello"), None, True)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "?"},
    ]
    with pytest.raises(ChatError, match="tools differ"):
        conv.prepare_chat(history, TOOLS)
    # A template that renders earlier turns differently once more follow (as reasoning-dropping ones do).
    renderer = conv.renderer
    plain = renderer._render
    renderer._render = lambda m, t, g: plain(
        [{**x, "content": x["content"].upper()} if len(m) > 2 else x for x in m], t, g
    )
    with pytest.raises(ChatError, match=r"renders messages\[0:2\] differently"):
        conv.prepare_chat(history, None)


def test_completions_extend_the_recorded_text_and_cannot_be_mixed_with_chat():
    conv = conversation(budget=30)
    first = conv.prepare_completion("12+30=")
    assert first.input_ids == list(b"12+30=")
    conv.record_completion(first, model("42", eos=False))
    second = conv.prepare_completion("12+30=42\nand 1+1=")
    assert second.input_ids == [*b"12+30=42", *b"\nand 1+1="] and second.appended == list(b"\nand 1+1=")
    with pytest.raises(ChatError, match="at character 7"):
        conv.prepare_completion("12+30=43 more")
    with pytest.raises(ChatError, match="cannot mix"):
        conv.prepare_chat([{"role": "user", "content": "x"}], None)
    assert conv.left == 28


def test_a_sample_with_no_call_has_nothing_to_return_and_bad_messages_are_named():
    with pytest.raises(ChatError, match="no call"):
        conversation().trajectory()
    for messages, match in [([], "non-empty"), ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role 'robot'"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "type 'image_url'"),
                            ([{"role": "user"}], r"messages\[0\] \(user\) has no content")]:  # fmt: skip
        with pytest.raises(ChatError, match=match):
            conversation().prepare_chat(messages, None)


def test_a_renderer_is_refused_for_a_tokenizer_that_renders_through_the_engines():
    with pytest.raises(RenderError, match="--tokenizer PATH"):
        ChatRenderer(object())
    conv = Conversation("no chat here: the reason", tool_parsers.load("hermes"), 10)
    with pytest.raises(ChatError, match="the reason"):
        conv.prepare_chat([{"role": "user", "content": "x"}], None)


# ---------------------------------------------------------------------- tool parsers


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', None, [{"name": "a", "arguments": {"x": 1}}]),
        ('Sure. <tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>\n'
         '<tool_call>{"name": "b"}</tool_call>',
         "Sure.", [{"name": "a", "arguments": {"x": 2}}, {"name": "b", "arguments": {}}]),
        ("no call here", "no call here", []),
        ('<tool_call>{"name": "a", "arguments": {</tool_call>', '<tool_call>{"name": "a", "arguments": {</tool_call>',
         []),
        ('<tool_call>{"name": "a"}', '<tool_call>{"name": "a"}', []),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>[1]</tool_call>',
         '<tool_call>{"name": "a"}</tool_call><tool_call>[1]</tool_call>', []),
    ],
    ids=["one", "two with content", "none", "bad json", "unclosed", "one of two bad"],
)  # fmt: skip
def test_the_hermes_parser_returns_calls_or_the_text_as_content(text, content, calls):
    assert tool_parsers.hermes(text) == (content, calls)


def test_custom_parsers_are_loaded_by_name_and_a_failing_one_gives_plain_content(monkeypatch):
    module = types.ModuleType("rollfleet_test_parsers")
    module.upper = lambda text: (None, [{"name": text.upper(), "arguments": {}}])
    module.broken = lambda text: 1 / 0
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert tool_parsers.load("rollfleet_test_parsers:upper")("ab") == (None, [{"name": "AB", "arguments": {}}])
    assert tool_parsers.load("rollfleet_test_parsers:broken")("ab") == ("ab", [])
    assert tool_parsers.load("none")('<tool_call>{"name": "a"}</tool_call>')[1] == []
    with pytest.raises(ConfigError, match="--tool-parser 'qwen'"):
        tool_parsers.load("qwen")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        tool_parsers.load("rollfleet_test_parsers:nope")


# ---------------------------------------------------------------------- requests


def test_a_chat_request_becomes_engine_params():
    req = openai_requests.chat_request({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "max_completion_tokens": 40,
        "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 7, "n": 1, "logprobs": True, "top_logprobs": 0,
        "stream": True, "stream_options": {"include_usage": True}, "tools": TOOLS, "tool_choice": "none",
    })  # fmt: skip
    assert req.params == {"temperature": 0.5, "top_p": 0.9, "stop": ["END"], "sampling_seed": 7}
    assert (req.max_tokens, req.stream, req.include_usage, req.logprobs, req.parse_tools) == (
        40,
        True,
        True,
        True,
        False,
    )


@pytest.mark.parametrize(
    "extra, match",
    [({"n": 2}, "n must be 1"), ({"top_logprobs": 3}, "top_logprobs above 0 is not served"),
     ({"tool_choice": "required"}, "tool_choice 'required' is not served"), ({"stop": ["a"] * 5}, "up to 4"),
     ({"temperature": 3}, r"temperature must be a number in \[0, 2\]"), ({"max_tokens": 0}, "max_tokens must be"),
     ({"response_format": {"type": "json_object"}}, "unserved request argument: response_format"),
     ({"stream_options": {"include_usage": True}}, "with stream: true only"),
     ({"tools": [{"type": "code"}]}, r"tools\[0\] must be")],
)  # fmt: skip
def test_a_bad_chat_request_is_refused_naming_the_field(extra, match):
    with pytest.raises(ChatError, match=match):
        openai_requests.chat_request({"messages": [{"role": "user", "content": "x"}], **extra})


def test_streamed_chunks_carry_the_reply_in_openai_order():
    calls = openai_requests.openai_tool_calls([{"name": "calc", "arguments": {"e": "1+1"}}], "z")
    message = {"role": "assistant", "content": "ok", "tool_calls": calls}
    chunks = list(openai_requests.chat_chunks("id", 1, "m", message, "tool_calls", None, {"total_tokens": 3}))
    assert [c["choices"][0]["delta"] if c["choices"] else "usage" for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "ok"},
        {"tool_calls": [{"index": 0, **calls[0]}]}, {}, "usage"]  # fmt: skip
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"e": "1+1"}


def _normalized(messages: list[dict]) -> list[dict]:
    from agent.openai_session import normalize

    return normalize(messages)


def test_the_rollout_config_names_a_bad_tool_parser():
    from common.config import RolloutConfig

    assert RolloutConfig(tool_parser="my_module:parse").tool_parser == "my_module:parse"
    with pytest.raises(ConfigError, match="tool_parser must be one of \\['hermes', 'none'\\] or module:function"):
        RolloutConfig(tool_parser="qwen")
