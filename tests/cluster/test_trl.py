"""TRL's GRPOTrainer drawing its completions from a rollfleet fleet (``coordinator.integrations.trl``).

A real coordinator and agent with an hf engine serving the warmed-up tiny model of the GRPO example;
TRL (from the registry) trains that model in this process on CPU for a few steps with
``rollout_func=FleetRollouts``. Asserted, as a user would check them:

- every step's completions came from the fleet: one fleet batch per TRL step, the coordinator
  reports those batches delivered, and the token ids TRL trained on are the fleet's;
- the weights reached the engines: the fleet is at version ``steps - 1`` (a push before every step
  but the first), and at every step the logprobs TRL's current model gives the fleet's tokens equal
  the engine's (< 1e-3; ~1e-7 measured), which a push that did not land would break (~0.1-3);
- the reward moves: TRL's logged reward (the fleet's) rises over the run.

A second run allows the fleet two pushes of lag (``--max-staleness 2``) with
``FleetRollouts(correction="token_tis")``: batches arrive stale (one version behind here, the
coordinator prefetching one batch), the correction's weights differ from 1 there, its metrics
reach TRL's log at every step, and the reward still rises.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.cluster.test_grpo_example import one_thread, start_fleet, warm_models  # noqa: E402,F401

STEPS = 14


def assert_rises(rewards: list[float]) -> None:
    """The mean reward of the last third of the steps beats the first third's by 0.03. A step's reward is
    the mean of 256 samples (standard error about 0.026 at 0.25); thirds (not the first and last three
    steps, which failed runs rising by 0.045 with a 0.05 margin) average that noise down to about 0.012."""
    third = max(1, len(rewards) // 3)
    start, end = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
    assert end >= start + 0.03, f"reward did not rise: {start:.3f} -> {end:.3f} by thirds; per step {rewards}"


def _logprob_diff(model, out: dict, i: int) -> float:
    """Largest |trainer logprob - engine logprob| over completion ``i``'s tokens, with the trainer's weights now."""
    from examples.grpo.policy import response_logprobs  # the GRPO example's recompute, one row

    with torch.no_grad():
        mine, _ = response_logprobs(model, [out["prompt_ids"][i]], [out["completion_ids"][i]])
    mine = mine[0].double()
    return (mine - torch.tensor(out["logprobs"][i])).abs().max().item()


def run_trl(make_cluster, tmp_path, warm, *, steps: int, max_staleness: int, correction: str = "none"):
    """TRL trains the warmed-up model ``steps`` steps on a fleet: ``(trainer, fleet, seen, diffs, stats, version)``."""
    from trl import GRPOConfig, GRPOTrainer

    from agent.hf.model import load_model
    from coordinator.integrations.trl import FleetRollouts

    cluster, _ = start_fleet(make_cluster, tmp_path, warm, max_staleness=max_staleness)
    model, tokenizer = load_model(warm("add"))

    fleet = FleetRollouts(cluster.address, weights="gloo", correction=correction, timeout=120)
    seen: list[list[int]] = []
    diffs: list[float] = []
    rollout = fleet.rollout_func

    def recording(prompts, trainer):
        out = rollout(prompts, trainer)
        seen.append(out["completion_ids"][0])
        diffs.append(max(_logprob_diff(trainer.model, out, i) for i in range(0, len(prompts), 61)))
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        max_steps=steps,
        learning_rate=3e-4,  # the GRPO example's; 1e-3 overshoots on this model
        lr_scheduler_type="constant",
        beta=0.0,
        bf16=False,  # the engines generate in fp32 on CPU
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
        stats = fleet.client.stats()
        version = fleet.client.weight_version()
    finally:
        fleet.close()
    return trainer, fleet, seen, diffs, stats, version


def test_trl_grpo_trains_on_fleet_rollouts_and_pushes_weights(make_cluster, tmp_path, one_thread, warm_models):  # noqa: F811
    trainer, fleet, seen, diffs, stats, version = run_trl(
        make_cluster, tmp_path, warm_models, steps=STEPS, max_staleness=0
    )
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    assert len(rewards) == STEPS and len(seen) == STEPS
    assert fleet.rollout_id == STEPS
    assert stats.weights.version == STEPS - 1, stats.weights
    # The trainer's current model scores the fleet's tokens as the engine did: each push reached it.
    assert max(diffs) < 1e-3, diffs
    assert version == STEPS - 1  # a push before each step after the first
    assert not any(k.startswith("correction/") for r in trainer.state.log_history for k in r)  # "none": untouched
    assert_rises(rewards)
    print("rewards", [round(r, 3) for r in rewards], "max logprob diff", max(diffs))


STALE_STEPS = 24


def test_trl_with_stale_batches_applies_the_fleets_correction(make_cluster, tmp_path, one_thread, warm_models):  # noqa: F811
    trainer, fleet, seen, diffs, stats, version = run_trl(
        make_cluster, tmp_path, warm_models, steps=STALE_STEPS, max_staleness=2, correction="token_tis"
    )
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert len(logs) == STALE_STEPS and version == STALE_STEPS - 1
    keys = ("correction/kl_k3", "correction/weight_mean", "correction/ratio_max", "rollfleet/staleness_mean")
    assert all(k in r for r in logs for k in keys), logs[-1]  # the metrics reach TRL's log at every step
    stale = [r for r in logs if r["rollfleet/staleness_mean"] > 0]
    assert stale, "no batch was stale: the fleet never generated ahead"
    # Stale batches: the model TRL trains is not the one that generated them, so the ratios and weights leave 1.
    assert all(r["correction/kl_k3"] > 1e-4 for r in stale), [r["correction/kl_k3"] for r in stale]
    assert any(abs(r["correction/weight_mean"] - 1) > 1e-3 for r in stale)
    last = fleet.last_correction
    counted = last.mask > 0
    assert not torch.allclose(last.weights[counted], torch.ones_like(last.weights[counted]))
    assert max(diffs) > 1e-3  # the engine's logprobs are another policy's: why a correction is needed
    rewards = [r["reward"] for r in logs]
    assert_rises(rewards)
    print(
        "rewards", [round(r, 3) for r in rewards],
        "staleness", [r["rollfleet/staleness_mean"] for r in logs],
        "kl_k3", [f"{r['correction/kl_k3']:.1e}" for r in logs],
        "weight_mean", [round(r["correction/weight_mean"], 4) for r in logs],
    )  # fmt: skip
