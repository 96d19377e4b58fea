"""``agent join`` (run a node's agent), ``agent sim-engine`` and ``agent hf-engine`` (one standalone engine),
``agent make-model`` (a small model directory for the hf engine).

Every mistake on the command line is one line on stderr naming the flag and the value, and
exit status 2 (a config error: the systemd unit does not restart it), before anything is
written to ``--data-dir``. Errors once running (an engine that never comes up) exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import logging
import os
import shlex
import sys

from common.config import ArgumentParser, map_size, number, seconds
from common.config_file import REDACTED, add_config_flag, parse_args_with_config
from common.curve import check_exposure, client_keys, is_loopback
from common.errors import ConfigError, DatasetError, EngineStartError, RolloutError, StorageFull
from common.logs import add_log_flags, setup_logging
from common.transport import advertised_host, validate_endpoint

# Flags whose value is itself a list of flags: ``--sim-args --unhealthy`` means ``--sim-args=--unhealthy``.
_ARGS_FLAGS = ("--sim-args", "--hf-args", "--sglang-args")

ENGINE_API_KEY_ENV = "ROLLFLEET_ENGINE_API_KEY"
"""The environment variable ``--engine-api-key`` defaults to (the systemd unit's agent.env sets it)."""


def engine_api_key(args, environ=os.environ) -> str:
    """``--engine-api-key`` (from the command line or the config file), else ``$ROLLFLEET_ENGINE_API_KEY``, else "".

    ConfigError for a key that cannot travel in an HTTP header (spaces, control or non-ASCII characters)."""
    given = args.engine_api_key
    flag = "--engine-api-key" if given else ENGINE_API_KEY_ENV
    key = given if given else environ.get(ENGINE_API_KEY_ENV, "")
    bad = sorted({repr(c) for c in key if not 33 <= ord(c) <= 126})
    if bad:
        raise ConfigError(f"{flag}: the key holds {', '.join(bad)}; an API key is printable ASCII without spaces")
    return key


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
        choices=("sim", "hf", "sglang"),
        default=None,
        help="launch sim engines, hf engines (a torch model) or SGLang servers "
        "(default: sim on a node without GPUs, unless --engine-url is given)",
    )
    g.add_argument("--engines", type=number(int, min=1), default=1, help="engines to launch (sglang: tp groups)")
    g.add_argument(
        "--engine-url", action="append", default=[], metavar="URL", help="attach to a running SGLang-API server"
    )
    g.add_argument("--model-path", help="model directory for --engine sglang or --engine hf")
    g.add_argument("--tp-size", type=number(int, min=1), default=None, help="GPUs per SGLang engine (default 1)")
    g.add_argument(
        "--gpu-ids", type=_gpu_ids, default=None, help="GPU ids to use (default: CUDA_VISIBLE_DEVICES, else 0..N-1)"
    )
    g.add_argument("--sglang-args", default="", help="extra flags for sglang.launch_server, one shell-quoted string")
    g.add_argument("--sim-args", default="", help="extra flags for each sim engine, e.g. '--token-latency-ms 5'")
    g.add_argument(
        "--hf-args", default="", help="extra flags for each hf engine, e.g. '--device cuda --dtype bfloat16'"
    )
    g.add_argument(
        "--engine-api-key",
        default=None,
        metavar="KEY",
        help="the engines' API key (SGLang --api-key): sent to every engine as 'Authorization: Bearer KEY', and the "
        f"sim, hf and sglang engines launched here are started with it; default: ${ENGINE_API_KEY_ENV}, which keeps "
        "it off the command line",
    )
    g.add_argument(
        "--concurrency", type=number(int, min=1), default=64, help="concurrent requests (samples) per engine"
    )
    g.add_argument("--engine-start-timeout", type=seconds, default=600.0, help="seconds an engine has to get healthy")
    g.add_argument("--health-interval", type=seconds, default=5.0, help="seconds between engine health checks")
    g.add_argument(
        "--health-timeout",
        type=seconds,
        default=20.0,
        help="seconds an engine's health probe (/health_generate) may take before the engine counts as hung and "
        "leaves the pool: a hung engine is out within this plus --health-interval (default 20, SGLang's own "
        "SGLANG_HEALTH_CHECK_TIMEOUT; a busy engine's probe waits behind its queue, so keep it above a few seconds)",
    )
    g.add_argument(
        "--max-restarts", type=number(int, min=0), default=3, help="engine restarts per 10 minutes before retiring it"
    )
    sp.add_argument(
        "--payload-bind",
        default=None,
        help="endpoint trainers fetch payloads from (port 0: any; default tcp://127.0.0.1:0 when the coordinator "
        "is on loopback, else tcp://0.0.0.0:0; off loopback: needs --curve-secret or --insecure)",
    )
    sp.add_argument("--curve-secret", default=None, help="CurveZMQ: this agent's key pair file, NAME.key_secret")
    sp.add_argument("--curve-server-key", default=None, help="CurveZMQ: the coordinator's public key, coordinator.key")
    sp.add_argument(
        "--insecure", action="store_true", help="allow a --payload-bind reachable from other hosts without keys"
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
    sp.add_argument(
        "--metrics-port",
        type=number(int, min=0, max=65535),
        default=None,
        help="serve Prometheus /metrics on this HTTP port; 0 picks a free one (logged); default: off",
    )
    sp.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics port binds (default 127.0.0.1)")
    sp.add_argument(
        "--map-size",
        type=map_size,
        default=1 << 40,
        metavar="SIZE",
        help="most the LMDB store may hold, e.g. 64GiB (address space, not disk; default 1TiB); when full the agent "
        "stops, and a restart with a larger value on the same --data-dir delivers every committed group",
    )
    sp.add_argument("--no-sync", action="store_true", help="skip fsync on store commits (faster, not crash-safe)")
    add_log_flags(sp)
    add_config_flag(sp)


def build_parser() -> argparse.ArgumentParser:
    from agent.hf import config as hf_config
    from agent.sim import cli as sim_cli

    parser = ArgumentParser(prog="agent", description="rollfleet node agent")
    sub = parser.add_subparsers(dest="command", required=True)
    join_parser = sub.add_parser("join", help="join a coordinator and generate on this node's engines")
    _join_args(join_parser)
    parser.config_commands = {"join": join_parser}
    sim = sub.add_parser("sim-engine", help="run one sim engine (SGLang HTTP API on CPU)")
    sim_cli.add_arguments(sim)
    hf = sub.add_parser("hf-engine", help="run one hf engine (a torch causal LM behind SGLang's HTTP API)")
    hf_config.add_arguments(hf)
    _make_model_args(sub.add_parser("make-model", help="write a small random model directory for the hf engine"))
    return parser


def _make_model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("path", help="directory to create (must not exist, or be empty)")
    sp.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="size preset (default tiny, 1.8 M)")
    sp.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    sp.add_argument(
        "--context-length", type=number(int, min=2), default=512, help="max_position_embeddings (default 512)"
    )
    for flag, field in (
        ("--hidden-size", "hidden_size"),
        ("--layers", "num_hidden_layers"),
        ("--heads", "num_attention_heads"),
        ("--intermediate-size", "intermediate_size"),
    ):
        sp.add_argument(flag, dest=field, type=number(int, min=1), default=None, help=f"override the preset's {field}")


