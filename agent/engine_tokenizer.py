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

Chat prompts (a list of messages) are sent with ``add_generation_prompt``, which SGLang serves only
with a Jinja chat template: a server launched with a built-in template name (``--chat-template
chatml``) answers 400. Without a local tokenizer the agent has no template of its own to render
with, so such a prompt fails with an error saying what to give instead (``--tokenizer PATH``, or a
Jinja ``--chat-template FILE.jinja`` for the server); :func:`probe` warns about it at start-up, and
after the first refusal the engines are not asked again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agent.engine_client import EngineClient
from common.errors import ConfigError, EngineError, EngineRejected, EngineUnavailable, StateError

log = logging.getLogger("rollfleet.agent")

_PROBE = "rollfleet tokenizer probe"
_CHAT_PROBE = [{"role": "user", "content": _PROBE}]


def chat_refused(url: str, name: str, exc: EngineError) -> ConfigError:
    """The error of a chat prompt the engine would not tokenize: what it said, and what to do."""
    return ConfigError(
        f"{url}/tokenize refuses chat messages ({exc}); the agent has no local tokenizer for {name!r} to render "
        "them with: pass --tokenizer PATH (a Hugging Face tokenizer with a chat template; pip install "
        "'rollfleet[hf]'), or launch the server with a Jinja chat template file (--chat-template FILE.jinja: "
        "SGLang adds the generation prompt only with one), or give string prompts"
    )


class EngineTokenizer:
    """Encodes prompts with ``POST /tokenize`` on a healthy engine (``urls()`` lists them, in order)."""

    eos_token_id = None  # the engine stops at its own EOS; the agent never needs the id

    def __init__(self, client: EngineClient, urls: Callable[[], list[str]], name: str):
        self.client = client
        self.urls = urls
        self.model = name
        self.name = f"{name} (through the engines' /tokenize)"
        self.chat_error: str | None = None
        """Set once an engine refused to tokenize chat messages: every later chat prompt fails with it."""

    def encode(self, prompt: Any) -> list[int]:
        raise StateError("EngineTokenizer tokenizes over HTTP: await encode_async(prompt)")

    async def encode_async(self, prompt: Any) -> list[int]:
        chat = isinstance(prompt, list)
        if chat and self.chat_error is not None:
            raise ConfigError(self.chat_error)
        urls = self.urls()
        if not urls:
            raise EngineUnavailable("no healthy engine to tokenize the prompt with (/tokenize)")
        last: EngineError | None = None
        for url in urls:  # the first healthy one normally; the next if it just went down
            try:
                return await self.client.tokenize(url, prompt)
            except EngineRejected as exc:
                if not chat or exc.status != 400:
                    raise
                self.chat_error = str(chat_refused(url, self.model, exc))
                raise ConfigError(self.chat_error) from None
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
    try:
        await client.tokenize(url, _CHAT_PROBE)
    except EngineRejected as exc:  # string prompts still work: only chat prompts will fail, each saying why
        log.warning("%s", chat_refused(url, name, exc))
    except EngineError:
        pass  # not a refusal: the engine's next answer will tell
