"""The weight digest: one short fingerprint of a set of named tensors, the same on trainer and engine.

An engine reports the digest of the weights it holds (the sim's ``/model_info`` ``weight_digest``);
a trainer computes it over what it sent, so a test or an operator can check that every engine
holds exactly those weights. The recipe, which both sides must follow byte for byte:

1. Sort the entries by name (names are unique; a duplicate is a ValueError).
2. For each entry, feed SHA-256 with: the name (UTF-8), a NUL byte; the dtype name as torch spells
   it without ``torch.`` (``"float32"``, ``"bfloat16"``), a NUL byte; the shape as decimal sizes
   joined by ``,`` (``"2,3"``; ``""`` for a scalar), a NUL byte; the data length in bytes as 8
   bytes little-endian; the data: the elements in C (row-major) order, each in its in-memory
   little-endian layout.
3. The digest is the first 16 hex digits of the SHA-256.

So the digest depends on names, dtypes, shapes and values, never on iteration order or on device.
An empty set of tensors has the digest ``e3b0c44298fc1c14`` (the SHA-256 of nothing).

Accepted values: a torch tensor (any device; read through a contiguous CPU copy), an object
with ``tobytes``, ``dtype`` and ``shape`` (a numpy array), an object with ``.numpy()`` (turned
into the former), or raw ``bytes``/``bytearray``/``memoryview`` (dtype ``uint8``, shape
``[len]``). Nothing here imports torch or numpy: a tensor passed in brings its own library.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from typing import Any

__all__ = ["DIGEST_CHARS", "EMPTY_DIGEST", "tensor_record", "weights_digest"]

DIGEST_CHARS = 16
EMPTY_DIGEST = hashlib.sha256().hexdigest()[:DIGEST_CHARS]


def _is_torch_tensor(value: Any) -> bool:
    return (
        hasattr(value, "data_ptr")
        and hasattr(value, "element_size")
        and str(getattr(value, "dtype", "")).startswith("torch.")
    )


def tensor_record(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """``(dtype name, shape, data bytes)`` of one value, as the digest reads it (see the module docstring)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return "uint8", (len(data),), data
    if _is_torch_tensor(value):
        t = value.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        nbytes = t.numel() * t.element_size()
        # ctypes reads the contiguous buffer directly: no numpy needed, and bfloat16 works too.
        data = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
        return str(t.dtype).removeprefix("torch."), tuple(int(s) for s in t.shape), data
    if not hasattr(value, "tobytes") and callable(getattr(value, "numpy", None)):
        value = value.numpy()
    if hasattr(value, "tobytes") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return str(value.dtype), tuple(int(s) for s in value.shape), value.tobytes(order="C")
    raise TypeError(f"cannot digest a {type(value).__name__}: expected a tensor, an array or bytes")


def weights_digest(named: Iterable[tuple[str, Any]]) -> str:
    """The digest of ``(name, value)`` pairs: 16 hex digits (recipe in the module docstring)."""
    entries = sorted(named, key=lambda item: item[0])
    h = hashlib.sha256()
    previous = None
    for name, value in entries:
        if name == previous:
            raise ValueError(f"duplicate tensor name {name!r}")
        previous = name
        dtype, shape, data = tensor_record(value)
        h.update(name.encode("utf-8") + b"\0")
        h.update(dtype.encode("ascii") + b"\0")
        h.update(",".join(str(s) for s in shape).encode("ascii") + b"\0")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:DIGEST_CHARS]
