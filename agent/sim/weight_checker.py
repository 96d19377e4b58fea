"""SGLang's ``/weights_checker``: per-tensor checksums of the weights an engine holds, snapshots and compares.

Body (GET or POST, optional): ``{"action": "checksum" | "snapshot" | "compare" | "reset_tensors",
"skip_tensor_list": [substring, ...], "selector": "all" | "target" | "draft"}`` (the last two from
SGLang 0.5.23; 0.5.15 ignores them). Answer ``{"success", "message"}``, 400 when ``success`` is
false, and for ``checksum``::

    {"success": true, "message": "Success.",
     "ranks": [{"checksums": {name: hex16}, "per_gpu_checksum": hex64, "parallelism_info": ...}, ...],
     "per_engine_checksum": hex64}

as SGLang computes them (``utils/weight_checker.py``, ``managers/tokenizer_control_mixin.py``, CPU
convention): a tensor's checksum is the first 8 bytes of the SHA-256 of its raw bytes (contiguous, in
the dtype the engine stores it), as 16 hex digits (:func:`common.weight_rows.tensor_checksum`, the
definition a trainer computes too); ``per_gpu_checksum`` is the SHA-256 over the sorted
names of name then checksum; ``per_engine_checksum`` the SHA-256 over the ranks' ``per_gpu_checksum``.
Skipped: names containing a non-persistent buffer pattern (``inv_freq``, ``cos_sin_cache``, ...) or a
``skip_tensor_list`` entry. There is one rank per ``--tp-size``; the engine holds whole tensors, so
every rank reports the same checksums. ``parallelism_info`` is a list with one ``{"role": "target",
tp_rank, tp_size, dp_rank, dp_size, pp_rank, pp_size, rank, size}`` in 0.5.23 and that object
without ``role`` in 0.5.15. ``selector: "draft"`` has no runner to act on: success without ``ranks``.

``snapshot`` copies the tensors; ``compare`` checks the tensors against it, bit for bit, and fails
with 400 ``"check tensor equality failed:\\nname=... max_abs_err=... ..."``, a line per tensor that
differs (with no snapshot: 400 with an empty message, SGLang's bare assertion); 0.5.23 forgets the
snapshot after a compare that passed. ``reset_tensors`` overwrites every checked tensor with random
values (a test of the checker, as in SGLang). Any other action: 400 ``"Unsupported action='...'"``.

The tensors are the engine's ``weights.named_tensors()``: the sim's :class:`~agent.sim.weights.WeightStore`,
the hf engine's model parameters then buffers. The work runs off the event loop (on the hf engine's
model thread, between two decode steps).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

from common.weight_rows import tensor_checksum

if TYPE_CHECKING:
    from agent.sim.engine import SimEngine

ACTIONS = ("checksum", "snapshot", "compare", "reset_tensors")
SELECTORS = ("all", "target", "draft")


class CheckerError(Exception):
    """A checker action failed; the message is the 400 answer's ``message``."""


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: SHA-256 over the sorted names of name then checksum."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(ranks: list[dict]) -> str:
    """``per_engine_checksum``: SHA-256 over the ranks' ``per_gpu_checksum``, in rank order."""
    h = hashlib.sha256()
    for rank in ranks:
        h.update(rank["per_gpu_checksum"].encode())
    return h.hexdigest()


def _random_like(tensor: Any) -> Any:
    import torch

    if tensor.dtype.is_floating_point:
        return torch.rand(tensor.shape, dtype=torch.float32).to(tensor.dtype)
    if tensor.dtype == torch.bool:
        return torch.rand(tensor.shape) > 0.5
    info = torch.iinfo(tensor.dtype)
    return torch.randint(int(info.min), int(info.max), tuple(tensor.shape), dtype=tensor.dtype)


def _raw(tensor: Any) -> str:
    return f"raw(shape={tuple(tensor.shape)} dtype={tensor.dtype})"


