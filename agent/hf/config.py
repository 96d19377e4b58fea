"""The hf engine's flags, and the engine settings they give.

Importing this module imports neither torch nor transformers, so ``agent --help`` and the
``--hf-args`` check stay fast. :func:`engine_config` gives the same settings to an engine built
in-process (tests), keyed by flag ``dest``; an unknown key is a TypeError.

The SGLang flags the sim honours (``--sglang-version``, ``--api-key``, ``--admin-api-key``,
``--load-format``, ``--chat-template``: :func:`agent.sim.config.add_sglang_arguments`) are the hf
engine's too; its ``architectures`` are its model's.
"""

from __future__ import annotations

import argparse
from typing import Any

from agent.sim.config import CRASH_EXIT_CODE, add_sglang_arguments
from common.config import number

VERSION = "rollfleet-hf"
DEVICES = "auto, cpu, cuda or cuda:N"


def device_flag(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected {DEVICES}, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the hf engine's flags to ``parser``."""
    g = parser.add_argument_group("rollfleet-hf engine")
    add_sglang_arguments(g)
    g.add_argument(
        "--model-path", "--model", dest="model_path", required=True, help="Hugging Face model directory to serve"
    )
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument(
        "--port", type=number(int, min=0, max=65535), default=0, help="HTTP port; 0 picks a free one (default)"
    )
    g.add_argument(
        "--device", type=device_flag, default="auto", help=f"{DEVICES}; auto: cuda when available (default auto)"
    )
    g.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="model dtype (default float32)"
    )
    g.add_argument(
        "--threads", type=number(int, min=1), default=None, help="torch CPU threads (default: torch's own choice)"
    )
    g.add_argument(
        "--slots",
        "--max-running-requests",
        dest="slots",
        type=number(int, min=1),
        default=64,
        help="max running requests, decoded together in one batch (default 64)",
    )
    g.add_argument(
        "--stream-interval", type=number(int, min=1), default=1, help="tokens per streamed chunk (default 1)"
    )
    g.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0, help="sampling RNG seed (default 0)")
    g.add_argument("--weight-version", default="default", help="initial weight_version label (default 'default')")
    g.add_argument(
        "--context-length",
        type=number(int, min=2),
        default=None,
        help="context length (default: the model config's max_position_embeddings)",
    )
    g.add_argument(
        "--weight-sync-timeout",
        type=number(float, above=0),
        default=60.0,
        help="seconds a weight-update group may take to form, and each broadcast to arrive (default 60)",
    )
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


def engine_config(args: argparse.Namespace | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Flag defaults, updated by parsed ``args`` and then by ``overrides`` (keyed by flag ``dest``)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    cfg = vars(parser.parse_args(["--model-path", ""]))
    unknown = set(overrides) - set(cfg)
    if unknown:
        raise TypeError(f"unknown HFEngine option(s): {sorted(unknown)}")
    if args is not None:
        cfg.update({k: v for k, v in vars(args).items() if k in cfg})
    cfg.update(overrides)
    if not cfg["model_path"]:
        raise TypeError("HFEngine needs model_path")
    return cfg
