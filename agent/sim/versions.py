"""The SGLang release a sim (or hf) engine imitates: ``--sglang-version 0.5.23`` (default) or ``0.5.15``.

Each field of :class:`Behaviour` is one way the two releases differ, read from their wheels
(``sglang==0.5.23`` and ``sglang==0.5.15.post1``, files under ``sglang/srt/``):

- ``weight_update_sessions``: 0.5.23 has ``/begin_weight_update`` and ``/end_weight_update``, and
  ``/update_weights_from_distributed`` answers 400 outside a session without receiving anything
  (``managers/scheduler_components/weight_updater.py``); 0.5.15 has neither route (404) and needs none.
- ``abort_sent``: 0.5.23 marks a rid whose per-rid abort was sent and drops every later abort of it
  (``managers/tokenizer_manager.py`` ``abort_request``); 0.5.15 sends each one.
- ``ready_route``: ``/ready`` exists in 0.5.23 only (``entrypoints/http_server.py``), and only 0.5.23's
  auth lets it through without a key (``utils/auth.py``: ``/health``, ``/ready``, ``/metrics`` prefixes;
  0.5.15: ``/health``, ``/metrics``).
- ``model_info_0523``: 0.5.23's ``/model_info`` adds ``served_model_name``, ``load_format``,
  ``reasoning_parser``, ``tool_call_parser`` and ``disaggregation_mode``.
- ``checker_roles``: 0.5.23's ``/weights_checker`` takes ``skip_tensor_list`` and ``selector``, reports
  ``parallelism_info`` as a list (one entry per runner role, ``"role": "target"``), and forgets its
  snapshot after a ``compare`` that passed (``utils/weight_checker.py``); 0.5.15's
  ``parallelism_info`` is one object without ``role``, and a snapshot stays until the next one.
- ``non_persistent``: the name patterns both skip in checksums, compares and resets (they differ).
- ``get_weights_architectures``: the model classes whose SGLang implementation defines
  ``get_weights_by_name`` (``models/*.py``, subclasses included); any other answers 400 "Get parameter by
  name failed" (``model_executor/model_runner_components/weight_exporter.py`` in 0.5.23,
  ``model_executor/model_runner.py`` in 0.5.15: the same restriction, less ``EmbeddingGemma2Model`` and
  ``GraniteSWAForCausalLM``).
- ``tokenize_needs_jinja``: 0.5.23 refuses ``/tokenize`` of ``messages`` with ``add_generation_prompt``
  when the chat template is a built-in name (``entrypoints/openai/serving_tokenize.py``); 0.5.15 has no
  such field.

Both releases: the abort-mode pause re-aborts and re-checks every 1.0 s
(``tokenizer_manager.pause_generation``), uvicorn closes idle keep-alive connections after 5 s
(``SGLANG_TIMEOUT_KEEP_ALIVE``), ``--load-format dummy`` refuses every disk load that does not name
another format, and ``/weights_checker`` exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from common.errors import ConfigError

SGLANG_VERSIONS = ("0.5.23", "0.5.15")
DEFAULT_SGLANG_VERSION = "0.5.23"

PAUSE_RECHECK_S = 1.0
"""Seconds an abort-mode pause waits before it aborts again and re-checks for in-flight requests."""

KEEPALIVE_TIMEOUT_S = 5.0
"""Seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive`` in SGLang)."""

_GET_WEIGHTS_0515 = frozenset(
    {
        "Exaone4ForCausalLM",
        "GraniteForCausalLM",
        "IQuestCoderForCausalLM",
        "InternLM3ForCausalLM",
        "Llama4ForCausalLM",
        "LlamaForCausalLM",
        "LlamaForCausalLMEagle",
        "LlamaForCausalLMEagle3",
        "Ministral3ForCausalLM",
        "MistralForCausalLM",
        "MistralForCausalLMEagle",
        "OPTForCausalLM",
        "Phi3ForCausalLM",
        "TeleFLMForCausalLM",
    }
)
_GET_WEIGHTS_0523 = _GET_WEIGHTS_0515 | {"EmbeddingGemma2Model", "GraniteSWAForCausalLM"}


@dataclass(frozen=True)
class Behaviour:
    """What differs between the SGLang releases the engine can imitate (see the module docstring)."""

    version: str
    weight_update_sessions: bool
    abort_sent: bool
    ready_route: bool
    open_prefixes: tuple[str, ...]
    model_info_0523: bool
    checker_roles: bool
    non_persistent: tuple[str, ...]
    get_weights_architectures: frozenset[str]
    tokenize_needs_jinja: bool


BEHAVIOURS = {
    "0.5.23": Behaviour(
        version="0.5.23",
        weight_update_sessions=True,
        abort_sent=True,
        ready_route=True,
        open_prefixes=("/health", "/ready", "/metrics"),
        model_info_0523=True,
        checker_roles=True,
        non_persistent=("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu"),
        get_weights_architectures=_GET_WEIGHTS_0523,
        tokenize_needs_jinja=True,
    ),
    "0.5.15": Behaviour(
        version="0.5.15",
        weight_update_sessions=False,
        abort_sent=False,
        ready_route=False,
        open_prefixes=("/health", "/metrics"),
        model_info_0523=False,
        checker_roles=False,
        non_persistent=("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32"),
        get_weights_architectures=_GET_WEIGHTS_0515,
        tokenize_needs_jinja=False,
    ),
}


def behaviour(version: str | None) -> Behaviour:
    """The behaviour of ``--sglang-version`` (None: the default); ValueError for another release."""
    try:
        return BEHAVIOURS[version or DEFAULT_SGLANG_VERSION]
    except KeyError:
        raise ValueError(f"--sglang-version must be one of {', '.join(SGLANG_VERSIONS)}, got {version!r}") from None


def builtin_chat_template(arg: str | None) -> str | None:
    """The built-in template name ``--chat-template`` gives (None for none, or for a Jinja file).

    As SGLang's template manager: a path ending in ``.jinja`` is a Jinja template and must exist; any
    other value is a built-in template name or a JSON template file, both of which set a template name.
    ConfigError for a Jinja path that does not exist.
    """
    if not arg:
        return None
    if arg.endswith(".jinja"):
        if not os.path.isfile(arg):
            raise ConfigError(
                f"--chat-template {arg}: Chat template {arg} is not a built-in template name or a valid chat "
                "template file path."
            )
        return None
    return arg


def configure(engine: Any, cfg: dict[str, Any]) -> None:
    """Set an engine's SGLang settings from its flags (``--sglang-version``, keys, load format, chat template).

    The sim and the hf engine both call it once their scheduler exists; the HTTP layer reads
    ``engine.sglang`` (a :class:`Behaviour`), ``engine.load_format``, ``engine.api_key``,
    ``engine.admin_api_key`` and ``engine.chat_template_name``.
    """
    engine.sglang = behaviour(cfg.get("sglang_version"))
    engine.load_format = str(cfg.get("load_format") or "auto")
    engine.api_key = cfg.get("api_key") or None
    engine.admin_api_key = cfg.get("admin_api_key") or None
    engine.chat_template_name = builtin_chat_template(cfg.get("chat_template"))
    engine.scheduler.abort_sent_enabled = engine.sglang.abort_sent
