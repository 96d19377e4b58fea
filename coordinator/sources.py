"""Prompt sources: what the lease book (``coordinator/lease_book.py``) leases to agents.

The lease book keeps one table of leases in flight, whatever source they came from, and one
grant loop (``LeaseBook.grant``). A source supplies the prompts and decides what each outcome of
its leases means; a lease names its source (``Lease.source``), and the lease book hands every
outcome to that source: a prompt given back, a group filtered, a group failed, a group committed
where none was asked for, an evaluation result. Two kinds exist today:

- **The training datasets** (``TrainingSource``, key ``TRAIN``): one, or several mixed by weight
  (``--dataset NAME=PATH,weight=W``, common/mixture.py), each with its own data-epoch frontier
  (``coordinator/mix_frontier.py``), exactly once per ``(dataset, data_epoch, index)``; a batch holds
  each dataset's share (``coordinator/batches.py``), and leases go where a share lacks. Its leases are
  *bounded*: they count in the training bound (``leased + ready <= demand + prefetch``), in bounded
  staleness and in over-sampling, and an agent presumed dead keeps them (``LeaseBook.held``). Its
  groups are committed, filtered or failed toward the trainer's batches; it keeps the filter verdicts
  since the last batch (``drops``, that batch's metrics) and the starvation record
  (``coordinator/starvation.py``).
- **An evaluation dataset** (``coordinator/evaluation.py``'s ``EvalSource``, key ``eval/<name>``):
  prompts of the running pass, leased only while a trainer waits on it; not bounded (released at
  once when the agent goes silent); a prompt ends with a result (``EvalResult``), never a group.

Every method is pure (events in, effects out), as in the rest of the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from common import protocol as p
from common.config import RolloutConfig
from common.metrics import DropStats
from common.mixture import DEFAULT, SourceSpec, shares
from coordinator.effects import Persist
from coordinator.frontier import FILTERED, LEASED, PENDING
from coordinator.prompt_key import dataset_of
from coordinator.records import TRAIN, DropPrompt, Lease, LedgerSnapshot, Prompt, PromptState, PutPrompt, SetMixture

if TYPE_CHECKING:
    from coordinator.counters import CoreCounters
    from coordinator.membership import AgentRecord
    from coordinator.mix_frontier import MixFrontier
    from coordinator.starvation import Starvation

__all__ = ["MAX_FAILURES", "TRAIN", "HeldPrompts", "PromptSource", "TrainingSource", "mixture_schedule"]

MAX_FAILURES = 3
"""Failed attempts after which a prompt is filtered with its failure kind as the reason
(``reward_error``, ``filter_error``, ``generation_failed``), unless the rollout starves first."""


class PromptSource(Protocol):
    key: str
    """The name leases carry (``Lease.source``), unique in the lease book."""
    bounded: bool
    """Its leases count in the training bound, staleness and over-sampling, and are kept for a silent agent."""

    def take(self, now: float) -> tuple[int, int] | None:
        """The next prompt to lease, ``(data_epoch, index)``, marked leased; None when it has none now."""

    def grant_fields(self, lease: Lease) -> dict:
        """``protocol.LeaseGrant`` fields of ``lease`` beside its id, prompt, rollout id and source."""

    def with_rows(self, rec: AgentRecord) -> bool:
        """Whether the shell adds the prompts' rows to the agent's ``Grant``."""

    def note_lease(self, lease: Lease, delta: int) -> None:
        """``lease`` entered (``delta`` 1) or left (-1) the lease book's table of leases in flight."""

    def give_back(self, lease: Lease) -> None:
        """``lease`` ended without an outcome (released, lost, reassigned): its prompt is pending again, first."""

    def committed(self, lease: Lease) -> None:
        """A receipt came for ``lease`` (its group committed); the lease book has ended the lease."""

    def filtered(self, lease: Lease, agent_id: str, reason: str) -> list:
        """The agent's filter dropped ``lease``'s group; the lease is ended."""

    def failed(self, lease: Lease, agent_id: str, kind: str, detail: str) -> list:
        """``lease``'s group failed (``kind``: reward_error, filter_error, generation_failed); the lease is ended."""

    def result(self, lease: Lease, msg: p.EvalResult) -> list:
        """An evaluation result came for ``lease``; the lease is ended."""


