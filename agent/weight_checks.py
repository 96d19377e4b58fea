"""What a verified weight update compares when an engine cannot read its rows back, and the engines paused.

SGLang 0.5.23 reads rows back (``/get_weights_by_name``) only for some model classes (Llama, OPT, Granite,
Exaone4, Gemma2 embeddings and their subclasses); for every model it has ``/weights_checker``, whose
``checksum`` action gives, per TP (and DP) rank, a checksum of every tensor the rank holds. Such a
checksum equals the trainer's (:func:`common.weight_rows.tensor_checksum` of what it sent) only where
the engine holds the tensor whole, unquantized, under the trainer's name, hashed on the CPU (on a GPU
SGLang hashes with a Triton kernel of its own). So, per engine (:func:`compare_checksums`):

1. where its checksums are comparable, each sampled tensor's must equal the trainer's;
2. engines of one layout on this agent must hold the same checksums (replicas of one model after one
   update): an engine outvoted by the others fails, naming the first tensor that differs; two that
   disagree with no majority both fail;
3. an engine checked neither way is listed as ``unchecked`` with the reason, for the caller to say so.

Pure: no I/O. :class:`PausedEngines` is the executor's record of the engines it has paused.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from common.errors import EngineError, EngineRejected

__all__ = ["PausedEngines", "Reading", "compare_checksums", "lacks_read_back", "reading"]

NO_READ_BACK = "Get parameter by name failed"
"""SGLang's answer to ``/get_weights_by_name`` on a model class without it (HTTP 400)."""


def lacks_read_back(exc: EngineRejected) -> bool:
    """Whether a refused ``/get_weights_by_name`` means the engine cannot read rows back at all."""
    return exc.status == 404 or NO_READ_BACK in str(exc)


@dataclass(frozen=True, slots=True)
class Reading:
    """One engine's ``/weights_checker`` checksums after an update."""

    url: str
    ranks: tuple[dict[str, str], ...]
    """Per rank, ``{tensor name: checksum}``."""
    layout: tuple
    """What must be equal for two engines' checksums to be comparable (ranks' placements, device, quantization)."""
    why_not_comparable: str = ""
    """Empty when the checksums can be compared with the trainer's; otherwise why not."""


def reading(url: str, answer: dict, server_info: dict) -> Reading:
    """A Reading from a ``/weights_checker`` ``checksum`` answer and the engine's ``/server_info``."""
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise_shape(url, answer)
    sums, places = [], []
    for rank in ranks:
        checksums = rank.get("checksums") if isinstance(rank, dict) else None
        if not isinstance(checksums, dict):
            raise_shape(url, answer)
        sums.append({str(k): str(v) for k, v in checksums.items()})
        info = rank.get("parallelism_info") or {}
        if isinstance(info, list):  # one entry per role (target, drafts) in some builds
            info = info[0] if info and isinstance(info[0], dict) else {}
        places.append((info.get("role", "target"), info.get("tp_size", 1), info.get("dp_size", 1)))
    device = server_info.get("device")
    quantization = server_info.get("quantization")
    tp = max(place[1] for place in places)
    if device != "cpu":
        why = (
            f"the engine hashes on device {device!r}, not as the trainer does"
            if device
            else "no device in /server_info"
        )
    elif quantization:
        why = f"quantized weights ({quantization}) are hashed dequantized"
    elif tp > 1:
        why = f"each of its {tp} tensor-parallel ranks holds a shard"
    else:
        why = ""
    return Reading(url, tuple(sums), (tuple(places), device, quantization), why)


def raise_shape(url: str, answer) -> None:
    raise EngineError(f"{url}/weights_checker: unexpected answer: {str(answer)[:200]}")


def compare_checksums(readings: dict[str, Reading], expected: dict[str, str]) -> tuple[dict, dict]:
    """``(errors, unchecked)``, each ``{engine name: why}`` (see the module docstring)."""
    errors: dict[str, str] = {}
    checked: set[str] = set()
    for name, got in readings.items():
        if got.why_not_comparable or not expected:
            continue
        for tensor, want in expected.items():
            for i, sums in enumerate(got.ranks):
                have = sums.get(tensor)
                if have is None:
                    continue  # held under another name (fused), or not on this rank
                checked.add(name)
                if have != want:
                    where = f" on rank {i}" if len(got.ranks) > 1 else ""
                    errors[name] = (
                        f"{got.url} holds weights that differ from what the trainer sent: {tensor!r} "
                        f"(checksum {have}{where}, {want} sent)"
                    )
                    break
            if name in errors:
                break
    by_layout: dict[tuple, list[str]] = {}
    for name, got in readings.items():
        if name not in errors:
            by_layout.setdefault(got.layout, []).append(name)
    for names in by_layout.values():
        if len(names) < 2:
            continue
        checked.update(names)
        votes = Counter(_signature(readings[n]) for n in names)
        top, count = votes.most_common(1)[0]
        majority = next((readings[n].ranks for n in names if _signature(readings[n]) == top), None)
        if count * 2 <= len(names):
            majority = None
        for name in names:
            ranks = readings[name].ranks
            if ranks == majority:
                continue
            others = [n for n in names if n != name]
            ref = majority if majority is not None else readings[others[0]].ranks
            tensor = _first_difference(ranks, ref)
            against = "the other engines of its layout" if majority is not None else f"engine {others[0]}"
            errors[name] = f"{readings[name].url} holds weights that differ from {against}: {tensor!r}"
    unchecked = {
        name: f"{got.why_not_comparable or 'no checksums sent'}, and no other engine of this agent shares its layout"
        for name, got in readings.items()
        if name not in checked and name not in errors
    }
    return errors, unchecked


def _signature(got: Reading) -> tuple:
    return tuple(tuple(sorted(sums.items())) for sums in got.ranks)


def _first_difference(ranks: tuple[dict[str, str], ...], ref: tuple[dict[str, str], ...]) -> str:
    for mine, theirs in zip(ranks, ref, strict=False):
        for tensor in sorted(mine.keys() | theirs.keys()):
            if mine.get(tensor) != theirs.get(tensor):
                return tensor
    return "(their number of ranks)"


class PausedEngines:
    """The engines (by URL) the weights executor has paused and not yet continued.

    SGLang 0.5.23 holds a request that arrives during a pause at its gate, where a per-request abort cannot
    reach it: the abort is dropped, and so is every later abort of that id (``abort_sent``), and the request
    runs to its end after the continue. So a per-request abort for a paused engine waits for its continue.
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def hold(self, url: str) -> None:
        self._events.setdefault(url, asyncio.Event())

    def release(self, url: str) -> None:
        event = self._events.pop(url, None)
        if event is not None:
            event.set()

    def paused(self, url: str) -> bool:
        return url in self._events

    async def wait_released(self, url: str, timeout: float) -> bool:
        """Wait until ``url`` is continued, up to ``timeout`` seconds; whether it was."""
        event = self._events.get(url)
        if event is None:
            return True
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True
