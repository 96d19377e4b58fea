"""What a verified update compares, with one definition for both sides (the trainer computes it from what
it sent, the sim and hf engines from what they hold), so the two can never drift apart:

- the first rows of a tensor as plain floats: what ``/get_weights_by_name`` answers;
- a tensor's checksum as SGLang's ``/weights_checker`` reports it for a tensor on the CPU: the first 8
  bytes of the SHA-256 of its raw bytes, as 16 hex digits (``sglang.srt.managers.mm_utils.tensor_hash``,
  0.5.23; on a GPU SGLang hashes with a Triton kernel instead, which no trainer reproduces).
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["leading_rows", "tensor_checksum"]


def leading_rows(tensor: Any, rows: int) -> list | float:
    """``tensor``'s first ``rows`` rows (first dimension) as nested lists of floats; a scalar as one float."""
    t = tensor.detach().to("cpu")
    if t.dim() == 0:
        return float(t.float())
    return t[: max(0, rows)].float().tolist()


def tensor_checksum(tensor: Any) -> str:
    """SGLang's CPU checksum of ``tensor`` in its own dtype: ``sha256(raw bytes)[:8]`` as 16 hex digits."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(memoryview(t.view(_uint8()).numpy())).hexdigest()[:16]


def _uint8():
    import torch

    return torch.uint8
