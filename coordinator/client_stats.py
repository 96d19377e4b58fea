"""``stats()`` for a trainer: the coordinator's statistics decoded into ``FleetStats``.

The coordinator answers ``Stats`` with the dict ``coordinator status --json`` prints (``CoordinatorStats.to_dict()``,
coordinator/records.py); a replay (``coordinator replay``) answers with fewer keys. ``FleetStats.from_wire`` reads
what a trainer acts on into typed sub-records (the weights and their lock, the batches, the prompts by state, the
agents, the training datasets, the evaluations) and keeps the whole answer as ``raw`` (``to_dict()``), the rest
(gateways, a replay's ``replay``) included. A key missing from the answer reads as its zero, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.client_results import EvalMetrics, WireRecord


@dataclass(frozen=True, slots=True)
class WeightLock:
    """The weight update running now (``FleetStats.weights.lock``): it holds the fleet's weight lock."""

    holder: str | None
    """The trainer's client id."""
    kind: str
    """``"disk"``, ``"distributed"`` or ``"catch_up"``."""
    update_id: int
    """The coordinator's id of the update (``WeightUpdateResult.update_id`` once it is done)."""
    step: str
    """Where the update is (docs/weights.md): ``"begin"``, ``"group"``, ``"init"``, ``"bucket"``, ``"finish"``."""
    deadline_in_s: float
    """Seconds left before the coordinator aborts it."""

    @classmethod
    def from_wire(cls, raw: dict | None) -> WeightLock | None:
        if not raw:
            return None
        return cls(
            raw.get("holder"),
            str(raw.get("kind", "")),
            int(raw.get("update_id", 0)),
            str(raw.get("step", "")),
            float(raw.get("deadline_in_s", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class WeightStats:
    """The fleet's weights (``FleetStats.weights``; docs/weights.md, Status)."""

    version: int
    """The last update recorded (``weight_version()``)."""
    updates: int
    """Updates recorded since the start."""
    kind: str
    """The last update's: ``"disk"`` or ``"distributed"`` ("" before any)."""
    path: str
    """The last disk update's checkpoint ("" otherwise)."""
    lock: WeightLock | None
    """The update running now; None when none is."""
    engines: dict[str, int | None]
    """``"agent/engine"`` -> the version it serves, for every engine of the weight group's members."""
    behind: tuple[str, ...]
    """Engines up but out of the pool until an update or a ``catch_up`` reaches them (``"agent/engine"``)."""

    @classmethod
    def from_wire(cls, raw: dict) -> WeightStats:
        return cls(
            int(raw.get("version", 0)),
            int(raw.get("updates", 0)),
            str(raw.get("kind", "")),
            str(raw.get("path", "")),
            WeightLock.from_wire(raw.get("lock")),
            dict(raw.get("engines") or {}),
            tuple(raw.get("behind") or ()),
        )


@dataclass(frozen=True, slots=True)
class BatchStats:
    """Where the batches are (``FleetStats.batches``)."""

    last_rollout_id: int
    """The last batch recorded (-1: none yet)."""
    consumed_upto: int
    """Every batch up to this one was fetched by the trainer (all its ranks)."""
    trimmed_upto: int
    """Batches up to this one are behind the last two checkpoints, and trimmed."""
    pending_generates: int
    """``generate`` calls waiting for their batch."""
    in_repair: tuple[int, ...]
    """Batches being completed with replacements for groups lost with their node."""
    ready: int
    """Groups committed on agents and waiting for a batch."""
    prefetch: int
    """Ready groups kept beyond demand (``--prefetch``, or ``generate(..., prefetch=N)``'s)."""


@dataclass(frozen=True, slots=True)
class PromptCounts:
    """Prompts of the open data epochs by state (``FleetStats.prompts``, ``SourceStats.prompts``)."""

    pending: int = 0
    """Not leased yet."""
    leased: int = 0
    """Being generated."""
    ready: int = 0
    """Generated and committed on an agent, waiting for a batch."""
    delivered: int = 0
    """In a batch."""
    filtered: int = 0
    """Dropped by the filter (or failed for good)."""

    @classmethod
    def from_wire(cls, raw: dict | None) -> PromptCounts:
        raw = raw or {}
        return cls(*(int(raw.get(name, 0)) for name in ("pending", "leased", "ready", "delivered", "filtered")))


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """One agent as the coordinator sees it (``FleetStats.agents[agent_id]``)."""

    status: str
    """``"alive"``, ``"dead"`` (silent past the TTL) or ``"retired"``."""
    capacity: int
    """Samples it may generate at once now (0 while its engines are down, stale or updating)."""
    leases: int
    """Leases it holds now."""
    engines: tuple[dict, ...]
    """Its engines as it last reported them (``name``, ``state``, ``version``, ``in_flight``, ...)."""
    session: int
    """Its fencing session: a new value each time it registers."""
    silent_s: float
    """Seconds since the coordinator last heard from it."""

    @classmethod
    def from_wire(cls, raw: dict) -> AgentInfo:
        return cls(
            str(raw.get("status", "")),
            int(raw.get("capacity", 0)),
            int(raw.get("leases", 0)),
            tuple(raw.get("engines") or ()),
            int(raw.get("session", 0)),
            float(raw.get("silent_s", 0.0)),
        )


@dataclass(frozen=True, slots=True)
class SourceStats:
    """One training dataset (``FleetStats.sources[name]``; ``default`` for a plain ``--dataset PATH``)."""

    weight: float
    """The mixture's weight for the next batch not generated yet (``set_mixture``)."""
    prompts: PromptCounts
    """Its prompts of the open data epochs by state."""
    data_epochs: tuple[int, ...]
    """Its open data epochs."""
    filtered: int
    """Its prompts the filter dropped, since the start."""

    @classmethod
    def from_wire(cls, raw: dict) -> SourceStats:
        return cls(
            float(raw.get("weight", 0.0)),
            PromptCounts.from_wire(raw.get("prompts")),
            tuple(raw.get("data_epochs") or ()),
            int(raw.get("filtered", 0)),
        )


@dataclass(frozen=True, slots=True)
class EvalProgress:
    """One evaluation dataset (``FleetStats.evaluations[name]``): its running pass, or its last one."""

    running: bool
    """A pass runs now."""
    prompts: int
    """The dataset's prompts."""
    pass_id: int | None = None
    """The running pass (None when none runs)."""
    finished: int = 0
    """Prompts of the running pass counted so far."""
    leased: int = 0
    """Prompts of the running pass in flight."""
    waiting: int = 0
    """``evaluate`` calls waiting for the running pass."""
    last: EvalMetrics | None = None
    """The last finished pass's metrics, when no pass runs (None before the first)."""

    @classmethod
    def from_wire(cls, raw: dict) -> EvalProgress:
        if raw.get("running"):
            return cls(True, int(raw.get("prompts", 0)), int(raw.get("pass", 0)), int(raw.get("finished", 0)),
                       int(raw.get("leased", 0)), int(raw.get("waiting", 0)))  # fmt: skip
        last = raw.get("last")
        return cls(False, int(raw.get("prompts", 0)), last=EvalMetrics.from_wire(last) if last else None)


@dataclass(frozen=True, slots=True)
class FleetStats(WireRecord):
    """``stats()``: the coordinator's view of the fleet at one moment, decoded (coordinator/client_stats.py).
    ``raw`` (``to_dict()``) is the whole answer, as ``coordinator status --json`` prints it."""

    paused: bool
    """Admission is paused (``pause()``; until ``resume()`` or a ``generate`` of a batch not generated yet)."""
    starved: str | None
    """Why the rollout is starved (every recent group failed), e.g. ``every group of the last 64 failed: ...``;
    None if it is not."""
    waiting_for_update: str | None
    """Why the next batch waits for a weight update (``--max-staleness``); None if it does not."""
    trainer: str | None
    """The attached trainer's client id (None: no trainer attached)."""
    leased: int
    """Leases in flight."""
    held: int
    """Leases held for agents presumed dead (not in ``leased``)."""
    weights: WeightStats
    """The fleet's weight version, the update running, each engine's version, the engines behind."""
    batches: BatchStats
    """The last batch recorded, consumed and trimmed; waiting ``generate`` calls; ready groups."""
    prompts: PromptCounts
    """The open data epochs' prompts by state, over every training dataset."""
    data_epochs: tuple[int, ...]
    """The open data epochs."""
    filtered_total: int
    """Prompts the filter dropped since the start."""
    agents: dict[str, AgentInfo]
    """Every agent the coordinator knows, by id (retired ones too)."""
    sources: dict[str, SourceStats]
    """Each training dataset."""
    evaluations: dict[str, EvalProgress]
    """Each evaluation dataset."""
    receipts: dict[str, int]
    """``accepted``, ``refused`` (duplicates of a prompt already accounted for): receipts since the start."""
    fenced_messages: dict[str, int]
    """Agent messages refused for a dead or superseded session, by type."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @classmethod
    def from_wire(cls, raw: dict) -> FleetStats:
        return cls(
            paused=bool(raw.get("paused", False)),
            starved=raw.get("starved"),
            waiting_for_update=raw.get("waiting_for_update"),
            trainer=raw.get("trainer"),
            leased=int(raw.get("leased", 0)),
            held=int(raw.get("held", 0)),
            weights=WeightStats.from_wire(raw.get("weights") or {}),
            batches=BatchStats(
                int(raw.get("last_rollout_id", -1)),
                int(raw.get("consumed_upto", -1)),
                int(raw.get("trimmed_upto", -1)),
                int(raw.get("pending_generates", 0)),
                tuple(raw.get("batches_in_repair") or ()),
                int(raw.get("ready", 0)),
                int(raw.get("prefetch", 0)),
            ),
            prompts=PromptCounts.from_wire(raw.get("prompts")),
            data_epochs=tuple(raw.get("data_epochs") or ()),
            filtered_total=int(raw.get("filtered_total", 0)),
            agents={name: AgentInfo.from_wire(a) for name, a in (raw.get("agents") or {}).items()},
            sources={name: SourceStats.from_wire(s) for name, s in (raw.get("sources") or {}).items()},
            evaluations={name: EvalProgress.from_wire(e) for name, e in (raw.get("evaluations") or {}).items()},
            receipts=dict(raw.get("receipts") or {}),
            fenced_messages=dict(raw.get("fenced_messages") or {}),
            raw=raw,
        )
