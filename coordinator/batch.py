"""A trainer batch as ``generate()`` returns it, and its padded tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import RolloutError
from common.types import Group, as_array


@dataclass
class RolloutBatch:
    rollout_id: int
    groups: list[Group]
    metrics: dict = field(default_factory=dict)

    def __len__(self) -> int:
        """Groups in the batch (``rollout_batch_size`` unless it is a partial one)."""
        return len(self.groups)

    @property
    def deficit(self) -> int:
        """Groups a partial batch (``generate(..., deadline=)``) lacks; 0 for a full one."""
        return int(self.metrics.get("rollout/deficit", 0))

    @property
    def samples(self):
        return [s for g in self.groups for s in g.samples]

    def to_tensors(self, pad_token_id: int = 0) -> dict:
        """Padded torch tensors, one row per sample (prompt + response, right-padded).

        Keys: ``tokens``, ``attention_mask``, ``loss_mask`` (response tokens the
        loss sees), ``rollout_logprobs`` (aligned with ``tokens``; 0 on prompt
        and padding), ``rewards``, ``prompt_lengths``, ``response_lengths``,
        ``group_index`` (dataset index of each row).
        """
        try:
            import torch
        except ImportError as exc:
            raise RolloutError("to_tensors() needs torch: pip install 'rollfleet[torch]'") from exc
        samples = self.samples
        width = max((len(s.prompt_tokens) + len(s.response_tokens) for s in samples), default=0)
        n = len(samples)
        tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        loss_mask = torch.zeros((n, width), dtype=torch.float32)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        # Each sample's arrays are viewed in place (torch.frombuffer) and copied once, into the padded rows.
        for row, s in enumerate(samples):
            lp, lr = len(s.prompt_tokens), len(s.response_tokens)
            if lp:
                tokens[row, :lp] = torch.frombuffer(as_array("i", s.prompt_tokens), dtype=torch.int32)
            if lr:
                end = lp + lr
                tokens[row, lp:end] = torch.frombuffer(as_array("i", s.response_tokens), dtype=torch.int32)
                loss_mask[row, lp:end] = torch.frombuffer(as_array("b", s.loss_mask), dtype=torch.int8)
                logprobs[row, lp:end] = torch.frombuffer(as_array("d", s.response_logprobs), dtype=torch.float64)
            attention[row, : lp + lr] = 1
        return {
            "tokens": tokens,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
            "prompt_lengths": torch.tensor([len(s.prompt_tokens) for s in samples], dtype=torch.long),
            "response_lengths": torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.long),
            "group_index": torch.tensor([g.index for g in self.groups for _ in g.samples], dtype=torch.long),
        }
