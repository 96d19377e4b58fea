"""A sample's response tokens by the weight version that produced them: what off-policy correction and packed
micro-batches read (coordinator/batch.py, coordinator/packing.py)."""

from __future__ import annotations

__all__ = ["token_spans", "version_number"]


def version_number(label) -> int:
    """A weight-version label as an int: ``"7"`` is 7, the launch label (``default`` or empty) is 0, else -1."""
    if label in (None, "", "default"):
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        return -1


def token_spans(sample) -> list[tuple[int, int, int]]:
    """``(version, start, end)`` response-token ranges of ``sample``, clipped to its response, versions as ints.

    From its ``weight_versions`` spans; a sample without spans is all of its ``weight_version``.
    """
    n = len(sample.response_tokens)
    spans = sample.weight_versions or [[sample.weight_version, 0, n]]
    out = []
    for label, start, end in spans:
        start, end = max(0, int(start)), min(n, int(end))
        if end > start:
            out.append((version_number(label), start, end))
    return out
