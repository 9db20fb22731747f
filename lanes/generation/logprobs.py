"""Log probabilities of generated tokens, from the model's raw logits.

As vLLM's default (`raw_logprobs`): the log-softmax of the row the model gave, before
temperature, top-k or top-p, so a token's logprob says what the model thinks of it,
whatever the request sampled with. `token_logprobs` serves only the rows that asked
(`Seq.top_logprobs`), all of them in one numpy pass; the others never reach it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
# The most alternatives anyone may ask for (chat's top_logprobs; completions' is 5).
MAX_TOP_LOGPROBS = 20
# Rows scored in one numpy pass: each pass holds a few float32 and int64 copies of its
# rows' logits, so a long prompt scored whole (echo) would hold them for every
# position at once (2048 positions of a 150k vocabulary: over a GB each).
ROWS_PER_PASS = 256


@dataclass(frozen=True, slots=True)
class Alternative:
    """A token the model could have made at a position, and its logprob there."""

    token: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's logprob, and the `k` likeliest tokens at its position
    (likeliest first; ties by token id), `k` as its sequence asked."""

    token: int
    logprob: float
    top: tuple[Alternative, ...] = ()


def log_softmax(logits: Array) -> Array:
    """Row-wise log-softmax of [rows, vocab] logits, in float32 (float16 logits are
    widened first: their sums would lose the small probabilities)."""
    x = np.asarray(logits, dtype=np.float32)
    shifted: Array = x - x.max(axis=-1, keepdims=True)
    result: Array = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def token_logprobs(
    logits: Array, tokens: Sequence[int], counts: Sequence[int]
) -> list[TokenLogprob]:
    """Per row of [rows, vocab] `logits`: `tokens[i]`'s logprob and the `counts[i]`
    likeliest tokens (no more than the vocabulary has). Always one record per row."""
    rows = len(tokens)
    if logits.ndim != 2 or logits.shape[0] != rows or len(counts) != rows:
        raise ValueError(
            f"token_logprobs: expected [{rows}, vocab] logits and {rows} counts, "
            f"found {logits.shape} and {len(counts)}"
        )
    if rows > ROWS_PER_PASS:
        return [
            record
            for at in range(0, rows, ROWS_PER_PASS)
            for record in _pass(
                logits[at : at + ROWS_PER_PASS],
                tokens[at : at + ROWS_PER_PASS],
                counts[at : at + ROWS_PER_PASS],
            )
        ]
    return _pass(logits, tokens, counts)


def _pass(logits: Array, tokens: Sequence[int], counts: Sequence[int]) -> list[TokenLogprob]:
    rows = len(tokens)
    lp = log_softmax(logits)
    chosen = lp[np.arange(rows), np.asarray(tokens, dtype=np.int64)].tolist()
    k = min(max(counts, default=0), lp.shape[1])
    if k == 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen, strict=True)]
    # The k likeliest of each row, unordered (argpartition: no full sort of a large
    # vocabulary), then ordered by logprob, the lower id first among equals as argmax
    # takes it (a tie across the k-th place may keep either: argpartition's choice).
    if k < lp.shape[1]:
        picked = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
    else:
        picked = np.broadcast_to(np.arange(lp.shape[1]), lp.shape)
    values = np.take_along_axis(lp, picked, axis=-1)
    order = np.lexsort((picked, -values), axis=-1)
    ids = np.take_along_axis(picked, order, axis=-1).tolist()
    best = np.take_along_axis(values, order, axis=-1).tolist()
    return [
        TokenLogprob(
            t, c, tuple(Alternative(i, v) for i, v in zip(ids[r][:n], best[r][:n], strict=True))
        )
        for r, (t, c, n) in enumerate(zip(tokens, chosen, counts, strict=True))
    ]
