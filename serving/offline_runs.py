"""The offline lane of an embed or infer workload on its model's thread: when its
batches take turns with the interactive ones, how many items the next run takes, and
when an interactive arrival stops the run (see serving/worker.py for the lanes).

An offline run fits in the interactive workload's slack: its `slo.p99_ms` minus its
measured service time (the cost model's upper estimate of a typical interactive
batch), or DEFAULT_SLACK_S without a p99 SLO. An arrival stops the run on the model
at once only while more of it is left than it has done (`stop_delay`, by the cost
model's estimate of its length); past its middle the run may end, but is stopped once
the arrival has waited as long as the run had run. What a stopped run had done is
lost, so where arrivals stop runs they are sized to the gaps the traffic leaves
(`gap_filling_items`, from the interactive arrival rate).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort

from lanes.costmodel import CostModel
from lanes.serving.metrics import Rate, Utilization
from lanes.serving.slo import tokens_of

# An offline run's budget without `slo.p99_ms`: what an interactive request may wait
# behind one offline batch at most.
DEFAULT_SLACK_S = 0.020
# Offline batches until the cost model has seen enough runs to size them.
LEARNING_ITEMS = 4
# How far back the interactive lane's busy share looks when it decides whether offline
# batches go beside it: long enough to see a load, short enough to follow it.
TURNS_WINDOW_S = 1.0
_WEIGHT = 0.5  # of the newest interactive batch in the typical one: adapts in a few


class OfflineLane:
    """The offline lane's share of one workload's model thread.

    `cost` is the worker's cost model (learned from both lanes' whole runs), `clock`
    its clock. With `beside_threads` (serving/beside.py) offline batches run beside
    the interactive ones until these keep the model busier than `beside_until` over
    the last TURNS_WINDOW_S; then, as always without them, the lanes take turns here.
    Runs taken in turns are stopped by interactive arrivals where `preempt` (always
    with `beside_threads`: a turn then means a busy model)."""

    def __init__(
        self,
        cost: CostModel,
        p99_s: float | None,
        max_batch_size: int,
        beside_threads: int,
        beside_until: float,
        preempt: bool,
        clock: Callable[[], float],
    ) -> None:
        self.cost = cost
        self.p99_s = p99_s
        self.max_batch_size = max_batch_size
        self.beside_threads = beside_threads
        self.beside_until = beside_until
        self.preempts = preempt or bool(beside_threads)
        self.clock = clock
        self.run: OfflineRun | None = None  # on the model thread now
        self._typical = _Typical()  # of interactive batches: their service time
        self._arrivals = Rate()  # interactive requests: sizes the runs they may stop
        self._interactive_busy = Utilization(window_s=TURNS_WINDOW_S)

    def arrived(self, at: float) -> None:
        """An interactive request came (its rate sizes runs that arrivals stop)."""
        if self.preempts:
            self._arrivals.record(at)

    def interactive_waits(self) -> None:
        """An interactive request waits: if arrivals stop runs and one is on the model,
        stop it now or, nearly done, later."""
        run = self.run
        if self.preempts and run is not None:
            run.stop_for(self.clock() - run.start)

    def interactive_ran(self, start: float, end: float, items: int, tokens: int | None) -> None:
        """An interactive run; `tokens` (its padded tokens) when it ran whole."""
        self._interactive_busy.record(start, end)
        if tokens is not None:
            self._typical.observe(items, tokens)

    def takes_turns(self) -> bool:
        """Whether offline batches run on the model's thread now, in turns."""
        if not self.beside_threads:
            return True
        return self._interactive_busy.fraction(self.clock()) > self.beside_until

    def slack_s(self) -> float:
        """What one offline run may take: the p99 SLO minus the interactive service
        time (DEFAULT_SLACK_S without a p99 SLO); 0 when the service time alone
        exceeds the SLO."""
        if self.p99_s is None:
            return DEFAULT_SLACK_S
        service = self.cost.estimate(self._typical.items, self._typical.tokens)
        return max(self.p99_s - (service.upper if service is not None else 0.0), 0.0)

    def items(self, candidates: Sequence[Any]) -> int:
        """How many of the waiting offline items one run takes: as many as fit in the
        slack by the cost model (padded to the longest of the candidates), at most
        `max_batch_size`; LEARNING_ITEMS until the model has a fit. Where arrivals stop
        runs, of those the number that wastes the least in the gaps the interactive
        arrivals leave (`gap_filling_items`). 0 while offline batches go beside the
        interactive ones instead."""
        if not self.takes_turns():
            return 0
        most = self.max_batch_size
        fit = self.cost.fit
        if fit is None:
            return min(LEARNING_ITEMS, most)
        tokens = max((tokens_of(c) for c in candidates), default=0)
        fits = self.cost.largest_batch(self.slack_s(), most, tokens)
        if not self.preempts:
            return fits
        rate = self._arrivals.per_second(self.clock())
        return gap_filling_items(lambda k: fit.seconds(k, k * tokens), rate, fits)


