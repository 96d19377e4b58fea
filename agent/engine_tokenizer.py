"""Tokenizing through the engines' own ``/tokenize`` when no local tokenizer loads.

An agent attached to a server (``--engine-url``) reads the tokenizer to use from its
``/model_info`` ``tokenizer_path``. That path may exist only on the server's machine, or need
``transformers``, which the agent's machine may lack. SGLang tokenizes for its clients
(``POST /tokenize {prompt | messages, add_generation_prompt}`` -> ``{tokens, count,
max_model_len}``), so the agent asks the engine instead: the ids are the server's own, chat
prompts go through the server's chat template, and nothing is installed. The price is one HTTP
call per prompt (per group, not per sample), on the engine that runs the group.

A server started with ``--skip-tokenizer-init`` cannot tokenize: :func:`probe` then fails with
one line saying what to pass or install.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.engine_client import EngineClient
from common.errors import ConfigError, EngineError, EngineUnavailable, StateError

_PROBE = "rollfleet tokenizer probe"


class EngineTokenizer:
    """Encodes prompts with ``POST /tokenize`` on a healthy engine (``urls()`` lists them, in order)."""

    eos_token_id = None  # the engine stops at its own EOS; the agent never needs the id

    def __init__(self, client: EngineClient, urls: Callable[[], list[str]], name: str):
        self.client = client
        self.urls = urls
        self.name = f"{name} (through the engines' /tokenize)"

    def encode(self, prompt: Any) -> list[int]:
        raise StateError("EngineTokenizer tokenizes over HTTP: await encode_async(prompt)")

    async def encode_async(self, prompt: Any) -> list[int]:
        urls = self.urls()
        if not urls:
            raise EngineUnavailable("no healthy engine to tokenize the prompt with (/tokenize)")
        last: EngineError | None = None
        for url in urls:  # the first healthy one normally; the next if it just went down
            try:
                return await self.client.tokenize(url, prompt)
            except EngineUnavailable as exc:
                last = exc
        raise last

    def decode(self, ids: list[int]) -> str:
        raise StateError("EngineTokenizer does not decode: the engines' answers carry their text")


async def probe(client: EngineClient, url: str, name: str, why: str) -> None:
    """ConfigError in one line unless ``url`` tokenizes; ``why``: why no local tokenizer loaded."""
    try:
        await client.tokenize(url, _PROBE)
    except EngineError as exc:
        raise ConfigError(
            f"the engines' tokenizer {name!r} does not load here ({why}) and {url}/tokenize does not answer "
            f"({exc}); pass --tokenizer byte|PATH, or install transformers: pip install 'rollfleet[hf]'"
        ) from None
