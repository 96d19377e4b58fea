"""``coordinator replay --from DIR --show ROLLOUT_ID [--samples N]``: one recorded batch, for people.

Prints the batch's size and metrics, then its first ``N`` samples: where each comes from (group,
dataset row, data epoch, node), its reward, status and weight-version spans, and its prompt and
response text. The prompt text is the ``prompt`` the row metadata carries (a chat prompt as JSON);
texts are shown as Python literals, so newlines and odd characters stay visible on one line, and
cut at ``MAX_TEXT`` characters.
"""

from __future__ import annotations

import json

from coordinator.record_format import BatchFile

MAX_TEXT = 400


def _text(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    cut = len(text) > MAX_TEXT
    return repr(text[:MAX_TEXT]) + (f" ... ({len(text)} chars)" if cut else "")


def _spans(spans: list) -> str:
    return " ".join(f"{v}:[{a},{b})" for v, a, b in spans) or "-"


def render(batch: BatchFile, path: str, samples: int) -> str:
    groups = batch.groups
    n = sum(len(g.samples) for g in groups)
    deficit = int(batch.metrics.get("rollout/deficit", 0))
    head = f"batch {batch.rollout_id} ({path}): {len(groups)} groups, {n} samples"
    if deficit:
        head += f", a partial batch lacking {deficit} group(s)"
    out = [head, "", "metrics:"]
    width = max((len(k) for k in batch.metrics), default=0)
    for key in sorted(batch.metrics):
        value = batch.metrics[key]
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        out.append(f"  {key.ljust(width)}  {shown}")
    shown_samples = [(g, i, s) for g in groups for i, s in enumerate(g.samples)][:samples]
    if shown_samples:
        out += ["", f"first {len(shown_samples)} of {n} samples:"]
    for k, (g, i, s) in enumerate(shown_samples):
        where = f"row {g.index} (data epoch {g.data_epoch}) from {g.agent_id or '-'}"
        out.append(
            f"[{k}] group {groups.index(g)} sample {i}: {where}"
            f"  reward {s.reward:g}  {s.status}  {len(s.prompt_tokens)}+{len(s.response_tokens)} tokens"
            f"  versions {_spans(s.weight_versions) if s.weight_versions else s.weight_version}"
        )
        prompt = s.metadata.get("prompt") if isinstance(s.metadata, dict) else None
        out.append(f"    prompt:   {_text(prompt) if prompt is not None else '(not in the row metadata)'}")
        out.append(f"    response: {_text(s.response_text)}")
        if g.label is not None:
            out.append(f"    label:    {_text(g.label)}")
    return "\n".join(out)
