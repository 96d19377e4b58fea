"""Prompt keys: which training dataset, which of its data epochs, which row.

A training prompt travels as ``(data_epoch, index)``: on the wire, in the ledger, in receipts and in
batches. Of a mixture, ``data_epoch`` packs the dataset's place in the mixture with the dataset's own
data epoch (``common/mixture.py``: ``epoch_key``; dataset 0's keys are its epochs). ``PromptKey`` is
such a prompt unpacked; ``dataset_of`` and ``epoch_of`` read one part of a packed key, for the paths
that run once a receipt or a lease and need only that part.

This is the coordinator's one reader of packed keys: no other module shifts or masks them.
"""

from __future__ import annotations

from typing import NamedTuple

from common.mixture import EPOCH_BITS, EPOCH_MASK, epoch_key

__all__ = ["PromptKey", "dataset_of", "epoch_of"]


def dataset_of(data_epoch: int) -> int:
    """The training dataset (its place in the mixture) of packed key ``data_epoch``."""
    return data_epoch >> EPOCH_BITS


def epoch_of(data_epoch: int) -> int:
    """The dataset's own data epoch of packed key ``data_epoch``."""
    return data_epoch & EPOCH_MASK


class PromptKey(NamedTuple):
    """A training prompt: row ``index`` of dataset ``dataset``'s data epoch ``epoch``."""

    dataset: int
    epoch: int
    index: int

    @classmethod
    def of(cls, data_epoch: int, index: int) -> PromptKey:
        """The prompt ``(data_epoch, index)`` as it travels, unpacked."""
        return cls(dataset_of(data_epoch), epoch_of(data_epoch), index)

    @property
    def data_epoch(self) -> int:
        """The packed key the prompt travels under."""
        return epoch_key(self.dataset, self.epoch)

    @property
    def prompt(self) -> tuple[int, int]:
        """``(data_epoch, index)``, as it travels."""
        return self.data_epoch, self.index
