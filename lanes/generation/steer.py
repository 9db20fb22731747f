"""SLOs that steer a generate workload's steps: `slo.ttft_ms` bounds one step's
prefill, `slo.itl_ms` its rows, through costs measured on the workload's own runs.

A step runs the joiners' prefill before the rows' decode, so whatever it prefills
delays every row's next token, and a newcomer's first token waits for the whole
prefill it is part of. The prefill budget (the scheduler's `max_prefill_tokens`, a
hard one: longer prompts are prefilled in parts over several steps) is the tokens
whose prefill fits in `ttft_ms` by the prefill cost model; the rows are as many as
one decode step of the current cache length fits in `itl_ms` by the decode cost
model. Both models (lanes/costmodel.py) learn from every run; until they have a fit,
the prefill budget is DEFAULT_PREFILL_TOKENS and the rows `max_batch_size`. Pure: the
engine feeds it its runs' times and reads the two bounds before each plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lanes.costmodel import CostModel

DEFAULT_PREFILL_TOKENS = 512  # a step's prefill budget before the cost model has a fit
MIN_PREFILL_TOKENS = 16  # a chunk is never smaller: each run has its fixed cost too


class Steer:
    """The prefill budget and the row bound of one generate workload's steps."""

    def __init__(
        self,
        ttft_s: float | None,
        itl_s: float | None,
        max_rows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.max_rows = max_rows
        self.prefill_cost = CostModel(clock=clock)
        self.decode_cost = CostModel(clock=clock)

    @property
    def chunked(self) -> bool:
        """Whether prefill is bounded (and long prompts are prefilled in parts)."""
        return self.ttft_s is not None

    def observe_prefill(self, rows: int, tokens: int, seconds: float) -> None:
        """A prefill run (or a chunk) of `rows` prompts, `tokens` padded in all."""
        self.prefill_cost.observe(rows, tokens, seconds)

    def observe_decode(self, rows: int, length: int, seconds: float) -> None:
        """A decode step of `rows` over a cache `length` long."""
        self.decode_cost.observe(rows, rows * length, seconds)

    def prefill_tokens(self, default: int) -> int:
        """One step's prefill budget in tokens: `default` without `ttft_ms`."""
        if self.ttft_s is None:
            return default
        fit = self.prefill_cost.fit
        if fit is None:
            return DEFAULT_PREFILL_TOKENS
        room = self.ttft_s / fit.spread - fit.fixed_s - fit.per_item_s
        if fit.per_token_s <= 0:
            return default if room >= 0 else MIN_PREFILL_TOKENS
        # The epsilon keeps float rounding from costing a token (as in the cost model).
        return max(int(room / fit.per_token_s + 1e-9), MIN_PREFILL_TOKENS)

    def rows(self, length: int) -> int:
        """Rows one decode step may hold over a cache `length` long (at least 1)."""
        if self.itl_s is None:
            return self.max_rows
        return self.decode_cost.largest_batch(self.itl_s, self.max_rows, length)
