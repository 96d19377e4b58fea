"""A sample's output as the model produces it, token by token, and when it is finished.

:class:`HFOutput` is the sim's :class:`~agent.sim.output.SampleOutput` grown one token at a time,
so :func:`agent.sim.output.response_object` renders it unchanged; its text comes from the
model's tokenizer (special tokens skipped, as SGLang's ``skip_special_tokens`` default).

Finish checks run after every token, in SGLang's order (``Req.check_finished``): the
``max_new_tokens`` budget (``{"type": "length", "length": N}``; the budget is already capped by
the context length), then, unless ``ignore_eos``, an EOS or ``stop_token_ids`` token
(``{"type": "stop", "matched": id}``), then stop strings in the decoded output
(``{"type": "stop", "matched": "str"}``; the text ends before the string unless
``no_stop_trim``; ``output_ids`` keep every token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.sim.output import SampleOutput

if TYPE_CHECKING:
    from agent.sim.sample import Sample


@dataclass(slots=True)
class HFOutput(SampleOutput):
    """An output that grows as tokens arrive; ``finish_reason`` is None until it is finished."""

    tokenizer: Any = None
    text_stop: int | None = None  # characters of the full decoded text kept in the final text

    def text_upto(self, k: int) -> str:
        return self.tokenizer.decode(self.ids[:k], skip_special_tokens=True)

    def final_text(self) -> str:
        text = self.text_upto(len(self.ids))
        return text if self.text_stop is None else text[: self.text_stop]


class HFOutputs:
    """Builds each sample's empty output (the scheduler's ``output_model``) and adds its tokens."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self._token_text: dict[int, str] = {}

    def build(self, sample: Sample) -> HFOutput:
        return HFOutput(finish_reason=None, tokenizer=self.tokenizer)

    def stop_ids(self, sample: Sample) -> list[int]:
        """The ids that end ``sample`` (EOS and its ``stop_token_ids`` in the vocabulary)."""
        ids = set(self.eos_ids)
        ids.update(t for t in sample.params.all_stop_token_ids if t < self.vocab_size)
        return sorted(ids)

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def add(self, sample: Sample, token: int, logprob: float, stop_ids: list[int]) -> bool:
        """Append one token to the sample's output; True when that finished it."""
        out: HFOutput = sample.output  # type: ignore[assignment]
        params = sample.params
        out.ids.append(token)
        if sample.return_logprob:
            out.logprobs.append([logprob, token, self.token_text(token) if sample.return_text_in_logprobs else None])
        if len(out.ids) >= sample.max_new_tokens:
            out.finish_reason = {"type": "length", "length": sample.max_new_tokens}
        elif not params.ignore_eos and token in stop_ids:
            out.finish_reason = {"type": "stop", "matched": token}
        elif params.stop:
            text = out.text_upto(len(out.ids))
            hits = [(text.find(s), s) for s in (b.decode("utf-8", "replace") for b in params.stop)]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                start, matched = min(hits)
                out.finish_reason = {"type": "stop", "matched": matched}
                out.text_stop = start + len(matched) if params.no_stop_trim else start
        return out.finish_reason is not None

    def finish_empty(self, sample: Sample) -> None:
        """Finish a sample with a zero-token budget without running it."""
        sample.output.finish_reason = {"type": "length", "length": 0}  # type: ignore[union-attr]
