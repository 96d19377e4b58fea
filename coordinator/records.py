"""The coordinator's typed records and ledger operations (pure: no I/O).

Records:
    GroupRef        one committed group: ``(data_epoch, index, agent_id, key)``,
                    plus the payload address a trainer fetches it from. This
                    is the one field order used in memory, in the ledger and
                    on the wire (``BatchRefs``).
    Lease           one prompt leased to one agent while it generates it.
    PromptState     the ledger's record of a prompt that is READY, DELIVERED
                    or FILTERED (the frontier's durable states).
    RecordedBatch   a trainer batch as recorded: group refs, metrics, the
                    prompts of groups lost with a retired node, and the size
                    of a partial batch (made at a ``generate`` deadline).
    EvalRecord      an evaluation dataset's current pass: its id, the calls
                    that asked for it, and its metrics once done.
    WeightLog       the fleet's weights: current version, how it was reached,
                    updates pushed, and the lease-id boundary of each recent
                    update (so a lease's ``start`` is known after a restart).

Ledger operations (``PutPrompt``, ``DropPrompt``, ``PutBatch``, ``DropBatch``,
``SetCursors``, ``SetPaused``, ``SetMark``, ``CloseEpoch``, ``SetWeights``, and for evaluation
passes ``SetEvalPass``, ``PutEvalResult``, ``DropEvalResults``) are what a
``Persist`` effect carries. ``coordinator/ledger.py`` alone encodes them for
LMDB; ``LedgerSnapshot.apply`` folds them in memory with the same meaning, so
the ledger's reader, the core's restore and the tests share one definition.

Records are frozen: a recorded batch changes by replacement, so a batch
handed to a ``Persist`` can never change before the ledger writes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType

from common.protocol import TRAIN_SOURCE
from coordinator.frontier import DELIVERED, FILTERED, READY, STATE_NAMES

Prompt = tuple[int, int]
"""A prompt: ``(data_epoch, index)``."""

MARKS = ("trimmed_upto", "last_rollout_id", "consumed_upto", "last_checkpoint")
"""Rollout-id marks the ledger keeps (see ``LedgerSnapshot``)."""


@dataclass(frozen=True, slots=True)
class GroupRef:
    data_epoch: int
    index: int
    agent_id: str
    key: str
    payload_address: str = ""
    """Where a trainer fetches the payload; filled in when a batch is sent, never recorded."""
    lengths: tuple[int, ...] = ()
    """Each sample's tokens (prompt + response), from the agent's receipt: what ranks' shares are balanced by
    and what every rank counts micro-batches from (``coordinator/shares.py``). Recorded; () in old ledgers."""

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def prompt(self) -> Prompt:
        return (self.data_epoch, self.index)

    def to_wire(self) -> list:
        return [self.data_epoch, self.index, self.agent_id, self.key, self.payload_address]

    @classmethod
    def from_wire(cls, item: list) -> GroupRef:
        data_epoch, index, agent_id, key, address = item
        return cls(data_epoch, index, agent_id, key, address)


TRAIN = TRAIN_SOURCE
"""The training dataset's prompt source (``coordinator/sources.py``)."""


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    agent_id: str
    data_epoch: int
    index: int
    rollout_id: int
    """The rollout being collected when the prompt was leased."""
    start: int = 0
    """Weight updates pushed when it was granted (docs/weights.md, staleness)."""
    source: str = TRAIN
    """The prompt source it was leased from (``coordinator/sources.py``): ``TRAIN`` or ``eval/<name>``."""

    @property
    def prompt(self) -> Prompt:
        return (self.data_epoch, self.index)


@dataclass(frozen=True, slots=True)
class EvalRecord:
    """One evaluation dataset's current pass as recorded (``coordinator/evaluation.py``).

    ``tokens`` are the ``evaluate`` calls that asked for this pass (a resend, or a call after a
    restart, carries the same token and gets this pass); ``fingerprint`` the dataset file it ran
    on; ``metrics`` its result once ``done``."""

    name: str
    pass_id: int
    tokens: tuple[str, ...] = ()
    fingerprint: str = ""
    done: bool = False
    metrics: MappingProxyType = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))


