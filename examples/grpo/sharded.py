"""The GRPO trainer as one rank of several: ``torchrun --nproc-per-node N -m examples.grpo.sharded ...``.

Every rank loads the same warmed-up model, shards it with FSDP2 (``fully_shard``), pulls its own share of
each batch straight from the fleet (``RolloutClient(rank=R, world_size=N)``), trains on it (FSDP averages
the gradients), and takes part in every weight push (rank 0 sends; docs/guides/sharded-trainers.md).
``examples/grpo/run.py --nproc N`` starts it for you, on a fleet it starts.

    torchrun --nproc-per-node 2 -m examples.grpo.sharded --coordinator tcp://127.0.0.1:PORT \\
        --model runs/grpo/model --out runs/grpo --steps 100
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True, help="the fleet's coordinator address")
    ap.add_argument("--model", required=True, help="the engines' starting model directory (every rank loads it)")
    ap.add_argument("--out", required=True, help="where metrics (rank 0: metrics.jsonl) and checkpoints go")
    ap.add_argument("--config", default="{}", help="TrainConfig fields as JSON (e.g. '{\"steps\": 24}')")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--backend", default="gloo", help="the trainer's process group backend (gloo on CPU)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from agent.hf.model import load_model
    from examples.grpo.train import TrainConfig, format_row, train

    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)
    try:
        config = TrainConfig(**json.loads(args.config))
        model, _ = load_model(args.model)
        rank = dist.get_rank()
        log = print if rank == 0 else (lambda line: None)
        history = train(args.coordinator, model, config, out=args.out, log=log)
        if rank == 0 and history:
            print(f"rank 0: {len(history)} steps; last: {format_row(history[-1])}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
