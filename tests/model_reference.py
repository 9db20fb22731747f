"""What the demo decoder itself says, computed apart from lanes' engine: the raw logits
of one whole prefill of a prompt, and their log-softmax in float64. The logprobs,
echo and sampling-control tests check the served numbers against these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lanes.tasks.decoder import Decoder

Array = np.ndarray[Any, Any]


def log_softmax(logits: Array) -> Array:
    """Log-softmax along the last axis, in float64 (written apart from lanes')."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    rows: Array = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return rows


def prefill_logits(decoder: Decoder, ids: Sequence[int]) -> Array:
    """The raw logits [len(ids), vocab] of one run of `ids` on an empty cache: row i is
    what the model says of the token after ids[: i + 1]."""
    n = len(ids)
    step = decoder.step(
        np.asarray([list(ids)], dtype=np.int64),
        np.ones((1, n), dtype=np.int64),
        np.arange(n, dtype=np.int64)[None],
        decoder.empty_past(1),
    )
    rows: Array = step.logits[0].astype(np.float64)
    return rows


def next_logprobs(decoder: Decoder, ids: Sequence[int]) -> Array:
    """The next token's log-softmax after `ids` (the last row of their prefill's)."""
    return log_softmax(prefill_logits(decoder, ids)[-1])
