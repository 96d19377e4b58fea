"""The model's weights as the weight endpoints see them: checked, then copied in place.

Names are the model's ``state_dict`` keys (``model.layers.0.self_attn.q_proj.weight``, …; a
tied ``lm_head.weight`` shares the embedding's storage, so either name updates both and a
checkpoint without it is complete). An update is checked in full before anything is copied:
every name must be a state key and every shape must match (dtypes are converted), else the
whole update is refused with a :class:`~agent.sim.weights.WeightError` and nothing changes.

``digest`` is :func:`common.weights_digest.weights_digest` over ``named_parameters()`` (tied
weights once, under the embedding's name), in the engine's dtype: what a trainer holding the
same model in the same dtype computes over its own parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.sim.weights import WeightError
from common.weights_digest import weights_digest

ONLINE_FAILURE = (
    "Failed to update parameter online: {}. The full weights of the ModelRunner are partially updated. "
    "Please discard the whole weights."
)


class ModelWeights:
    """Checks and copies named tensors into a model; its digest (model thread for copies)."""

    def __init__(self, model: Any):
        self.model = model
        self.state = model.state_dict(keep_vars=True)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = weights_digest((n, p.detach()) for n, p in self.model.named_parameters())
        return self._digest

    def get(self, name: str) -> torch.Tensor | None:
        """The model's parameter or buffer ``name`` (``/get_weights_by_name``); None if it has none."""
        return self.state.get(name)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``named_parameters()`` then ``named_buffers()`` (tied weights once), as SGLang's weight checker
        walks a model (``/weights_checker``)."""
        return [(n, p.detach()) for n, p in self.model.named_parameters()] + list(self.model.named_buffers())

    def check(self, named: dict[str, Any]) -> list[tuple[torch.Tensor, Any]]:
        """``(target, source)`` pairs for ``named``; WeightError naming the first bad name or shape."""
        unknown = [name for name in named if name not in self.state]
        if unknown:
            raise WeightError(f"{len(unknown)} tensor name(s) are not parameters of the model, e.g. {unknown[0]!r}")
        pairs = []
        for name, tensor in named.items():
            target = self.state[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightError(
                    f"tensor {name!r} has shape {list(tensor.shape)}, the model's has {list(target.shape)}"
                )
            pairs.append((target, tensor))
        return pairs

    def copy(self, pairs: list[tuple[torch.Tensor, Any]]) -> None:
        """Copy checked pairs in place (model thread)."""
        with torch.no_grad():
            for target, source in pairs:
                target.copy_(source)
        self._digest = None
