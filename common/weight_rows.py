"""The first rows of a tensor as plain floats: what ``/get_weights_by_name`` answers and what a verified
update compares. One definition for both sides (the trainer computes it from what it sent, the sim and
hf engines from what they hold), so the two can never drift apart."""

from __future__ import annotations

from typing import Any

__all__ = ["leading_rows"]


def leading_rows(tensor: Any, rows: int) -> list | float:
    """``tensor``'s first ``rows`` rows (first dimension) as nested lists of floats; a scalar as one float."""
    t = tensor.detach().to("cpu")
    if t.dim() == 0:
        return float(t.float())
    return t[: max(0, rows)].float().tolist()
