"""The scheduler: pause gate, weight-update lock, slots, waiting queue and timed decode.

A sample passes four stages, the same ones SGLang has:

1. **Pause gate.** While the engine is paused (any mode) new samples wait here. Like SGLang's
   tokenizer manager, ``/abort_request`` does not reach a sample held at the gate (only a client
   disconnect does).
2. **Reader lock.** In-flight samples hold a reader lock. An unpaused weight update takes the
   writer lock: it waits for the readers to drain and new samples queue behind it. While paused,
   weight updates skip the lock.
3. **Scheduler.** ``--slots`` (``max_running_requests``) samples decode at once; the rest sit in
   a FIFO waiting queue. An abort of a queued sample finishes it at once with
   ``{"type":"abort","message":"Abort in waiting queue"}`` and no ``prompt_tokens``; an abort of
   a running sample finishes it with ``{"type":"abort","message":"Aborted","status_code":null,
   "err_type":null}`` and the partial output. Both are HTTP 200.
4. **Decode.** The whole output is built once when the sample gets a slot; "decoding" only moves a
   position through it. With ``--token-latency-ms 0`` (the default, "instant" mode) there is no
   sleep at all. Otherwise a sample sleeps once per chunk of tokens (a stream chunk, or >= 20 ms
   of tokens, or <= 0.5 s for non-stream requests); an abort or pause interrupts the sleep and
   credits the tokens produced so far.

Abort semantics, as in SGLang: an empty rid without ``abort_all`` is ignored; a rid that is not
exactly a live request id (at the gate, queued or running) is ignored (tokenizer-manager check,
one tokenizer worker); otherwise every scheduler-held sample whose rid *starts with* it is aborted
(scheduler prefix match), so aborting ``req-1`` also aborts ``req-10``. A sample held at the pause
gate is not in the scheduler yet, so an abort of its rid is lost. With ``abort_sent_enabled``
(SGLang 0.5.23) the first per-rid abort of a live rid marks it ``abort_sent`` and every later one
is dropped: a sample whose abort was lost at the gate then runs to its natural end after
``continue``. ``abort_all`` reaches the waiting queue and the running slots, not the pause gate.
A client disconnect aborts its samples, the gate included.

Pause, under ``pause_lock`` (SGLang's ``is_pause_cond``): ``abort`` mode holds new samples at the
gate and loops {abort everything in the scheduler; stop if no sample holds the reader lock and no
weight update holds the writer lock; sleep ``pause_recheck_s`` (1.0 s, SGLang's)}; ``retract`` and
``in_place`` freeze running samples where they are (they stop producing tokens) and hold new ones.
:meth:`continue_generation` takes ``pause_lock`` too, so it waits for a pause in progress (and for
a weight call that holds the lock while paused), then unpauses (:meth:`resume`).

Weight versions: every produced token is credited to the weight version current when it was
produced; a sample's ``weight_spans`` are half-open ``[start, end)`` output-token ranges.

Cache flush: only when nothing runs or waits; while paused, waiting samples do not count, and a
``retract`` pause counts its frozen samples as retracted (waiting), as SGLang does.

Simplified against SGLang: ``retract`` behaves like ``in_place`` (but for the flush); an abort of a frozen (paused)
running sample finishes it at once instead of after ``continue``; abort credits the tokens
produced so far rather than "one more step"; ``cached_tokens`` comes from an exact-prompt cache
that flush and weight updates clear.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from agent.sim.output import OutputModel
from agent.sim.rwlock import ReaderWriterLock
from agent.sim.sample import Sample, SampleState
from agent.sim.versions import PAUSE_RECHECK_S

T = TypeVar("T")

_FROZEN_POLL_S = 1.0  # how often a frozen sample checks whether its client went away
_PREFIX_CACHE_MAX = 100_000


def _resolve(fut: asyncio.Future, value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _interrupt(sample: Sample) -> None:
    """End the sample's current nap early (abort, pause or continue)."""
    wakeup = sample.wakeup
    if wakeup is not None and not wakeup.done():
        wakeup.set_result(False)


