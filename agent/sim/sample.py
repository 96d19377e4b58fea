"""One sample: a single output sequence of a ``/generate`` call, with its own rid.

Every ``/generate`` call expands into samples (batch items x ``n``). A sample moves through the
states of :class:`SampleState` exactly once, in order, and may skip ahead to ``DONE``:
``AT_GATE`` (held while the engine is paused), ``WAITING`` (in the scheduler's FIFO queue),
``RUNNING`` (holds a slot), ``ABORTED_WAITING`` (aborted in the queue), ``DONE`` (its slot,
rid and read lock are released; the scheduler forgets it).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from agent.sim.output import find_answer, find_tool_call

if TYPE_CHECKING:
    from agent.sim.output import SampleOutput
    from agent.sim.params import SamplingParams


class SampleState(enum.IntEnum):
    AT_GATE = 0
    WAITING = 1
    RUNNING = 2
    ABORTED_WAITING = 3
    DONE = 4


class Prompt:
    """Prompt token ids, shared by the ``n`` samples of one batch item."""

    __slots__ = ("ids", "key", "answer", "tool_call")

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.key = hash(tuple(ids))  # ints only: stable across processes (seeds and the prefix cache use it)
        self.answer = find_answer(ids)
        self.tool_call = find_tool_call(ids)


# emit(sample, tokens, final): writes one stream chunk showing the first ``tokens`` output tokens.
Emit = Callable[["Sample", int, bool], Awaitable[None]]


class Sample:
    """Request options, scheduling state and decode progress of one sample."""

    __slots__ = (
        "rid",
        "index",
        "prompt",
        "params",
        "max_new_tokens",
        "stream_interval",
        "return_logprob",
        "return_text_in_logprobs",
        "logprob_start_len",
        "return_prompt_ids",
        "started_at",
        "state",
        "holds_read_lock",
        "admitted",
        "wakeup",
        "aborted",
        "aborted_waiting",
        "output",
        "position",
        "cached_tokens",
        "weight_spans",
        "emit",
        "client_gone",
    )

    def __init__(
        self,
        rid: str,
        index: int,
        prompt: Prompt,
        params: SamplingParams,
        max_new_tokens: int,
        data: dict,
        stream_interval: int,
    ):
        self.rid = rid
        self.index = index  # position among the call's samples (the ``index`` of batch stream chunks)
        self.prompt = prompt
        self.params = params
        self.max_new_tokens = max_new_tokens  # resolved: an explicit null became "up to the context length"
        self.stream_interval = stream_interval
        self.return_logprob = bool(data.get("return_logprob"))
        self.return_text_in_logprobs = bool(data.get("return_text_in_logprobs"))
        start = data.get("logprob_start_len")
        self.logprob_start_len: int = -1 if start is None else start
        self.return_prompt_ids = bool(data.get("return_prompt_token_ids"))
        self.started_at = time.perf_counter()
        self.state = SampleState.AT_GATE
        self.holds_read_lock = False
        self.admitted: asyncio.Future[bool] | None = None  # set when a WAITING sample gets a slot (False: aborted)
        self.wakeup: asyncio.Future[bool] | None = None  # the pending nap; resolving it early interrupts the nap
        self.aborted = False
        self.aborted_waiting = False
        self.output: SampleOutput | None = None  # built when the sample gets a slot
        self.position = 0  # output tokens produced so far
        self.cached_tokens = 0
        # Half-open [start, end) output-token ranges per weight version (SGLang 0.5.23 ``weight_versions``).
        self.weight_spans: list[dict[str, Any]] = []
        self.emit: Emit | None = None  # set for streaming calls
        self.client_gone: Callable[[], bool] | None = None  # True once the caller's connection is closing
