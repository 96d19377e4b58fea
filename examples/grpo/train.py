"""The GRPO trainer: pull a batch, score it against the policy, step, push the weights, repeat.

One step ``t`` (the trainer holds weight version ``t``; version 0 is the warmed-up model the
engines started from)::

    batch = client.generate(t)                         # B groups x n samples, from the fleet
    advantages = group_advantages(rewards)             # per group: (r - mean) / std
    logprobs = response_logprobs(model, ...)           # the trainer's policy, version t
    c = rollout_correction(logprobs.detach(), rollout_logprobs, mask, mode=config.correction, versions=...)
    loss = pg_loss(logprobs, advantages, mask, c.weights)   # ppo_clip: clipped_pg_loss(logprobs, rollout_logprobs, ...)
    optimizer.step()
    client.update_weights(model.named_parameters(), t + 1, backend="gloo")   # or from disk

With ``max_staleness`` ETA the fleet generates ahead of the trainer: batch ``t`` holds samples made
on versions ``t - ETA`` to ``t`` (with ETA 1, the default, the fleet generates batch ``t + 1`` while
the trainer is busy with batch ``t``). The correction (``config.correction``) weights each token by its
importance ratio ``pi_t / mu`` against the engine's logprob ``mu``, truncated or masked as the mode says
(``coordinator.correction``), or, with ``ppo_clip`` (the default when ETA > 0), takes PPO's clipped
surrogate with that ratio (``policy.clipped_pg_loss``); ``none`` treats the samples as on-policy. Every
step logs the mismatch metrics (``correction/kl_k3`` ...), per staleness too.

The logprob check: every sample records which weight version generated which span of its
tokens. For the samples generated on a single version the trainer holds (the current one, and
the ``max_staleness`` before it, kept as copies of the parameters), the trainer recomputes the
logprob of every response token and compares it with the engine's:
``train/rollout_logprob_abs_diff`` is the mean absolute difference over those tokens. With the
same fp32 weights and the same tokens it is ~1e-6; an off-by-one in token alignment, a wrong
logprob (other temperature, another token's) or a weight push that did not apply makes it
orders of magnitude larger. ``checked_versions`` lists the versions a step checked, so every
push is seen checked.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coordinator.batch import token_spans
from coordinator.client import RolloutClient
from coordinator.correction import MODES, rollout_correction
from examples.grpo.policy import clipped_pg_loss, group_advantages, pg_loss, response_logprobs

EXAMPLE_MODES = (*MODES, "ppo_clip")
"""``--correction`` choices: ``coordinator.correction``'s modes, and ``ppo_clip`` (PPO's clipped surrogate against
the engine's logprobs: ``policy.clipped_pg_loss``)."""


@dataclass
class TrainConfig:
    steps: int = 150
    """Batches to train on (one optimizer step and one weight push each)."""
    lr: float = 1e-3
    correction: str | None = None
    """Off-policy correction (:data:`EXAMPLE_MODES`); None: ``ppo_clip`` when ``max_staleness`` > 0, else ``none``."""
    correction_clip: float = 2.0
    """``clip`` of ``token_tis``/``seq_tis``/``seq_mis``."""
    clip: float = 0.2
    """``ppo_clip``'s range: the ratio against the engine's logprobs is clipped to ``1 +- clip``."""
    device: str = "cpu"
    """Where the trainer's model runs: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (CUDA when torch sees one)."""
    max_grad_norm: float = 1.0
    weights: str = "gloo"
    """How weights reach the engines: ``gloo`` (broadcast from this process) or ``disk`` (a checkpoint)."""
    max_staleness: int = 1
    """The coordinator's ``--max-staleness``; also how many older versions the trainer keeps for the check."""
    target_reward: float | None = None
    """Stop early once the mean reward of ``target_window`` consecutive steps reaches it (None: run every step)."""
    target_window: int = 3
    seed: int = 0
    expect: dict = field(default_factory=dict)
    """Rollout configuration the fleet must have (``RolloutClient(expect=...)``)."""
    eval_every: int = 0
    """Run ``client.evaluate`` of ``eval_name`` (and ``eval_sampled``) before the first step and every this
    many steps (0: never)."""
    eval_name: str = "greedy"
    eval_sampled: str = ""
    """A second evaluation dataset with several samples per prompt (pass@k), or "" for none."""
    record: str = ""
    """A directory where every batch pulled is recorded (``RolloutClient(record=...)``), for ``coordinator replay``;
    "" for none."""


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def correction_mode(config: TrainConfig) -> str:
    mode = config.correction or ("ppo_clip" if config.max_staleness > 0 else "none")
    if mode not in EXAMPLE_MODES:
        raise ValueError(f"correction must be one of {', '.join(EXAMPLE_MODES)}; got {mode!r}")
    return mode


def sample_version(sample) -> int | None:
    """The weight version that generated all of ``sample``'s response, or None if it spans several."""
    versions = {_version(span[0]) for span in sample.weight_versions} or {_version(sample.weight_version)}
    return versions.pop() if len(versions) == 1 else None