def stop_delay(done_s: float, expected_s: float | None) -> float:
    """When an interactive arrival should stop the offline run on the model, in seconds
    from now, `done_s` into a run expected to take `expected_s` (None: not known yet).

    At once when more of the run is left than it has done: finishing would keep the
    arrival waiting longer than a stop throws away. Otherwise the run may end first,
    but is stopped once the arrival has waited `done_s`, so a wrong estimate costs at
    most twice the better of the two choices made knowing when the run ends."""
    if expected_s is None or expected_s - done_s > done_s:
        return 0.0
    return done_s


@dataclass(eq=False)
class OfflineRun:
    """An offline run on the model thread: its stop, its start and expected length
    (the cost model's, on the worker's clock), and a stop scheduled for later."""

    start: float
    expected_s: float | None
    stop: ort.RunOptions = field(default_factory=ort.RunOptions)
    timer: asyncio.TimerHandle | None = None

    @property
    def stopping(self) -> bool:
        return self.stop.terminate or self.timer is not None

    def stop_for(self, done_s: float) -> None:
        """An interactive arrival `done_s` into the run: stop it now or later."""
        if self.stopping:
            return
        delay = stop_delay(done_s, self.expected_s)
        if delay == 0:
            self.end_now()
        else:
            self.timer = asyncio.get_running_loop().call_later(delay, self.end_now)

    def end_now(self) -> None:
        self.stop.terminate = True

    def ended(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def gap_filling_items(seconds: Callable[[int], float], rate: float, most: int) -> int:
    """The offline run size (1..`most`) that does the most offline work per idle second
    when interactive requests arrive at `rate` per second and stop the run they find;
    `seconds(k)` is a run of k items' expected length.

    Taking arrivals as random (Poisson), a run of c seconds ends before the next one
    with probability exp(-rate c), and a try costs (1 - exp(-rate c)) / rate idle
    seconds on average, whether it ends or is stopped; so k items per run do
    k rate / (exp(rate c(k)) - 1) items per idle second. Where a run's fixed cost is
    small, that falls with k: in busy traffic a few items per run waste the least, and
    as the traffic thins out the best size grows to `most`. A run past its middle
    may end instead of stopping (`stop_delay`), so the size errs on the small side."""
    if rate <= 0:
        return most
    best, best_rate = 1, 0.0
    for k in range(1, most + 1):
        exponent = rate * max(seconds(k), 1e-9)
        done = k / math.expm1(exponent) if exponent < 700 else 0.0
        if done > best_rate:
            best, best_rate = k, done
    return best


class _Typical:
    """A running mean of interactive batches' items and padded tokens."""

    def __init__(self) -> None:
        self.items = 1
        self.tokens = 0
        self._items = self._tokens = 0.0
        self._seen = False

    def observe(self, items: int, tokens: int) -> None:
        if not self._seen:
            self._items, self._tokens, self._seen = float(items), float(tokens), True
        else:
            self._items += _WEIGHT * (items - self._items)
            self._tokens += _WEIGHT * (tokens - self._tokens)
        self.items = max(round(self._items), 1)
        self.tokens = round(self._tokens)