class HeldPrompts(Protocol):
    """What the training source asks of the lease book: the prompts held for agents presumed dead."""

    held: dict[int, Lease]

    def take_held(self, dataset: int = 0) -> Prompt | None:
        """The oldest prompt of ``dataset`` held for a silent agent, no longer held; None if there is none."""


class TrainingSource:
    """The training datasets' prompts (module docstring): one, or a mixture (common/mixture.py) whose
    datasets each run through their own epochs of the mix frontier (coordinator/mix_frontier.py).
    Leases go to the dataset that most lacks groups for the waiting batches (``plan``). Its outcome
    rules: a filtered group's prompt is FILTERED; a failed one's is retried, and filtered with its
    failure kind after ``MAX_FAILURES`` attempts, unless every recent group failed (its starvation
    record: coordinator/starvation.py): then the prompts filtered during the streak are pending again
    and no prompt is leased until the next ``generate``."""

    key = TRAIN
    bounded = True

    def __init__(
        self,
        config: RolloutConfig,
        frontier: MixFrontier,
        held: HeldPrompts,
        starvation: Starvation,
        counters: CoreCounters,
        schedule: list[tuple[int, list[float]]],
    ):
        """``frontier``: the mixture's, whose prompts it leases; ``held``: the lease book's prompts held for silent
        agents; ``starvation``: its record of failed groups (it owns it; batches and the trainer read it)."""
        self.datasets = [SourceSpec.from_dict(d) for d in config.mixture] or [SourceSpec(DEFAULT)]
        """The training datasets (common/mixture.py), in order: a dataset's number is its place here."""
        self.names = [spec.name for spec in self.datasets]
        self.mixed = bool(config.mixture)
        """Named datasets (``--dataset NAME=PATH,...``): grants name theirs and carry rows; batches get per-dataset
        metrics."""
        self.batch_size = config.rollout_batch_size
        self.frontier = frontier
        self.starvation = starvation
        self._held = held
        self._counters = counters
        self.schedule = schedule
        """``[(from rollout id, weights)]``, ascending: the mixture in force from each rollout id on."""
        n = len(self.datasets)
        self.in_flight = [0] * n
        """Leases in the lease book by dataset (held ones not counted)."""
        self.failures: dict[Prompt, int] = {}
        """Prompts whose groups failed, by count (filtered at ``MAX_FAILURES``)."""
        self.filtered_count = [0] * n
        """Prompts filtered by dataset (the dynamic filter's drops and repeated failures), since the start."""
        self.drops = DropStats()
        """Filter verdicts since the last batch was assembled (its ``rollout/dynamic_filter/*`` metrics)."""
        self.dataset_drops = [0] * n
        """Filter drops since the last batch was assembled, by dataset."""
        self._wanted: list[int] = [0] * n
        """What ``take`` may still lease per dataset in this pump (``plan``)."""
        self._fields = [self._spec_fields(spec) for spec in self.datasets]

    @property
    def filtered_total(self) -> int:
        """Prompts filtered, all datasets."""
        return sum(self.filtered_count)

    def _spec_fields(self, spec: SourceSpec) -> dict:
        fields: dict = {}
        if self.mixed:
            fields["dataset"] = spec.name
        if spec.n_samples is not None:
            fields["n_samples"] = spec.n_samples
        if spec.sampling():
            fields["sampling"] = spec.sampling()
        if spec.reward is not None:
            fields["reward"] = spec.reward
        if spec.filter is not None:
            fields["filter"] = spec.filter
        return fields

    def weights_at(self, rollout_id: int) -> list[float]:
        weights = self.schedule[0][1]
        for start, w in self.schedule:
            if start <= rollout_id:
                weights = w
        return weights

    def shares(self, rollout_id: int, total: int | None = None) -> list[int]:
        """Groups of each dataset in batch ``rollout_id`` (of ``total`` groups; default a full batch)."""
        size = self.batch_size if total is None else total
        if not self.mixed:
            return [size]
        return shares(self.weights_at(rollout_id), size)

    def allowance(self, first: int, last: int) -> list[int]:
        """Groups of each dataset that full batches ``first..last`` hold together (zeros when ``last < first``).

        Under ``--max-staleness`` it is what each dataset may have leased or ready (coordinator/staleness.py,
        rule 1 by shares): batches up to ``last`` are all the bound admits groups for. O(mixture changes)."""
        out = [0] * len(self.datasets)
        size = self.batch_size
        for i, (start, weights) in enumerate(self.schedule):
            lo = first if i == 0 else max(first, start)  # the first weights also hold before their rollout id
            hi = last if i + 1 == len(self.schedule) else min(last, self.schedule[i + 1][0] - 1)
            if lo <= hi:
                for s, n in enumerate(shares(weights, size) if self.mixed else [size]):
                    out[s] += n * (hi - lo + 1)
        return out

    def plan(self, wanted: list[int], ready: list[int]) -> int:
        """Set what each dataset may lease now: ``wanted`` groups in flight or ready, less what it has. Returns
        the total. A dataset with more ready than wanted does not hold another's leases back."""
        self._wanted = [max(0, w - self.in_flight[s] - ready[s]) for s, w in enumerate(wanted)]
        return sum(self._wanted)

    def limit(self, allowance: list[int], ready: list[int]) -> int:
        """Lower the plan so that no dataset has more than ``allowance`` in flight or ready (bounded staleness: rule
        1 by shares). Returns the new total."""
        have = [n + r for n, r in zip(self.in_flight, ready, strict=True)]
        self._wanted = [min(n, max(0, a - h)) for n, a, h in zip(self._wanted, allowance, have, strict=True)]
        return sum(self._wanted)

    def note_lease(self, lease: Lease, delta: int) -> None:
        self.in_flight[dataset_of(lease.data_epoch)] += delta

    def take(self, now: float) -> tuple[int, int] | None:
        # The dataset that lacks most first (ties: the earlier); none past its plan.
        wanted = self._wanted
        order = sorted(range(len(wanted)), key=lambda d: (-wanted[d], d)) if self.mixed else [0]
        for d in order:
            if wanted[d] <= 0:
                break
            taken = self._take_from(d, now)
            if taken is not None:
                wanted[d] -= 1
                return taken
        return None

    def _take_from(self, dataset: int, now: float) -> tuple[int, int] | None:
        # A prompt held for a silent agent goes to another only once the open epochs have nothing
        # else pending, before a new epoch opens.
        frontier, held = self.frontier, self._held
        taken = frontier.take(now, not held.held, dataset)
        return taken or held.take_held(dataset) or frontier.take(now, True, dataset)

    def grant_fields(self, lease: Lease) -> dict:
        return self._fields[dataset_of(lease.data_epoch)]

    def with_rows(self, rec: AgentRecord) -> bool:
        return self.mixed or not rec.local_dataset

    def give_back(self, lease: Lease) -> None:
        self.frontier.release(lease.data_epoch, lease.index)

    def committed(self, lease: Lease) -> None:
        pass  # the receipt is accepted or refused on its own prompt (``Admission._accept``)

    def filtered(self, lease: Lease, agent_id: str, reason: str) -> list:
        out = self.filter_prompt(lease.prompt, agent_id, reason)
        if out:  # a streak of them starves the rollout (coordinator/starvation.py), naming the datasets
            self.starvation.dropped(self._named(lease.prompt, reason))
        return out

    def _named(self, prompt: Prompt, text: str) -> str:
        """``text`` prefixed with ``prompt``'s dataset in a mixture (a starved rollout names the dataset)."""
        return f"dataset {self.names[dataset_of(prompt[0])]}: {text}" if self.mixed else text

    def failed(self, lease: Lease, agent_id: str, kind: str, detail: str) -> list:
        return self.prompt_failed(lease.prompt, agent_id, kind, detail)

    def filter_prompt(self, prompt: Prompt, agent_id: str, reason: str) -> list:
        """The training prompt ``prompt`` is filtered (``reason``), unless it is accounted for already."""
        if self.frontier.state_of(*prompt) not in (PENDING, LEASED):
            return []
        self.frontier.set(*prompt, FILTERED)
        dataset = dataset_of(prompt[0])
        self.drops.record_dropped(reason)
        self.dataset_drops[dataset] += 1
        self.filtered_count[dataset] += 1
        self._counters.dropped(reason)
        self.failures.pop(prompt, None)
        return [Persist([PutPrompt(*prompt, PromptState(FILTERED, agent_id, reason=reason))], [])]

    def note_kept(self) -> None:
        """A group was accepted (ready for a batch): a kept verdict in the next batch's filter metrics."""
        self.drops.record_kept()

    def take_drops(self) -> tuple[DropStats, list[int]]:
        """The filter verdicts since the last batch (all of them, and drops by dataset), for the batch assembled
        now; counting starts over."""
        taken = self.drops, self.dataset_drops
        self.drops, self.dataset_drops = DropStats(), [0] * len(self.datasets)
        return taken

    def _take_back_drop(self, reason: str, prompt: Prompt) -> None:
        """A filter drop counted since the last batch was undone: its prompt is pending again."""
        dataset = dataset_of(prompt[0])
        self.dataset_drops[dataset] = max(0, self.dataset_drops[dataset] - 1)
        n = self.drops.dropped.get(reason, 0)
        if n > 1:
            self.drops.dropped[reason] = n - 1
        elif n == 1:
            del self.drops.dropped[reason]

    def prompt_failed(self, prompt: Prompt, agent_id: str, kind: str, detail: str) -> list:
        """A group of ``prompt`` failed (``kind``: reward_error, filter_error, generation_failed)."""
        starvation, frontier = self.starvation, self.frontier
        if starvation.starved:
            frontier.release(*prompt)  # a lease granted before: no attempt counted, nothing burned
            return []
        # A prompt that keeps failing (a reward that raises on its label, a prompt
        # too long for the engine) is filtered, not retried forever...
        out: list = []
        self.failures[prompt] = self.failures.get(prompt, 0) + 1
        if self.failures[prompt] >= MAX_FAILURES:
            out += self.filter_prompt(prompt, agent_id, kind)
            starvation.filtered(prompt, kind)
        else:
            frontier.release(*prompt)
        fresh = starvation.error(prompt, kind, self._named(prompt, detail))
        if fresh is None:
            return out
        # ...unless every group fails: then the failures are not the prompts' own.
        ops: list = []
        for failed in fresh.failed:
            self.failures.pop(failed, None)
        for (epoch, index), reason in fresh.filtered:
            if frontier.is_open(epoch) and frontier.state_of(epoch, index) == FILTERED:
                frontier.reopen(epoch, index)
                ops.append(DropPrompt(epoch, index))
                self.filtered_count[dataset_of(epoch)] -= 1
                self._take_back_drop(reason, (epoch, index))
        return out + [Persist(ops, [])]

    def result(self, lease: Lease, msg: p.EvalResult) -> list:
        self.give_back(lease)  # an evaluation result for a training lease (a broken agent): generated again
        return []


def mixture_schedule(
    datasets: list[SourceSpec], restored: LedgerSnapshot, last_rollout_id: int
) -> tuple[list[tuple[int, list[float]]], list]:
    """The mixture's schedule at a start, ``[(from rollout id, weights)]``, and the ledger operations the start
    must write first. The ledger's schedule, if it has one; else the configured weights from rollout 0 (of a
    ledger written before schedules were: the last start's weights). Weights changed on the command line at
    this start (``--allow-config-change``) hold from the batch after ``last_rollout_id`` on."""
    configured = [spec.weight for spec in datasets]
    schedule = list(restored.mixture) or [(0, configured)]
    old = restored.changed.get("mixture", [None])[0]
    if old and len(old) == len(configured) and not restored.mixture:  # batches so far: the last start's weights
        schedule[:] = [(0, [float(d.get("weight", 1.0)) for d in old])]
    ops: list = []
    if schedule[-1][1] != configured and "mixture" in restored.changed:
        schedule.append((last_rollout_id + 1, configured))
        ops.append(SetMixture(tuple(schedule)))
    return schedule, ops
