"""What a sequence's declared controls do to its row of logits before it picks:
logit_bias, OpenAI's presence and frequency penalties, vLLM's repetition penalty and
min_tokens. Only the rows that declared one come here (Advance.controlled counts
them); the logits a row's logprobs score are left raw.

Order, as vLLM's sampler: min_tokens' mask, the bias, then the penalties; temperature,
min_p, top_k and top_p follow in `sample`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from lanes.generation.seq import Seq

Array = np.ndarray[Any, Any]


def processed(seq: Seq, row: Array, ends: Collection[int]) -> Array:
    """`seq`'s [vocab] `row` after its controls (a copy; `row` is not changed): `ends`
    (eos) and its stop tokens masked to -inf before its min_tokens, its logit_bias
    added, its penalties taken on what it has made (and, for repetition, its prompt)."""
    out = row.astype(np.float64)
    if len(seq.tokens) < seq.min_tokens:
        out[[*ends, *seq.stop_token_ids]] = -np.inf
    if seq.logit_bias:
        out[list(seq.logit_bias)] += list(seq.logit_bias.values())
    if seq.presence_penalty or seq.frequency_penalty or seq.repetition_penalty != 1:
        counts = _counts(seq)
        if counts and (seq.presence_penalty or seq.frequency_penalty):
            ids = np.fromiter(counts, dtype=np.int64, count=len(counts))
            made = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            out[ids] -= seq.frequency_penalty * made + seq.presence_penalty
        if seq.repetition_penalty != 1:
            seen = np.unique(np.asarray([*seq.prompt_ids, *counts], dtype=np.int64))
            scores = out[seen]
            penalty = seq.repetition_penalty
            out[seen] = np.where(scores > 0, scores / penalty, scores * penalty)
    return out


def _counts(seq: Seq) -> dict[int, int]:
    """How often `seq` made each token: counted on from where the last step stopped,
    never recounted (a sequence's tokens are only ever appended)."""
    counts = seq.counts
    tokens = seq.tokens
    for token in tokens[seq.counted :]:
        counts[token] = counts.get(token, 0) + 1
    seq.counted = len(tokens)
    return counts