def make_model_command(args: argparse.Namespace) -> int:

    from transformers.utils import logging as transformers_logging

    from agent.hf.model import make_model

    transformers_logging.disable_progress_bar()
    overrides = {
        k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    }
    summary = make_model(args.path, preset=args.preset, seed=args.seed, context_length=args.context_length, **overrides)
    print(json.dumps(summary, indent=2))
    return 0


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
    sglang_only = {"--tp-size": args.tp_size, "--gpu-ids": args.gpu_ids, "--sglang-args": args.sglang_args}
    if kind not in ("sglang", "hf") and args.model_path:
        raise ConfigError(f"--model-path only applies to --engine sglang or hf (engine here: {kind or 'url'})")
    if kind != "sglang":
        given = [flag for flag, value in sglang_only.items() if value]
        if given:
            verb = "only applies" if len(given) == 1 else "only apply"
            raise ConfigError(f"{', '.join(given)} {verb} to --engine sglang (engine here: {kind or 'url'})")
    if kind != "sim" and args.sim_args:
        raise ConfigError(f"--sim-args only applies to --engine sim (engine here: {kind or 'url'})")
    if kind != "hf" and args.hf_args:
        raise ConfigError(f"--hf-args only applies to --engine hf (engine here: {kind or 'url'})")
    if kind in ("sglang", "hf") and not args.model_path:
        raise ConfigError(f"--engine {kind} needs --model-path PATH")
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


