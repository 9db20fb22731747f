"""What a batch costs: run time learned online from the batches a workload runs.

    cost = CostModel()
    cost.observe(items=16, tokens=16 * 40, seconds=0.031)   # after every run
    cost.estimate(32, 32 * 40)      # Estimate(seconds=..., upper=...) or None
    cost.largest_batch(budget_s=0.02, max_items=64, tokens_per_item=40)

The model is linear, `seconds = fixed + per_item * items + per_token * tokens`, fitted
by least squares over the most recent runs (a window of runs no older than
`horizon_s`: a machine's speed drifts, and so does the mix of requests). `tokens` is
what a text batch pads to (items x its longest row); a task without tokens passes 0.
A coefficient the data cannot support (negative, or a feature that never varied) is
dropped and the rest refitted, so the model stays monotone in both sizes.

The spread is the `quantile` of measured / predicted over the window: `upper` is the
prediction scaled by it, what a run of that size takes at worst but rarely. Until
`min_samples` runs are seen the model knows nothing (`estimate` is None), and callers
keep their default behaviour. Pure: no threads, no I/O; the clock is injected.

Past the sizes it was fitted on a fit extrapolates, and a young one (a burst of full
batches, or runs of a few sizes) can over-estimate a smaller or larger run several
times over. `Fit.at_least` is what a refusal may stand on: the fit read only at the
sizes it has seen, less than or as much as `seconds` at any size.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Estimate:
    """A run's predicted time, and its time at the model's spread quantile."""

    seconds: float
    upper: float


@dataclass(frozen=True, eq=False)
class Seen:
    """The sizes of the runs a fit was made from: each one's items, and its rows' length
    in tokens (what it padded to, per item; 0 without tokens)."""

    items: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, items: Sequence[int] | np.ndarray, rows: Sequence[int] | np.ndarray) -> Seen:
        return cls(np.asarray(items, dtype=np.float64), np.asarray(rows, dtype=np.float64))


NOTHING_SEEN = Seen.of([], [])


@dataclass(frozen=True)
class Steps:
    """A non-decreasing step function: `most[i]` from `at[i]` on (`at` ascending), 0
    before `at[0]`."""

    at: list[float]
    most: list[float]

    def __call__(self, x: float) -> float:
        i = bisect_right(self.at, x)
        return self.most[i - 1] if i else 0.0


@dataclass(frozen=True)
class Fit:
    """The fitted coefficients (seconds), the spread (measured / predicted), and the run
    sizes they were fitted on."""

    fixed_s: float
    per_item_s: float
    per_token_s: float
    spread: float
    samples: int
    seen: Seen = NOTHING_SEEN

    def seconds(self, items: int, tokens: int) -> float:
        return self.fixed_s + self.per_item_s * items + self.per_token_s * tokens

    def at_least(self, items: int, tokens: int) -> float:
        """What a run of `items` padded to `tokens` in all takes at least, by the sizes
        seen: the most of `seconds` at a seen size with rows no longer, of as many items
        or fewer; or of more items, their share for `items` (a batch's item takes no
        longer than a smaller batch's). 0 where no seen size has rows this short: the
        fit does not know how little a run smaller than any it saw takes."""
        if items == 1:  # what every waiting request asks, at every batch: a lookup
            return self._alone(tokens)
        seen = self.seen
        shorter = seen.rows * items <= tokens
        if items <= 0 or not shorter.any():
            return 0.0
        sizes, rows = seen.items[shorter], seen.rows[shorter]
        runs = self.fixed_s + self.per_item_s * sizes + self.per_token_s * sizes * rows
        return float(np.max(runs * np.minimum(1.0, items / sizes)))

    @cached_property
    def _alone(self) -> Steps:
        """`at_least(1, tokens)` by the row's length: each seen size's share for one
        item, the most over the rows no longer."""
        seen = self.seen
        shares = self.fixed_s / seen.items + self.per_item_s + self.per_token_s * seen.rows
        order = np.argsort(seen.rows, kind="stable")
        return Steps(seen.rows[order].tolist(), np.maximum.accumulate(shares[order]).tolist())


@dataclass(frozen=True)
class _Run:
    at: float
    items: int
    tokens: int
    seconds: float


class CostModel:
    """Run time per batch size (and padded tokens), learned from observed runs."""

    def __init__(
        self,
        *,
        window: int = 256,
        horizon_s: float = 300.0,
        quantile: float = 0.99,
        min_samples: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"quantile: expected a number in (0, 1), found {quantile!r}")
        self.quantile = quantile
        self.horizon_s = horizon_s
        self.min_samples = max(min_samples, 2)
        self._clock = clock
        self._runs: deque[_Run] = deque(maxlen=window)
        self._fit: Fit | None = None
        self._stale = True

    def observe(self, items: int, tokens: int, seconds: float) -> None:
        """One run of `items` (padded to `tokens` in all) that took `seconds`."""
        if items <= 0 or seconds < 0:
            return
        self._runs.append(_Run(self._clock(), items, max(tokens, 0), seconds))
        self._stale = True

    @property
    def fit(self) -> Fit | None:
        """The current fit, or None while there are fewer than `min_samples` recent runs."""
        if self._runs and self._runs[0].at < self._clock() - self.horizon_s:
            self._stale = True  # the oldest run has aged out
        if self._stale:
            self._fit = self._refit()
            self._stale = False
        return self._fit

    def estimate(self, items: int, tokens: int = 0) -> Estimate | None:
        fit = self.fit
        if fit is None:
            return None
        seconds = max(fit.seconds(items, tokens), 0.0)
        return Estimate(seconds, seconds * fit.spread)

    def largest_batch(self, budget_s: float, max_items: int, tokens_per_item: float = 0) -> int:
        """The most items (1..max_items) whose `upper` estimate fits in `budget_s`;
        `max_items` while the model knows nothing, 1 when even one item does not fit."""
        fit = self.fit
        if fit is None:
            return max_items
        per_item = (fit.per_item_s + fit.per_token_s * tokens_per_item) * fit.spread
        room = budget_s - fit.fixed_s * fit.spread
        if per_item <= 0:
            return max_items if room >= 0 else 1
        # The epsilon keeps float rounding (9 x 1 ms = 8.999... ms) from costing an item.
        return int(min(max(room / per_item + 1e-9, 1), max_items))

    def _refit(self) -> Fit | None:
        cutoff = self._clock() - self.horizon_s
        while self._runs and self._runs[0].at < cutoff:
            self._runs.popleft()
        if len(self._runs) < self.min_samples:
            return None
        items = np.array([r.items for r in self._runs], dtype=np.float64)
        tokens = np.array([r.tokens for r in self._runs], dtype=np.float64)
        seconds = np.array([r.seconds for r in self._runs], dtype=np.float64)
        columns = {"fixed": np.ones_like(items), "items": items, "tokens": tokens}
        # A feature that never varied cannot be told apart from the fixed cost, except
        # items when it never varied: then time is taken as proportional to the items
        # (for other sizes an over-estimate of larger batches, the safe side).
        if np.ptp(tokens) == 0:
            del columns["tokens"]
        if np.ptp(items) == 0:
            del columns["fixed"]
        coef = _nonnegative_fit(columns, seconds)
        fixed, per_item, per_token = (coef.get(n, 0.0) for n in ("fixed", "items", "tokens"))
        predicted = fixed + per_item * items + per_token * tokens
        ratios = seconds / np.maximum(predicted, 1e-12)
        spread = max(float(np.quantile(ratios, self.quantile)), 1.0)
        seen = Seen.of(items, tokens // items)
        return Fit(fixed, per_item, per_token, spread, len(self._runs), seen)


def _nonnegative_fit(columns: dict[str, np.ndarray], target: np.ndarray) -> dict[str, float]:
    """Least squares; a feature whose coefficient comes out negative is dropped and the
    rest refitted (at most one pass per feature)."""
    names = list(columns)
    while names:
        matrix = np.stack([columns[n] for n in names], axis=1)
        solution, *_ = np.linalg.lstsq(matrix, target, rcond=None)
        negative = [n for n, c in zip(names, solution, strict=True) if c < 0]
        if not negative:
            return {n: float(c) for n, c in zip(names, solution, strict=True)}
        names.remove(min(negative, key=lambda n: solution[names.index(n)]))
    return {}