def _version(label) -> int:
    return 0 if label in ("", "default", None) else int(label)


def snapshot(model) -> dict[str, torch.Tensor]:
    """The model's parameters, full (an FSDP2 model's are gathered: a collective, every rank calls it)."""
    return {name: _full(p).detach().clone() for name, p in model.named_parameters()}


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _ranks() -> tuple[int, int]:
    """``(rank, world_size)`` of this trainer process: torch.distributed's when it is initialized, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(
    address: str,
    model,
    config: TrainConfig,
    *,
    out: str | Path,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run GRPO against the fleet at ``address``, updating ``model`` in place; returns one metrics dict per step.

    Metrics are appended to ``out/metrics.jsonl`` as they come; disk checkpoints go under
    ``out/checkpoints`` (the last two kept).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    correction_mode(config)  # a bad mode fails before the fleet is touched
    rank, world = _ranks()
    model.to(resolve_device(config.device))
    reference = None
    if world > 1:  # one process of several (torchrun): FSDP2 shards the model; each rank trains on its share
        import copy

        from torch.distributed.fsdp import fully_shard

        reference = copy.deepcopy(model)  # unsharded: recomputes older versions' logprobs for the check
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    history: list[dict] = []
    metrics_path = out / ("metrics.jsonl" if rank == 0 else f"metrics-rank{rank}.jsonl")
    metrics_path.write_text("")
    started = time.monotonic()
    expect = {"max_staleness": config.max_staleness, **config.expect}
    record = (f"{config.record}/rank{rank}" if world > 1 else config.record) if config.record else None
    with RolloutClient(address, expect=expect, record=record, rank=rank, world_size=world) as client:
        version = client.weight_version()
        held = {version: snapshot(model)}  # weights of the versions samples may come from
        leads = rank == 0  # evaluations are the leader's calls
        evals: dict = _evaluate(client, config, -1, log) if config.eval_every and leads else {}
        for step in range(config.steps):
            t0 = time.monotonic()
            batch = client.generate(step)  # with several ranks, this rank's share; metrics are the whole batch's
            t_generate = time.monotonic() - t0
            row = {
                "step": step,
                "version": version,
                **_train_step(model, optimizer, batch, version, held, config, reference),
            }
            t1 = time.monotonic()
            version += 1
            _push(client, model, version, config, out, reference)
            held[version] = snapshot(model)
            for old in [v for v in held if v < version - config.max_staleness]:
                del held[old]
            row.update(
                {
                    "reward": batch.metrics["rollout/reward_mean"],
                    "response_len": batch.metrics["rollout/response_len_mean"],
                    "staleness_mean": batch.metrics.get("rollout/staleness_mean", 0.0),
                    "staleness_max": batch.metrics.get("rollout/staleness_max", 0),
                    "truncated": batch.metrics["rollout/truncated_ratio"],
                    "generate_s": round(t_generate, 3),
                    "train_s": round(t1 - t0 - t_generate, 3),
                    "push_s": round(time.monotonic() - t1, 3),
                    "elapsed_s": round(time.monotonic() - started, 1),
                }
            )
            last = step + 1 == config.steps
            if config.eval_every and leads and ((step + 1) % config.eval_every == 0 or last):
                evals = _evaluate(client, config, step, log)  # on the weights just pushed
            row.update(evals)
            history.append(row)
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(format_row(row))
            window = [h["reward"] for h in history[-config.target_window :]]
            if config.target_reward is not None and len(window) == config.target_window:
                if min(window) >= config.target_reward:
                    log(f"reward >= {config.target_reward} for {config.target_window} steps: done")
                    break
    return history


def _evaluate(client, config: TrainConfig, step: int, log) -> dict:
    """One evaluation pass on the fleet (the coordinator's ``--eval-dataset``): ``eval_*`` metrics for the rows."""
    m = client.evaluate(config.eval_name)
    log(
        f"eval after step {step}: {config.eval_name} reward {m.reward_mean:.3f} over {m.prompts} prompts, "
        f"truncated {m.truncated_ratio:.2f}, weights {','.join(m.weight_versions)}"
    )
    out = {
        "eval_reward": m.reward_mean,
        "eval_truncated": m.truncated_ratio,
        "eval_after_step": step,
        "eval_versions": list(m.weight_versions),
    }
    if config.eval_sampled:
        m = client.evaluate(config.eval_sampled)
        k = m.n_samples
        log(f"eval after step {step}: {config.eval_sampled} pass@1 {m.pass_at[1]:.3f}, pass@{k} {m.pass_at[k]:.3f}")
        out.update({"eval_pass@1": m.pass_at[1], f"eval_pass@{k}": m.pass_at[k]})
    return out


def _train_step(model, optimizer, batch, version: int, held: dict, config: TrainConfig, reference=None) -> dict:
    samples = batch.samples
    device = next(model.parameters()).device
    prompts = [s.prompt_tokens for s in samples]
    responses = [s.response_tokens for s in samples]
    rollout_lp, _ = _pad([s.response_logprobs for s in samples])
    rewards = [torch.tensor([s.reward for s in g.samples]) for g in batch.groups]
    advantages = torch.cat([group_advantages(r[None, :])[0] for r in rewards]).to(device)

    logprobs, mask = response_logprobs(model, prompts, responses)
    # Tokens the model did not generate (a tool's output: loss mask 0) are context, not actions.
    loss_mask, _ = _pad([s.loss_mask for s in samples])
    mask = mask * loss_mask[:, : mask.shape[1]].float().to(device)
    rollout_lp = rollout_lp.to(device=device, dtype=logprobs.dtype)
    mode = correction_mode(config)
    correction = rollout_correction(  # with ppo_clip: "none", for the metrics
        logprobs.detach(),
        rollout_lp,
        mask,
        mode="none" if mode == "ppo_clip" else mode,
        clip=config.correction_clip,
        versions=_response_versions(samples, mask.shape[1]).to(device),
        current_version=version,
    )
    stats = dict(correction.metrics)
    if mode == "ppo_clip":
        loss, clip_stats = clipped_pg_loss(logprobs, rollout_lp, advantages, mask, config.clip)
        stats.update(clip_stats)
    else:
        loss = pg_loss(logprobs, advantages, mask, correction.weights)
    diff = _logprob_check(reference or model, samples, logprobs.detach(), version, held)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
    optimizer.step()
    return {"loss": loss.item(), "grad_norm": _full(grad_norm).item(), "samples": len(samples), **stats, **diff}


def _response_versions(samples, width: int) -> torch.Tensor:
    """``[n, width]``: the weight version of each response token (``to_tensors()["versions"]``'s response part)."""
    versions = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        for version, start, end in token_spans(s):
            versions[row, start:end] = version
    return versions


def _logprob_check(model, samples, current: torch.Tensor, version: int, held: dict) -> dict:
    """|trainer logprob - engine logprob| over the response tokens of samples made on weights the trainer holds."""
    diffs: list[torch.Tensor] = []
    checked: dict[int, int] = {}
    by_version: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        v = sample_version(s)
        if v in held:
            by_version.setdefault(v, []).append(i)
    for v, rows in sorted(by_version.items()):
        if v == version:
            recomputed = current[rows]
        else:
            with torch.no_grad():
                recomputed, _ = response_logprobs(
                    model, [samples[i].prompt_tokens for i in rows], [samples[i].response_tokens for i in rows], held[v]
                )
        for k, i in enumerate(rows):
            engine = torch.tensor(samples[i].response_logprobs, dtype=torch.float64)
            generated = torch.tensor(samples[i].loss_mask, dtype=torch.bool)  # inserted tokens have no engine logprob
            diffs.append((recomputed[k, : len(engine)].double().cpu() - engine).abs()[generated])
        checked[v] = len(rows)
    if not diffs:
        return {"train/rollout_logprob_abs_diff": math.nan, "logprob_diff_max": math.nan, "checked_versions": {}}
    flat = torch.cat(diffs)
    return {
        "train/rollout_logprob_abs_diff": flat.mean().item(),
        "logprob_diff_max": flat.max().item(),
        "checked_versions": {str(v): n for v, n in checked.items()},
    }


def _pad(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in rows)
    values = torch.zeros((len(rows), longest), dtype=torch.float64)
    mask = torch.zeros((len(rows), longest))
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = 1
    return values, mask


def _push(client, model, version: int, config: TrainConfig, out: Path, reference=None) -> None:
    """The new weights to every engine. With several ranks every rank calls it: an FSDP2 model's shards are
    gathered bucket by bucket as rank 0 sends them (a broadcast), or rank 0 writes the checkpoint (disk)."""
    if config.weights == "gloo":  # gloo sends CPU tensors: a model on a GPU is copied out first
        client.update_weights([(n, p.detach().cpu()) for n, p in model.named_parameters()], version, backend="gloo")
        return
    path = out / "checkpoints" / f"version-{version}"
    if reference is None:
        model.save_pretrained(path)
    else:
        full = snapshot(model)  # every rank gathers; rank 0 writes
        if client.rank == 0:
            reference.load_state_dict(full, strict=False)
            reference.save_pretrained(path)
    client.update_weights_from_disk(str(path.resolve()), version)
    stale = out / "checkpoints" / f"version-{version - 2}"
    if stale.exists():
        shutil.rmtree(stale)  # engines restarted later reload the latest; keep one before it


def format_row(row: dict) -> str:
    diff = row["train/rollout_logprob_abs_diff"]
    return (
        f"step {row['step']:4d}  reward {row['reward']:.3f}  len {row['response_len']:5.1f}  "
        f"staleness {row['staleness_mean']:.2f}  logprob_diff {diff:.1e}  kl {row['correction/kl_k3']:.1e}  "
        f"w {row['correction/weight_mean']:.3f}  loss {row['loss']:+.4f}  "
        f"gen {row['generate_s']:.2f}s train {row['train_s']:.2f}s push {row['push_s']:.2f}s  "
        f"[{row['elapsed_s']:.0f}s]"
    )
