"""Training datasets mixed by weight (``coordinator serve --dataset NAME=PATH,weight=W,...``).

A *mixture* is an ordered list of training sources, each a JSONL dataset with its own weight and,
optionally, its own reward, dynamic filter, group size and sampling settings. Pure helpers:

- ``parse_dataset`` reads one ``--dataset`` value; a plain ``PATH`` is the one source ``default``.
- ``shares`` splits ``rollout_batch_size`` groups by weight with largest-remainder rounding: the
  floors first, then one more to the largest fractional parts, ties to the earlier source. Every
  batch of a rollout id holds exactly these counts, whatever the filters drop.
- Prompt keys. The coordinator names a prompt ``(data_epoch, index)`` on the wire, in the ledger and
  in receipts. A mixture keeps that shape: source number ``s`` (its place in the list) and its own
  data epoch ``e`` travel as one integer, ``epoch_key(s, e) = s << 32 | e``. Source 0's keys are its
  epochs, so a single dataset's ledger is the same as before mixtures. ``split_key`` undoes it;
  groups handed to trainers carry the source's name and its own epoch (``Group.source``, ``data_epoch``).

The source list (names, order, weights and settings) is part of the batch shape the ledger checks at
restart: changing it needs ``--allow-config-change``. ``client.set_mixture`` changes the weights from
a rollout id on, recorded in the ledger.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

from common.errors import ConfigError
from common.named_flags import NAME, parse_named

DEFAULT = "default"
"""The name of the one source a plain ``--dataset PATH`` makes."""
EPOCH_BITS = 32
EPOCH_MASK = (1 << EPOCH_BITS) - 1
MAX_SOURCES = 1 << 16

_OPTIONS = {
    "weight": float,
    "reward": str,
    "filter": str,
    "n_samples": int,
    "max_new_tokens": int,
    "temperature": float,
    "top_p": float,
    "input_key": str,
    "label_key": str,
    "shuffle_seed": int,
}


def epoch_key(source: int, data_epoch: int) -> int:
    """The one integer that names source ``source``'s data epoch ``data_epoch`` (module docstring)."""
    return (source << EPOCH_BITS) | data_epoch


def split_key(key: int) -> tuple[int, int]:
    """``(source number, data epoch)`` of an epoch key."""
    return key >> EPOCH_BITS, key & EPOCH_MASK


@dataclass(frozen=True)
class SourceSpec:
    """One training source of a mixture; a setting left None is the fleet's."""

    name: str
    weight: float = 1.0
    reward: str | None = None
    filter: str | None = None
    n_samples: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None

    def sampling(self) -> dict:
        """Sampling settings over the fleet's (a grant's ``sampling``)."""
        out = {}
        for key in ("max_new_tokens", "temperature", "top_p"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> SourceSpec:
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError(f"bad training source {d!r}: {exc}") from None


@dataclass(frozen=True)
class DatasetArg:
    """One parsed ``--dataset`` value: the spec, where its rows are and how they are read."""

    spec: SourceSpec
    path: str
    input_key: str | None = None
    label_key: str | None = None
    shuffle_seed: int | None = None
    options: dict = field(default_factory=dict)


def parse_dataset(text: str) -> DatasetArg:
    """One ``--dataset`` value: ``PATH`` (the source ``default``) or ``NAME=PATH,weight=W[,OPTION=V...]``."""
    name, sep, _ = text.partition("=")
    if not sep or (not NAME.match(name) and "/" in name):
        return DatasetArg(SourceSpec(DEFAULT), text)  # a plain path (one with '=' in it too)
    usage = "PATH or NAME=PATH,weight=W[,reward=SPEC,filter=SPEC,...]"
    name, path, options = parse_named("--dataset", text, _OPTIONS, usage)
    weight = options.get("weight", 1.0)
    if not (math.isfinite(weight) and weight >= 0):
        raise ConfigError(f"--dataset {text!r}: weight must be a number >= 0, got {weight!r}")
    spec_keys = ("weight", "reward", "filter", "n_samples", "max_new_tokens", "temperature", "top_p")
    spec = SourceSpec(name, **{k: options[k] for k in spec_keys if k in options})
    return DatasetArg(
        spec, path, options.get("input_key"), options.get("label_key"), options.get("shuffle_seed"), options
    )


def check_sources(specs: list[SourceSpec]) -> None:
    """A usable list: at least one, names unique, weights >= 0 with a positive sum; ConfigError otherwise."""
    if not specs:
        raise ConfigError("no training dataset: give --dataset PATH or --dataset NAME=PATH,weight=W")
    if len(specs) > MAX_SOURCES:
        raise ConfigError(f"at most {MAX_SOURCES} training datasets, got {len(specs)}")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"--dataset: the name {spec.name!r} is given twice")
        seen.add(spec.name)
    if len(specs) > 1 and any(s.name == DEFAULT for s in specs):
        raise ConfigError("--dataset: with several datasets each needs a name (NAME=PATH,weight=W)")
    check_weights({s.name: s.weight for s in specs}, [s.name for s in specs])


def check_weights(weights: dict, names: list[str]) -> dict[str, float]:
    """``weights`` as ``{name: float}`` over exactly ``names``; ConfigError naming what is wrong."""
    if not isinstance(weights, dict):
        raise ConfigError(f"a mixture is a dict of dataset name to weight, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ConfigError(f"unknown dataset name(s) in the mixture: {unknown}; the datasets are {names}")
    out: dict[str, float] = {}
    for name in names:
        value = weights.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"the weight of dataset {name!r} must be a number >= 0, got {value!r}")
        out[name] = float(value)
    if sum(out.values()) <= 0:
        raise ConfigError(f"the mixture's weights must not all be 0: {out}")
    return out


def shares(weights: list[float], total: int) -> list[int]:
    """``total`` split by ``weights``: largest-remainder rounding, ties to the earlier source; sums to ``total``."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDatasets:
    """The training datasets of a mixture seen as one, for the ledger's dataset check: their total size and
    a fingerprint of the names, sizes and fingerprints in order."""

    def __init__(self, names: list[str], datasets: list):
        self.names, self.datasets = names, datasets
        h = hashlib.sha256(b"rollfleet-mixture-1")
        for name, ds in zip(names, datasets, strict=True):
            h.update(f"\0{name}\0{len(ds)}\0{ds.fingerprint}".encode())
        self.fingerprint = h.hexdigest()

    def __len__(self) -> int:
        return sum(len(ds) for ds in self.datasets)