@dataclass(frozen=True, slots=True)
class PromptState:
    """A prompt the ledger accounts for. ``status`` is READY, DELIVERED or FILTERED (frontier states)."""

    status: int
    agent_id: str
    key: str = ""
    """The accepted group (READY, DELIVERED)."""
    stats: dict = field(default_factory=dict)
    """The group's statistics, for the metrics of the batch it joins (READY)."""
    seq: int = 0
    """Acceptance order, so ready groups are batched first come first served after a restart (READY)."""
    rollout_id: int = -1
    """The batch it was delivered in (DELIVERED)."""
    reason: str = ""
    """Why the filter rejected it (FILTERED)."""
    start: int = 0
    """Weight updates pushed when its lease was granted (READY): batches take the oldest first."""

    def __post_init__(self):
        if self.status not in (READY, DELIVERED, FILTERED):
            raise ValueError(f"a ledger prompt is ready, delivered or filtered, not {self.status!r}")

    @property
    def ready(self) -> bool:
        return self.status == READY

    @property
    def delivered(self) -> bool:
        return self.status == DELIVERED

    @property
    def filtered(self) -> bool:
        return self.status == FILTERED

    @property
    def status_name(self) -> str:
        return STATE_NAMES[self.status]


@dataclass(frozen=True, slots=True)
class RecordedBatch:
    groups: tuple[GroupRef, ...]
    metrics: MappingProxyType
    lost: tuple[Prompt, ...] = ()
    """Prompts of groups lost with a retired node, decided on when a trainer asks again."""
    size: int = 0
    """Groups the batch holds when complete: a partial batch (a ``generate`` deadline) its own,
    recorded with it; 0 for a full one, i.e. ``rollout_batch_size`` (a repair fills to this)."""
    world: int = 0
    """Ranks of the sharded trainer its shares were made for (``coordinator/shares.py``); 0: none made."""
    ranks: tuple[int, ...] = ()
    """The rank of each group (aligned with ``groups``) when ``world`` is set."""
    taken: tuple[int, ...] = ()
    """Ranks that hold their share (sent ``consumed``); the batch is consumed once all ``world`` do."""
    lost_ranks: tuple[int, ...] = ()
    """Ranks whose groups were lost and not replaced yet: a repair's groups go to them, in order."""
    equal_groups: bool = False
    """Shares of equal group counts (``Attach.balance`` ``groups``), else of balanced tokens."""

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
        object.__setattr__(self, "lost", tuple(tuple(p) for p in self.lost))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "taken", tuple(sorted(set(self.taken))))
        object.__setattr__(self, "lost_ranks", tuple(self.lost_ranks))

    def share(self, rank: int) -> list[GroupRef]:
        """The groups of rank ``rank`` (every group when no shares were made)."""
        if not self.world:
            return list(self.groups)
        return [g for g, r in zip(self.groups, self.ranks, strict=True) if r == rank]


BOUNDARIES_KEPT = 256
"""Recent updates whose lease-id boundary the weight log keeps; a lease older than all of them
counts as granted just before the oldest kept one (its staleness is far past any bound anyway)."""


@dataclass(frozen=True, slots=True)
class WeightLog:
    """The fleet's weights as recorded (docs/weights.md): versions only move forward.

    ``boundaries`` holds, for each of the last ``BOUNDARIES_KEPT`` updates, the highest lease id
    granted before it completed (lease ids grow across restarts: ``generation << 32 | n``), so
    the updates pushed before lease ``L`` was granted are ``start_of(L)``.
    """

    version: int = 0
    updates: int = 0
    """Updates pushed so far (staleness is counted in these, not in version labels)."""
    kind: str = ""
    """``disk``, ``distributed``, or ``""`` for the launch weights."""
    path: str = ""
    """The checkpoint of a ``disk`` update."""
    boundaries: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "boundaries", tuple(self.boundaries)[-BOUNDARIES_KEPT:])

    def start_of(self, lease_id: int) -> int:
        """Updates pushed before ``lease_id`` was granted (admission stops while an update runs)."""
        before = sum(1 for b in self.boundaries if b < lease_id)
        return self.updates - len(self.boundaries) + before

    def entry(self) -> dict:
        """The Welcome config's ``weights`` entry: what every engine must serve."""
        return {"version": self.version, "kind": self.kind, "path": self.path}


# ---------------------------------------------------------------------- ledger operations


@dataclass(frozen=True, slots=True)
class PutPrompt:
    data_epoch: int
    index: int
    state: PromptState


@dataclass(frozen=True, slots=True)
class DropPrompt:
    data_epoch: int
    index: int


@dataclass(frozen=True, slots=True)
class PutBatch:
    rollout_id: int
    batch: RecordedBatch


@dataclass(frozen=True, slots=True)
class DropBatch:
    rollout_id: int


@dataclass(frozen=True, slots=True)
class SetCursors:
    cursors: MappingProxyType
    """``data_epoch -> cursor`` of every open epoch."""

    def __post_init__(self):
        object.__setattr__(self, "cursors", MappingProxyType(dict(self.cursors)))


