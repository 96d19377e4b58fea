"""The hf engine's scheduler: the sim's request path, with decoding done by a model in batches.

:class:`HFScheduler` is the sim's :class:`~agent.sim.scheduler.Scheduler` (pause gate,
weight-update reader/writer lock, slots, waiting queue, abort and pause semantics, weight-version
spans, flush rules) with one stage replaced: instead of moving a position through a pre-built
output, a running sample joins the *batch loop*.

The batch loop is one task. Each turn it collects the rows that left (finished, aborted or
gone samples) and the samples that are waiting to join, and makes ONE call on the model thread
(:meth:`agent.hf.decoder.Decoder.advance`): one forward pass for the whole batch plus a prefill
of the joiners. Back on the event loop it appends each token to its sample's output, checks the
finish conditions (:mod:`agent.hf.output`), credits the token to the weight version the step
ran under, and wakes the sample's own coroutine. That coroutine writes its stream chunks, so a
slow client never stalls the batch. The event loop stays free while the model works.

Invariants:

- the model runs on one thread only (``executor`` has one worker), so a step never races a
  weight copy (:meth:`agent.hf.engine.HFEngine.apply_weights` runs there too);
- a token is credited to the version current when its step was submitted: a weight update
  either waits for every running sample (unpaused) or runs while the batch is frozen (paused),
  and its copy queues behind any step already submitted;
- during an ``in_place`` or ``retract`` pause no step starts; rows and their caches are kept
  and decoding resumes where it stopped on ``continue``. An ``abort`` pause aborts every row;
- a sample leaves the batch at the next turn after it finished or was aborted, before the next
  forward pass, so no token is produced for it after its end.

Statistics: ``steps`` (decode turns) and ``max_batch`` (the most rows one forward pass ran).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Any

from agent.hf.decoder import Decoder, Join, Produced
from agent.hf.output import HFOutputs
from agent.hf.sampler import RowSampling
from agent.sim.sample import Sample, SampleState
from agent.sim.scheduler import Scheduler, _client_gone, _resolve

log = logging.getLogger("rollfleet.hf_engine")

_WAKE_POLL_S = 1.0  # how often a waiting sample checks whether its client went away


class HFScheduler(Scheduler):
    """The sim's scheduler whose decode stage is a model's batched decode."""

    def __init__(
        self,
        *,
        slots: int,
        weight_version: str,
        outputs: HFOutputs,
        decoder: Decoder,
        executor: Executor,
        device: Any,
    ):
        super().__init__(
            slots=slots,
            token_latency_s=0.0,
            prefill_latency_s=0.0,
            weight_version=weight_version,
            output_model=outputs,  # type: ignore[arg-type]  # duck-typed: build(sample)
        )
        self.outputs = outputs
        self.decoder = decoder
        self.executor = executor
        self.device = device
        self._joining: list[Sample] = []
        self._rows: dict[int, Sample] = {}  # key -> sample, for every row in the decoder's batch
        self._stop_ids: dict[int, list[int]] = {}
        self._work = asyncio.Event()
        self._between_steps = asyncio.Event()  # clear while a step runs on the model thread
        self._between_steps.set()
        self._loop_task: asyncio.Task | None = None
        self.steps = 0
        self.max_batch = 0

    # ------------------------------------------------------------ sample side

    async def _decode(self, sample: Sample) -> None:
        """Join the batch, then write the sample's chunks as the batch loop reports its tokens."""
        out = sample.output
        assert out is not None
        if sample.max_new_tokens == 0:
            self.outputs.finish_empty(sample)
            return
        self._start()
        self._joining.append(sample)
        self._work.set()
        emit, interval, emitted = sample.emit, sample.stream_interval, 0
        while True:
            produced = sample.position
            if emit is not None and produced > emitted and not sample.aborted:
                # The final chunk is the caller's; intermediate ones fall on multiples of the interval.
                end = produced if out.finish_reason is None else produced - 1
                for boundary in range((emitted // interval + 1) * interval, end + 1, interval):
                    await emit(sample, boundary, False)
                    if sample.aborted:
                        return
                emitted = produced
            if sample.aborted or out.finish_reason is not None:
                return
            await self._nap(sample, _WAKE_POLL_S)  # the batch loop, abort, pause and continue wake it early
            if _client_gone(sample):
                sample.aborted = True

    def finish(self, sample: Sample) -> None:
        held = sample.state == SampleState.RUNNING
        super().finish(sample)
        if held:
            self._work.set()  # its row leaves at the next turn

    # ------------------------------------------------------------ batch loop

    def _start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(), name="hf-batch-loop")

    def _gone(self, sample: Sample) -> bool:
        return sample.aborted or sample.state != SampleState.RUNNING or sample.output.finish_reason is not None  # type: ignore[union-attr]

    def _row_sampling(self, sample: Sample, stop_ids: list[int]) -> RowSampling:
        import torch

        params = sample.params
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.sampling_seed)
        return RowSampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            min_new_tokens=params.min_new_tokens,
            stop_ids=stop_ids,
            generator=generator,
        )

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Cleared before the state is read, so a wake-up that comes while this turn runs is kept.
            self._work.clear()
            if self._frozen:
                await self._work.wait()
                continue
            leave = {key for key, sample in self._rows.items() if self._gone(sample)}
            for key in leave:
                del self._rows[key]
                self._stop_ids.pop(key, None)
            joins = []
            for sample in self._joining:
                if self._gone(sample):
                    continue
                key = id(sample)
                stop_ids = self.outputs.stop_ids(sample)
                self._rows[key] = sample
                self._stop_ids[key] = stop_ids
                start = sample.logprob_start_len if sample.return_logprob else -1
                joins.append(Join(key, list(sample.prompt.ids), self._row_sampling(sample, stop_ids), start))
            self._joining.clear()
            if not self._rows:
                if leave:
                    await loop.run_in_executor(self.executor, self.decoder.advance, leave, [])
                await self._work.wait()
                continue
            version = self.weight_version
            self._between_steps.clear()
            try:
                produced = await loop.run_in_executor(self.executor, self.decoder.advance, leave, joins)
            except Exception:
                log.exception("hf engine: a decode step failed; aborting the running samples")
                await self._fail_rows(loop)
                continue
            finally:
                self._between_steps.set()
            self.steps += 1
            self.max_batch = max(self.max_batch, len(produced))
            self._apply(produced, version)

    async def _fail_rows(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a failed step: abort every row and start from an empty batch."""
        for sample in self._rows.values():
            self._abort_one(sample)
        self._rows.clear()
        self._stop_ids.clear()
        await loop.run_in_executor(self.executor, self.decoder.reset)

    def _apply(self, produced: list[Produced], version: str) -> None:
        for item in produced:
            sample = self._rows.get(item.key)
            if sample is None or self._gone(sample):
                continue
            out = sample.output
            if item.input_logprobs is not None:
                texts = sample.return_text_in_logprobs
                prompt = sample.prompt.ids[len(sample.prompt.ids) - len(item.input_logprobs) :]
                out.input_logprobs = [  # type: ignore[union-attr]
                    [lp, t, self.outputs.token_text(t) if texts else None]
                    for lp, t in zip(item.input_logprobs, prompt, strict=True)
                ]
            self.outputs.add(sample, item.token, item.logprob, self._stop_ids[item.key])
            self._advance(sample, len(out.ids), version)  # type: ignore[union-attr]
            wakeup = sample.wakeup
            if wakeup is not None:
                _resolve(wakeup, True)

    # ------------------------------------------------------------ control

    async def pause(self, mode: str) -> None:
        """The sim's pause; an ``in_place``/``retract`` pause returns once the step in flight (if any) is over."""
        await super().pause(mode)
        await self._between_steps.wait()

    def resume(self) -> None:
        super().resume()
        self._work.set()

    def shutdown(self) -> None:
        super().shutdown()
        if self._loop_task is not None:
            self._loop_task.cancel()
