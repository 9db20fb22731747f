"""A decoder's KV cache on the host, and what one step returns.

`Past` holds, per layer, keys and values shaped [batch, heads, length, head_dim] as
numpy arrays (the Optimum signature's `past_key_values.N.key|value`). The same
cache on the session's device is `DevicePast` (lanes/tasks/device_past.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class Past:
    """The KV cache: per layer, keys and values shaped [batch, heads, length, head_dim]."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def arrays(self) -> tuple[Array, ...]:
        """Keys then values."""
        return (*self.keys, *self.values)

    @property
    def nbytes(self) -> int:
        """The bytes its arrays hold."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def row(self, r: int) -> Past:
        """Row `r` alone (views, not copies)."""
        return Past(
            tuple(k[r : r + 1] for k in self.keys), tuple(v[r : r + 1] for v in self.values)
        )

    def zeros(self, batch: int, length: int) -> Past:
        """Zeros shaped like these arrays, with `batch` rows and `length` positions."""
        _, heads, _, dim = self.keys[0].shape

        def zeros(a: Array) -> Array:
            return np.zeros((batch, heads, length, dim), dtype=a.dtype)

        return Past(tuple(zeros(k) for k in self.keys), tuple(zeros(v) for v in self.values))

    @classmethod
    def concatenate(cls, parts: Sequence[Past]) -> Past:
        """`parts`' rows one after another; they share a length."""
        keys = zip(*(p.keys for p in parts), strict=True)
        values = zip(*(p.values for p in parts), strict=True)
        return cls(tuple(np.concatenate(k) for k in keys), tuple(np.concatenate(v) for v in values))


@dataclass(frozen=True)
class StepOutput:
    logits: Array  # [batch, new tokens, vocab]
    present: Past  # the cache including the new tokens
