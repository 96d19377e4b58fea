"""``agent join`` (run a node's agent) and ``agent sim-engine`` (one standalone sim engine).

Every mistake on the command line is one line on stderr naming the flag and the value, and
exit status 2 (a config error: the systemd unit does not restart it), before anything is
written to ``--data-dir``. Errors once running (an engine that never comes up) exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import os
import shlex
import sys

from common.config import ArgumentParser, log_level, number, seconds
from common.errors import ConfigError, DatasetError, EngineStartError, RolloutError
from common.transport import advertised_host, validate_endpoint

# Flags whose value is itself a list of flags: ``--sim-args --unhealthy`` means ``--sim-args=--unhealthy``.
_ARGS_FLAGS = ("--sim-args", "--sglang-args")


def _gpu_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids such as 0,1,2, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU ids such as 0,1,2, got {text!r}")
    return ids


def _join_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--coordinator", required=True, help="coordinator endpoint, tcp://HOST:PORT")
    sp.add_argument("--data-dir", required=True, help="directory of this node's group store (keep it across restarts)")
    g = sp.add_argument_group("engines")
    g.add_argument(
        "--engine",
        choices=("sim", "sglang"),
        default=None,
        help="launch sim engines or SGLang servers (default: sim on a node without GPUs, unless --engine-url is given)",
    )
    g.add_argument("--engines", type=number(int, min=1), default=1, help="engines to launch (sglang: tp groups)")
    g.add_argument(
        "--engine-url", action="append", default=[], metavar="URL", help="attach to a running SGLang-API server"
    )
    g.add_argument("--model-path", help="model for --engine sglang")
    g.add_argument("--tp-size", type=number(int, min=1), default=None, help="GPUs per SGLang engine (default 1)")
    g.add_argument(
        "--gpu-ids", type=_gpu_ids, default=None, help="GPU ids to use (default: CUDA_VISIBLE_DEVICES, else 0..N-1)"
    )
    g.add_argument("--sglang-args", default="", help="extra flags for sglang.launch_server, one shell-quoted string")
    g.add_argument("--sim-args", default="", help="extra flags for each sim engine, e.g. '--token-latency-ms 5'")
    g.add_argument(
        "--concurrency", type=number(int, min=1), default=64, help="concurrent requests (samples) per engine"
    )
    g.add_argument("--engine-start-timeout", type=seconds, default=600.0, help="seconds an engine has to get healthy")
    g.add_argument("--health-interval", type=seconds, default=5.0, help="seconds between engine health checks")
    g.add_argument(
        "--max-restarts", type=number(int, min=0), default=3, help="engine restarts per 10 minutes before retiring it"
    )
    sp.add_argument(
        "--payload-bind", default="tcp://0.0.0.0:0", help="endpoint trainers fetch payloads from (port 0: any)"
    )
    sp.add_argument(
        "--advertise-host",
        default=None,
        help="address trainers reach this node at (default: the route to the coordinator)",
    )
    sp.add_argument("--agent-id", default=None, help="stable id (default: stored in --data-dir, else hostname-random)")
    sp.add_argument(
        "--tokenizer", default=None, help="'byte' or an HF path (default: the engine's /model_info tokenizer_path)"
    )
    sp.add_argument(
        "--dataset",
        default=None,
        help="read prompts from this local replica (must match the coordinator's: size and fingerprint)",
    )
    sp.add_argument("--input-key", default="prompt", help="with --dataset: row key holding the prompt")
    sp.add_argument("--label-key", default="label", help="with --dataset: row key holding the label")
    sp.add_argument("--no-sync", action="store_true", help="skip fsync on store commits (faster, not crash-safe)")
    sp.add_argument("--log-level", type=log_level, default="INFO", help="DEBUG, INFO, WARNING or ERROR (any case)")


def build_parser() -> argparse.ArgumentParser:
    from agent.sim import cli as sim_cli

    parser = ArgumentParser(prog="agent", description="rollfleet node agent")
    sub = parser.add_subparsers(dest="command", required=True)
    _join_args(sub.add_parser("join", help="join a coordinator and generate on this node's engines"))
    sim = sub.add_parser("sim-engine", help="run one sim engine (SGLang HTTP API on CPU)")
    sim_cli.add_arguments(sim)
    return parser


def join_args_values(argv: list[str]) -> list[str]:
    """``--sim-args --unhealthy`` as ``--sim-args=--unhealthy``: argparse takes a value starting with
    ``-`` for a flag of its own and would say "expected one argument"."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _ARGS_FLAGS and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def gpus_visible() -> list[str]:
    """The GPUs this node shows: CUDA_VISIBLE_DEVICES when set (empty: none), else /dev/nvidia<N>."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [x for x in visible.split(",") if x.strip() and x.strip() != "-1"]
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def _engine_kind(args) -> str | None:
    """The engine kind to launch, None for URL engines only. The sim engine is never a silent
    default on a node with GPUs: there an agent with no engine flags is a config error."""
    if args.engine is not None:
        kind = args.engine
    elif args.engine_url:
        kind = None
    elif args.sim_args:
        kind = "sim"
    else:
        gpus = gpus_visible()
        if gpus:
            raise ConfigError(
                f"this node has GPUs ({', '.join(gpus)}) but no engine was given: pass --engine sglang "
                "--model-path PATH, --engine-url URL, or --engine sim for the CPU sim engine"
            )
        kind = "sim"
    sglang_only = {"--model-path": args.model_path, "--tp-size": args.tp_size, "--gpu-ids": args.gpu_ids,
                   "--sglang-args": args.sglang_args}  # fmt: skip
    if kind != "sglang":
        given = [flag for flag, value in sglang_only.items() if value]
        if given:
            verb = "only applies" if len(given) == 1 else "only apply"
            raise ConfigError(f"{', '.join(given)} {verb} to --engine sglang (engine here: {kind or 'url'})")
    if kind != "sim" and args.sim_args:
        raise ConfigError(f"--sim-args only applies to --engine sim (engine here: {kind or 'url'})")
    if kind == "sglang" and not args.model_path:
        raise ConfigError("--engine sglang needs --model-path PATH")
    return kind


def _split(flag: str, value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r}: {exc}") from None


class _FlagsOf(argparse.ArgumentParser):
    """Parses the flags given to an engine inside another flag; a mistake is a ConfigError naming that flag."""

    def __init__(self, outer: str):
        super().__init__(prog=outer, add_help=False)
        self.outer = outer

    def error(self, message: str):
        raise ConfigError(f"{self.outer}: {message}")


def _sim_argv(value: str) -> list[str]:
    """The words of --sim-args, checked against the sim engine's own flags before any engine starts."""
    from agent.sim.config import add_arguments

    argv = _split("--sim-args", value)
    parser = _FlagsOf("--sim-args")
    add_arguments(parser)
    parser.parse_args(["--port", "0", *argv])
    return argv


