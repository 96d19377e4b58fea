"""How a lease ends without a receipt, as an agent tells the coordinator: ``Release`` and ``EvalResult`` records.

Part of the protocol: ``common.protocol`` re-exports these. A lease given back unfinished names why with a
``ReleaseReason``; one whose group *failed* also carries a ``Failure`` (the step that failed and a bounded
detail), which the coordinator counts against the prompt and the rollout's health (coordinator/starvation.py).
An evaluation lease's scored group travels as an ``EvalOutcome`` (coordinator/evaluation.py).
"""

from __future__ import annotations

import enum

from common.wire import Record, record


class ReleaseReason(enum.StrEnum):
    """Why an agent gave leases back unfinished (``Release.reason``)."""

    PAUSED = "paused"
    """A pause aborted its generation, or came before it reached an engine."""
    STOPPED = "stopped"
    """The coordinator stopped it (``Stop``: over-sampling, the batch was full)."""
    SHUTDOWN = "shutdown"
    """The agent is stopping: leases still generating or just granted are given back."""
    NO_ENGINE = "no_engine"
    """Every engine of the agent is retired (its restart budget spent): it cannot run here."""
    FAILED = "failed"
    """Its group failed (``Release.failure`` says how): counted against the prompt."""
    NOT_COMMITTED = "not_committed"
    """Its group could not be committed (the agent's store is full): not the prompt's fault, not counted."""


class FailureKind(enum.StrEnum):
    """The step a group failed at. These are also the reasons a prompt that keeps failing is filtered with,
    so they are metric-name safe."""

    REWARD_ERROR = "reward_error"
    """Its reward raised (or returned a non-number)."""
    FILTER_ERROR = "filter_error"
    """Its filter raised (or returned a non-verdict)."""
    GENERATION_FAILED = "generation_failed"
    """Anything else (a prompt the engine rejects, a chat template that fails)."""
    GENERATE_ERROR = "generate_error"
    """Its custom generate function raised (or returned no trajectory)."""


FAILURE_KINDS = tuple(k.value for k in FailureKind)
"""Every ``FailureKind`` value, in declaration order."""

MAX_FAILURE_DETAIL = 300
"""Characters of a failure's detail (spec and exception) kept on the wire: a message, not a log."""


@record
class Failure(Record):
    """Why a group failed (``Release.failure``): the step and what it said."""

    kind: FailureKind
    """The step that failed."""
    detail: str = ""
    """At most ``MAX_FAILURE_DETAIL`` characters, whitespace folded (``Failure.of`` makes it so)."""

    @classmethod
    def of(cls, kind: FailureKind | str, detail: str) -> Failure:
        """A failure with ``detail`` folded onto one line and cut to ``MAX_FAILURE_DETAIL`` characters;
        ValueError for a kind that is not a ``FailureKind``."""
        try:
            kind = FailureKind(kind)
        except ValueError:
            raise ValueError(f"unknown failure kind {kind!r}; one of {FAILURE_KINDS}") from None
        detail = " ".join(str(detail).split())
        if len(detail) > MAX_FAILURE_DETAIL:
            detail = detail[: MAX_FAILURE_DETAIL - 3] + "..."
        return cls(kind, detail)

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


@record
class EvalOutcome(Record):
    """One evaluation prompt's scored group (``EvalResult.result``), one entry per sample."""

    rewards: list[float]
    """Each sample's reward."""
    lengths: list[int]
    """Response tokens of each sample."""
    truncated: int
    """Samples cut at the token limit."""
    versions: list[str]
    """The weight versions its samples were generated with, sorted."""

    def to_dict(self) -> dict:
        """As the ledger keeps an evaluation result (coordinator/evaluation.py)."""
        return {
            "rewards": list(self.rewards),
            "lengths": list(self.lengths),
            "truncated": self.truncated,
            "versions": list(self.versions),
        }
