"""The sim engine's flags, and the engine settings they give.

The flags of :func:`add_arguments` configure the engine (each checked against its bounds, so
``--slots 0`` or ``--accuracy 2`` is an error naming the flag); the common ``sglang.launch_server``
flags are accepted too (``--max-running-requests``, ``--model``, ``--random-seed`` are aliases;
``--tp-size``/``--dp-size`` are only reported, the rest have no effect), so the sim runs from an
SGLang command line. :func:`engine_config` gives the same settings to an engine built in-process.

:func:`add_sglang_arguments` adds the SGLang flags whose behaviour the sim and the hf engine both
imitate (``--sglang-version``, ``--api-key``, ``--admin-api-key``, ``--load-format``,
``--chat-template``; :mod:`agent.sim.versions` says what the release changes).
"""

from __future__ import annotations

import argparse
from typing import Any

from agent.sim.versions import DEFAULT_SGLANG_VERSION, SGLANG_VERSIONS
from common.config import number

VERSION = "rollfleet-sim"
CRASH_EXIT_CODE = 17


def tensor_names(text: str) -> list[str]:
    """``NAME[,NAME...]``: non-empty tensor names, comma-separated."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME...] without empty names, got {text!r}")
    return names


def add_sglang_arguments(g: argparse._ArgumentGroup) -> None:
    """The SGLang flags both the sim and the hf engine honour (see :mod:`agent.sim.versions`)."""
    g.add_argument(
        "--sglang-version",
        choices=SGLANG_VERSIONS,
        default=DEFAULT_SGLANG_VERSION,
        help=f"the SGLang release whose HTTP behaviour to imitate (default {DEFAULT_SGLANG_VERSION}): 0.5.23 has "
        "weight-update sessions (/begin_weight_update, /end_weight_update; broadcasts refused outside one), "
        "/ready, abort_sent and the 0.5.23 /model_info fields; 0.5.15 has none of these",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="SGLang's --api-key: every route but /health*, /ready (0.5.23) and /metrics needs "
        '\'Authorization: Bearer KEY\', else 401 {"error": "Unauthorized"}',
    )
    g.add_argument(
        "--admin-api-key",
        default=None,
        help="SGLang's --admin-api-key: the control routes (weights, pause, abort, flush) need this key instead",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        help="SGLang's --load-format (default auto): the format of a disk update that names none; 'dummy' refuses "
        "every such update, as SGLang's dummy loader does; reported in /model_info (0.5.23) and /server_info",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="SGLang's --chat-template: a Jinja file (*.jinja), or a built-in template name, with which 0.5.23 "
        "refuses /tokenize of messages with add_generation_prompt",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sim engine's flags to ``parser``."""
    g = parser.add_argument_group("rollfleet-sim engine")
    add_sglang_arguments(g)
    g.add_argument(
        "--architecture",
        default="Qwen2ForCausalLM",
        help="the model class reported in /model_info 'architectures' (default Qwen2ForCausalLM); "
        "/get_weights_by_name answers only for the classes SGLang implements it for (LlamaForCausalLM, "
        "MistralForCausalLM, OPTForCausalLM, ...), else 400 'Get parameter by name failed'",
    )
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=number(int, min=0, max=65535), required=True, help="HTTP port; 0 picks a free one")
    g.add_argument(
        "--slots",
        "--max-running-requests",
        dest="slots",
        type=number(int, min=1),
        default=256,
        help="max running requests (default 256)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=number(int, min=0),
        default=None,
        help="most requests waiting for a slot; one more is refused with SGLang's 503 'The request queue is full.' "
        "(default: unbounded)",
    )
    g.add_argument(
        "--token-latency-ms",
        type=number(float, min=0),
        default=0.0,
        help="decode time per token per request; 0 = instant (default)",
    )
    g.add_argument(
        "--prefill-latency-ms", type=number(float, min=0), default=0.0, help="time before the first token (default 0)"
    )
    g.add_argument(
        "--stream-interval", type=number(int, min=1), default=1, help="tokens per streamed chunk (default 1)"
    )
    g.add_argument(
        "--output-len-dist",
        choices=("fixed", "lognormal"),
        default="lognormal",
        help="distribution of the natural output length (default lognormal)",
    )
    g.add_argument(
        "--output-len-median", type=number(int, min=1), default=256, help="median output length (default 256)"
    )
    g.add_argument("--output-len-sigma", type=number(float, min=0), default=1.0, help="lognormal sigma (default 1.0)")
    g.add_argument(
        "--output-len-max", type=number(int, min=1), default=8192, help="cap on the drawn output length (default 8192)"
    )
    g.add_argument(
        "--accuracy",
        type=number(float, min=0, max=1),
        default=0.5,
        help="probability that an arithmetic answer is correct (default 0.5)",
    )
    g.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0, help="RNG seed (default 0)")
    g.add_argument("--context-length", type=number(int, min=1), default=32768, help="context length (default 32768)")
    g.add_argument("--weight-version", default="default", help="initial weight_version label")
    g.add_argument(
        "--weight-sync-timeout",
        type=number(float, above=0),
        default=60.0,
        help="seconds a weight-update group may take to form, and each broadcast to arrive (default 60)",
    )
    g.add_argument("--model-path", "--model", dest="model_path", default="rollfleet-sim", help="reported model_path")
    g.add_argument(
        "--startup-delay",
        type=number(float, min=0),
        default=0.0,
        help="seconds the port is open but /health answers 503 (default 0)",
    )
    g.add_argument("--unhealthy", action="store_true", help="never become healthy (/health always 503)")
    g.add_argument(
        "--health-timeout",
        type=number(float, above=0),
        default=20.0,
        help="seconds /health blocks while paused before answering 503 (default 20)",
    )
    g.add_argument(
        "--crash-after-requests",
        type=number(int, min=0),
        default=0,
        help=f"exit with code {CRASH_EXIT_CODE} after answering N /generate calls (0 = never)",
    )
    g.add_argument(
        "--corrupt-broadcasts",
        action="store_true",
        help="a testing aid: every tensor received by /update_weights_from_distributed is stored with its "
        "first element changed (a receive that goes wrong silently), which a verified update must catch",
    )
    g.add_argument(
        "--corrupt-tensors",
        type=tensor_names,
        default=None,
        metavar="NAME[,NAME...]",
        help="a testing aid: like --corrupt-broadcasts, but only the named tensors of a broadcast are changed "
        "(a verification that reads back only some tensors misses them)",
    )
    g.add_argument(
        "--preload-torch",
        action="store_true",
        help="import torch before listening, as an SGLang server has it loaded, so the first weight-update group "
        "does not pay the import (by default the sim imports torch at its first weight operation)",
    )
    g.add_argument(
        "--init-delay",
        type=number(float, min=0),
        default=0.0,
        help="a testing aid: /init_weights_update_group waits this many seconds before it joins the rendezvous "
        "(an engine slow or dying inside it, while the others wait there); default 0",
    )
    c = parser.add_argument_group(
        "sglang.launch_server compatibility",
        "accepted so the sim runs from an SGLang command line; tp/dp sizes are only reported in /server_info",
    )
    c.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=number(int, min=1), default=1)
    c.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=number(int, min=1), default=1)
    c.add_argument("--base-gpu-id", type=int, default=0)
    c.add_argument("--gpu-id-step", type=int, default=1)
    c.add_argument("--mem-fraction-static", type=float, default=None)
    c.add_argument("--dtype", default="auto")
    c.add_argument("--tokenizer-path", default=None)
    c.add_argument("--log-level", default=None)
    for flag in (
        "--skip-server-warmup",
        "--enable-metrics",
        "--enable-memory-saver",
        "--trust-remote-code",
        "--disable-radix-cache",
        "--skip-tokenizer-init",
    ):
        c.add_argument(flag, action="store_true")


def engine_config(args: argparse.Namespace | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Flag defaults, updated by parsed ``args`` and then by ``overrides`` (keyed by flag ``dest``).

    An override that names no flag is a TypeError, so a mistyped option fails loudly.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    cfg = vars(parser.parse_args(["--port", "0"]))
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown SimEngine option(s): {sorted(unknown)}")
    if args is not None:
        cfg.update(vars(args))
    cfg.update(overrides)
    return cfg
