"""The offline runs of an embed or infer workload's model: when an interactive arrival
stops one, and how many items the next may take (see serving/worker.py).

An arrival stops the run on the model at once only while more of it is left than it
has done (`stop_delay`, by the cost model's estimate of its length); past its middle
the run may end, but is stopped once the arrival has waited as long as the run had
run. What a stopped run had done is lost, so runs are sized to the gaps the traffic
leaves (`gap_filling_items`, from the interactive arrival rate).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import onnxruntime as ort


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