def _hf_argv(value: str, engines: int) -> list[str]:
    """The words of --hf-args, checked against the hf engine's flags; ``--threads`` defaults to half
    of this node's cores shared among the engines (cpu_count // (2 * engines), at least 1): the agent,
    and often a trainer, run beside them, and an oversubscribed torch runs many times slower."""
    from agent.hf.config import add_arguments

    argv = _split("--hf-args", value)
    parser = _FlagsOf("--hf-args")
    add_arguments(parser)
    parsed = parser.parse_args(["--model-path", "-", *argv])
    if parsed.threads is None:
        argv += ["--threads", str(max(1, (os.cpu_count() or 1) // (2 * engines)))]
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
    from agent.settings import AgentSettings, SupervisorSettings
    from agent.worker import Agent
    from common.tokenizer import check_tokenizer

    validate_endpoint(args.coordinator, "--coordinator")
    kind = _engine_kind(args)
    api_key = engine_api_key(args)
    specs = []
    if kind == "sim":
        specs += plan_engines("sim", count=args.engines, sim_args=_sim_argv(args.sim_args), api_key=api_key)
    elif kind == "hf":
        specs += plan_engines(
            "hf",
            count=args.engines,
            model_path=args.model_path,
            hf_args=_hf_argv(args.hf_args, args.engines),
            api_key=api_key,
        )
    elif kind == "sglang":
        specs += plan_engines(
            "sglang",
            count=args.engines,
            model_path=args.model_path,
            tp_size=args.tp_size or 1,
            gpu_ids=args.gpu_ids,
            sglang_args=_split("--sglang-args", args.sglang_args),
            api_key=api_key,
        )
    if args.engine_url:
        specs += plan_engines("url", urls=args.engine_url)
    if args.tokenizer:
        check_tokenizer(args.tokenizer, "--tokenizer")
    curve = client_keys(
        args.curve_secret, args.curve_server_key, secret_flag="--curve-secret", server_flag="--curve-server-key"
    )
    advertise = args.advertise_host or advertised_host(args.coordinator)
    if args.payload_bind is None:
        args.payload_bind = "tcp://127.0.0.1:0" if is_loopback(f"tcp://{advertise}:0") else "tcp://0.0.0.0:0"
    validate_endpoint(args.payload_bind, "--payload-bind")
    exposed = check_exposure(
        args.payload_bind,
        "--payload-bind",
        keyed=curve is not None,
        insecure=args.insecure,
        keys_flag="--curve-secret FILE --curve-server-key FILE",
    )
    _check_payload_bind(args.payload_bind)
    dataset = None
    if args.dataset:
        from common.dataset import Dataset

        dataset = Dataset(args.dataset, input_key=args.input_key, label_key=args.label_key)
    settings = AgentSettings(
        coordinator=args.coordinator,
        data_dir=args.data_dir,
        engines=tuple(specs),
        payload_bind=args.payload_bind,
        advertise_host=advertise,
        concurrency=args.concurrency,
        supervisor=SupervisorSettings(
            start_timeout=args.engine_start_timeout,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            max_restarts=args.max_restarts,
            api_key=api_key,  # the supervisor's probes and the agent's EngineClient send it (agent/worker.py)
        ),
        agent_id=args.agent_id,
        tokenizer=args.tokenizer,
        dataset=dataset,
        sync=not args.no_sync,
        map_size=args.map_size,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        curve=curve,
    )
    agent = Agent(settings)
    if exposed:
        logging.getLogger("rollfleet.agent").warning("%s", exposed)
    if api_key and not args.engine_api_key:
        args.effective_config["engine-api-key"] = f"{REDACTED} (from ${ENGINE_API_KEY_ENV})"
    logging.getLogger("agent").info("effective config: %s", json.dumps(args.effective_config, sort_keys=True))
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
    try:
        args, effective = parse_args_with_config(build_parser(), argv)
    except ConfigError as exc:
        print(f"agent: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "hf-engine":
        from agent.hf import cli as hf_cli

        try:
            hf_cli.run(args)
        except ConfigError as exc:
            print(f"agent hf-engine: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
        return 0
    if args.command == "make-model":
        try:
            return make_model_command(args)
        except ConfigError as exc:
            print(f"agent make-model: error: {exc}", file=sys.stderr)
            return 2
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
    setup_logging(args.log_level, args.log_format)
    args.effective_config = effective  # logged once the command has checked everything and started
    try:
        return join(args)
    except (ConfigError, DatasetError, EngineStartError, ValueError) as exc:
        print(f"agent: error: {exc}", file=sys.stderr)
        return 2
    except StorageFull as exc:  # full at start (the store's first writes): stopped before joining
        print(f"agent: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
