"""Group payloads: what an agent stores in its LMDB and a trainer receives.

A *group* is the ``n_samples_per_prompt`` samples generated for one dataset
prompt. Agents build groups, commit them to their store and serve them to
trainers; trainers decode them into ``Group``/``Sample`` objects.

Token ids, logprobs and loss masks are machine arrays (``array('i')``,
``array('d')``, ``array('b')``) in a ``Sample`` and on the wire, never Python
lists: decoding 8 x 512 tokens into lists of ints and floats cost a trainer
about 20 us per sample, most of its share of the control path. An array is
list-like (``len``, indexing, iteration, slicing, ``tolist()``) and hands its
memory to numpy or torch without a copy (``np.frombuffer(s.response_tokens,
np.int32)``, ``torch.frombuffer(...)``). Logprobs keep full float64
precision, so importance ratios computed from them are exact.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack

SAMPLE_STATUSES = ("completed", "truncated", "aborted")

_LITTLE = sys.byteorder == "little"


def as_array(typecode: str, values) -> array:
    """``values`` as an ``array(typecode)``: the same object when it already is one, else a copy."""
    if type(values) is array and values.typecode == typecode:
        return values
    return array(typecode, values)


def _pack_array(typecode: str, values) -> bytes:
    arr = as_array(typecode, values)  # a field assigned after construction may hold a list
    if not _LITTLE:
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _unpack_array(typecode: str, data: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr


@dataclass
class Sample:
    """One generated response to a prompt, as a trainer consumes it.

    The four sequences are stored as arrays whatever they are built from (lists are converted):
    ``prompt_tokens`` and ``response_tokens`` ``array('i')``, ``response_logprobs`` ``array('d')``,
    ``loss_mask`` ``array('b')``.
    """

    prompt_tokens: array
    response_tokens: array
    response_logprobs: array
    """Logprob of each response token under the generating policy (same length)."""
    loss_mask: array
    """1 for tokens the policy produced and the loss should see."""
    reward: float
    status: str
    """``completed`` (stop/EOS), ``truncated`` (length) or ``aborted``."""
    weight_version: str
    """The engine's ``weight_version`` label when the sample finished."""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    response_text: str = ""
    weight_versions: list = field(default_factory=list)
    """``[version, start, end]`` response-token spans when the engine reports them."""

    def __post_init__(self) -> None:
        self.prompt_tokens = as_array("i", self.prompt_tokens)
        self.response_tokens = as_array("i", self.response_tokens)
        self.response_logprobs = as_array("d", self.response_logprobs)
        self.loss_mask = as_array("b", self.loss_mask)

    def to_wire(self) -> dict:
        return {
            "p": _pack_array("i", self.prompt_tokens),
            "r": _pack_array("i", self.response_tokens),
            "lp": _pack_array("d", self.response_logprobs),
            "m": _pack_array("b", self.loss_mask),
            "rw": float(self.reward),
            "s": self.status,
            "wv": self.weight_version,
            "wvs": self.weight_versions,
            "t": self.response_text,
            "md": self.metadata,
        }

    @classmethod
    def from_wire(cls, d: dict, label: Any) -> Sample:
        return cls(
            prompt_tokens=_unpack_array("i", d["p"]),
            response_tokens=_unpack_array("i", d["r"]),
            response_logprobs=_unpack_array("d", d["lp"]),
            loss_mask=_unpack_array("b", d["m"]),
            reward=d["rw"],
            status=d["s"],
            weight_version=d["wv"],
            label=label,
            metadata=d["md"],
            response_text=d["t"],
            weight_versions=d["wvs"],
        )


@dataclass
class Group:
    """All samples for one dataset prompt."""

    index: int
    """Index of the prompt's row in the dataset (0-based)."""
    samples: list[Sample]
    data_epoch: int = 0
    rollout_id: int = -1
    """The rollout id that was being collected when the prompt was leased."""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    agent_id: str = ""
    gen_seconds: float = 0.0
    """Wall time from the first request to the last response of the group."""
    source: str = "default"
    """The training dataset it came from (``--dataset NAME=PATH,...``; ``default`` for a plain ``--dataset PATH``)."""

    def to_wire(self) -> bytes:
        return msgpack.packb(
            {
                "i": self.index,
                "e": self.data_epoch,
                "rid": self.rollout_id,
                "l": self.label,
                "md": self.metadata,
                "a": self.agent_id,
                "g": self.gen_seconds,
                "src": self.source,
                "ss": [s.to_wire() for s in self.samples],
            },
            use_bin_type=True,
        )

    @classmethod
    def from_wire(cls, data: bytes) -> Group:
        d = msgpack.unpackb(data, raw=False)
        label = d["l"]
        return cls(
            index=d["i"],
            data_epoch=d["e"],
            rollout_id=d["rid"],
            label=label,
            metadata=d["md"],
            agent_id=d["a"],
            gen_seconds=d["g"],
            source=d.get("src", "default"),
            samples=[Sample.from_wire(s, label) for s in d["ss"]],
        )

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
