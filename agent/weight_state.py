"""The agent core's view of weight updates (docs/weights.md): pure, no I/O, no clock.

``WeightState`` is the part of ``AgentSession`` (agent/session.py) that follows the coordinator's
weight-update steps. It turns each ``Weights*`` message into a ``RunWeightsStep`` for the executor
(agent/weights.py), each ``WeightsStepDone`` into the ``WeightsReport`` to send, and keeps:

- ``current``: the last completed update as this agent knows it (from the Welcome's ``weights``
  entry and from the steps it ran), which a restarted engine must be brought to. It is the agent's
  only record of the fleet's weights: the executor reads it (``WeightsExecutor(fleet=...)``);
- ``updating``: an update is open (begun and not finished or aborted) or a step still runs. While
  it is true no lease is put on an engine: new ``/generate`` calls wait for the update's end;
- ``catching_up``: the catch-ups open (``WeightsBegin.catch_up``: the fleet's version again, to
  engines out of the pool only). Its steps run and are reported like any, but they neither set
  ``updating`` nor count in ``begun``: leases keep running on the serving engines;
- ``begun``: updates begun so far. A lease remembers it when it is put on an engine, so an abort
  that comes back after an update began is known to be the update's (``interrupted``), not a
  trainer's pause or the engine's own.

Invariants: every step run is answered by exactly one ``WeightsStepDone``; ``updating`` turns
false only when no step runs and no update is open; versions only move through ``current``
when a ``disk``/``finish`` step succeeded or an ``abort`` said which weights the fleet is on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.events import Log, RunWeightsStep, SetWeights, WeightsRecord, WeightsStepDone
from common import protocol as p
from common.weight_step import WeightKind, WeightStep

OPENS = (p.WeightsBegin, p.WeightsFromDisk, p.WeightsInitGroup, p.WeightsBucket, p.WeightsFinish, p.WeightsAbort)
"""Coordinator messages that are steps of a weight update."""

CLOSING_STEPS = (WeightStep.DISK, WeightStep.FINISH, WeightStep.ABORT)
"""Steps after which the update is over for this agent."""


class WeightState:
    def __init__(self):
        self.current = WeightsRecord()
        self.open_update: int | None = None
        self.running = 0  # steps handed to the executor and not yet done
        self.begun = 0
        self.catching_up: set[int] = set()

    @property
    def updating(self) -> bool:
        return self.open_update is not None or self.running > 0

    def interrupted(self, epoch: int) -> bool:
        """A lease put on its engine when ``begun`` was ``epoch`` was interrupted by an update."""
        return self.updating or epoch != self.begun

    def on_step(self, msg: p.Message, out: list, *, report: bool = True) -> None:
        """A ``Weights*`` message from the coordinator: run it."""
        if (isinstance(msg, p.WeightsBegin | p.WeightsAbort) and msg.catch_up) or msg.update_id in self.catching_up:
            self.catching_up.add(msg.update_id)
            out.append(RunWeightsStep(msg, report))
            return
        if not self.updating or self.open_update != msg.update_id:
            self.begun += 1
        self.open_update = msg.update_id
        self.running += 1
        out.append(RunWeightsStep(msg, report))

    def on_welcome(self, raw, out: list) -> None:
        """A new session: the Welcome says which weights the fleet is on; an update we were in is over."""
        if raw is not None:
            try:
                record = raw if isinstance(raw, WeightsRecord) else WeightsRecord.from_dict(raw)
            except (KeyError, TypeError, ValueError):
                out.append(Log(logging.ERROR, f"malformed weights entry in the Welcome: {raw!r}"))
                record = self.current
        else:
            record = self.current
        for update_id in sorted(self.catching_up):
            self.on_step(p.WeightsAbort(update_id, record.version, "", True), out, report=False)
        if self.open_update is not None:
            # The session it belonged to is gone: end it here (engines continue, the group is destroyed).
            self.on_step(
                p.WeightsAbort(self.open_update, record.version, record.path if record.kind == WeightKind.DISK else ""),
                out,
                report=False,
            )
        if record != self.current:
            self.current = record
            out.append(SetWeights(record))

    def on_done(self, ev: WeightsStepDone, session: int, send: Callable[[p.Message], None], out: list) -> bool:
        """The executor finished a step: report it (``send``); True when the update is over for this agent.

        ``ev.record``, the weights the step reached, becomes ``current``: the executor brought its engines to
        them already, and reads them here from now on.
        """
        catch_up = ev.update_id in self.catching_up
        if not catch_up:
            self.running = max(0, self.running - 1)
        if ev.report:
            send(
                p.WeightsReport(
                    session, ev.update_id, ev.step, ev.ok, ev.seq, dict(ev.engines), ev.error, list(ev.members)
                )
            )
        if ev.record is not None and ev.record != self.current:
            self.current = ev.record
        if not ev.ok:
            out.append(Log(logging.ERROR, f"weight update {ev.update_id} step {ev.step} failed: {ev.error}"))
        if catch_up:
            if ev.step in CLOSING_STEPS:
                self.catching_up.discard(ev.update_id)
            return False  # engines it brought back are announced as they turn healthy
        if ev.step in CLOSING_STEPS and self.open_update == ev.update_id:
            self.open_update = None
        return not self.updating