@dataclass(frozen=True, slots=True)
class SetPaused:
    paused: bool


@dataclass(frozen=True, slots=True)
class SetMark:
    name: str
    rollout_id: int

    def __post_init__(self):
        if self.name not in MARKS:
            raise ValueError(f"unknown ledger mark {self.name!r}; one of {MARKS}")


@dataclass(frozen=True, slots=True)
class CloseEpoch:
    """Delete every prompt record of a closed data epoch."""

    data_epoch: int


@dataclass(frozen=True, slots=True)
class SetWeights:
    """Record the weight log (a completed update, or a higher version engines reported)."""

    log: WeightLog


@dataclass(frozen=True, slots=True)
class SetMixture:
    """Record the mixture's schedule (``client.set_mixture``): ``(from rollout id, weights)``, ascending."""

    schedule: tuple


@dataclass(frozen=True, slots=True)
class SetEvalPass:
    """Record an evaluation dataset's current pass (a new one, a token added, or its result)."""

    record: EvalRecord


@dataclass(frozen=True, slots=True)
class PutEvalResult:
    """One evaluation prompt's result in the current pass of ``name``."""

    name: str
    index: int
    result: dict


@dataclass(frozen=True, slots=True)
class DropEvalResults:
    """Delete every prompt result of ``name`` (a new pass starts)."""

    name: str


LedgerOp = (
    PutPrompt
    | DropPrompt
    | PutBatch
    | DropBatch
    | SetCursors
    | SetPaused
    | SetMark
    | CloseEpoch
    | SetWeights
    | SetMixture
    | SetEvalPass
    | PutEvalResult
    | DropEvalResults
)


@dataclass(slots=True)
class LedgerSnapshot:
    """Everything the ledger holds; what a restarted coordinator starts from.

    ``generation`` is bumped at every coordinator start; ``prompts`` holds the
    prompts of open epochs that are READY, DELIVERED or FILTERED; ``batches``
    the recorded batches a trainer may still ask for. Marks: ``trimmed_upto``
    (batches up to it were trimmed behind a checkpoint), ``last_rollout_id``,
    ``consumed_upto`` (highest batch a trainer fetched) and
    ``last_checkpoint``. ``paused`` is the trainer's pause; ``weights`` the weight log.
    """

    generation: int = 1
    dataset_size: int = -1
    dataset_fingerprint: str = ""
    cursors: dict[int, int] = field(default_factory=dict)
    prompts: dict[Prompt, PromptState] = field(default_factory=dict)
    batches: dict[int, RecordedBatch] = field(default_factory=dict)
    trimmed_upto: int = -1
    last_rollout_id: int = -1
    consumed_upto: int = -1
    last_checkpoint: int = -1
    paused: bool = False
    weights: WeightLog = field(default_factory=WeightLog)
    evals: dict[str, EvalRecord] = field(default_factory=dict)
    """Each evaluation dataset's current pass."""
    eval_results: dict[tuple[str, int], dict] = field(default_factory=dict)
    """``(name, index) -> result`` of the prompts the current passes have finished."""
    mixture: list[tuple[int, list[float]]] = field(default_factory=list)
    """``client.set_mixture``'s changes: ``(from rollout id, weights)``, ascending; empty: the configured weights."""
    changed: dict = field(default_factory=dict)
    """Batch settings this start changed (``--allow-config-change``): ``{field: [old, new]}``; not stored."""

    def eval_results_of(self, name: str) -> dict[int, dict]:
        """``index -> result`` of evaluation dataset ``name``'s current pass."""
        return {index: r for (n, index), r in self.eval_results.items() if n == name}

    def apply(self, ops: list[LedgerOp]) -> None:
        """Fold ``ops`` in, with the meaning ``Ledger.apply`` gives them on disk."""
        for op in ops:
            if isinstance(op, PutPrompt):
                self.prompts[(op.data_epoch, op.index)] = op.state
            elif isinstance(op, DropPrompt):
                self.prompts.pop((op.data_epoch, op.index), None)
            elif isinstance(op, PutBatch):
                self.batches[op.rollout_id] = op.batch
            elif isinstance(op, DropBatch):
                self.batches.pop(op.rollout_id, None)
            elif isinstance(op, SetCursors):
                self.cursors = dict(op.cursors)
            elif isinstance(op, SetPaused):
                self.paused = op.paused
            elif isinstance(op, SetMark):
                setattr(self, op.name, op.rollout_id)
            elif isinstance(op, CloseEpoch):
                for prompt in [p for p in self.prompts if p[0] == op.data_epoch]:
                    del self.prompts[prompt]
            elif isinstance(op, SetWeights):
                self.weights = op.log
            elif isinstance(op, SetEvalPass):
                self.evals[op.record.name] = op.record
            elif isinstance(op, PutEvalResult):
                self.eval_results[(op.name, op.index)] = dict(op.result)
            elif isinstance(op, DropEvalResults):
                for key in [k for k in self.eval_results if k[0] == op.name]:
                    del self.eval_results[key]
            else:
                raise TypeError(f"not a ledger operation: {op!r}")


