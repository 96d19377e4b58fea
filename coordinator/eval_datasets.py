"""``coordinator serve --eval-dataset NAME=PATH[,OPTION=VALUE...]``: parsing and loading.

Options, each optional (defaults: the training flags' values):

    n_samples        samples per prompt (pass@k is reported for k = 1, 2, 4, ... up to it)
    max_new_tokens   tokens per sample
    temperature      sampling temperature (0: greedy)
    top_p            nucleus sampling
    pass_threshold   a sample passes when its reward is at least this (default 1.0)

A name is ``[A-Za-z0-9_.-]+`` and may be declared once. Rows are read like the training
dataset's (``--input-key``, ``--label-key``); each file is checked at start, like it.
"""

from __future__ import annotations

import os
import re

from common.config import RolloutConfig
from common.errors import ConfigError
from coordinator.evaluation import EvalSpec

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_OPTIONS = {
    "n_samples": int,
    "max_new_tokens": int,
    "temperature": float,
    "top_p": float,
    "pass_threshold": float,
}


def parse_eval_dataset(text: str) -> tuple[str, str, dict]:
    """``(name, path, options)`` of one ``--eval-dataset`` value; ConfigError naming what is wrong."""
    flag = f"--eval-dataset {text!r}"
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"{flag}: expected NAME=PATH[,n_samples=N,max_new_tokens=N,temperature=T,...]")
    if not _NAME.match(name):
        raise ConfigError(f"{flag}: the name {name!r} may hold only letters, digits, '_', '.' and '-'")
    path, *items = rest.split(",")
    options: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key not in _OPTIONS:
            raise ConfigError(f"{flag}: unknown option {key!r}; options: {', '.join(_OPTIONS)}")
        try:
            parsed = _OPTIONS[key](value)
        except ValueError:
            raise ConfigError(f"{flag}: {key} must be a {_OPTIONS[key].__name__}, got {value!r}") from None
        if key in ("n_samples", "max_new_tokens") and parsed < 1:
            raise ConfigError(f"{flag}: {key} must be at least 1, got {parsed}")
        if key == "temperature" and not 0 <= parsed <= 100:
            raise ConfigError(f"{flag}: temperature must be in [0, 100], got {parsed}")
        if key == "top_p" and not 0 < parsed <= 1:
            raise ConfigError(f"{flag}: top_p must be in (0, 1], got {parsed}")
        options[key] = parsed
    return name, path, options


def load_eval_datasets(values: list[str], config: RolloutConfig, *, input_key: str, label_key: str, data_dir: str):
    """``{name: (Dataset, EvalSpec)}`` for every ``--eval-dataset`` value (files checked now)."""
    from common.dataset import Dataset

    out: dict = {}
    for text in values or ():
        name, path, options = parse_eval_dataset(text)
        if name in out:
            raise ConfigError(f"--eval-dataset: {name!r} is declared twice")
        index = os.path.join(data_dir, f"eval-{name}.index")
        dataset = Dataset(path, input_key=input_key, label_key=label_key, index_path=index)
        sampling = {k: options[k] for k in ("max_new_tokens", "temperature", "top_p") if k in options}
        spec = EvalSpec(
            name=name,
            size=len(dataset),
            fingerprint=dataset.fingerprint,
            n_samples=options.get("n_samples", config.n_samples_per_prompt),
            sampling=sampling,
            pass_threshold=options.get("pass_threshold", 1.0),
        )
        out[name] = (dataset, spec)
    return out