def _client_gone(sample: Sample) -> bool:
    gone = sample.client_gone
    return gone is not None and gone()


class Scheduler:
    """Runs samples through gate, lock, slots and decode; owns the weight version and the prefix cache."""

    def __init__(
        self,
        *,
        slots: int,
        token_latency_s: float,
        prefill_latency_s: float,
        weight_version: str,
        output_model: OutputModel,
    ):
        self.slots = slots
        self.token_latency_s = token_latency_s
        self.prefill_latency_s = prefill_latency_s
        self.weight_version = weight_version
        self.output_model = output_model
        # Tokens per nap: >= 20 ms of tokens for streams, <= 0.5 s of tokens otherwise.
        self._min_stream_batch = max(1, math.ceil(0.02 / token_latency_s)) if token_latency_s else 1
        self._nonstream_chunk = max(1, int(0.5 / token_latency_s)) if token_latency_s else 1

        self.live_rids: set[str] = set()  # every in-flight rid, gate included (duplicate check)
        self._scheduled: dict[str, Sample] = {}  # waiting + running, by rid
        self._waiting: deque[Sample] = deque()
        self._free_slots = slots
        self.num_running = 0
        self._paused = False
        self.pauses = 0  # /pause_generation calls served (observability)
        self._pause_mode = ""
        self._frozen = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = ReaderWriterLock()
        self.pause_lock = asyncio.Lock()  # SGLang's is_pause_cond
        self.pause_recheck_s = PAUSE_RECHECK_S
        self.abort_sent_enabled = True  # SGLang 0.5.23's abort_sent (agent.sim.versions.configure sets it)
        self._abort_sent: set[str] = set()  # live rids whose per-rid abort was sent
        self.weight_session: str | None = None  # the selector of the open weight-update session (0.5.23)
        self._prefix_cache: set[int] = set()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # ------------------------------------------------------------ state

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pause_mode(self) -> str:
        """The mode of the current pause; empty while not paused."""
        return self._pause_mode

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and not self._waiting

    @property
    def updating_weights(self) -> bool:
        """True while a weight update holds the writer lock or waits for readers to drain."""
        return self._lock.writer

    def running(self) -> Iterator[Sample]:
        return (s for s in self._scheduled.values() if s.state == SampleState.RUNNING)

    def waiting(self) -> Iterator[Sample]:
        return iter(self._waiting)

    async def wait_unpaused(self) -> None:
        await self._unpaused.wait()

    # ------------------------------------------------------------ abort

    def _abort_one(self, sample: Sample) -> None:
        sample.aborted = True
        if sample.state == SampleState.WAITING:
            try:
                self._waiting.remove(sample)
            except ValueError:
                pass
            sample.state = SampleState.ABORTED_WAITING
            sample.aborted_waiting = True
            if sample.admitted is not None and not sample.admitted.done():
                sample.admitted.set_result(False)
        elif sample.state == SampleState.RUNNING:
            _interrupt(sample)

    def abort_samples(self, samples: list[Sample]) -> None:
        """Abort these samples wherever they are, the pause gate included (their client went away)."""
        for sample in samples:
            self._abort_one(sample)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's abort: the tokenizer's exact-rid check (and ``abort_sent``), then the scheduler's prefix
        match; the number of samples aborted."""
        if not abort_all:
            if not rid or rid not in self.live_rids:
                return 0
            if self.abort_sent_enabled:
                if rid in self._abort_sent:
                    return 0
                self._abort_sent.add(rid)
        n = 0
        for sample in list(self._scheduled.values()):
            if abort_all or sample.rid.startswith(rid):
                if sample.state in (SampleState.WAITING, SampleState.RUNNING):
                    self._abort_one(sample)
                    n += 1
        return n

    # ------------------------------------------------------------ slots

    def _release_slot(self) -> None:
        queue = self._waiting
        while queue:
            nxt = queue.popleft()
            if nxt.admitted is None or nxt.admitted.done():
                continue
            nxt.state = SampleState.RUNNING
            self.num_running += 1
            nxt.admitted.set_result(True)
            return
        self._free_slots += 1

    def queue_full(self, incoming: int, max_queued: int) -> bool:
        """SGLang's ``--max-queued-requests``: True if ``incoming`` new samples would leave more than
        ``max_queued`` waiting for a slot (samples held at the pause gate do not count)."""
        free = 0 if self._waiting else self._free_slots
        return len(self._waiting) + max(0, incoming - free) > max_queued

    def finish(self, sample: Sample) -> None:
        """Release everything the sample holds (slot, queue place, rid, read lock); idempotent."""
        state = sample.state
        if state == SampleState.DONE:
            return
        if state == SampleState.WAITING:
            try:
                self._waiting.remove(sample)
            except ValueError:
                pass
        elif state == SampleState.RUNNING:
            self.num_running -= 1
            self._release_slot()
        sample.state = SampleState.DONE
        if self._scheduled.get(sample.rid) is sample:
            del self._scheduled[sample.rid]
        self.live_rids.discard(sample.rid)
        self._abort_sent.discard(sample.rid)
        if sample.holds_read_lock:
            sample.holds_read_lock = False
            self._lock.release_read()

    # ------------------------------------------------------------ decode

    def _build_output(self, sample: Sample) -> None:
        sample.output = self.output_model.build(sample)
        prompt_len = len(sample.prompt.ids)
        if sample.prompt.key in self._prefix_cache:
            sample.cached_tokens = prompt_len - 1
        else:
            if len(self._prefix_cache) > _PREFIX_CACHE_MAX:
                self._prefix_cache.clear()
            self._prefix_cache.add(sample.prompt.key)
        self.prompt_tokens += prompt_len
        self.cached_tokens += sample.cached_tokens

    def _advance(self, sample: Sample, new_position: int, version: str | None = None) -> None:
        """Credit the tokens up to ``new_position`` to ``version`` (default: the current weight version)."""
        old = sample.position
        if new_position <= old:
            return
        if version is None:
            version = self.weight_version
        spans = sample.weight_spans
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = new_position
        else:
            spans.append({"version": version, "start": old, "end": new_position})
        self.generated_tokens += new_position - old
        sample.position = new_position

    async def _nap(self, sample: Sample, secs: float) -> bool:
        """Sleep ``secs``; True if it ran out, False if interrupted (abort, pause, continue)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        handle = loop.call_later(secs, _resolve, fut, True)
        sample.wakeup = fut
        try:
            return await fut
        finally:
            handle.cancel()
            sample.wakeup = None

    async def drive(self, sample: Sample) -> None:
        """Run one sample through gate, lock, scheduler and decode; stream its final chunk."""
        try:
            await self._run(sample)
        finally:
            self.finish(sample)
        if sample.emit is not None:
            await sample.emit(sample, sample.position, True)

    async def _run(self, sample: Sample) -> None:
        while self._paused and not sample.aborted:
            await self._unpaused.wait()
        if sample.aborted:
            return
        if self._lock.writer:
            await self._lock.acquire_read()
        else:
            self._lock.acquire_read_nowait()
        sample.holds_read_lock = True
        self._scheduled[sample.rid] = sample
        if self._free_slots > 0 and not self._waiting:
            self._free_slots -= 1
            self.num_running += 1
            sample.state = SampleState.RUNNING
        else:
            sample.admitted = asyncio.get_running_loop().create_future()
            sample.state = SampleState.WAITING
            self._waiting.append(sample)
            if not await sample.admitted:
                return
        self._build_output(sample)
        if self.prefill_latency_s > 0 and not sample.aborted:
            await self._nap(sample, self.prefill_latency_s)
        if not sample.aborted:
            await self._decode(sample)

    async def _decode(self, sample: Sample) -> None:
        total = len(sample.output.ids)  # type: ignore[union-attr]
        latency = self.token_latency_s
        emit = sample.emit
        interval = sample.stream_interval
        if latency <= 0.0:
            while self._frozen and not sample.aborted:
                await self._nap(sample, _FROZEN_POLL_S)
                if _client_gone(sample):
                    sample.aborted = True
            if sample.aborted:
                return
            if emit is not None:
                for boundary in range(interval, total, interval):
                    self._advance(sample, boundary)
                    await emit(sample, boundary, False)
                    if sample.aborted:
                        return
            self._advance(sample, total)
            return

        loop = asyncio.get_running_loop()
        min_batch = self._min_stream_batch
        chunk = self._nonstream_chunk
        while sample.position < total:
            if sample.aborted:
                return
            if self._frozen:
                await self._nap(sample, _FROZEN_POLL_S)
                if _client_gone(sample):
                    sample.aborted = True
                continue
            pos = sample.position
            if emit is not None:
                target = pos + min_batch
                if target < total and target % interval:
                    target = (target // interval + 1) * interval
                if target > total:
                    target = total
            else:
                target = min(total, pos + chunk)
            t0 = loop.time()
            if await self._nap(sample, (target - pos) * latency):
                new = target
            else:
                new = min(target, pos + int((loop.time() - t0) / latency))
            self._advance(sample, new)
            if emit is not None:
                last = min(new, total - 1)
                for boundary in range((pos // interval + 1) * interval, last + 1, interval):
                    await emit(sample, boundary, False)
                    if sample.aborted:
                        return
            elif _client_gone(sample):
                sample.aborted = True

    # ------------------------------------------------------------ control

    async def pause(self, mode: str) -> None:
        """SGLang's ``pause_generation``, ``pause_lock`` held throughout (see the module docstring)."""
        async with self.pause_lock:
            self.pauses += 1
            self._paused = True
            self._pause_mode = mode
            self._unpaused.clear()
            if mode == "abort":
                self._frozen = False
                while True:
                    self.abort(abort_all=True)
                    if not self._lock.locked:
                        break
                    await asyncio.sleep(self.pause_recheck_s)
            else:
                self._frozen = True
                for sample in list(self._scheduled.values()):
                    if sample.state == SampleState.RUNNING:
                        _interrupt(sample)

    async def continue_generation(self) -> None:
        """SGLang's ``continue_generation``: unpause once ``pause_lock`` is free (no pause in progress)."""
        async with self.pause_lock:
            self.resume()

    def resume(self) -> None:
        """Unpause now (``continue_generation`` without the lock; shutdown)."""
        self._paused = False
        self._pause_mode = ""
        self._frozen = False
        self._unpaused.set()
        for sample in list(self._scheduled.values()):
            if sample.state == SampleState.RUNNING:
                _interrupt(sample)

    def can_flush(self) -> bool:
        """Whether a cache flush may happen now: SGLang's ``is_fully_idle(ignore_waiting=paused)``.

        While paused, waiting samples do not count, and neither do the frozen running samples of
        a ``retract`` pause (SGLang moved them to the waiting queue); an ``in_place`` pause with
        running samples cannot flush.
        """
        if not self._paused:
            return self.idle
        return self._pause_mode == "retract" or self.num_running == 0

    def flush(self) -> bool:
        """Clear the prefix cache if :meth:`can_flush`; False (and nothing cleared) otherwise."""
        if not self.can_flush():
            return False
        self._prefix_cache.clear()
        return True

    async def update_weights(self, change: Callable[[], Awaitable[T]], *, hold_pause: bool = True) -> T:
        """Await ``change`` with the writer lock held (in-flight samples drained), or at once while paused.

        As SGLang's tokenizer manager, whether the engine is paused is read under ``pause_lock`` (so the
        call waits for a pause in progress); a paused call with ``hold_pause`` (distributed updates and
        session calls) keeps the lock until it is done, so ``continue_generation`` waits for it; a
        disk update (``hold_pause=False``) releases it at once.
        """
        async with self.pause_lock:
            paused = self._paused
            if paused and hold_pause:
                return await change()
        if paused:
            return await change()
        await self._lock.acquire_write()
        try:
            return await change()
        finally:
            self._lock.release_write()

    def shutdown(self) -> None:
        self.abort(abort_all=True)
        self.resume()
