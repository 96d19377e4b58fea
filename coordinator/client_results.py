"""What the trainer API's calls return: frozen records decoded from the coordinator's answers.

Each record is decoded once, on the client's side, from the answer's result (``from_wire``), which it keeps as
``raw`` (``to_dict()`` returns a copy: JSON-ready, e.g. for a logger). The wire is unchanged; a key the client
does not know yet stays in ``raw``.

=================================  =======================================================================
call                               returns
=================================  =======================================================================
``pause``                          ``PauseResult(leased)``
``resume``                         ``ResumeResult()``
``set_mixture``                    ``MixtureResult(from_rollout_id, weights)``
``evaluate``                       ``EvalMetrics(name, pass_id, prompts, samples, ..., pass_at, ...)``
``update_weights``, ``catch_up``,  ``WeightUpdateResult(update_id, version, engines, retried)``
``update_weights_from_disk``
``state_dict``                     ``RolloutState``: the checkpoint payload, a plain dict (a ``TypedDict``)
``stats``                          ``FleetStats`` (coordinator/client_stats.py)
=================================  =======================================================================

``state_dict`` alone stays a dict: it is saved into the trainer's checkpoint (``torch.save``, whose
``weights_only`` loading refuses classes it does not know, or JSON) and handed back to ``load_state_dict``
as it was loaded.

Until the next release a record also answers ``record["key"]`` as the dict it replaces did (from ``raw``),
with a ``DeprecationWarning`` naming the attribute to read instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict


class WireRecord:
    """A record decoded from an answer's result, which it keeps as ``raw``."""

    __slots__ = ()
    raw: dict

    def to_dict(self) -> dict:
        """The answer as the coordinator sent it (a copy): JSON-ready."""
        return dict(self.raw)

    def __getitem__(self, key: str):
        """``record["key"]``, as the dict this record replaces answered it; deprecated (removed in the next
        release): read the attribute, or ``to_dict()``."""
        warnings.warn(
            f"{type(self).__name__}[{key!r}]: the trainer API returns records now; read its attributes "
            "(docs/reference/trainer-api.md) or .to_dict()[...]; item access goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.raw[key]


@dataclass(frozen=True, slots=True)
class PauseResult(WireRecord):
    """``pause()``'s answer: admission is stopped (durably: a restarted coordinator stays paused)."""

    leased: int
    """Leases in flight when the answer left: 0 after ``pause(drain=True)`` (every result durable), else those
    the agents are still finishing."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @property
    def drained(self) -> bool:
        """No lease in flight: a ``state_dict()`` now is the trainer's checkpoint."""
        return self.leased == 0

    @classmethod
    def from_wire(cls, raw: dict) -> PauseResult:
        return cls(int(raw.get("leased", 0)), dict(raw))


@dataclass(frozen=True, slots=True)
class ResumeResult(WireRecord):
    """``resume()``'s answer: admission is on again (durably). The coordinator says nothing more yet."""

    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @classmethod
    def from_wire(cls, raw: dict) -> ResumeResult:
        return cls(dict(raw))


@dataclass(frozen=True, slots=True)
class MixtureResult(WireRecord):
    """``set_mixture()``'s answer: the weights recorded, and the first batch they apply to."""

    from_rollout_id: int
    """The first rollout id generated with these weights (the next not generated yet when asked)."""
    weights: dict[str, float]
    """Every training dataset's weight (a name left out of the call weighs 0)."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @classmethod
    def from_wire(cls, raw: dict) -> MixtureResult:
        return cls(int(raw["from_rollout_id"]), {str(k): float(v) for k, v in raw["weights"].items()}, dict(raw))


@dataclass(frozen=True, slots=True)
class EvalMetrics(WireRecord):
    """One evaluation pass's metrics (``evaluate(name)``; the ``last`` pass in ``stats().evaluations``)."""

    name: str
    """The evaluation dataset (``coordinator serve --eval-dataset NAME=PATH``)."""
    pass_id: int
    """The pass: 1, 2, ... per dataset (the wire's ``pass``)."""
    prompts: int
    """Prompts of the pass (every one counted once)."""
    samples: int
    """Samples scored (``prompts - failed_prompts`` times ``n_samples``)."""
    failed_prompts: int
    """Prompts whose generation or reward failed for good (left out of the means)."""
    n_samples: int
    """Samples per prompt."""
    reward_mean: float
    """Mean reward over the samples scored."""
    pass_at: dict[int, float]
    """pass@k for k = 1, 2, 4, ... and ``n_samples`` (the wire's ``pass@K`` keys): the unbiased estimate of the
    chance that one of k samples reaches the dataset's pass threshold."""
    response_length_mean: float
    """Mean response length in tokens."""
    truncated_ratio: float
    """Share of the samples cut at the length limit."""
    weight_versions: tuple[str, ...]
    """The weight versions the samples were generated with, as the engines label them (``"3"``; ``"default"``
    for the launch weights), sorted."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @classmethod
    def from_wire(cls, raw: dict) -> EvalMetrics:
        pass_at = {int(k[len("pass@") :]): float(v) for k, v in raw.items() if k.startswith("pass@")}
        return cls(
            str(raw.get("name", "")),
            int(raw.get("pass", 0)),
            int(raw.get("prompts", 0)),
            int(raw.get("samples", 0)),
            int(raw.get("failed_prompts", 0)),
            int(raw.get("n_samples", 0)),
            float(raw.get("reward_mean", 0.0)),
            dict(sorted(pass_at.items())),
            float(raw.get("response_length_mean", 0.0)),
            float(raw.get("truncated_ratio", 0.0)),
            tuple(str(v) for v in raw.get("weight_versions", ())),
            dict(raw),
        )


@dataclass(frozen=True, slots=True)
class WeightUpdateResult(WireRecord):
    """A weight update done: every engine named serves ``version`` (``update_weights``, ``catch_up``,
    ``update_weights_from_disk``; with ``world_size > 1`` every rank returns rank 0's)."""

    update_id: int
    """The coordinator's id of the update (0: a catch-up with nothing behind, answered at once)."""
    version: int
    """The version the engines serve."""
    engines: dict[str, int]
    """``"agent/engine"`` -> its version now, for every engine the update reached (a catch-up: those it
    brought back; empty when none was behind, or after a disk update the agents load themselves)."""
    retried: str | None = None
    """The first attempt's error when an engine lost in it made the client retry once, on a new group
    (``update_weights`` only); None when the first attempt succeeded."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    """The answer as the coordinator sent it (``to_dict()``)."""

    @classmethod
    def from_wire(cls, raw: dict, retried: str | None = None) -> WeightUpdateResult:
        """From the coordinator's answer; ``retried``: the first attempt's error, when the client retried."""
        raw = dict(raw) if retried is None else {**raw, "retried": retried}
        engines = {str(k): int(v) for k, v in (raw.get("engines") or {}).items()}
        return cls(int(raw["update_id"]), int(raw["version"]), engines, raw.get("retried"), raw)


class RolloutState(TypedDict):
    """``state_dict()``: the rollout's side of a trainer checkpoint, plain JSON data. Save it with the model
    (``torch.save``, JSON) and hand it back to ``load_state_dict`` as loaded; batches after ``rollout_id`` are then
    delivered again, identical."""

    format: int
    """1."""
    rollout_id: int
    """The last batch the trainer consumed (``generate`` returned it) when the checkpoint was taken."""
    dataset_fingerprint: str
    """The training data's fingerprint: a checkpoint loads only on the same data."""
    dataset_size: int
    """Rows of the training data."""
    config: dict
    """The fleet's rollout config at the checkpoint."""
    mixture: NotRequired[list]
    """The mixture's schedule, ``[[from_rollout_id, [weight per dataset]], ...]`` (absent from a replay's)."""
