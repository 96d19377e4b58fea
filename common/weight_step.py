"""The names of a weight update's kinds and steps (docs/weights.md), shared by coordinator and agents.

Both are ``StrEnum``s: a member *is* its string, so the wire (``WeightsReport.step``,
``UpdateWeights.kind``), the status JSON (``weights.lock.step``, ``kind``) and every error text keep
the plain strings, and a string read off the wire compares equal to its member. Format members with
``{step}``, never ``{step!r}`` (that spells the class).

Steps, in the order an update meets them (the coordinator's lock walks them in
coordinator/weight_lock.py; an agent runs one per coordinator message in agent/weights.py):

    disk:         DISK
    distributed:  BEGIN -> GROUP -> (INIT) -> BUCKET ... -> FINISH
    catch_up:     BEGIN -> GROUP -> INIT -> BUCKET ... -> FINISH     (the engines behind only)
    any:          ABORT (an agent's step: its engines leave the update)
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["BROADCASTS", "WeightKind", "WeightStep"]


class WeightKind(StrEnum):
    """What an ``UpdateWeights`` asks for; also how the fleet reached its weights (``WeightLog.kind``)."""

    DISK = "disk"
    """Every engine loads a checkpoint path."""
    DISTRIBUTED = "distributed"
    """The trainer broadcasts the tensors to a group of the engines (the trainer is rank 0)."""
    CATCH_UP = "catch_up"
    """The fleet's current version again, broadcast to the engines behind it only."""


BROADCASTS = (WeightKind.DISTRIBUTED, WeightKind.CATCH_UP)
"""Kinds whose tensors come from the trainer over a process group."""


class WeightStep(StrEnum):
    """One step of a weight update: what the coordinator's lock is at, what an agent reports."""

    DISK = "disk"
    """Agents load the checkpoint (``WeightsFromDisk``)."""
    BEGIN = "begin"
    """Agents confirm their engines for a broadcast group (``WeightsBegin``)."""
    GROUP = "group"
    """The group is chosen and the trainer answered; the last one formed is kept (no init)."""
    INIT = "init"
    """The group's engines join a new process group (``WeightsInitGroup``)."""
    BUCKET = "bucket"
    """A bucket of tensors is broadcast (``WeightsBucket``)."""
    FINISH = "finish"
    """Agents label, flush and check their engines (``WeightsFinish``)."""
    ABORT = "abort"
    """An agent's engines leave a failed update (``WeightsAbort``); the coordinator awaits no report of it."""
