"""One command for the whole GRPO example: ``.venv/bin/python -m examples.grpo.run --out runs/grpo``.

It makes a tiny model (``make_model``, random weights), warms it up briefly on the task, writes
the dataset, starts a coordinator and one agent with hf engines serving the warmed-up model,
trains with GRPO through ``RolloutClient`` (pushing weights after every step), and plots the
run. Everything goes under ``--out``: ``model/`` (the engines' starting weights), ``data.jsonl``,
``metrics.jsonl``, ``grpo.png``, ``logs/`` and the coordinator's and agent's data dirs.

Every process it starts is ended when it stops, on success, on an error and on Ctrl-C or
SIGTERM: the agent stops its engines as it exits (and they die with it if it is killed).
These are the two commands a real deployment runs, on loopback::

    coordinator serve --dataset data.jsonl --data-dir coord --bind tcp://127.0.0.1:PORT \\
        --reward exact --dynamic-filter none --n-samples-per-prompt 8 --rollout-batch-size 64 \\
        --max-new-tokens 16 --temperature 1.0 --max-staleness 1
    agent join --coordinator tcp://127.0.0.1:PORT --data-dir agent --engine hf --model-path model \\
        --hf-args '--threads 1'
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_module(name: str):
    """The task's module: ``add`` (single-digit sums, one turn), ``calculator`` (two-digit sums with a tool) or
    ``openai-calculator`` (the same through the OpenAI client: examples/tools/openai_calculator.py)."""
    from examples.grpo import openai_tool_task, task, tool_task

    return {"add": task, "calculator": tool_task, "openai-calculator": openai_tool_task}[name]


def prepare_model(
    out: Path, *, warmup_steps: int, seed: int, log=print, task: str = "add", device="cpu", batch_size: int = 32
) -> Path:
    """``out/model``: a fresh tiny model after ``warmup_steps`` supervised steps of ``batch_size`` correct
    answers (the engines' version 0), made on ``device`` (the trainer's)."""
    import torch

    from agent.hf.model import load_model, make_model
    from examples.grpo.warmup import call_accuracy, evaluate, warm_up_task

    make_model(str(out / "model-init"), preset="tiny", seed=seed)
    model, tokenizer = load_model(str(out / "model-init"))
    t0 = time.monotonic()
    model.to(device)
    module = task_module(task)

    def progress(step: int, loss: float) -> None:
        if step < warmup_steps:
            log(f"warm-up: step {step}/{warmup_steps}, loss {loss:.3f}, {time.monotonic() - t0:.0f}s")

    loss = warm_up_task(
        model, steps=warmup_steps, batch_size=batch_size, seed=seed, task_module=module, log=log, progress=progress
    )
    model.to("cpu")
    line = f"warm-up: {warmup_steps} supervised steps of {batch_size} in {time.monotonic() - t0:.1f}s, loss {loss:.3f}"
    if task == "add":
        quality = evaluate(model, seed=seed)
        line += f"; sampled: reward {quality['reward']:.2f}, format {quality['format']:.2f}"
    else:  # the local sampler has no tool: the fleet's first steps measure the reward
        calls, whole = (call_accuracy(model, task_module=module, whole=w) for w in (False, True))
        line += f"; greedy decoding writes {calls:.0%} of the tool calls right, {whole:.0%} of the whole answers"
    log(line)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    torch.manual_seed(seed)
    return out / "model"


class Processes:
    """The processes this run started, each in its own session, logged to ``logs/NAME.log``; ``stop`` ends them."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT
            )
        self.procs[name] = proc
        return proc

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail}")

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to every process group (agent first: it stops its engines), then SIGKILL what is left."""
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in reversed(self.procs.values()):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def coordinator_argv(dataset: Path, data_dir: Path, address: str, args) -> list[str]:
    return [
        sys.executable, "-m", "coordinator.cli", "serve",
        "--dataset", str(dataset), "--data-dir", str(data_dir), "--bind", address,
        "--reward", "exact", "--dynamic-filter", "none",
        "--n-samples-per-prompt", str(args.group_size), "--rollout-batch-size", str(args.batch_size),
        "--max-new-tokens", str(args.max_new_tokens), "--temperature", "1.0",
        "--max-staleness", str(args.max_staleness), "--shuffle-seed", str(args.seed),
        "--prefetch", str(prefetch_groups(args)),
        *(["--generate", task_module(args.task).GENERATE] if args.task != "add" else []),
        # Greedy (temperature 0), one sample per prompt: client.evaluate("greedy") is the greedy accuracy;
        # "sampled": the same prompts, 4 samples each at the training temperature, for pass@1 and pass@4.
        "--eval-dataset", f"greedy={eval_dataset(dataset)},n_samples=1,temperature=0",
        "--eval-dataset", f"sampled={eval_dataset(dataset)},n_samples=4,temperature=1.0",
    ]  # fmt: skip


EVAL_PROMPTS = 64


def prefetch_groups(args) -> int:
    """The coordinator's ``--prefetch``: ``--prefetch-batches`` batches (default: ETA, at least one) of ready groups
    beyond demand. With the coordinator's default (one batch) the fleet is never more than one version ahead,
    whatever ``--max-staleness`` allows."""
    batches = args.prefetch_batches if args.prefetch_batches is not None else max(1, args.max_staleness)
    return batches * args.batch_size


def eval_dataset(dataset: Path) -> Path:
    """The first ``EVAL_PROMPTS`` rows of the (shuffled) training file: what the greedy evaluation scores."""
    path = dataset.with_name("eval.jsonl")
    if not path.exists():
        path.write_text("".join(dataset.read_text().splitlines(keepends=True)[:EVAL_PROMPTS]))
    return path


def agent_argv(address: str, data_dir: Path, model: Path, args) -> list[str]:
    concurrency = args.batch_size * args.group_size  # a whole batch decodes at once
    return [
        sys.executable, "-m", "agent.cli", "join",
        "--coordinator", address, "--data-dir", str(data_dir), "--agent-id", "node-0",
        "--engine", "hf", "--model-path", str(model), "--engines", str(args.engines),
        "--concurrency", str(concurrency),
        f"--hf-args=--threads {args.engine_threads} --slots {concurrency} --seed {args.seed} "
        f"--device {args.engine_device}",
    ]  # fmt: skip


def wait_ready(address: str, procs: Processes, engines: int, timeout: float = 300) -> None:
    """Until the agent is registered with ``engines`` healthy engines (its capacity says so)."""
    from coordinator.client import RolloutClient

    deadline = time.monotonic() + timeout
    with RolloutClient(address, attach=False, timeout=5) as probe:
        while True:
            procs.check()
            try:
                agent = probe.stats().agents.get("node-0")
            except Exception:  # the coordinator is still starting
                agent = None
            healthy = [e for e in agent.engines if e.get("state") == "healthy"] if agent is not None else []
            if agent is not None and agent.status == "alive" and len(healthy) >= engines:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not become ready in {timeout:.0f}s; see {procs.logs}")
            time.sleep(0.2)


def train_sharded(address: str, model_dir: Path, config, out: Path, args) -> list[dict]:
    """The trainer as ``args.nproc`` ranks under torchrun (examples/grpo/sharded.py); rank 0's metrics."""
    import dataclasses
    import json

    from examples.grpo.plot import load_metrics

    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "--standalone",
        "-m",
        "examples.grpo.sharded",
        "--coordinator",
        address,
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--threads",
        str(args.trainer_threads),
        "--config",
        json.dumps(dataclasses.asdict(config)),
    ]
    print(f"training on {args.nproc} processes: {' '.join(argv[1:6])} ...")
    done = subprocess.run(argv, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the sharded trainer exited with {done.returncode}")
    return load_metrics(out / "metrics.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/grpo", help="run directory; must not exist or be empty")
    ap.add_argument("--steps", type=int, default=200, help="GRPO steps at most (default 200)")
    ap.add_argument("--stop-at-reward", type=float, default=None, help="stop once 3 steps in a row reach it")
    ap.add_argument("--weights", choices=("gloo", "disk"), default="gloo", help="how weights reach the engines")
    ap.add_argument(
        "--batch-size", type=int, default=None, help="prompts (groups) per step (default 64; 16 for openai-calculator)"
    )
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument(
        "--task",
        choices=("add", "calculator", "openai-calculator"),
        default="add",
        help="add: single-digit sums in one turn (default); calculator: two-digit sums with a calculator tool "
        "called mid-generation (multi-turn, --generate examples.tools.calculator:rollout); openai-calculator: "
        "the same as a tool-using agent loop in plain openai client code (examples.tools.openai_calculator)",
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=None, help="default 16 (add), 32 (calculator) or 96 (openai-calculator)"
    )
    ap.add_argument("--max-staleness", type=int, default=1, help="eta, in weight updates (default 1)")
    ap.add_argument(
        "--prefetch-batches",
        type=int,
        default=None,
        help="batches the fleet may generate ahead of the trainer (coordinator --prefetch); default ETA (at least 1)",
    )
    ap.add_argument(
        "--correction",
        choices=("none", "token_tis", "seq_tis", "seq_mis", "geo_rs", "icepop", "ppo_clip"),
        default=None,
        help="off-policy correction of the loss: a coordinator.correction mode, or ppo_clip (PPO's clipped "
        "surrogate against the engine's logprobs); default ppo_clip when --max-staleness > 0, none at 0",
    )
    ap.add_argument(
        "--engine-device",
        default="auto",
        help="the hf engine's --device: auto (CUDA when torch sees one; default), cpu, cuda, cuda:N",
    )
    ap.add_argument(
        "--trainer-device",
        default="auto",
        help="where the trainer's model runs: auto (CUDA when torch sees one, else CPU; default), cpu, cuda, cuda:N",
    )
    ap.add_argument(
        "--lr", type=float, default=None, help="GRPO's learning rate (default 3e-4; 1e-4 for openai-calculator)"
    )
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="supervised warm-up steps (default 90 add, 75 calculator, 1000 openai-calculator after 150 of calculator)",
    )
    ap.add_argument(
        "--warmup-batch-size",
        type=int,
        default=None,
        help="answers per warm-up step (default 32; 8 for openai-calculator, which needs many steps more than samples)",
    )
    ap.add_argument("--engines", type=int, default=1, help="hf engines on the agent (default 1)")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine (default 1)")
    ap.add_argument("--trainer-threads", type=int, default=1, help="torch threads of the trainer (default 1)")
    ap.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="trainer processes (default 1): more runs the trainer under torchrun with FSDP2 (gloo), each rank "
        "training its own share of every batch (examples/grpo/sharded.py; docs/guides/sharded-trainers.md)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="evaluate EVAL_PROMPTS prompts (greedy, and pass@1/pass@4) before training and every K steps (0: never)",
    )
    args = ap.parse_args(argv)
    module = task_module(args.task)  # every flag left unset takes the task's own default
    for flag in ("batch_size", "lr", "max_new_tokens", "warmup_steps", "warmup_batch_size"):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(module, flag.upper()))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"{out} is not empty: remove it or pass another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM cleans up like Ctrl-C

    import torch

    from agent.hf.model import load_model
    from examples.grpo.plot import load_metrics, plot
    from examples.grpo.train import TrainConfig, train

    started = time.monotonic()
    from examples.grpo.train import correction_mode, resolve_device

    mode = correction_mode(TrainConfig(max_staleness=args.max_staleness, correction=args.correction))
    print(
        f"GRPO example: run dir {out}; --max-staleness {args.max_staleness}, correction {mode}, "
        f"trainer on {resolve_device(args.trainer_device)}"
    )
    model_dir = prepare_model(
        out,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        task=args.task,
        device=resolve_device(args.trainer_device),
        batch_size=args.warmup_batch_size,
    )
    torch.set_num_threads(args.trainer_threads)  # the warm-up had every core (no fleet yet); now they are shared
    dataset = task_module(args.task).write_dataset(out / "data.jsonl", seed=args.seed)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = Processes(out / "logs")
    try:
        procs.start("coordinator", coordinator_argv(dataset, out / "coordinator", address, args))
        procs.start("agent", agent_argv(address, out / "agent", model_dir, args))
        print(f"started a coordinator at {address} and an agent with {args.engines} hf engine(s); logs in {procs.logs}")
        wait_ready(address, procs, args.engines)
        print(f"fleet ready after {time.monotonic() - started:.0f}s; training")
        config = TrainConfig(
            steps=args.steps,
            lr=args.lr,
            weights=args.weights,
            max_staleness=args.max_staleness,
            correction=args.correction,
            device=args.trainer_device,
            target_reward=args.stop_at_reward,
            seed=args.seed,
            expect={"n_samples_per_prompt": args.group_size, "rollout_batch_size": args.batch_size},
            eval_every=args.eval_every,
            eval_sampled="sampled",
        )
        if args.nproc > 1:
            history = train_sharded(address, model_dir, config, out, args)
        else:
            model, _ = load_model(str(model_dir))
            history = train(address, model, config, out=out)
    except KeyboardInterrupt:
        print("interrupted: stopping everything")
        procs.stop()
        if (out / "metrics.jsonl").exists() and load_metrics(out / "metrics.jsonl"):
            print(f"plot of the steps done: {plot(load_metrics(out / 'metrics.jsonl'), out / 'grpo.png')}")
        return 130
    finally:
        procs.stop()
    png = plot(history, out / "grpo.png")
    first, last = history[0]["reward"], history[-1]["reward"]
    reached = next((h for h in history if h["reward"] >= 0.8), None)
    print(f"reward {first:.2f} -> {last:.2f} in {len(history)} steps, {history[-1]['elapsed_s']:.0f}s of training")
    kl = [h["correction/kl_k3"] for h in history]
    print(f"mismatch KL(rollout || trainer), k3 per token: mean {sum(kl) / len(kl):.2e}, max {max(kl):.2e}")
    evals = [h for h in history if "eval_reward" in h]
    if evals:
        e0, e1 = evals[0], evals[-1]
        print(
            f"evaluation: greedy reward {e0['eval_reward']:.2f} -> {e1['eval_reward']:.2f}, "
            f"pass@1 {e0['eval_pass@1']:.2f} -> {e1['eval_pass@1']:.2f}, "
            f"pass@4 {e0['eval_pass@4']:.2f} -> {e1['eval_pass@4']:.2f}"
        )
    if reached:
        print(f"first step with reward >= 0.8: {reached['step']} after {reached['elapsed_s']:.0f}s")
    print(f"total {time.monotonic() - started:.0f}s; metrics {out / 'metrics.jsonl'}, plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
