"""The order rows are served in within a data epoch: file order, or a seeded shuffle in O(1) memory.

``SHUFFLE_ORDER`` names the shuffle algorithm. A ledger records it beside ``--shuffle-seed``;
the prompt frontier keys its cursor by position in this order, so a data dir shuffled by one
algorithm must never be resumed by another (the coordinator refuses it at start).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

SHUFFLE_ORDER = 2
"""1: a full in-memory shuffle of ``range(n)`` by ``random.Random`` (earlier builds); 2: :class:`ShuffledOrder`."""

_M64 = (1 << 64) - 1
_ROUNDS = 4


class ShuffledOrder(Sequence[int]):
    """A pseudo-random permutation of ``range(n)`` computed per position: O(1) memory, ~1 us a lookup.

    ``order[pos]`` is a keyed Feistel network on the mixed-radix domain ``Z_a x Z_b``
    (``a = ceil(sqrt(n))``, ``b = ceil(n / a)``, so ``a * b - n < a``): each round maps
    ``(hi, lo) -> (lo, (hi + F(lo)) mod |Z_hi|)``, which is invertible, so the network permutes
    ``range(a * b)``; positions that land at or beyond ``n`` are encrypted again ("cycle walking"),
    which stays inside ``range(n)`` and is rare (fewer than ``a`` of ``a * b`` values). ``F`` is
    splitmix64's finaliser of ``lo ^ key``, one 64-bit key per round.
    """

    __slots__ = ("_a", "_b", "_keys", "_n")

    def __init__(self, n: int, keys: Sequence[int]):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if len(keys) % 2:
            raise ValueError("an even number of round keys is needed (the domain's shape is restored every 2 rounds)")
        self._n = n
        self._a = math.isqrt(max(0, n - 1)) + 1
        self._b = max(1, -(-n // self._a))
        self._keys = tuple(k & _M64 for k in keys)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, pos):
        if isinstance(pos, slice):
            return [self[i] for i in range(*pos.indices(self._n))]
        n = self._n
        if pos < 0:
            pos += n
        if not 0 <= pos < n:
            raise IndexError(f"position {pos} out of range for {n}")
        a, b, keys = self._a, self._b, self._keys
        x = pos
        while True:
            hi, lo = divmod(x, b)
            m_hi, m_lo = a, b
            for k in keys:
                z = lo ^ k
                z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
                z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
                hi, lo = lo, (hi + (z ^ (z >> 31))) % m_hi
                m_hi, m_lo = m_lo, m_hi
            x = hi * b + lo
            if x < n:
                return x

    def __eq__(self, other) -> bool:
        if isinstance(other, ShuffledOrder):
            return (self._n, self._keys) == (other._n, other._keys)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._n, self._keys))

    def __repr__(self) -> str:
        return f"ShuffledOrder(n={self._n})"


def epoch_permutation(n: int, data_epoch: int, seed: int | None) -> Sequence[int]:
    """The order in which rows are served in data epoch ``data_epoch``: ``order[pos]`` is a row index.

    ``seed is None`` -> ``range(n)`` (file order every epoch). Otherwise a ``ShuffledOrder``, a
    pure function of ``(n, seed, data_epoch)`` that holds no per-row state: every epoch is
    shuffled differently, and the same epoch identically in every process and after a restart
    (the round keys are a sha256 of the pair, not ``hash()``, which varies per process).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if seed is None:
        return range(n)
    digest = hashlib.sha256(f"rollfleet-epoch:{int(seed)}:{int(data_epoch)}".encode()).digest()
    keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "big") for r in range(_ROUNDS)]
    return ShuffledOrder(n, keys)
