"""Verifying a broadcast on one engine (docs/weights.md, ``FinishWeights.verify``): its weights read back.

Where the engine's model has ``/get_weights_by_name`` (SGLang 0.5.23: Llama, OPT, Granite and a few
more), the sampled tensors' first rows must be exactly what the trainer sent; otherwise its
``/weights_checker`` checksums are compared with the trainer's where they can be, and engines of one
layout with each other (agent/weight_checks.py). Which way an engine is read is learnt at its first
verified update and kept until it restarts. An engine verified neither way is said once.
"""

from __future__ import annotations

import logging
import math

from agent.engine_client import EngineClient
from agent.supervisor import EngineSupervisor
from agent.weight_checks import Reading, compare_checksums, lacks_read_back, reading
from common.errors import EngineError, EngineRejected

log = logging.getLogger("rollfleet.agent.weights")


class Verifier:
    def __init__(self, supervisor: EngineSupervisor, client: EngineClient):
        self.supervisor = supervisor
        self.client = client
        self.read_mode: dict[str, str] = {}  # how an engine's weights are read back: "values" or "checksum"
        self._warned: set[str] = set()  # engines whose limited verification was said (once)

    def restarted(self, name: str) -> None:
        """A new process: how it reads back is learnt again."""
        self.read_mode.pop(name, None)
        self._warned.discard(name)

    async def read_back(self, name: str, url: str, verify: dict) -> Reading | None:
        """A verified update on one engine: the sampled rows where its model has ``/get_weights_by_name``
        (checked here), else its ``/weights_checker`` checksums (a Reading, compared by :meth:`compare`)."""
        mode = self.read_mode.get(name)
        if mode != "checksum" and verify.get("values"):
            try:
                await self._check_values(name, url, verify)
            except EngineRejected as exc:
                if mode == "values" or not lacks_read_back(exc):
                    raise
                self.read_mode[name] = "checksum"
                log.info("engine %s: %s; its updates are verified with /weights_checker", name, exc)
            else:
                self.read_mode[name] = "values"
                return None
        try:
            out = await self.client.weights_checker(url, "checksum")
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            raise EngineError(
                f"{url} cannot verify weights: its model has no /get_weights_by_name and the server no "
                "/weights_checker; push with verify=False"
            ) from None
        return reading(url, out, self.supervisor.server_info(name))

    def compare(self, readings: dict[str, Reading], verify: dict) -> dict[str, str]:
        """Checksums against the trainer's where they can be compared, and engines of one layout against each
        other; an engine checked neither way is said once (its verification is limited)."""
        errors, unchecked = compare_checksums(readings, dict(verify.get("checksums") or {}))
        for name, why in unchecked.items():
            if name not in self._warned:
                self._warned.add(name)
                log.warning("engine %s: weight verification limited: %s", name, why)
        return errors

    async def _check_values(self, name: str, url: str, verify: dict) -> None:
        """A verified update: the engine holds exactly the rows the trainer sent of each sampled tensor
        (``/get_weights_by_name``); EngineError naming the first tensor that differs."""
        rows = int(verify.get("rows", 1))
        dp = int(getattr(self.supervisor, "dp", lambda _name: 1)(name))
        for tensor, expected in dict(verify.get("values", {})).items():
            got = await self.client.get_weights_by_name(url, tensor, rows)
            if dp > 1 and isinstance(got, list) and len(got) == dp:
                # One answer per data-parallel rank: every replica must hold the rows.
                bad = next((i for i, one in enumerate(got) if not _same(one, expected)), None)
                if bad is None:
                    continue
                got = got[bad]
            if not _same(got, expected):
                raise EngineError(
                    f"{url} holds weights that differ from what the trainer sent: {tensor!r} (first {rows} rows: "
                    f"{_brief(got)} on the engine, {_brief(expected)} sent)"
                )


def _same(got, expected, rtol: float = 1e-5) -> bool:
    """Whether two nested lists of numbers match in shape and value (NaN matches NaN; an engine that
    rounds through another dtype on the way out, within ``rtol``)."""
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(_same(g, e, rtol) for g, e in zip(got, expected, strict=True))
        )
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return False
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    return got == expected or abs(got - expected) <= rtol * max(abs(expected), abs(got))


def _brief(values, limit: int = 6) -> str:
    """The first few numbers of a nested list, for an error message."""
    flat: list = []
    stack = [values]
    while stack and len(flat) <= limit:
        item = stack.pop(0)
        if isinstance(item, list):
            stack[:0] = item
        else:
            flat.append(item)
    more = ", ..." if len(flat) > limit else ""
    return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else repr(v) for v in flat[:limit]) + more + "]"
