"""Tokenizers the agent uses to turn prompts into ``input_ids``.

``ByteTokenizer`` is the sim engine's vocabulary: one token per UTF-8 byte
(ids 0-255) plus three specials. It needs no download, so the whole system
runs on a laptop. A real SGLang model uses its Hugging Face tokenizer
(``load_tokenizer("hf:/path/to/model")``), which needs ``transformers``.

The sim engine reports ``tokenizer_path == BYTE_TOKENIZER_NAME`` in
``/model_info``; agents attached to an engine by URL read that field to pick
the matching tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol

from common.errors import ConfigError

BYTE_TOKENIZER_NAME = "rollfleet:byte"


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, prompt: Any) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def prompt_to_text(prompt: Any) -> str:
    """Flatten a prompt (a string or a list of chat messages) to plain text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        parts = []
        for message in prompt:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', 'user')}: {message.get('content', '')}")
            else:
                parts.append(str(message))
        return "\n".join(parts)
    return str(prompt)


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255, then BOS, EOS, PAD."""

    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259
    eos_token_id = EOS
    name = BYTE_TOKENIZER_NAME

    def encode(self, prompt: Any) -> list[int]:
        return list(prompt_to_text(prompt).encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer; chat-message prompts go through its chat template."""

    def __init__(self, path: str):
        check_tokenizer(path, "tokenizer")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tokenizer {path!r} cannot be loaded: {exc}") from None
        self.eos_token_id = self._tok.eos_token_id
        self.name = path

    @property
    def chat_template(self) -> str | None:
        """The template chat messages are rendered with (None: the tokenizer has none)."""
        return getattr(self._tok, "chat_template", None) or None

    def render_chat(self, messages: list) -> str:
        """``messages`` through the chat template, with the generation prompt: the text a model is asked to continue.

        Rendered to text and encoded separately (:meth:`encode`) rather than with ``tokenize=True``,
        whose return type changed across transformers releases (a list of ids before 5.0, a
        ``BatchEncoding`` since): the text is the one stable contract. ``ValueError`` names what the
        template refused (a role it does not know, a missing ``content``), or that there is no template.
        """
        if self.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template, so chat messages cannot be rendered")
        try:
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja's TemplateError, or whatever a template's own code raises
            raise ValueError(f"the chat template of {self.name!r} cannot render these messages: {exc}") from None
        if not isinstance(text, str):
            raise ValueError(f"the chat template of {self.name!r} rendered a {type(text).__name__}, not text")
        return text

    def encode(self, prompt: Any) -> list[int]:
        """Token ids of a string, or of chat messages rendered by :meth:`render_chat`.

        The rendered text is encoded without added special tokens, as ``apply_chat_template(...,
        tokenize=True)`` and SGLang's chat path do: a template that wants a BOS writes it itself.
        """
        if isinstance(prompt, list):
            return [int(i) for i in self._tok.encode(self.render_chat(prompt), add_special_tokens=False)]
        return list(self._tok.encode(prompt))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(name: str) -> Tokenizer:
    """``rollfleet:byte`` or ``byte`` for the byte tokenizer, else an HF path (``hf:`` optional)."""
    if name in (BYTE_TOKENIZER_NAME, "byte"):
        return ByteTokenizer()
    if name.startswith("hf:"):
        name = name[3:]
    return HFTokenizer(name)


def check_tokenizer(name: str, what: str = "tokenizer") -> None:
    """ConfigError naming ``what`` unless ``name`` can be loaded here: the byte tokenizer, or an HF
    tokenizer with ``transformers`` installed and, for a filesystem path, the path present.

    Cheap (nothing is loaded), so a CLI checks its flag before it starts anything.
    """
    if name in (BYTE_TOKENIZER_NAME, "byte"):
        return
    path = name[3:] if name.startswith("hf:") else name
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"{what} {name!r} needs the 'transformers' package: pip install 'rollfleet[sglang]'")
    if path.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"{what} {name!r}: no such file or directory")