class WeightChecker:
    """One engine's ``/weights_checker``: its snapshot and the actions."""

    def __init__(self, engine: SimEngine):
        self.engine = engine
        self._snapshot: dict[str, Any] | None = None

    # ------------------------------------------------------------ helpers

    def _skipped(self, name: str, skip: list[str]) -> bool:
        patterns = self.engine.sglang.non_persistent
        return any(p in name for p in patterns) or any(s in name for s in skip)

    async def _off_loop(self, fn: Any) -> Any:
        """Run ``fn`` on the hf engine's model thread, or on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(getattr(self.engine, "executor", None), fn)

    def _parallelism_info(self, rank: int) -> Any:
        config = self.engine.config
        tp_size = int(config.get("tp_size") or 1)
        modern = self.engine.sglang.checker_roles
        info = {
            "tp_rank": rank,
            "tp_size": tp_size,
            "dp_rank": 0,
            "dp_size": 1 if modern else int(config.get("dp_size") or 1),
            "pp_rank": 0,
            "pp_size": 1,
            "rank": rank,
            "size": tp_size,
        }
        return [{"role": "target", **info}] if modern else info

    # ------------------------------------------------------------ actions

    def _checksums(self, skip: list[str]) -> dict[str, str]:
        return {
            name: tensor_checksum(t) for name, t in self.engine.weights.named_tensors() if not self._skipped(name, skip)
        }

    async def checksum(self, skip: list[str]) -> dict:
        checksums = await self._off_loop(lambda: self._checksums(skip))
        tp_size = int(self.engine.config.get("tp_size") or 1)
        per_gpu = overall_checksum(checksums)
        ranks = [
            {"checksums": dict(checksums), "per_gpu_checksum": per_gpu, "parallelism_info": self._parallelism_info(r)}
            for r in range(tp_size)
        ]
        return {"ranks": ranks, "per_engine_checksum": engine_checksum(ranks)}

    async def snapshot(self) -> None:
        def copy() -> dict[str, Any]:
            return {name: t.detach().cpu().clone() for name, t in self.engine.weights.named_tensors()}

        self._snapshot = await self._off_loop(copy)

    async def compare(self, skip: list[str]) -> None:
        expected = self._snapshot
        if expected is None:
            raise CheckerError("")  # SGLang: a bare ``assert self._snapshot_tensors is not None``
        errors = await self._off_loop(lambda: self._differences(expected, skip))
        if errors:
            raise CheckerError("check tensor equality failed:\n" + "\n".join(errors))
        if self.engine.sglang.checker_roles:
            self._snapshot = None  # 0.5.23 keeps a snapshot for one passing compare

    def _differences(self, expected: dict[str, Any], skip: list[str]) -> list[str]:
        actual = self.engine.weights.named_tensors()
        if len(actual) != len(expected):
            longer = "longer" if len(actual) > len(expected) else "shorter"
            raise CheckerError(f"zip() argument 2 is {longer} than argument 1")
        errors = []
        for (expect_name, expect), (actual_name, tensor) in zip(expected.items(), actual, strict=True):
            if ".cos_sin_cache" in expect_name:
                continue
            if expect_name != actual_name:
                raise CheckerError(f"expect_name={expect_name!r} actual_name={actual_name!r}")
            got = tensor.detach().cpu()
            if got.numel() != expect.numel():
                shapes = f"expect_dq.shape={expect.reshape(-1).shape} actual_dq.shape={got.reshape(-1).shape}"
                raise CheckerError(shapes)
            diff = (got.reshape(-1).float() - expect.reshape(-1).float()).abs()
            if bool((diff == 0).all()):
                continue
            if self._skipped(expect_name, skip):
                continue  # SGLang logs it as information only
            exceed = int((~(diff <= 0.0)).sum())
            mean = diff.sum().item() / max(diff.numel(), 1)
            errors.append(
                f"name={expect_name} max_abs_err={diff.max().item()} mean_abs_err={mean} num_exceed={exceed} "
                f"expect={_raw(expect)} actual={_raw(got)} "
            )
        return errors

    async def reset_tensors(self, skip: list[str]) -> None:
        def draw() -> dict[str, Any]:
            held = self.engine.weights.named_tensors()
            return {name: _random_like(t) for name, t in held if not self._skipped(name, skip)}

        named = await self._off_loop(draw)
        state = getattr(self.engine.weights, "state", None)  # the hf engine copies only into the model's state
        if state is not None:
            named = {name: t for name, t in named.items() if name in state}
        if named:
            self.engine.apply_weights(named, replace=False)

    async def handle(self, data: dict) -> tuple[bool, str, dict]:
        """``(success, message, extra fields)`` for a parsed body (validated by the caller)."""
        modern = self.engine.sglang.checker_roles
        action = data.get("action", "checksum")
        skip = list(data.get("skip_tensor_list") or ()) if modern else []
        if modern and data.get("selector", "all") == "draft":
            return True, "Success.", {}  # no draft runner: nothing acts, whatever the action
        try:
            if action == "checksum":
                return True, "Success.", await self.checksum(skip)
            if action == "snapshot":
                await self.snapshot()
            elif action == "compare":
                await self.compare(skip)
            elif action == "reset_tensors":
                await self.reset_tensors(skip)
            else:
                return False, f"Unsupported action={action!r}", {}
        except CheckerError as exc:
            return False, str(exc), {}
        except Exception as exc:  # SGLang answers any failure with its text
            return False, str(exc), {}
        return True, "Success.", {}
