"""``agent join`` (run a node's agent) and ``agent sim-engine`` (one standalone sim engine)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys

from common.errors import ConfigError, DatasetError, EngineStartError, RolloutError
from common.transport import advertised_host, validate_endpoint


def _join_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--coordinator", required=True, help="coordinator endpoint, tcp://HOST:PORT")
    sp.add_argument("--data-dir", required=True, help="directory of this node's group store (keep it across restarts)")
    g = sp.add_argument_group("engines")
    g.add_argument("--engine", choices=("sim", "sglang"), default=None, help="launch sim engines or SGLang servers (default: sim unless --engine-url is given)")
    g.add_argument("--engines", type=int, default=1, help="number of engines to launch (sglang: tp groups)")
    g.add_argument("--engine-url", action="append", default=[], metavar="URL", help="attach to a running SGLang-API server (repeatable)")
    g.add_argument("--model-path", help="model for --engine sglang")
    g.add_argument("--tp-size", type=int, default=1, help="GPUs per SGLang engine")
    g.add_argument("--gpu-ids", default=None, help="comma-separated GPU ids to use (default: CUDA_VISIBLE_DEVICES or 0..N-1)")
    g.add_argument("--sglang-args", default="", help="extra flags for sglang.launch_server, one shell-quoted string")
    g.add_argument("--sim-args", default="", help="extra flags for each sim engine, e.g. '--token-latency-ms 5'")
    g.add_argument("--concurrency", type=int, default=64, help="concurrent requests (samples) per engine")
    g.add_argument("--engine-start-timeout", type=float, default=600.0)
    g.add_argument("--health-interval", type=float, default=5.0)
    g.add_argument("--max-restarts", type=int, default=3, help="engine restarts allowed per 10 minutes before it is retired")
    sp.add_argument("--payload-bind", default="tcp://0.0.0.0:0", help="endpoint trainers fetch payloads from (port 0: any)")
    sp.add_argument("--advertise-host", default=None, help="address trainers reach this node at (default: the route to the coordinator)")
    sp.add_argument("--agent-id", default=None, help="stable id (default: stored in --data-dir, else hostname-random)")
    sp.add_argument("--tokenizer", default=None, help="'byte' or an HF path (default: the engine's /model_info tokenizer_path)")
    sp.add_argument("--dataset", default=None, help="read prompts from this local replica (must match the coordinator's: size and fingerprint)")
    sp.add_argument("--input-key", default="prompt", help="with --dataset: row key holding the prompt")
    sp.add_argument("--label-key", default="label", help="with --dataset: row key holding the label")
    sp.add_argument("--no-sync", action="store_true", help="skip fsync on store commits (faster, not crash-safe)")
    sp.add_argument("--log-level", default="INFO")


def build_parser() -> argparse.ArgumentParser:
    from agent.sim import cli as sim_cli

    parser = argparse.ArgumentParser(prog="agent", description="rollfleet node agent")
    sub = parser.add_subparsers(dest="command", required=True)
    _join_args(sub.add_parser("join", help="join a coordinator and generate on this node's engines"))
    sim = sub.add_parser("sim-engine", help="run one sim engine (SGLang HTTP API on CPU)")
    sim_cli.add_arguments(sim)
    return parser


def join(args) -> int:
    from agent.engine_plan import plan_engines
    from agent.worker import Agent

    validate_endpoint(args.coordinator, "--coordinator")
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {args.concurrency}")
    gpu_ids = [int(x) for x in args.gpu_ids.split(",")] if args.gpu_ids else None
    specs = []
    kind = args.engine or ("sim" if not args.engine_url else None)
    if kind == "sim":
        specs += plan_engines("sim", count=args.engines, sim_args=shlex.split(args.sim_args))
    elif kind == "sglang":
        specs += plan_engines("sglang", count=args.engines, model_path=args.model_path, tp_size=args.tp_size, gpu_ids=gpu_ids, sglang_args=shlex.split(args.sglang_args))
    if args.engine_url:
        specs += plan_engines("url", urls=args.engine_url)
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
    args = build_parser().parse_args(argv)
    if args.command == "sim-engine":
        from agent.sim import cli as sim_cli

        sim_cli.run(args)
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
