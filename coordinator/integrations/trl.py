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
- **Off-policy correction: ours, not TRL's.** The fleet generates ahead of the trainer within its
  ``--max-staleness``, so a step's samples come from weights up to that many pushes older than
  the model TRL updates. TRL 1.16's own importance-sampling correction
  (``vllm_importance_sampling_correction``) would take the ``logprobs`` a ``rollout_func``
  returns, but it runs only when ``use_vllm=True`` (``GRPOTrainer._generate_and_score_completions``
  and ``_compute_loss`` test ``self.use_vllm and self.vllm_importance_sampling_correction``), which
  makes TRL start or connect to a vLLM server and sync weights to it: not something a fleet
  without vLLM can turn on. Without it TRL computes no ``old_per_token_logps`` at one generation
  per step, so its ratio is ``pi / sg(pi)`` = 1 and the loss treats stale samples as on-policy.
  ``FleetRollouts(..., correction=MODE)`` therefore applies :func:`coordinator.correction.rollout_correction`
  itself: on its first call it wraps that trainer's ``_compute_loss`` so that, before TRL's loss,
  the current model's logprobs of the completion tokens are computed (one extra forward pass,
  no gradient), compared with the fleet's (``inputs["sampling_per_token_logps"]``, which TRL
  keeps from the ``logprobs`` key), and the per-token weights multiply the advantages:
  ``A_i -> A_i * w_t``. Every TRL loss type but ``vespo`` is linear in the advantage, so that is
  the per-token loss multiplied by ``w_t``; a masked token keeps its place in the loss's
  denominator (IcePop's definition). The metrics (``correction/kl_k3``, ...) go to TRL's log
  beside its own, with ``rollfleet/staleness_mean`` and ``rollfleet/staleness_max`` of the batch.
  ``correction="none"`` (the default) changes nothing in TRL.

**Several processes** (``accelerate launch --num_processes N`` or ``torchrun``): every process makes its own
``FleetRollouts``, a ``RolloutClient`` of rank ``RANK`` among ``WORLD_SIZE`` (the launcher's environment; rank 0
leads, docs/guides/sharded-trainers.md) asking for shares of equal group counts (``balance="groups"``): each
process's slice holds ``rollout_batch_size / N`` whole groups, fetched by that process from the agents, so
TRL's groups of ``num_generations`` consecutive completions line up across processes when it gathers the
rewards. Weights are pushed from every process (rank 0 sends, the others take part), and ``rollout_batch_size``
must be a multiple of the number of processes.
"""

from __future__ import annotations

import os
from typing import Any

from common.errors import ConfigError
from coordinator.client import RolloutClient, WeightUpdateResult

PLACEHOLDER_PROMPT = "(prompt chosen by the rollfleet coordinator)"

CORRECTION_MODES = ("none", "token_tis", "seq_tis", "seq_mis", "geo_rs", "icepop")
"""``coordinator.correction.MODES`` (repeated here so that this module imports without torch)."""

LINEAR_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
"""TRL loss types whose per-token loss is linear in the advantage: scaling ``A`` by ``w`` scales the loss by ``w``."""


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
        correction: str = "none",
        correction_args: dict | None = None,
        client: RolloutClient | None = None,
        **client_kwargs: Any,
    ):
        """``correction``: an off-policy correction mode (``coordinator.correction.MODES``; module docstring),
        ``correction_args`` its ``clip`` / ``low`` / ``high`` (``rollout_correction``'s defaults otherwise)."""
        if correction not in CORRECTION_MODES:
            raise ConfigError(f"correction must be one of {', '.join(CORRECTION_MODES)}, got {correction!r}")
        unknown = set(correction_args or {}) - {"clip", "low", "high"}
        if unknown:
            raise ConfigError(f"correction_args takes clip, low and high; got {', '.join(sorted(unknown))}")
        if weights not in ("gloo", "nccl", "disk"):
            raise ConfigError(f"weights must be 'gloo', 'nccl' or 'disk', got {weights!r}")
        if weights == "disk" and not checkpoint_dir:
            raise ConfigError("weights='disk' needs checkpoint_dir (a directory every engine can read)")
        if client is None:
            rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
            client_kwargs.setdefault("rank", rank)
            client_kwargs.setdefault("world_size", world)
            if client_kwargs["world_size"] > 1:
                client_kwargs.setdefault("balance", "groups")  # each process's slice has a fixed size
        self.client = client or RolloutClient(coordinator, **client_kwargs)
        self.processes = self.client.world_size
        self.weights = weights
        self.checkpoint_dir = checkpoint_dir
        self.bucket_bytes = bucket_bytes
        self.rollout_id = first_rollout_id
        config = self.client.config
        self.batch_size = int(config["rollout_batch_size"])
        self.n_samples = int(config["n_samples_per_prompt"])
        if self.batch_size % self.processes:
            raise ConfigError(
                f"rollout_batch_size {self.batch_size} does not split into {self.processes} processes' equal slices: "
                "use a multiple of the number of processes"
            )
        self.rollout_config = dict(config)
        self.base_version = self.client.weight_version()
        self.pushed_step = 0
        self.last_batch = None
        self.correction = correction
        self.correction_args = dict(correction_args or {})
        self.last_correction = None
        """The ``Correction`` of the last loss computed (its weights and metrics), or None."""
        self._corrected: set[int] = set()

    # ------------------------------------------------------------ TRL wiring

    def grpo_args(self) -> dict:
        """``GRPOConfig`` fields that make one trainer step consume exactly one fleet batch."""
        return {
            "num_generations": self.n_samples,
            "per_device_train_batch_size": self.batch_size * self.n_samples // self.processes,
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
        if self.correction != "none" and id(trainer) not in self._corrected:
            self.install_correction(trainer)
        step = int(trainer.state.global_step)
        if step > self.pushed_step:
            self.push_weights(trainer, step)
        batch = self.client.generate(self.rollout_id)
        self.rollout_id += 1
        self.last_batch = batch
        if self.correction != "none":
            logged = trainer._metrics["train" if trainer.model.training else "eval"]
            logged["rollfleet/staleness_mean"].append(float(batch.metrics.get("rollout/staleness_mean", 0.0)))
            logged["rollfleet/staleness_max"].append(float(batch.metrics.get("rollout/staleness_max", 0.0)))
        samples = [s for g in batch.groups for s in g.samples]
        if len(samples) != len(prompts):
            share = self.batch_size * self.n_samples // self.processes
            raise ConfigError(
                f"a TRL step asked this process for {len(prompts)} completions but its share of a fleet batch holds "
                f"{len(samples)} ({self.batch_size} groups x {self.n_samples} samples over {self.processes} "
                f"process(es)): build GRPOConfig with **FleetRollouts.grpo_args() (per_device_train_batch_size="
                f"{share}, num_generations={self.n_samples})"
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

    # ------------------------------------------------------------ correction

    def install_correction(self, trainer) -> None:
        """Make ``trainer``'s loss apply ``self.correction`` (module docstring); called by the first ``rollout_func``.

        The wrapper is set on this trainer object only (``GRPOTrainer.compute_loss`` looks up
        ``self._compute_loss`` at every step, so it takes effect from the step being generated).
        """
        if trainer.loss_type not in LINEAR_LOSSES:
            raise ConfigError(
                f"correction={self.correction!r} scales TRL's advantages, which is the loss scaled only for loss types "
                f"{', '.join(LINEAR_LOSSES)}; this trainer has loss_type={trainer.loss_type!r}"
            )
        if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
            raise ConfigError(
                f"correction={self.correction!r} and TRL's vllm_importance_sampling_correction would correct twice: "
                "turn one off"
            )
        from coordinator.correction import rollout_correction

        original = trainer._compute_loss

        def corrected_loss(model, inputs):
            import torch

            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
            with torch.no_grad():
                trainer_logprobs, _, _ = trainer._get_per_token_logps_and_entropies(
                    model,
                    torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
                    torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
                    completion_ids.size(1),
                )
            rollout_logprobs = inputs["sampling_per_token_logps"]
            # TRL marks a logprob the backend could not give as NaN; such a token is left out of the correction.
            known = ~torch.isnan(rollout_logprobs)
            result = rollout_correction(
                trainer_logprobs,
                torch.nan_to_num(rollout_logprobs),
                mask * known,
                mode=self.correction,
                **self.correction_args,
            )
            weights = torch.where(known, result.weights, mask.to(result.weights.dtype))
            advantages = inputs["advantages"]
            advantages = advantages[:, None] if advantages.dim() == 1 else advantages
            self.last_correction = result
            logged = trainer._metrics["train" if model.training else "eval"]
            for key, value in result.metrics.items():
                logged[key].append(value)
            return original(model, {**inputs, "advantages": advantages * weights.to(advantages.dtype)})

        trainer._compute_loss = corrected_loss
        self._corrected.add(id(trainer))

    # ------------------------------------------------------------ weights

    def push_weights(self, trainer, step: int) -> WeightUpdateResult:
        """Push the trainer's parameters to every engine as version ``base + step`` (every process calls it); the
        update's result (rank 0's, on every process)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        version = self.base_version + step
        if self.weights == "disk":
            path = os.path.join(self.checkpoint_dir, f"step-{step}")
            if self.client.rank == 0:  # one writer; the other processes wait for rank 0's update
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
