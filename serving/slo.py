"""How a workload's latency targets steer its dynamic batches.

`slo.p99_ms` is a target: the next batch never takes so many requests that its
predicted run (the cost model's `upper` estimate) would end past the p99 budget of
a request in it (its arrival + p99_ms); among the sizes that keep every budget, it
takes the one with the most items per second of run. A request that cannot meet its
budget even alone is served anyway (it is late, not failed) and constrains nobody.

A request's deadline (`slo.timeout_ms`, or the caller's own) is hard: one whose run,
alone and now, is expected to end past it (the `seconds` estimate: even a typical run
is too late) is answered 504 at once instead of late; and a batch never grows so that
its `upper` estimate ends past the deadline of a request in it.

Pure: the planner reads arrivals, deadlines and sizes, the time and a fit, and says
what to do; the worker does it. Without a fit (too few runs seen) there is no plan,
and the batcher behaves as without an SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lanes.costmodel import Fit


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
        if w.deadline is not None and now + run_seconds(fit, 1, w.tokens) > w.deadline:
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
