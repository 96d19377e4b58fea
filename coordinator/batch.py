"""A trainer batch as ``generate()`` returns it, and its padded tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import RolloutError
from common.types import Group, as_array
from coordinator.token_spans import token_spans


@dataclass
class RolloutBatch:
    """Batch ``rollout_id``: for a trainer of several processes, this rank's share of it (whole groups,
    token-balanced, ``coordinator/shares.py``) with the whole batch's ``metrics``."""

    rollout_id: int
    groups: list[Group]
    metrics: dict = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    rank_lengths: list[list[int]] | None = None
    """Every rank's sample lengths (prompt + response) in share order, for a trainer of several processes:
    what each rank counts every rank's micro-batches from, without a collective. None otherwise."""

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

    def to_tensors(self, pad_token_id: int = 0, *, current_version: int | None = None) -> dict:
        """Padded torch tensors, one row per sample (prompt + response, right-padded).

        Keys: ``tokens``, ``attention_mask``, ``loss_mask`` (response tokens the
        loss sees), ``rollout_logprobs`` (aligned with ``tokens``; 0 on prompt
        and padding), ``rewards``, ``prompt_lengths``, ``response_lengths``,
        ``group_index`` (dataset index of each row), ``versions`` (long, aligned
        with ``tokens``: the weight version that generated each response token,
        read from the sample's ``weight_versions`` spans, or its ``weight_version``
        when it has none; -1 on prompt and padding, on response tokens no span
        covers, and for a label that is not a number; the engines' launch
        label ``default`` is version 0).

        With ``current_version`` (the version the trainer holds), also
        ``staleness``: ``current_version - versions`` where the version is known,
        -1 where ``versions`` is -1. Both feed
        ``coordinator.correction.rollout_correction(..., versions=...)``.
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
        versions = torch.full((n, width), -1, dtype=torch.long)
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
                for version, start, stop in token_spans(s):
                    versions[row, lp + start : lp + stop] = version
            attention[row, : lp + lr] = 1
        out = {
            "tokens": tokens,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "rollout_logprobs": logprobs,
            "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
            "prompt_lengths": torch.tensor([len(s.prompt_tokens) for s in samples], dtype=torch.long),
            "response_lengths": torch.tensor([len(s.response_tokens) for s in samples], dtype=torch.long),
            "group_index": torch.tensor([g.index for g in self.groups for _ in g.samples], dtype=torch.long),
            "versions": versions,
        }
        if current_version is not None:
            out["staleness"] = torch.where(versions >= 0, int(current_version) - versions, -1)
        return out

    def micro_batches(
        self, max_tokens: int, num_micro_batches: int | None = None, *, current_version: int | None = None
    ) -> list[dict]:
        """The samples packed end to end, no padding, into micro-batches of at most ``max_tokens`` tokens.

        Whole samples only; a micro-batch holds more than ``max_tokens`` tokens (prompt + response) only
        when it is one sample alone that is longer. Deterministic: the number is
        ``coordinator.packing.count_micro_batches(lengths, max_tokens)`` (first-fit decreasing, at most
        ``11/9 OPT + 6/9``), a function of the sample lengths only, so ranks that know each other's
        lengths agree on it (e.g. its max) without a collective; ``num_micro_batches`` forces a count (at
        least that one, else ``ValueError``; extra ones are empty, with 0-length tensors, for a rank to step
        through in lockstep). Samples go to micro-batches by LPT, longest first to the lightest
        (largest micro-batch at most ``4/3 - 1/(3k)`` of the best), falling back to FFD split up to the
        count where LPT would overflow (``coordinator/packing.py``).

        Each micro-batch is a dict of torch tensors; ``T`` its total tokens, ``S`` its samples (in batch
        order). Names and dtypes as in :meth:`to_tensors`, one packed row instead of padded rows:
        ``tokens`` (1, T) long, each sample's prompt then response; ``position_ids`` (1, T) long, 0 at
        the start of every sample; ``cu_seqlens`` (S + 1,) int32, 0 then the cumulative sample lengths
        (flash-attn's varlen boundaries); ``loss_mask`` (1, T) float32; ``rollout_logprobs`` (1, T)
        float32, 0 on prompt tokens; ``versions`` (1, T) long, -1 on prompt tokens and uncovered ones;
        ``rewards`` (S,) float32; ``prompt_lengths``, ``response_lengths``, ``group_index`` (S,) long;
        ``sample_index`` (S,) long, each sample's row in ``to_tensors()`` / ``self.samples``; with
        ``current_version``, ``staleness`` (1, T) long. No ``attention_mask``: nothing is padding, and
        the boundaries are ``cu_seqlens`` / ``position_ids`` (an all-ones mask would let samples attend
        to each other in a model that ignores them).
        """
        from coordinator.packing import pack, packed_tensors

        lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in self.samples]
        if num_micro_batches is None and self.world_size > 1:
            num_micro_batches = self.micro_batch_count(max_tokens)
        bins = pack(lengths, max_tokens, num_micro_batches)
        return packed_tensors(self, bins, current_version=current_version)

    def micro_batch_count(self, max_tokens: int) -> int:
        """Micro-batches of ``max_tokens`` every rank steps through for this batch: the largest rank's count
        (``coordinator.packing.count_micro_batches`` over each rank's lengths); on one process, this batch's."""
        from coordinator.packing import count_micro_batches

        own = [len(s.prompt_tokens) + len(s.response_tokens) for s in self.samples]
        if self.world_size <= 1:
            return count_micro_batches(own, max_tokens)
        if self.rank_lengths is None:
            raise RolloutError(
                f"batch {self.rollout_id} was recorded without its samples' lengths (an older agent or ledger): "
                "give micro_batches(max_tokens, num_micro_batches=K) with the same K on every rank"
            )
        if sorted(self.rank_lengths[self.rank]) != sorted(own):
            raise RolloutError(
                f"batch {self.rollout_id}: rank {self.rank}'s samples do not have the lengths the coordinator "
                "recorded for them; micro-batch counts would differ between ranks"
            )
        return max(count_micro_batches(lengths, max_tokens) for lengths in self.rank_lengths)