# ---------------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True)
class AgentStats:
    status: str
    """``alive``, ``dead`` (its leases were reissued) or ``retired`` (its payloads are gone)."""
    capacity: int
    """Groups it may generate at once."""
    leases: int
    """Leases it holds now."""
    engines: tuple[dict, ...]
    """Its engines as it last reported them."""
    session: int
    """Its fencing session: a new value each time it registers (0 when known only from the ledger)."""
    silent_s: float = 0.0
    """Seconds since the coordinator last heard from it (any message counts)."""


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A read-only view of the coordinator at one moment (``coordinator status``, ``client.stats()``).

    Serialised with ``to_dict`` (what ``dataclasses.asdict`` gives); its keys are the JSON keys.
    """

    agents: dict[str, AgentStats]
    leased: int
    """Leases in flight."""
    ready: int
    """Groups committed on agents and waiting for a batch."""
    pending_generates: int
    batches_in_repair: tuple[int, ...]
    prefetch: int
    paused: bool
    starved: str | None
    """Why the rollout is starved (every recent group failed; admission stopped until the next
    ``generate``), e.g. ``every group of the last 64 failed: reward_error: ...``; None if it is not."""
    trainer: str | None
    """The attached trainer's client id."""
    prompts: dict[str, int]
    """Prompts of the open epochs by state (pending, leased, ready, delivered, filtered)."""
    data_epochs: tuple[int, ...]
    """The open data epochs."""
    last_rollout_id: int
    trimmed_upto: int
    consumed_upto: int
    filtered_total: int
    fenced_messages: dict[str, int]
    """Agent messages refused (answered with ``Fence``) for a dead or superseded session, by type."""
    weights: dict = field(default_factory=dict)
    """``{"version", "updates", "kind", "path", "lock": {...} | None, "engines": {"agent/engine": version}}``
    (docs/weights.md, Status)."""
    evaluations: dict = field(default_factory=dict)
    """Each evaluation dataset: ``{"running": True, "pass", "prompts", "finished", "leased", "waiting"}`` while a
    pass runs, else ``{"running": False, "prompts", "last": metrics of the last pass}``."""
    sources: dict = field(default_factory=dict)
    """Each training dataset (``default`` for a plain ``--dataset PATH``): ``{"weight", "prompts": by state,
    "data_epochs", "filtered"}``; the weight is the mixture's for the next batch (``set_mixture``)."""
    held: int = 0
    """Leases held for agents presumed dead (silent past the TTL, not retired): not in ``leased``, their
    prompts leased to no one else (coordinator/admission.py)."""
    receipts: dict = field(default_factory=dict)
    """``{"accepted", "refused"}``: receipts of committed groups since the start; ``refused`` counts groups
    refused as duplicates of a prompt already accounted for (wasted work)."""
    gateways: list = field(default_factory=list)
    """Each gateway of ``coordinator serve --gateways`` (empty without): ``{"gateway", "pid", "up",
    "incarnation", "restarts", "peers", "messages_in", "messages_out", "batches_in", "batches_out", "bytes_in",
    "bytes_out", "send_failures"}``; ``peers``: those heard from in the last 5 s (coordinator/gateways.py)."""
    waiting_for_update: str | None = None
    """Why the next batch cannot be completed before a weight update is pushed (``--max-staleness``: its rollout
    id is past the last the bound admits groups for), e.g. ``rollout 2 waits for 1 more weight update(s): ...``;
    None if it can. Its ``generate`` waits meanwhile (coordinator/staleness.py)."""

    def to_dict(self) -> dict:
        """``dataclasses.asdict(self)`` with the agents built directly: asdict copies every value it walks,
        12 ms per 1,000 agents, the event loop held meanwhile (``coordinator status`` on a large fleet)."""
        out = asdict(replace(self, agents={}))
        out["agents"] = {name: {k: getattr(a, k) for k in _AGENT_FIELDS} for name, a in self.agents.items()}
        return out


_AGENT_FIELDS = tuple(f.name for f in fields(AgentStats))
