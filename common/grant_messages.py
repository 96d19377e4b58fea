"""Lease grants (coordinator -> agent): ``Grant`` and its typed ``LeaseGrant`` records.

Part of the protocol: ``common.protocol`` imports and re-exports them, so they are registered (and
versioned) with the rest. Import them from ``common.protocol``.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from common.wire import Message, Record, message, record

TRAIN_SOURCE = "train"
"""``LeaseGrant.source`` of a training prompt."""
EVAL_SOURCE = "eval/"
"""``LeaseGrant.source`` of an evaluation prompt: ``eval/<dataset name>``."""


@record
class LeaseGrant(Record):
    """One lease of a ``Grant``: the prompt, where it comes from and how to generate it."""

    lease: int
    data_epoch: int
    index: int
    rollout_id: int
    """The rollout being collected when it was granted (the group's ``rollout_id``)."""
    source: str = TRAIN_SOURCE
    """Its prompt source (coordinator/sources.py): ``train``, or ``eval/<name>`` for an evaluation dataset."""
    eval_pass: int = 0
    """An evaluation lease's pass."""
    n_samples: int = 0
    """Samples of its group; 0: the fleet's ``n_samples_per_prompt``."""
    sampling: dict = field(default_factory=dict)
    """Sampling settings over the fleet's (an evaluation dataset's or a training source's own)."""
    dataset: str = ""
    """The training source's name in a mixture (common/mixture.py); "": the one dataset, ``default``."""
    reward: str = ""
    """The training source's own reward spec; "": the fleet's."""
    filter: str = ""
    """The training source's own dynamic filter spec; "": the fleet's."""
    prompt: Any = None
    """The dataset row (added by the coordinator's shell unless the agent reads its own copy)."""
    label: Any = None
    metadata: dict = field(default_factory=dict)

    @property
    def eval(self) -> str:
        """The evaluation dataset's name; "" for a training lease."""
        return self.source[len(EVAL_SOURCE) :] if self.source.startswith(EVAL_SOURCE) else ""


@message
class Grant(Message):
    """coordinator -> agent: new leases (``LeaseGrant``), rows added unless the agent has the dataset."""

    TYPE = "grant"
    session: int
    leases: list[LeaseGrant]
