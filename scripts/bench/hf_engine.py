#!/usr/bin/env python3
"""hf engine throughput and logprob fidelity: C concurrent /generate calls of N samples each.

The bench starts ``python -m agent.hf`` (its own process; flags ``--device``, ``--dtype``,
``--threads``, ``--slots`` pass through) on a model directory given by ``--model-path``, or made
now with ``agent.hf.model.make_model`` from ``--preset``. It sends ``--concurrency`` calls at
once, each ``n = --samples`` samples of ``--max-new-tokens`` tokens (``ignore_eos``, temperature
1, ``return_logprob``) on prompts of different lengths, and measures:

``tokens_per_s``
    output tokens of every sample / wall time from the first call sent to the last answer
    (the first round, a warm-up of one call, is not counted);
``max_logprob_diff`` / ``mean_logprob_diff``
    |engine logprob - recomputed logprob| over every output token, the recompute being a plain
    forward pass of prompt + output through the same model in float32 on the same device (so a
    bf16 engine shows its precision loss here);
``max_batch``
    the most rows one decode step ran (``/server_info``'s ``hf`` section).

Output: one JSON object per line on stdout; progress on stderr.

    python scripts/bench/hf_engine.py --quick                       # tiny model, CPU, ~20 s
    python scripts/bench/hf_engine.py --device cuda --preset small  # on a GPU
    python scripts/bench/hf_engine.py --device cuda --dtype bfloat16 --model-path /models/m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(metric: str, value, unit: str, **extra) -> None:
    print(json.dumps({"bench": "hf_engine", "metric": metric, "value": value, "unit": unit, **extra}), flush=True)


def start_engine(args, model_path: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "agent.hf", "--model-path", model_path, "--port", "0"]
    argv += ["--device", args.device, "--dtype", args.dtype, "--slots", str(args.slots)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    log("starting: " + " ".join(argv))
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()  # printed once the model is loaded and the port bound
    m = re.search(r"listening on (http://\S+)", line)
    if m is None:
        proc.wait(10)
        raise SystemExit(f"engine did not start (exit {proc.returncode}): {line!r}")
    return proc, m.group(1)


async def run_load(url: str, args, vocab: int) -> tuple[float, list[tuple[list[int], dict]], dict]:
    import aiohttp

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(0, min(vocab, 256)) for _ in range(8 + 8 * (i % 8))] for i in range(args.concurrency)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(url, timeout=timeout) as s:

        async def call(prompt, samples):
            body = {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": args.max_new_tokens,
                    "temperature": 1.0,
                    "n": samples,
                    "ignore_eos": True,
                },
                "return_logprob": True,
            }
            async with s.post("/generate", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
            return [(prompt, o) for o in (out if samples > 1 else [out])]

        await call(prompts[0], 1)  # warm-up: first forward passes, allocator
        t0 = time.perf_counter()
        results = await asyncio.gather(*(call(p, args.samples) for p in prompts))
        wall = time.perf_counter() - t0
        async with s.get("/server_info") as r:
            info = await r.json()
    return wall, [pair for res in results for pair in res], info


def recompute(model_path: str, device: str, pairs) -> tuple[float, float]:
    import torch

    from agent.hf.model import load_model

    model, _ = load_model(model_path, device=device, dtype="float32")
    diffs = []
    with torch.no_grad():
        for prompt, out in pairs:
            ids = out["output_ids"]
            engine = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], device=device)
            logits = model(input_ids=torch.tensor([prompt + ids], device=device)).logits[0].float()
            target = torch.tensor(ids, device=device)[:, None]
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, target)[:, 0]
            diffs.append((ref - engine).abs())
    alld = torch.cat(diffs)
    return float(alld.max()), float(alld.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None, help="model directory (default: make one from --preset)")
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (passed to the engine)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of the engine")
    ap.add_argument("--slots", type=int, default=256, help="engine --slots")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent /generate calls (C)")
    ap.add_argument("--samples", type=int, default=8, help="samples per call, n (N)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="C=8, N=4, 64 tokens")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.samples, args.max_new_tokens = 8, 4, 64

    from transformers.utils import logging as transformers_logging

    from agent.hf.engine import resolve_device
    from agent.hf.model import make_model

    transformers_logging.disable_progress_bar()
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        model_path = args.model_path
        if model_path is None:
            model_path = os.path.join(tmp, "model")
            summary = make_model(model_path, preset=args.preset, context_length=max(512, 128 + args.max_new_tokens))
            log(f"made a {args.preset} model: {summary['parameters']} parameters")
        proc, url = start_engine(args, model_path)
        try:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_path).vocab_size
            wall, pairs, info = asyncio.run(run_load(url, args, vocab))
        finally:
            proc.terminate()
            proc.wait(30)
        tokens = sum(len(o["output_ids"]) for _, o in pairs)
        if tokens == 0:
            sys.exit("error: the engine produced no tokens (its log above says why)")
        log(f"{len(pairs)} samples, {tokens} tokens in {wall:.2f} s; recomputing logprobs in float32")
        worst, mean = recompute(model_path, device, pairs)
    setup = {
        "device": device,
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "model": args.model_path or args.preset,
    }
    emit("tokens_per_s", round(tokens / wall, 1), "tokens/s", wall_s=round(wall, 3), tokens=tokens, **setup)
    emit("max_logprob_diff", worst, "nats", mean_logprob_diff=mean, **setup)
    emit("max_batch", info["hf"]["max_batch"], "rows", decode_steps=info["hf"]["decode_steps"], **setup)


if __name__ == "__main__":
    main()
