"""Weight-update messages (docs/weights.md): trainer -> coordinator -> agents -> engines.

Part of the protocol: ``common.protocol`` imports and re-exports every one of them, so they are
registered (and versioned) with the rest. Import them from ``common.protocol``.
"""

from __future__ import annotations

from dataclasses import field

from common.wire import Message, Record, message, record


@record
class FleetWeights(Record):
    """The fleet's weights (``Welcome.weights``): what every engine must serve, and how the fleet got there.

    ``kind`` is ``disk`` (``path`` is the checkpoint every engine loaded, so an engine that restarts re-loads
    it), ``distributed`` (a broadcast: an engine that missed it needs an update to serve again) or ``""``
    (the launch weights, version 0)."""

    version: int = 0
    """The version every engine serves (0: the launch weights)."""
    kind: str = ""
    """How the fleet reached it: ``disk``, ``distributed`` or ``""``."""
    path: str = ""
    """The checkpoint of a ``disk`` update ("" otherwise)."""

    @classmethod
    def from_dict(cls, d: dict) -> FleetWeights:
        """From its map form (``{"version", "kind", "path"}``); KeyError/TypeError/ValueError for a malformed one."""
        return cls(int(d["version"]), str(d.get("kind") or ""), str(d.get("path") or ""))


@message
class UpdateWeights(Message):
    """trainer -> coordinator: begin a weight update to ``version`` (greater than the fleet's).

    ``kind`` is ``disk`` (every engine loads ``path``; answered when all serve ``version``),
    ``distributed`` (answered at once with the group to join: ``{"update_id", "world_size",
    "group_name", "init"}``; tensors follow as ``WeightBucket``s) or ``catch_up`` (the fleet's
    current ``version`` again, to the engines behind it only, in a group of their own; answered
    ``{"world_size": 0}`` at once when no engine is behind). ``timeout`` is the lock's deadline in
    seconds, restarted by every bucket.
    """

    TYPE = "update_weights"
    session: int
    req: int
    version: int
    kind: str
    path: str = ""
    master_address: str = ""
    master_port: int = 0
    backend: str = "gloo"
    timeout: float = 300.0


@message
class WeightBucket(Message):
    """trainer -> coordinator: the next bucket of a distributed update; the trainer broadcasts its
    tensors (in ``names`` order, ``src=0``) once this is answered."""

    TYPE = "weight_bucket"
    session: int
    req: int
    update_id: int
    seq: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list]


@message
class FinishWeights(Message):
    """trainer -> coordinator: every bucket was broadcast; answered when all engines serve the version."""

    TYPE = "finish_weights"
    session: int
    req: int
    update_id: int
    verify: dict = field(default_factory=dict)
    """A verified update: ``{"rows": k, "values": {name: the first k rows as floats}}`` of a few of
    the tensors sent; every engine must hold exactly those (``/get_weights_by_name``)."""


@message
class AbortWeights(Message):
    """trainer -> coordinator: the trainer's own side of update ``update_id`` failed (its broadcast
    raised, or the call was cancelled): abort it now instead of at its deadline. Answered ``Ok``."""

    TYPE = "abort_weights"
    session: int
    req: int
    update_id: int
    why: str = ""


@message
class WeightsAlive(Message):
    """trainer -> coordinator: the trainer holding the weight lock is alive (sent every heartbeat
    interval, at most 0.25 s apart, while a broadcast call runs). A lock whose trainer is silent past
    the TTL is aborted. Answered ``{"update_id": the lock's or 0, "failed": why or None}``, ``failed``
    saying that ``update_id`` (the update the trainer works on) was aborted: the trainer then closes
    its rendezvous, so nothing waits on a group that will never form."""

    TYPE = "weights_alive"
    session: int
    req: int
    update_id: int = 0


@message
class WeightsBegin(Message):
    """coordinator -> agent: a distributed update starts: pause health checks, confirm each engine
    (process alive, free of any earlier group, one bounded pause in mode ``abort``); the ``begin``
    report's ``members`` lists the confirmed engines, and the group is formed of those only."""

    TYPE = "weights_begin"
    update_id: int
    version: int
    catch_up: bool = False
    """Only engines behind ``version`` are confirmed (and paused); the others keep serving."""


@message
class WeightsFromDisk(Message):
    """coordinator -> agent: every serving engine loads ``path`` and then serves ``version``."""

    TYPE = "weights_from_disk"
    update_id: int
    version: int
    path: str


@message
class WeightsInitGroup(Message):
    """coordinator -> agent: each listed engine joins the trainer's group at its ``rank_offsets`` entry."""

    TYPE = "weights_init_group"
    update_id: int
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    rank_offsets: dict


@message
class WeightsBucket(Message):
    """coordinator -> agent: each engine of the group receives this bucket (``/update_weights_from_distributed``)."""

    TYPE = "weights_bucket"
    update_id: int
    seq: int
    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list]


@message
class WeightsFinish(Message):
    """coordinator -> agent: every bucket arrived: label engines ``version``, continue generation."""

    TYPE = "weights_finish"
    update_id: int
    version: int
    verify: dict = field(default_factory=dict)
    """``FinishWeights.verify``: checked on every engine of the group before it serves the version."""


@message
class WeightsAbort(Message):
    """coordinator -> agent: the update failed or its trainer is gone; engines that received part of it
    leave the pool until an update reaches them (or re-load the last disk checkpoint, ``path``)."""

    TYPE = "weights_abort"
    update_id: int
    version: int
    path: str = ""
    catch_up: bool = False
    """The update was a catch-up: only its own group goes; the fleet's group and serving engines stay."""


@message
class WeightsReport(Message):
    """agent -> coordinator: one step of an update is done on every engine of the agent, or failed.

    ``step`` is ``begin``, ``disk``, ``init``, ``bucket`` (with ``seq``), ``finish`` or ``abort``;
    ``engines`` maps engine name to the version it now reports; ``error`` names the engine;
    ``members`` (``begin`` only) names the engines confirmed for the broadcast group.
    """

    TYPE = "weights_report"
    session: int
    update_id: int
    step: str
    ok: bool
    seq: int = 0
    engines: dict = field(default_factory=dict)
    error: str = ""
    members: list[str] = field(default_factory=list)
