"""One process of a TRL GRPOTrainer of several, on a fleet: for tests/cluster/test_trl_processes.py.

    torchrun --nproc-per-node 2 --standalone -m harness.trl_rank ADDRESS MODEL_DIR OUT_DIR STEPS

Each process trains with ``rollout_func=FleetRollouts`` (its own client, rank ``RANK`` of ``WORLD_SIZE``) and
writes ``OUT_DIR/rank<R>.json``: TRL's logged rewards, the largest |trainer - engine| logprob difference of
each step (its own completions, the trainer's current weights), the completions' group sizes, and the fleet's
weight version at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    address, model_dir, out, steps = argv[0], argv[1], Path(argv[2]), int(argv[3])
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from agent.hf.model import load_model
    from coordinator.integrations.trl import FleetRollouts
    from examples.grpo.policy import response_logprobs

    torch.set_num_threads(1)
    model, tokenizer = load_model(model_dir)
    fleet = FleetRollouts(address, weights="gloo", timeout=120)
    diffs: list[float] = []
    sizes: list[int] = []

    def recording(prompts, trainer):
        got = fleet.rollout_func(prompts, trainer)
        sizes.append(len(got["completion_ids"]))
        worst = 0.0
        for i in range(0, len(prompts), 37):
            with torch.no_grad():
                mine, _ = response_logprobs(trainer.model, [got["prompt_ids"][i]], [got["completion_ids"][i]])
            worst = max(worst, (mine[0].double() - torch.tensor(got["logprobs"][i])).abs().max().item())
        diffs.append(worst)
        return got

    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        max_steps=steps,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        beta=0.0,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **fleet.grpo_args(),
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=fleet.dataset(),
        reward_funcs=fleet.reward,
        rollout_func=recording,
        processing_class=tokenizer,
    )
    try:
        trainer.train()
        version = fleet.client.weight_version()
        rank = fleet.client.rank
    finally:
        fleet.close()
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    result = {"rank": rank, "rewards": rewards, "diffs": diffs, "sizes": sizes, "version": version}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
