"""The settings the coordinator's core starts with, checked once, here, when the record is made.

``CoreSettings`` is everything ``CoordinatorCore`` is told besides the ledger it resumes from and the
time: the rollout config and liveness, the training datasets (their sizes, order and fingerprint), the
starvation thresholds, the over-sampling factor, the trainers' keys and the evaluation datasets.
A record that exists is valid: each check raises ``ConfigError`` naming the flag and the value, so
the pure core never checks a setting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.config import Liveness, RolloutConfig
from common.errors import ConfigError
from common.mixture import DEFAULT, SourceSpec
from coordinator.evaluation import EvalSpec
from coordinator.starvation import default_starve_after

__all__ = ["CoreSettings", "check_count", "check_over_sampling", "file_order"]


def file_order(dataset: int, size: int, data_epoch: int) -> Sequence[int]:
    """Every data epoch in file order (no ``--shuffle-seed``)."""
    return range(size)


def check_count(flag: str, value) -> None:
    """``value`` is None or an integer >= 1 (``--starve-after``, ``--starve-after-drops``)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")


def check_over_sampling(value) -> None:
    """``--over-sampling``: a finite number >= 1.0 (1.0: off)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1):
        raise ConfigError(f"--over-sampling must be a number >= 1.0 (1.0: off), got {value!r}")


@dataclass(frozen=True)
class CoreSettings:
    config: RolloutConfig
    liveness: Liveness
    dataset_sizes: tuple[int, ...]
    """Rows of each training dataset, in ``config.mixture``'s order (one size without a mixture)."""
    fingerprint: str
    """The training data's fingerprint (of a mixture: its datasets' together); agents reading their own
    replica of the dataset (no mixture) must match it and ``dataset_size``."""
    order: Callable[[int, int, int], Sequence[int]] = file_order
    """``order(dataset, size, data_epoch)``: dataset ``dataset``'s rows in that data epoch (a permutation)."""
    starve_after: int | None = None
    """Failed groups in a row after which the rollout is starved (``--starve-after``; None: the default)."""
    starve_after_drops: int | None = None
    """Filter drops in a row after which it is starved (``--starve-after-drops``; None: the training data's size)."""
    over_sampling: float = 1.0
    """``--over-sampling``: groups started per waiting batch, as a multiple of its size (1.0: off)."""
    trainer_keys: tuple[str, ...] = ()
    """The trainers' CurveZMQ public keys (Z85), handed to agents in the Welcome for their payload endpoints."""
    eval_specs: tuple[EvalSpec, ...] = ()
    """The evaluation datasets (``--eval-dataset``)."""

    def __post_init__(self):
        if not isinstance(self.config, RolloutConfig):
            raise ConfigError(f"config must be a RolloutConfig, got {type(self.config).__name__}")
        if not isinstance(self.liveness, Liveness):
            raise ConfigError(f"liveness must be a Liveness, got {type(self.liveness).__name__}")
        sizes = tuple(self.dataset_sizes)
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ConfigError(f"a training dataset's size must be an integer >= 0, got {size!r}")
        if len(sizes) != len(self.datasets):
            raise ConfigError(f"{len(sizes)} dataset sizes for {len(self.datasets)} training datasets")
        check_count("--starve-after", self.starve_after)
        check_count("--starve-after-drops", self.starve_after_drops)
        check_over_sampling(self.over_sampling)
        names = [spec.name for spec in self.eval_specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"evaluation datasets named twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        object.__setattr__(self, "dataset_sizes", sizes)
        object.__setattr__(self, "trainer_keys", tuple(self.trainer_keys))
        object.__setattr__(self, "eval_specs", tuple(self.eval_specs))

    @property
    def datasets(self) -> list[SourceSpec]:
        """The training datasets (common/mixture.py), in order: a dataset's number is its place here."""
        return [SourceSpec.from_dict(d) for d in self.config.mixture] or [SourceSpec(DEFAULT)]

    @property
    def dataset_size(self) -> int:
        """Rows of the training data, every dataset of a mixture together."""
        return sum(self.dataset_sizes)

    @property
    def failures_to_starve(self) -> int:
        """``starve_after``, or its default: two batches' worth of groups, and at least 64."""
        return self.starve_after or default_starve_after(self.config.rollout_batch_size)

    @property
    def drops_to_starve(self) -> int | None:
        """``starve_after_drops``, or its default: the training data's size (an epoch); None for no data."""
        return self.starve_after_drops or self.dataset_size or None