def _check_payload_bind(bind: str) -> None:
    """A fixed --payload-bind port must be free now, before the store is opened: a failed start
    leaves nothing in --data-dir (not even a generated agent id)."""
    import zmq

    from common.transport import router

    validate_endpoint(bind, "--payload-bind")
    if bind.rsplit(":", 1)[-1] in ("0", "*"):
        return
    ctx = zmq.Context()
    try:
        sock, _ = router(ctx, bind)
        sock.close(linger=0)
    except ConfigError as exc:
        raise ConfigError(f"--payload-bind: {exc}") from None
    finally:
        ctx.term()


def join(args) -> int:
    from agent.engine_plan import plan_engines
    from agent.worker import Agent
    from common.tokenizer import check_tokenizer

    validate_endpoint(args.coordinator, "--coordinator")
    kind = _engine_kind(args)
    specs = []
    if kind == "sim":
        specs += plan_engines("sim", count=args.engines, sim_args=_sim_argv(args.sim_args))
    elif kind == "sglang":
        specs += plan_engines(
            "sglang",
            count=args.engines,
            model_path=args.model_path,
            tp_size=args.tp_size or 1,
            gpu_ids=args.gpu_ids,
            sglang_args=_split("--sglang-args", args.sglang_args),
        )
    if args.engine_url:
        specs += plan_engines("url", urls=args.engine_url)
    if args.tokenizer:
        check_tokenizer(args.tokenizer, "--tokenizer")
    _check_payload_bind(args.payload_bind)
    dataset = None
    if args.dataset:
        from common.dataset import Dataset

        dataset = Dataset(args.dataset, input_key=args.input_key, label_key=args.label_key)
    agent = Agent(
        dataset=dataset,
        coordinator=args.coordinator,
        data_dir=args.data_dir,
        engine_specs=specs,
        concurrency=args.concurrency,
        payload_bind=args.payload_bind,
        advertise_host=args.advertise_host or advertised_host(args.coordinator),
        agent_id=args.agent_id,
        tokenizer=args.tokenizer,
        sync=not args.no_sync,
        supervisor_options={
            "start_timeout": args.engine_start_timeout,
            "health_interval": args.health_interval,
            "max_restarts": args.max_restarts,
        },
    )
    print(f"agent {agent.agent_id} joining {args.coordinator}; payloads at {agent.payload_address}", flush=True)
    failures: list[BaseException] = []
    try:
        asyncio.run(agent.run())
    except* RolloutError as eg:
        failures.extend(eg.exceptions)
    for exc in failures:
        print(f"agent: error: {exc}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None) -> int:
    argv = join_args_values(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if args.command == "sim-engine":
        from agent.sim import cli as sim_cli

        try:
            sim_cli.run(args)
        except ConfigError as exc:
            print(f"agent sim-engine: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return join(args)
    except (ConfigError, DatasetError, EngineStartError, ValueError) as exc:
        print(f"agent: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
