"""Chat prompts through the engines' ``/tokenize`` (agent/engine_tokenizer.py) when the server cannot render them.

SGLang 0.5.23 answers ``/tokenize`` of messages with ``add_generation_prompt`` with 400 when its chat
template is a built-in name rather than a Jinja file; an agent without a local tokenizer has nothing
of its own to render with, so the prompt must fail saying what to give instead.
"""

from __future__ import annotations

import logging

import pytest

from agent.engine_client import EngineClient
from agent.engine_tokenizer import EngineTokenizer, probe
from common.errors import ConfigError
from common.tokenizer import ByteTokenizer
from harness.sim_server import serve

NAME = "/models/only-on-the-server"
CHAT = [{"role": "user", "content": "What is 2 + 3?"}]
HINTS = ("/tokenize refuses chat messages", "Jinja", "--tokenizer PATH", "--chat-template FILE.jinja", NAME)


@pytest.mark.timeout(30)
async def test_a_server_with_a_builtin_chat_template_fails_chat_prompts_saying_what_to_give(caplog):
    """Red if: each chat prompt fails with a bare HTTP 400 (the operator cannot tell what to change), or
    string prompts stop working too."""
    async with serve(chat_template="chatml", tokenizer_path=NAME) as (engine, _):
        url = f"http://127.0.0.1:{engine.port}"
        client = EngineClient()
        try:
            with caplog.at_level(logging.WARNING, logger="rollfleet.agent"):
                await probe(client, url, NAME, "no such path here")  # string prompts work: no error at start
            assert any(all(h in r.getMessage() for h in HINTS) for r in caplog.records), caplog.text
            tok = EngineTokenizer(client, lambda: [url], NAME)
            assert await tok.encode_async("2 + 3 =") == ByteTokenizer().encode("2 + 3 =")
            for _ in range(2):  # the second is refused from what the first learnt, with the same words
                with pytest.raises(ConfigError) as err:
                    await tok.encode_async(CHAT)
                for hint in HINTS:
                    assert hint in str(err.value), (hint, str(err.value))
                assert "HTTP 400" in str(err.value)
        finally:
            await client.close()


@pytest.mark.timeout(30)
async def test_a_server_with_a_jinja_chat_template_tokenizes_chat_prompts(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    async with serve(chat_template=str(template)) as (engine, _):
        url = f"http://127.0.0.1:{engine.port}"
        client = EngineClient()
        try:
            tok = EngineTokenizer(client, lambda: [url], NAME)
            assert len(await tok.encode_async(CHAT)) > 0
        finally:
            await client.close()
