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

from common.config import RolloutConfig
from common.errors import ConfigError
from common.named_flags import parse_named
from coordinator.evaluation import EvalSpec

_OPTIONS = {
    "n_samples": int,
    "max_new_tokens": int,
    "temperature": float,
    "top_p": float,
    "pass_threshold": float,
}


def parse_eval_dataset(text: str) -> tuple[str, str, dict]:
    """``(name, path, options)`` of one ``--eval-dataset`` value; ConfigError naming what is wrong."""
    usage = "NAME=PATH[,n_samples=N,max_new_tokens=N,temperature=T,...]"
    return parse_named("--eval-dataset", text, _OPTIONS, usage)


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
