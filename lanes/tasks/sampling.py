"""Picking the next token from one row of logits. Pure: no model, no state but the rng.

Shared by the single-sequence loop in `decoder.py` and the continuous-batching
engine, so one request samples the same way whichever path serves it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

# vLLM's: a temperature below it picks as 0 does. The logits divided by much less
# would overflow (1e-320: all infinite, every token as likely) to no one's benefit.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) is greedy; top_k 0 and top_p 1 cut nothing; top_p 0 keeps only the
    likeliest token (OpenAI accepts it); min_p 0 (vLLM's) cuts nothing."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.temperature < 0
            or self.top_k < 0
            or not 0 <= self.top_p <= 1
            or not 0 <= self.min_p <= 1
        ):
            raise ValueError(
                "expected temperature >= 0, top_k >= 0, 0 <= top_p <= 1 and 0 <= min_p <= 1, "
                f"found {self.temperature}, {self.top_k}, {self.top_p}, {self.min_p}"
            )


def generator(seed: int | None) -> np.random.Generator:
    """The random generator of one sequence. Any integer is a seed (OpenAI's are signed
    64-bit; numpy takes only non-negative ones): a negative one is taken modulo 2**64,
    so each signed 64-bit integer still names a stream of its own."""
    return np.random.default_rng(None if seed is None else seed % 2**64)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of a request's `choice`-th choice (OpenAI's `n`): its first keeps the
    request's seed, so n = 1 samples as before; each other one a signed 64-bit seed
    hashed from the seed and its place, so a rerun draws the same choices and no two
    choices share a stream. No seed: None, each choice's generator from fresh entropy."""
    if seed is None or choice == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def sample(logits: np.ndarray[Any, Any], params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token id from a [vocab] row of logits.

    Greedy (argmax) when temperature is 0 (or below GREEDY_BELOW). Otherwise: divide by temperature, drop
    the tokens less likely than min_p times the likeliest (as vLLM, before the other
    cuts), keep the top_k highest, keep the smallest most-likely set whose probability reaches
    top_p, and draw from what is left with `rng`. Deterministic for a given rng state.
    """
    if params.temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    scores = np.asarray(logits, dtype=np.float64) / params.temperature
    if params.min_p > 0:
        # p < min_p * p_max  <=>  score < max + log(min_p): no softmax needed.
        scores = np.where(scores < scores.max() + np.log(params.min_p), -np.inf, scores)
    candidates = np.arange(scores.shape[0])
    if 0 < params.top_k < scores.shape[0]:
        # In the vocabulary's order, as if the rest were masked (vLLM's): argpartition's
        # own order is reshuffled by a change in a row's last bits (batched rows round
        # otherwise), and a seeded draw would pick another token.
        candidates = np.sort(np.argpartition(scores, -params.top_k)[-params.top_k :])
        scores = scores[candidates]
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        reach = np.cumsum(probs[order])
        keep = min(int(np.searchsorted(reach, params.top_p)) + 1, len(order))
        candidates, probs = candidates[order[:keep]], probs[order[:keep]]
    cdf = np.cumsum(probs)
    pick = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(candidates[min(pick, len(candidates) - 1)])
