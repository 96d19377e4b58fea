"""Small causal LMs made in code, saved as Hugging Face model directories: no hub, no download.

:func:`make_model` writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and a
byte-level tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, and its chat template,
:data:`CHAT_TEMPLATE`, in ``chat_template.jinja``) that ``AutoTokenizer`` loads. The tokenizer's
ids are :class:`common.tokenizer.ByteTokenizer`'s: one token per UTF-8 byte (ids 0-255), then
``<|bos|>`` 256, ``<|eos|>`` 257, ``<|pad|>`` 258; it adds no special tokens when encoding, so
``AutoTokenizer(dir).encode(text) == list(text.encode())``.

The model is a ``LlamaForCausalLM`` (RMSNorm, rotary positions, SwiGLU MLP, tied embeddings)
with random initial weights drawn from ``seed``, in fp32. Presets (parameters with the 259-token
vocabulary): ``tiny`` 1.8 M (the GRPO example's), ``small`` 4.8 M. Any preset field can be
overridden.

:func:`load_model` reads a directory back for the hf engine and trainers: the model in eval
mode on a device and dtype, and the tokenizer.
"""

from __future__ import annotations

import json
import os
from typing import Any

from agent.chat_render import TOOLS_PREAMBLE
from common.errors import ConfigError
from common.tokenizer import ByteTokenizer

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
    "small": {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 768},
}
DEFAULT_CONTEXT_LENGTH = 512
SPECIAL_TOKENS = {"<|bos|>": ByteTokenizer.BOS, "<|eos|>": ByteTokenizer.EOS, "<|pad|>": ByteTokenizer.PAD}
CHAT_ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{ '<|system|>\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] ~ '\\n\\n' }}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{{ TOOLS_PREAMBLE ~ '<tools>\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{%- if not loop.last -%}{{ '\\n' }}{%- endif -%}{%- endfor -%}"
    "{{ '\\n</tools><|eos|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{%- set i = loop.index0 + ns.first -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('message ' ~ i ~ ' has role ' ~ message['role'] ~ ', which this template does not know "
    "(system, user, assistant, tool)') }}"
    "{%- endif -%}"
    "{%- set calls = message['tool_calls'] if message['tool_calls'] is defined and message['tool_calls'] else [] -%}"
    "{%- if (message['content'] is not defined or message['content'] is none) and not calls -%}"
    "{{ raise_exception('message ' ~ i ~ ' has no content') }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' }}"
    "{%- if message['content'] is not defined or message['content'] is none -%}"
    "{%- elif message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- else -%}{{ raise_exception('message ' ~ i ~ ' has a content part of type ' ~ part['type'] ~ "
    "'; this template renders text parts only') }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in calls -%}{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '<tool_call>' ~ ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) ~ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|eos|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
).replace("TOOLS_PREAMBLE", json.dumps(TOOLS_PREAMBLE))
"""The chat template :func:`make_model` writes: each message is ``<|ROLE|>`` and a newline, its content
(a string, or the ``text`` of its ``{"type": "text"}`` parts) and an assistant's ``tool_calls`` (each
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), then ``<|eos|>`` and a newline; the
generation prompt is ``<|assistant|>`` and a newline. With ``tools``, a first system turn (the first
system message's content, if any, then a blank line) says how to call them and lists them between
``<tools>`` and ``</tools>``, one JSON object a line: the byte chat format of agent/chat_render.py,
token for token. The role markers are plain bytes (only
``<|eos|>`` is a special token), and a role other than system, user, assistant or tool, a missing
``content`` or a non-text content part is an error naming the message."""


def _require(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} not installed: pip install 'rollfleet[hf]'")
    if "transformers" in modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # per-shard bars would clutter engine logs and examples


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte (index = byte) in a byte-level BPE vocabulary.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, DEL, NBSP, soft
    hyphen) are moved to code points from 256 on, in byte order: the convention the
    ``tokenizers`` ByteLevel pre-tokenizer and decoder use.
    """
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shifted = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with :class:`ByteTokenizer`'s ids and :data:`CHAT_TEMPLATE`."""
    _require("tokenizers", "transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: b for b, symbol in enumerate(byte_symbols())}
    vocab.update(SPECIAL_TOKENS)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", model_max_length=1 << 20
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(preset: str = "tiny", context_length: int = DEFAULT_CONTEXT_LENGTH, **overrides: int) -> Any:
    """The ``LlamaConfig`` of a preset, with ``overrides`` (config field names) applied."""
    _require("transformers")
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    fields: dict[str, Any] = dict(PRESETS[preset])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    heads = fields["num_attention_heads"]
    if fields["hidden_size"] % heads:
        raise ConfigError(f"hidden_size {fields['hidden_size']} is not a multiple of num_attention_heads {heads}")
    return LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        num_key_value_heads=heads,
        max_position_embeddings=context_length,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_id=ByteTokenizer.EOS,
        pad_token_id=ByteTokenizer.PAD,
        torch_dtype="float32",
        **fields,
    )


def make_model(
    path: str, *, preset: str = "tiny", seed: int = 0, context_length: int = DEFAULT_CONTEXT_LENGTH, **overrides: int
) -> dict:
    """Write a randomly initialised model and its tokenizer to ``path``; returns a summary.

    ``path`` must not exist or be an empty directory: an existing model is never overwritten.
    """
    _require("torch", "transformers", "safetensors")
    import torch
    from transformers import LlamaForCausalLM

    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"{path} already exists and is not an empty directory")
    config = model_config(preset, context_length, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    summary = {
        "path": os.path.abspath(path),
        "preset": preset,
        "parameters": params,
        "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "context_length": context_length,
        "vocab_size": config.vocab_size,
        "seed": seed,
    }
    with open(os.path.join(path, "rollfleet_model.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def load_model(path: str, *, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the model directory ``path``: the model in eval mode on ``device``."""
    _require("torch", "transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model-path {path}: no config.json there (make one with: agent make-model {path})")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r} (float32, bfloat16 or float16)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-path {path}: cannot load the model: {exc}") from None
    model.to(device)
    model.eval()
    return model, tokenizer
