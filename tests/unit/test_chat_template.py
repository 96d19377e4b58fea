"""Chat prompts through a Hugging Face tokenizer's chat template: token ids on every transformers version.

Under transformers 5 ``apply_chat_template(..., tokenize=True)`` returns a ``BatchEncoding``, whose
``list()`` is its keys; the tokenizer renders to text and encodes that instead. The template is the
one ``agent make-model`` writes (agent/hf/model.py ``CHAT_TEMPLATE``).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from common.chat_rows import check_chat_rows  # noqa: E402
from common.dataset import Dataset  # noqa: E402
from common.errors import DatasetError  # noqa: E402
from common.tokenizer import load_tokenizer  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "3+4="}],
    [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "12+30="}],
    [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "calculator: 4"},
        {"role": "user", "content": "and 5+5? é"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(hf_model_dir):
    from transformers import AutoTokenizer

    return load_tokenizer(hf_model_dir), AutoTokenizer.from_pretrained(hf_model_dir)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
def test_encode_of_messages_is_the_templates_text_encoded(tokenizers, messages):
    ours, hf = tokenizers
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")  # the generation prompt is kept
    ids = ours.encode(messages)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)
    # the same ids as the tokenize=True path, whatever type it returns on this transformers version
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    assert ours.decode(ids) == text.replace("<|eos|>", "")


def test_the_make_model_template_marks_roles_and_ends_turns_with_eos(tokenizers):
    ours, _ = tokenizers
    text = ours.render_chat(CONVERSATIONS[1])
    assert text == "<|system|>\nAnswer in \\boxed{}.<|eos|>\n<|user|>\n12+30=<|eos|>\n<|assistant|>\n"
    ids = ours.encode(CONVERSATIONS[1])
    assert ids.count(257) == 2  # <|eos|> is the one special token a turn ends with; the markers are bytes


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "wizard", "content": "hi"}], "message 0 has role wizard"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "message 1 has no content"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "content part of type image"),
    ],
)
def test_messages_the_template_cannot_render_raise_a_value_error_naming_why(tokenizers, messages, reason):
    ours, _ = tokenizers
    with pytest.raises(ValueError, match=reason):
        ours.encode(messages)


def test_a_tokenizer_without_a_chat_template_says_so(tmp_path):
    from agent.hf.model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    ours = load_tokenizer(str(tmp_path / "plain"))
    assert ours.encode("3+4=") == list(b"3+4=")
    with pytest.raises(ValueError, match="has no chat template"):
        ours.encode([{"role": "user", "content": "3+4="}])


def _write(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return path


def test_the_chat_check_names_the_file_and_line_of_the_first_row_the_template_refuses(tmp_path, tokenizers):
    ours, _ = tokenizers
    prompts = ["plain text"] + [CONVERSATIONS[i % 3] for i in range(20)] + [[{"role": "robot", "content": "x"}]]
    path = _write(tmp_path / "chat.jsonl", prompts)
    with Dataset(path) as dataset, pytest.raises(DatasetError) as err:
        check_chat_rows(dataset, ours)
    assert err.value.path == str(path) and err.value.line == 22
    assert "message 0 has role robot" in str(err.value)


def test_a_passed_chat_check_is_remembered_for_the_same_file_and_template(tmp_path, tokenizers):
    ours, _ = tokenizers
    path = _write(tmp_path / "chat.jsonl", [CONVERSATIONS[i % 3] for i in range(30)])
    cache = str(tmp_path / "dataset.chat-check")
    with Dataset(path) as dataset:
        assert check_chat_rows(dataset, ours, cache_path=cache) == 30
        assert check_chat_rows(dataset, ours, cache_path=cache) == -1  # skipped: checked already
    _write(path, [CONVERSATIONS[0]] * 5 + [[{"role": "robot", "content": "x"}]])
    with Dataset(path) as dataset, pytest.raises(DatasetError, match=":6: "):
        check_chat_rows(dataset, ours, cache_path=cache)  # another file: checked again


def test_the_byte_tokenizer_flattens_messages_and_needs_no_check(tmp_path):
    path = _write(tmp_path / "chat.jsonl", [[{"role": "anything", "content": "x"}]])
    with Dataset(path) as dataset:
        assert check_chat_rows(dataset, load_tokenizer("byte")) == 0


TOOLS = [{"type": "function", "function": {"name": "calc", "description": "évaluer",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "23+48="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "23+48="},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "23+48"}'}}]},
     {"role": "tool", "tool_call_id": "c0", "content": "71"}, {"role": "assistant", "content": "\\boxed{71}"},
     {"role": "user", "content": "and 1+1?"}],
]  # fmt: skip


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("messages", CONVERSATIONS + TOOL_CONVERSATIONS, ids=lambda m: f"{len(m)} messages")
def test_the_openai_endpoint_renders_the_hf_template_and_the_byte_format_alike(tokenizers, messages, tools):
    """The hf engine's tokenizer (make_model's template) and the sim's byte format give the same ids, tool calls
    and tool lists included, so the endpoint records the same conversation on either engine."""
    from agent.chat_render import ChatRenderer
    from agent.openai_session import normalize
    from common.tokenizer import ByteTokenizer

    ours, _ = tokenizers
    hf, byte = ChatRenderer(ours), ChatRenderer(ByteTokenizer())
    norm = normalize(messages)
    for generation_prompt in (True, False):
        assert hf.render(norm, tools, generation_prompt) == byte.render(norm, tools, generation_prompt)
    assert hf.end_of_turn() == byte.end_of_turn() == [257, 10]
