"""``coordinator serve``, ``coordinator status`` and ``coordinator replay``.

``serve --bind`` on an address reachable from other hosts needs ``--curve-dir`` (CurveZMQ keys,
docs/operate/keys.md) or an explicit ``--insecure``; loopback needs neither.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from common.config import ArgumentParser, Liveness, RolloutConfig, map_size, message_bytes, number, seconds
from common.config_file import add_config_flag, parse_args_with_config
from common.curve import check_exposure
from common.errors import ConfigError, DatasetError, RolloutError, StorageFull
from common.logs import add_log_flags, setup_logging
from common.transport import validate_endpoint

_COUNT = number(int, min=1)


def _serve_args(sp: argparse.ArgumentParser) -> None:
    d = RolloutConfig()
    sp.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="PATH | NAME=PATH,weight=W[,OPT=V]",
        help="JSONL file, one prompt per line; or one training dataset of a mixture, repeatable: "
        "NAME=PATH,weight=W with options reward, filter, n_samples, max_new_tokens, temperature, top_p, "
        "input_key, label_key, shuffle_seed (docs/concepts/mixtures.md)",
    )
    sp.add_argument("--input-key", default="prompt", help="row key holding the prompt (string or chat messages)")
    sp.add_argument("--label-key", default="label", help="row key holding the label given to the reward")
    sp.add_argument(
        "--tokenizer",
        default=None,
        help="the agents' tokenizer ('byte' or an HF path): chat rows its chat template cannot render are refused "
        "at start (file and line)",
    )
    sp.add_argument(
        "--eval-dataset",
        action="append",
        default=[],
        metavar="NAME=PATH[,OPT=V]",
        help="an evaluation dataset for client.evaluate(NAME); repeatable; options n_samples, max_new_tokens, "
        "temperature, top_p, pass_threshold (docs/concepts/evaluation.md)",
    )
    sp.add_argument("--data-dir", required=True, help="directory of the coordinator's LMDB ledger (keep it to resume)")
    sp.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="ZeroMQ endpoint agents and trainers connect to (off loopback: needs --curve-dir or --insecure)",
    )
    sp.add_argument(
        "--curve-dir",
        default=None,
        help="CurveZMQ keys: DIR/coordinator.key_secret, allowed DIR/agents/*.key and DIR/trainers/*.key",
    )
    sp.add_argument(
        "--insecure", action="store_true", help="allow a --bind reachable from other hosts without --curve-dir"
    )
    sp.add_argument("--rollout-batch-size", type=_COUNT, default=d.rollout_batch_size, help="groups per trainer batch")
    sp.add_argument("--n-samples-per-prompt", type=_COUNT, default=d.n_samples_per_prompt, help="samples per group")
    sp.add_argument("--max-new-tokens", type=_COUNT, default=d.max_new_tokens, help="tokens per sample")
    sp.add_argument("--temperature", type=number(float, min=0, max=100), default=d.temperature)
    sp.add_argument("--top-p", type=number(float, above=0, max=1), default=d.top_p)
    sp.add_argument("--top-k", type=number(int, min=-1), default=d.top_k, help="-1: off")
    sp.add_argument("--reward", default=d.reward, help="math | exact | module:function")
    sp.add_argument("--dynamic-filter", default=d.dynamic_filter, help="nonzero_std | none | module:function")
    sp.add_argument(
        "--generate",
        default=d.generate,
        metavar="MODULE:FUNCTION",
        help="a custom generate function making each sample (multi-turn, tools; docs/guides/generate-functions.md); "
        "default: one /generate call per sample",
    )
    sp.add_argument(
        "--tool-parser",
        default=d.tool_parser,
        metavar="NAME|MODULE:FUNCTION",
        help="how generate functions' OpenAI endpoint reads tool calls from the model's output: hermes "
        "(<tool_call>{json}</tool_call>, the default), none, or module:function (docs/guides/generate-functions.md)",
    )
    sp.add_argument(
        "--prefetch", type=number(int, min=-1), default=d.prefetch, help="ready groups beyond demand (-1: one batch)"
    )
    sp.add_argument(
        "--over-sampling",
        type=number(float, min=1),
        default=1.0,
        metavar="FACTOR",
        help="start ceil(rollout-batch-size x FACTOR) groups for a waiting generate() and stop the surplus once "
        "its batch is full (docs/concepts/over-sampling.md; default 1.0: off)",
    )
    sp.add_argument(
        "--max-staleness",
        type=number(int, min=0),
        default=d.max_staleness,
        help="most weight updates a batch's groups may lag behind it (docs/weights.md; default: unbounded)",
    )
    sp.add_argument(
        "--partial-rollout",
        action=argparse.BooleanOptionalAction,
        default=d.partial_rollout,
        help="continue samples a weight update interrupts from their partial output (else generate them again)",
    )
    sp.add_argument("--shuffle-seed", type=int, default=None, help="shuffle prompts per data epoch with this seed")
    sp.add_argument("--heartbeat-interval", type=seconds, default=Liveness.heartbeat_interval, help="seconds")
    sp.add_argument(
        "--agent-ttl",
        type=seconds,
        default=Liveness.ttl,
        help="silence after which an agent is presumed dead (its leases held for it, its capacity out of the pool)",
    )
    sp.add_argument(
        "--retire-after", type=seconds, default=Liveness.retire_after, help="silence after which an agent is retired"
    )
    sp.add_argument("--max-message-bytes", type=message_bytes, default=64 << 20, help="largest control message (64MiB)")
    sp.add_argument(
        "--starve-after",
        type=_COUNT,
        default=None,
        help="failed groups in a row (reward/filter raised) after which generate() raises Starved and admission "
        "stops (default: max(64, 2 x --rollout-batch-size))",
    )
    sp.add_argument(
        "--starve-after-drops",
        type=_COUNT,
        default=None,
        help="groups in a row the filter dropped (none kept) after which generate() raises Starved with the drop "
        "counts and admission stops (default: the dataset's size, one data epoch)",
    )
    sp.add_argument(
        "--metrics-port",
        type=number(int, min=0, max=65535),
        default=None,
        help="serve Prometheus /metrics and the status page (/, /status.json) on this HTTP port; 0 picks a free "
        "one (logged); default: off",
    )
    sp.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics port binds (default 127.0.0.1)")
    sp.add_argument(
        "--sampling-params",
        default="{}",
        metavar="JSON",
        help="JSON object merged into the sampling params sent to engines, checked against SGLang's "
        'SamplingParams fields, e.g. \'{"stop": ["</answer>"], "min_p": 0.05}\' (docs/operate/engine-errors.md)',
    )
    sp.add_argument(
        "--map-size",
        type=map_size,
        default=1 << 40,
        metavar="SIZE",
        help="most the LMDB ledger may hold, e.g. 64GiB (address space, not disk; default 1TiB); when full the "
        "coordinator stops, and a restart with a larger value on the same --data-dir carries on",
    )
    sp.add_argument(
        "--gateways",
        type=_gateways,
        default="auto",
        metavar="N|auto",
        help="relay processes that hold the agents' and trainers' connections and pass their messages to the "
        "coordinator in batches (docs/operate/gateways.md); 0: none, the coordinator serves --bind itself; auto "
        "(default): one per 8 cores this process may use (affinity, cgroup quota), at most 4, none below 8 cores or "
        "for a non-tcp --bind",
    )
    sp.add_argument("--no-sync", action="store_true", help="skip fsync on ledger commits (faster, not crash-safe)")
    sp.add_argument("--allow-config-change", action="store_true", help="restart with other batch settings; recorded")
    add_log_flags(sp)
    add_config_flag(sp)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="coordinator", description="rollfleet coordinator")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="run the coordinator")
    _serve_args(serve_parser)
    parser.config_commands = {"serve": serve_parser}
    st = sub.add_parser("status", help="print a running coordinator's statistics as a table (--json: as JSON)")
    st.add_argument("--coordinator", default="tcp://127.0.0.1:5555")
    st.add_argument("--json", action="store_true", help="print the statistics as JSON, for machines")
    st.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for an answer")
    _client_key_args(st)
    rp = sub.add_parser(
        "replay",
        help="serve the batches a trainer recorded (RolloutClient(record=DIR)) to an unchanged trainer, with no "
        "agents and no engines; --show prints one",
    )
    rp.add_argument("--from", dest="source", required=True, metavar="DIR", help="the directory the trainer recorded to")
    rp.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="ZeroMQ endpoint the trainer connects to, as to a coordinator (off loopback: needs --insecure)",
    )
    rp.add_argument("--insecure", action="store_true", help="allow a --bind reachable from other hosts (no keys)")
    rp.add_argument(
        "--show",
        type=number(int, min=0),
        default=None,
        metavar="ROLLOUT_ID",
        help="print this batch's metrics and first samples instead of serving",
    )
    rp.add_argument("--samples", type=number(int, min=0), default=4, metavar="N", help="samples --show prints (4)")
    add_log_flags(rp)
    return parser


def _sampling_params(text: str) -> dict:
    """``--sampling-params``: a JSON object of SGLang sampling parameters (common/sampling.py checks it)."""
    from common.sampling import check_sampling_params

    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--sampling-params: not valid JSON ({exc}): {text!r}") from None
    return check_sampling_params(params, "--sampling-params")


def _client_key_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--curve-secret", default=None, help="CurveZMQ: this client's NAME.key_secret (a trainers/ key)")
    sp.add_argument("--curve-server-key", default=None, help="CurveZMQ: the coordinator's public key, coordinator.key")


def _check_chat_rows(name: str, data_dir: str, datasets: list) -> None:
    """Every chat row of ``datasets`` rendered by the chat template of tokenizer ``name`` (common/chat_rows.py)."""
    from common.chat_rows import check_chat_rows
    from common.tokenizer import check_tokenizer, load_tokenizer

    check_tokenizer(name, "--tokenizer")
    tokenizer = load_tokenizer(name)
    os.makedirs(data_dir, exist_ok=True)
    for what, dataset in datasets:
        check_chat_rows(dataset, tokenizer, cache_path=os.path.join(data_dir, f"{what}.chat-check"))


def _gateways(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 64:
        raise argparse.ArgumentTypeError(f"expected auto or a number of gateways from 0 to 64, got {text!r}")
    return n


def _gateway_count(value: str | int, bind: str) -> int:
    from coordinator.gateways import auto_gateways

    if value == "auto":
        return auto_gateways() if bind.startswith("tcp://") else 0
    return value


def serve(args) -> int:
    from common.dataset import Dataset
    from common.filters import load_filter
    from common.mixture import DEFAULT, check_sources, parse_dataset
    from common.rewards import load_reward
    from coordinator.eval_datasets import load_eval_datasets
    from coordinator.server import CoordinatorServer, ServeSettings

    dataset_args = [parse_dataset(text) for text in args.dataset]
    named = len(dataset_args) > 1 or dataset_args[0].spec.name != DEFAULT
    check_sources([d.spec for d in dataset_args])
    config = RolloutConfig(
        mixture=[d.spec.to_dict() for d in dataset_args] if named else [],
        extra_sampling_params=_sampling_params(args.sampling_params),
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=args.n_samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        reward=args.reward,
        dynamic_filter=args.dynamic_filter,
        prefetch=args.prefetch,
        max_staleness=args.max_staleness,
        partial_rollout=args.partial_rollout,
        generate=args.generate,
        tool_parser=args.tool_parser,
    )
    liveness = Liveness(args.heartbeat_interval, args.agent_ttl, args.retire_after)
    validate_endpoint(args.bind, "--bind")
    curve = None
    if args.curve_dir:
        from common.curve import CoordinatorKeys

        curve = CoordinatorKeys.load(args.curve_dir)
    exposed = check_exposure(
        args.bind, "--bind", keyed=curve is not None, insecure=args.insecure, keys_flag="--curve-dir DIR"
    )
    # Fail here, with the spec named, rather than on every agent later.
    load_reward(config.reward)
    load_filter(config.dynamic_filter)
    for d in dataset_args:
        if d.spec.reward is not None:
            load_reward(d.spec.reward)
        if d.spec.filter is not None:
            load_filter(d.spec.filter)
    if config.generate:
        from common.plugins import import_callable

        import_callable(config.generate, kind="generate")
    if ":" in config.tool_parser:
        from common.plugins import import_callable

        import_callable(config.tool_parser, kind="tool-parser")
    # The row index is cached beside the ledger: a restart on the same file skips validation.
    mixture = None
    if named:
        from common.mixture import MixtureDatasets

        mixture = []
        for d in dataset_args:
            index = os.path.join(args.data_dir, f"dataset-{d.spec.name}.index")
            keys = {"input_key": d.input_key or args.input_key, "label_key": d.label_key or args.label_key}
            source_seed = d.shuffle_seed if d.shuffle_seed is not None else args.shuffle_seed
            mixture.append((Dataset(d.path, **keys, index_path=index), source_seed))
        dataset = MixtureDatasets([d.spec.name for d in dataset_args], [ds for ds, _ in mixture])
    else:
        index = os.path.join(args.data_dir, "dataset.index")
        dataset = Dataset(dataset_args[0].path, input_key=args.input_key, label_key=args.label_key, index_path=index)
    evals = load_eval_datasets(
        args.eval_dataset, config, input_key=args.input_key, label_key=args.label_key, data_dir=args.data_dir
    )
    if args.tokenizer:
        training = [(f"dataset-{n}", ds) for n, (ds, _) in zip(dataset.names, mixture, strict=True)] if mixture else []
        _check_chat_rows(
            args.tokenizer,
            args.data_dir,
            (training or [("dataset", dataset)]) + [(f"eval-{n}", d) for n, (d, _) in evals.items()],
        )
    settings = ServeSettings(
        data_dir=args.data_dir,
        bind=args.bind,
        seed=args.shuffle_seed,
        sync=not args.no_sync,
        max_message_bytes=args.max_message_bytes,
        starve_after=args.starve_after,
        starve_after_drops=args.starve_after_drops,
        allow_config_change=args.allow_config_change,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        map_size=args.map_size,
        curve=curve,
        over_sampling=args.over_sampling,
        curve_dir=args.curve_dir,
        gateways=_gateway_count(args.gateways, args.bind),
        log_level=args.log_level,
        log_format=args.log_format,
    )
    server = CoordinatorServer(
        settings, dataset=dataset, config=config, liveness=liveness, eval_datasets=evals, mixture=mixture
    )
    if exposed:
        logging.getLogger("rollfleet.coordinator").warning("%s", exposed)
    logging.getLogger("coordinator").info("effective config: %s", json.dumps(args.effective_config, sort_keys=True))
    print(f"coordinator listening on {server.endpoint}", flush=True)
    full: list[BaseException] = []
    try:
        asyncio.run(server.serve())
    except* StorageFull as eg:  # a ledger write found the map or the disk full: stopped, nothing acknowledged lost
        full.extend(eg.exceptions)
    if full:
        raise full[0]
    return 0


def status(args) -> int:
    from coordinator.client import RolloutClient

    validate_endpoint(args.coordinator, "--coordinator")
    keys = {"curve_secret": args.curve_secret, "curve_server_key": args.curve_server_key}
    with RolloutClient(args.coordinator, timeout=args.timeout, attach=False, **keys) as client:
        stats = client.stats().raw  # the answer as the coordinator sent it: what --json prints
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        from coordinator.status_table import render

        print(render(stats))
    return 0


def replay(args) -> int:
    import signal
    import threading

    if args.show is not None:
        from coordinator.record_format import describe_ids, read_batch, recorded_ids, require_pyarrow
        from coordinator.replay_show import render

        require_pyarrow("coordinator replay")
        if not os.path.isdir(args.source):
            raise ConfigError(f"--from {args.source}: no such directory")
        ids = recorded_ids(args.source)
        if args.show not in ids:
            raise ConfigError(
                f"--show {args.show}: batch {args.show} was not recorded in {args.source}; "
                f"recorded ids: {describe_ids(ids)}"
            )
        from coordinator.recorded_run import RecordedRun

        path = RecordedRun(args.source).path(args.show)
        print(render(read_batch(path), path, args.samples))
        return 0
    from common.curve import is_loopback
    from coordinator.replay_server import ReplayServer

    validate_endpoint(args.bind, "--bind")
    if not is_loopback(args.bind) and not args.insecure:
        raise ConfigError(f"--bind {args.bind} is reachable from other hosts; a replay has no keys: pass --insecure")
    server = ReplayServer(args.source, args.bind)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"replay of {server.run.describe()} from {server.run.directory} listening on {server.endpoint}", flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
    return 0


def main(argv=None) -> int:
    try:
        args, effective = parse_args_with_config(build_parser(), list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    args.effective_config = effective  # logged once the command has checked everything and started
    try:
        return {"serve": serve, "status": status, "replay": replay}[args.command](args)
    except (ConfigError, DatasetError, ValueError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
