"""The contract of a custom generate function (``coordinator serve --generate module:function``).

A generate function makes one sample of a group, in as many engine calls as it likes: a multi-turn
rollout that calls tools between turns, an agent loop, a self-correction pass. The agent calls it
once per sample, all samples of a group concurrently, sync or async::

    async def rollout(task: RolloutTask, engine) -> Trajectory | dict: ...
    def rollout(task: RolloutTask, engine) -> Trajectory | dict: ...    # run in a worker thread

``task`` (:class:`RolloutTask`) holds the prompt row, its tokens and the group's sampling params.
``engine`` speaks SGLang's ``/generate`` through the agent's pool (``agent/custom_rollout.py``):

- ``await engine.generate(input_ids, **params)`` -> :class:`Generation` (the sync function's
  engine blocks instead). ``params`` override the group's sampling params for this call
  (``max_new_tokens``, ``stop_token_ids``, ``temperature``...). Logprobs are always returned.
- ``await engine.encode(text)`` / ``engine.decode(ids)``: the agent's tokenizer (or the engines'
  ``/tokenize`` when the agent has none; decode then raises). The sync handle's ``encode`` blocks.

What the engine handle takes care of, so the function does not:

- **Weight updates.** A call cut short by a weight update is continued on the new weights from
  its partial output (``--partial-rollout``, the default): the function sees one
  :class:`Generation` whose ``weight_versions`` has a span per version. With
  ``--no-partial-rollout`` the sample starts over: the function is called again from the start.
- **Aborts.** ``pause(abort=True)`` or a lease given back cancels the function
  (``asyncio.CancelledError`` in an async one; a sync one's next engine call raises it): nothing
  it made is kept, and the prompt is generated again later, exactly once.
- **Engine failures.** An engine that dies mid-group starts every sample of the group over on
  another engine (the function is called again); errors an engine refuses a request with end the
  prompt as failed with the engine's message, as for single-turn samples.

An agent harness written for the OpenAI API runs unchanged on ``engine.openai_base_url`` /
``engine.openai_api_key`` (agent/openai_server.py): the sample's calls are rendered, generated
through the same handle and recorded; returning None (or a dict of only ``reward`` / ``metadata``)
makes that recording the sample.

What the function returns is the response after the prompt, turn by turn: a :class:`Trajectory`
(or a dict with the same fields). ``loss_mask`` marks the tokens the model generated with 1 and
the ones it did not (tool outputs, environment turns) with 0; their logprobs are 0.0. ``reward``
is optional: None (the default) lets the coordinator's ``--reward`` score the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RolloutTask:
    """One sample to make: what the generate function is given."""

    prompt: Any
    """The row's prompt: a string or chat messages."""
    prompt_tokens: list[int]
    """The prompt as the agent tokenized it (chat template applied); the response follows it."""
    label: Any
    metadata: dict
    sampling: dict
    """The group's sampling params (``max_new_tokens`` is the budget of the whole response)."""
    index: int
    """The dataset row."""
    sample: int
    """Which sample of the group (0 .. n_samples_per_prompt - 1)."""


@dataclass
class Generation:
    """One engine call's answer (joined across weight-update interruptions)."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    """``stop`` (EOS or a stop token/string), ``length`` (``max_new_tokens`` reached) or ``abort``."""
    weight_versions: list[list] = field(default_factory=list)
    """``[version, start, end)`` spans over ``tokens``."""
    matched_stop: Any = None
    """The stop token id or string that ended it, when the engine reports one."""


class Trajectory:
    """A sample's response built turn by turn: generated tokens (trained) and inserted ones (not).

    ``add(generation)`` appends what the model generated (loss mask 1, its logprobs and weight
    spans); ``insert(tokens)`` appends tokens the model did not generate (loss mask 0, logprob 0.0).
    ``status`` defaults to the last generation's: ``completed``, ``truncated`` or ``aborted``.
    """

    def __init__(self, *, reward: float | None = None, metadata: dict | None = None):
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.weight_versions: list[list] = []
        self.texts: list[str] = []
        self.reward = reward
        self.metadata: dict = dict(metadata or {})
        self.status: str | None = None
        self.prompt_tokens: list[int] | None = None
        """The sample's prompt if not the task's (the OpenAI endpoint's first rendered call); None: the task's."""

    def add(self, generation: Generation) -> Trajectory:
        offset = len(self.tokens)
        self.tokens += generation.tokens
        self.logprobs += generation.logprobs
        self.loss_mask += [1] * len(generation.tokens)
        self.weight_versions += [[v, s + offset, e + offset] for v, s, e in generation.weight_versions]
        self.texts.append(generation.text)
        self.status = {"length": "truncated", "abort": "aborted"}.get(generation.finish_reason, "completed")
        return self

    def insert(self, tokens: list[int], text: str = "") -> Trajectory:
        self.tokens += list(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.texts.append(text)
        return self

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def generated(self) -> int:
        """Tokens the model generated (loss mask 1): what counts against ``max_new_tokens``."""
        return sum(self.loss_mask)
