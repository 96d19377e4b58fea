"""The engine's weights and checkpoints on disk (its weight-update groups: :mod:`agent.sim.weight_groups`).

Weights are a dict ``name -> tensor`` (:class:`WeightStore`), fingerprinted by
:func:`common.weights_digest.weights_digest` (``/model_info`` ``weight_digest``). They change
the output in one place: a tensor named ``sim.accuracy`` (one number in [0, 1]) replaces
``--accuracy``, the probability that an arithmetic answer is right. A disk update replaces the
whole dict with the checkpoint's tensors; each broadcast bucket adds or overwrites its tensors.

Checkpoints (:func:`load_checkpoint`): a directory holding ``model.safetensors`` (read with the
``safetensors`` package) or else ``weights.pt`` (a ``torch.save`` of a dict name -> tensor, read
with ``weights_only=True``). A directory with neither holds no weights: a disk update then only
changes the label and ``model_path``, as before. A load format of ``safetensors`` or ``pt`` reads
only its own file (a directory holding only the other one is an error); ``auto`` (and SGLang's
other default-loader formats) read either. :func:`loader_refusal` is SGLang's answer to a format
its default loader cannot update from (``dummy`` above all).

torch is imported only when a weights file or a group is used; without it those calls fail with a
:class:`WeightError` saying so.
"""

from __future__ import annotations

import math
import os
from typing import Any

from common.weights_digest import weights_digest

ACCURACY_KEY = "sim.accuracy"
CHECKPOINT_FILES = ("model.safetensors", "weights.pt")
DISK_LOAD_FORMATS = ("auto", "safetensors", "pt", "npcache")
"""Formats SGLang's ``DefaultModelLoader`` reads, the only loader a disk update accepts."""
_OTHER_LOADERS = {
    "dummy": "DummyModelLoader",
    "sharded_state": "ShardedStateLoader",
    "gguf": "GGUFModelLoader",
    "bitsandbytes": "BitsAndBytesModelLoader",
    "layered": "LayeredModelLoader",
    "remote": "RemoteModelLoader",
}


def loader_refusal(load_format: str) -> str | None:
    """SGLang's failure message for a disk update in ``load_format``; None if its default loader reads it.

    SGLang builds the model loader of the format and refuses any but ``DefaultModelLoader``
    (``model_runner_components/weight_updater.py``): ``"Failed to get model loader: <...Loader object at
    0x...>."``, with no weight read.
    """
    if load_format in DISK_LOAD_FORMATS:
        return None
    loader = _OTHER_LOADERS.get(load_format)
    if loader is None:
        return f"Failed to get model loader: unknown load_format {load_format!r}."
    return f"Failed to get model loader: <sglang.srt.model_loader.loader.{loader} object at 0x{id(load_format):x}>."


class WeightError(Exception):
    """A weight operation failed; the message is the ``message`` of the 400 answer."""


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise WeightError(
            "torch is not installed: rollfleet-sim needs it for weight files and weight-update groups "
            "(pip install torch)"
        ) from None
    return torch


def accuracy_of(tensor: Any) -> float:
    """The value of a ``sim.accuracy`` tensor; WeightError unless it is one number in [0, 1]."""
    if tensor.numel() != 1:
        raise WeightError(f"{ACCURACY_KEY} must hold one number, got shape {list(tensor.shape)}")
    value = float(tensor.reshape(-1)[0])
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise WeightError(f"{ACCURACY_KEY} must be in [0, 1], got {value}")
    return value


class WeightStore:
    """The tensors an engine holds, their digest, and the accuracy they set (None: ``--accuracy``)."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self._digest: str | None = weights_digest(())
        self.accuracy: float | None = None

    @property
    def digest(self) -> str:
        """Computed when first read after a change: once per update, not once per bucket received."""
        if self._digest is None:
            self._digest = weights_digest(self.tensors.items())
        return self._digest

    def get(self, name: str) -> Any | None:
        """The tensor held under ``name`` (``/get_weights_by_name``); None if none."""
        return self.tensors.get(name)

    def named_tensors(self) -> list[tuple[str, Any]]:
        """Every tensor held, by name (``/weights_checker``)."""
        return list(self.tensors.items())

    def apply(self, named: dict[str, Any], *, replace: bool) -> None:
        """Add (or with ``replace``, substitute) tensors; nothing changes if ``sim.accuracy`` is invalid."""
        accuracy = accuracy_of(named[ACCURACY_KEY]) if ACCURACY_KEY in named else None
        tensors = dict(named) if replace else {**self.tensors, **named}
        self._digest = None
        self.tensors = tensors
        if accuracy is not None or replace:
            self.accuracy = accuracy


def load_checkpoint(path: str, load_format: str = "auto") -> dict[str, Any] | None:
    """The tensors of the checkpoint directory ``path``; None if it has no weights file. Blocking.

    ``load_format`` ``safetensors`` or ``pt`` reads only that file; WeightError if only the other is there.
    """
    safetensors_file = os.path.join(path, CHECKPOINT_FILES[0])
    torch_file = os.path.join(path, CHECKPOINT_FILES[1])
    wanted = {"safetensors": safetensors_file, "pt": torch_file}.get(load_format)
    if wanted is not None and not os.path.isfile(wanted):
        other = torch_file if wanted == safetensors_file else safetensors_file
        if os.path.isfile(other):
            raise WeightError(f"load_format {load_format!r}: no {os.path.basename(wanted)} in {path}")
    if wanted == torch_file:
        safetensors_file = ""  # read weights.pt even if model.safetensors is there
    if safetensors_file and os.path.isfile(safetensors_file):
        import_torch()
        try:
            from safetensors import safe_open
        except ImportError:
            raise WeightError(f"{safetensors_file} needs the safetensors package (pip install safetensors)") from None
        try:
            with safe_open(safetensors_file, framework="pt") as f:
                return {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:
            raise WeightError(f"cannot read {safetensors_file}: {exc}") from None
    if os.path.isfile(torch_file):
        torch = import_torch()
        try:
            loaded = torch.load(torch_file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise WeightError(f"cannot read {torch_file}: {exc}") from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise WeightError(f"{torch_file} must hold a dict of name -> tensor")
        return loaded
    return None
