"""rollfleet as the generation backend of TRL's ``GRPOTrainer``.

TRL's extension point for custom generation is ``GRPOTrainer(rollout_func=...)``: at the start of
each step the trainer calls ``rollout_func(prompts, trainer)`` with its per-process slice of
prompts (each repeated ``num_generations`` times) and expects a dict with ``prompt_ids``,
``completion_ids`` and ``logprobs`` (one entry per slice entry); any other key is handed to the
reward functions as a keyword argument, and ``env_mask`` marks the completion tokens the model did
not generate. :class:`FleetRollouts` fills that dict from a rollfleet batch:

- **The fleet owns the prompts.** Its coordinator leases them from its own dataset, exactly once,
  and filters groups as configured; the trainer's dataset is only a stand-in that sets how many
  rows a step asks for (:meth:`FleetRollouts.dataset`). The real prompt of each completion goes
  to the reward functions as ``rollfleet_prompt``, and the fleet's reward as ``rollfleet_reward``
  (:meth:`FleetRollouts.reward` returns it, so TRL's advantages use the agents' scores).
- **One step, one batch.** A step's slice must hold ``rollout_batch_size × n_samples_per_prompt``
  entries, with ``num_generations = n_samples_per_prompt``: :meth:`FleetRollouts.grpo_args` gives
  the ``GRPOConfig`` fields that make it so, and a mismatch is a clear error, not a silent reshape.
- **Weights after each step.** Before generating for step ``s > 0``, the trainer's current
  parameters are pushed to every engine as version ``base + s`` (``base``: the fleet's version
  when this object was made), through ``RolloutClient.update_weights`` (a broadcast, ``gloo`` on
  CPU or ``nccl``) or, with ``weights="disk"``, a checkpoint written under ``checkpoint_dir``.
  The fleet generates ahead of the trainer within its ``--max-staleness``; TRL's importance
  sampling against the returned ``logprobs`` corrects for the lag.

Single process only (``accelerate`` with one process): the fleet hands one trainer its batches.
"""

from __future__ import annotations

import os
from typing import Any

from common.errors import ConfigError
from coordinator.client import RolloutClient

PLACEHOLDER_PROMPT = "(prompt chosen by the rollfleet coordinator)"


class FleetRollouts:
    """A TRL ``rollout_func`` (and reward function) backed by a rollfleet fleet."""

    def __init__(
        self,
        coordinator: str,
        *,
        weights: str = "gloo",
        checkpoint_dir: str | None = None,
        bucket_bytes: int = 512 << 20,
        first_rollout_id: int = 0,
        client: RolloutClient | None = None,
        **client_kwargs: Any,
    ):
        if weights not in ("gloo", "nccl", "disk"):
            raise ConfigError(f"weights must be 'gloo', 'nccl' or 'disk', got {weights!r}")
        if weights == "disk" and not checkpoint_dir:
            raise ConfigError("weights='disk' needs checkpoint_dir (a directory every engine can read)")
        self.client = client or RolloutClient(coordinator, **client_kwargs)
        self.weights = weights
        self.checkpoint_dir = checkpoint_dir
        self.bucket_bytes = bucket_bytes
        self.rollout_id = first_rollout_id
        config = self.client.config
        self.batch_size = int(config["rollout_batch_size"])
        self.n_samples = int(config["n_samples_per_prompt"])
        self.rollout_config = dict(config)
        self.base_version = self.client.weight_version()
        self.pushed_step = 0
        self.last_batch = None

    # ------------------------------------------------------------ TRL wiring

    def grpo_args(self) -> dict:
        """``GRPOConfig`` fields that make one trainer step consume exactly one fleet batch."""
        return {
            "num_generations": self.n_samples,
            "per_device_train_batch_size": self.batch_size * self.n_samples,
            "gradient_accumulation_steps": 1,
            "steps_per_generation": 1,
            "max_completion_length": int(self.rollout_config["max_new_tokens"]),
            "temperature": float(self.rollout_config["temperature"]),
            "top_p": float(self.rollout_config["top_p"]),
        }

    def dataset(self):
        """The stand-in train dataset: ``rollout_batch_size`` placeholder prompts (the fleet picks the real ones)."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * self.batch_size})

    def __call__(self, prompts: list, trainer) -> dict:
        return self.rollout_func(prompts, trainer)

    def rollout_func(self, prompts: list, trainer) -> dict:
        step = int(trainer.state.global_step)
        if step > self.pushed_step:
            self.push_weights(trainer, step)
        batch = self.client.generate(self.rollout_id)
        self.rollout_id += 1
        self.last_batch = batch
        samples = [s for g in batch.groups for s in g.samples]
        if len(samples) != len(prompts):
            raise ConfigError(
                f"a TRL step asked for {len(prompts)} completions but a fleet batch holds {len(samples)} "
                f"({self.batch_size} groups x {self.n_samples} samples): build GRPOConfig with "
                f"**FleetRollouts.grpo_args() (per_device_train_batch_size={self.batch_size * self.n_samples}, "
                f"num_generations={self.n_samples}, one process)"
            )
        return {
            "prompt_ids": [s.prompt_tokens.tolist() for s in samples],
            "completion_ids": [s.response_tokens.tolist() for s in samples],
            "logprobs": [s.response_logprobs.tolist() for s in samples],
            "env_mask": [s.loss_mask.tolist() for s in samples],
            "rollfleet_reward": [float(s.reward) for s in samples],
            "rollfleet_prompt": [s.metadata.get("prompt", "") for s in samples],
        }

    @staticmethod
    def reward(prompts=None, completions=None, rollfleet_reward=None, **kwargs) -> list[float]:
        """A TRL reward function: the reward the fleet's agents computed for each completion."""
        if rollfleet_reward is None:
            raise ConfigError("rollfleet_reward is missing: use FleetRollouts.reward with rollout_func=FleetRollouts")
        return list(rollfleet_reward)

    # ------------------------------------------------------------ weights

    def push_weights(self, trainer, step: int) -> dict:
        """Push the trainer's parameters to every engine as version ``base + step``."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        version = self.base_version + step
        if self.weights == "disk":
            path = os.path.join(self.checkpoint_dir, f"step-{step}")
            model.save_pretrained(path)
            result = self.client.update_weights_from_disk(path, version=version)
        else:
            named = [(name, param.detach()) for name, param in model.named_parameters()]
            result = self.client.update_weights(named, version=version, backend=self.weights,
                                                bucket_bytes=self.bucket_bytes)  # fmt: skip
        self.pushed_step = step
        return result

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> FleetRollouts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FleetRollouts.reward.__name__ = "rollfleet_reward"
