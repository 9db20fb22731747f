"""How a workload's latency targets steer its dynamic batches.

`slo.p99_ms` is a target: the next batch never takes so many requests that its
predicted run (the cost model's `upper` estimate) would end past the p99 budget of
a request in it (its arrival + p99_ms); among the sizes that keep every budget, it
takes the one with the most items per second of run. A request that cannot meet its
budget even alone is served anyway (it is late, not failed) and constrains nobody.

A request's deadline (`slo.timeout_ms`, or the caller's own) is hard: one whose run,
alone and now, is sure to end past it is answered 504 at once instead of late; and a
batch never grows so that its `upper` estimate ends past the deadline of a request in
it. Sure: by the fit's expected time (not `upper`: even a typical run is too late) at
the sizes it has seen (`Fit.at_least`), never by its extrapolation past them: a young
fit's (a few sizes seen) can say many times what a smaller or larger run takes.

`plan_batch` is pure: it reads arrivals, deadlines and sizes, the time and a fit, and
says what to do. `Steering` is one worker's use of it, on the worker's clock. Without a
fit (too few runs seen) there is no plan, and the batcher behaves as without an SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lanes.costmodel import CostModel, Fit
from lanes.serving.batching import Pending, unreachable

# How often steering takes the cost model's fit afresh, on the worker's clock: a refit
# (least squares over the window) costs more than a small model's run, and the fit
# moves little from one batch to the next.
REFIT_S = 0.1


@dataclass(frozen=True)
class Waiting:
    """What the planner needs of one queued request (times on the worker's clock)."""

    arrived: float
    deadline: float | None
    tokens: int  # its length in tokens, what a batch pads to (0 without tokens)


@dataclass(frozen=True)
class BatchPlan:
    """The next batch: the first `size` requests of those not `unreachable` (indices
    into the candidates, in order), who are answered 504 now."""

    size: int
    unreachable: tuple[int, ...]


def run_seconds(fit: Fit, items: int, tokens: int) -> float:
    """The expected time of a run of `items` padded to `tokens` in all."""
    return max(fit.seconds(items, tokens), 0.0)


def plan_batch(
    waiting: Sequence[Waiting], now: float, fit: Fit, p99_s: float | None, most: int
) -> BatchPlan:
    """The batch to run now out of `waiting` (the head of the queue, oldest first), of
    at most `most` requests. `size` is at least 1 whenever a request is reachable."""
    unreachable: list[int] = []
    kept: list[Waiting] = []
    for i, w in enumerate(waiting):
        if w.deadline is not None and now + fit.at_least(1, w.tokens) > w.deadline:
            unreachable.append(i)
        elif len(kept) < most:
            kept.append(w)
    best, best_rate = 0, -1.0
    longest = 0
    hard = soft = math.inf  # the earliest deadline and p99 budget in the batch so far
    for k, w in enumerate(kept, start=1):
        longest = max(longest, w.tokens)
        upper = run_seconds(fit, k, k * longest) * fit.spread
        if w.deadline is not None:
            hard = min(hard, w.deadline)
        if p99_s is not None:
            budget = w.arrived + p99_s
            if now + run_seconds(fit, 1, w.tokens) * fit.spread <= budget:
                soft = min(soft, budget)  # it can still make it: it counts
        # The run only grows with k and the bounds only shrink: the first miss ends it.
        # One request alone always runs (it was reachable; p99 is only a target).
        if k > 1 and now + upper > min(hard, soft):
            break
        rate = k / upper if upper > 0 else math.inf
        if rate >= best_rate:
            best, best_rate = k, rate
    return BatchPlan(best, tuple(unreachable))


class Steering:
    """One workload's `slo.p99_ms` and deadlines, applied with its cost model."""

    def __init__(
        self, cost: CostModel, p99_s: float | None, most: int, clock: Callable[[], float]
    ) -> None:
        self.cost = cost
        self.p99_s = p99_s
        self.most = most  # max_batch_size
        self._clock = clock
        self._fit: Fit | None = None
        self._fit_at = -math.inf
        self._busy_until = 0.0  # while a batch runs: when it ends at the earliest

    def fit(self) -> Fit | None:
        """The cost model's fit, refitted at most every REFIT_S."""
        now = self._clock()
        if now - self._fit_at >= REFIT_S:
            self._fit, self._fit_at = self.cost.fit, now
        return self._fit

    def started(self, start: float, items: Sequence[Any]) -> None:
        """A batch of `items` started at `start`."""
        fit = self.fit()
        if fit is not None:
            self._busy_until = start + fit.at_least(len(items), padded_tokens(items))

    def check_reachable(
        self, items: Sequence[Any], now: float, deadline: float | None, busy: bool
    ) -> float:
        """Raise DeadlineExceeded now if these items' run is sure to end past `deadline`
        even if it starts as soon as the batch on the model (if `busy`) ends (both by
        `Fit.at_least`). Returns how long before the deadline a queued item's timer
        fires: its own run at least (0 without a deadline or a fit, or for an item
        smaller than any run seen)."""
        fit = self.fit() if deadline is not None else None
        if fit is None or deadline is None:
            return 0.0
        own = fit.at_least(1, max((tokens_of(i) for i in items), default=0))
        rest = max(self._busy_until - now, 0.0) if busy else 0.0
        if now + rest + own > deadline:
            raise unreachable(deadline - now)
        return own

    def batch_size(self, candidates: list[Pending]) -> int:
        """How many of the first waiting requests the next batch takes; those whose run
        can no longer end by their deadline are answered 504 first. `most` until the
        model has a fit."""
        fit = self.fit()
        if fit is None:
            return self.most
        now = self._clock()
        waiting = [Waiting(p.enqueued_at, p.deadline, tokens_of(p.item)) for p in candidates]
        plan = plan_batch(waiting, now, fit, self.p99_s, self.most)
        for i in plan.unreachable:
            late = candidates[i]
            left = (late.deadline if late.deadline is not None else now) - now
            late.future.set_exception(unreachable(left, now - late.enqueued_at))
        return plan.size


def tokens_of(item: Any) -> int:
    """An item's length in tokens (what a batch pads to); 0 for items without tokens."""
    n = getattr(item, "n_tokens", 0)
    return n if isinstance(n, int) else 0


def padded_tokens(items: Sequence[Any]) -> int:
    """What a batch of `items` pads to, in all."""
    return len(items) * max((tokens_of(i) for i in items), default=0)
