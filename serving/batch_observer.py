"""What an embed or infer workload's batch worker (serving/worker.py) learns from its
runs: its metrics, per lane too, the cost model, the busy fraction, and the spans.

Everything here runs on the event loop, after the run's callers have their answers
(the worker schedules it with call_soon), so a lone request never waits on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lanes.costmodel import CostModel
from lanes.errors import DeadlineExceeded
from lanes.serving.access import RequestRecord
from lanes.serving.batching import LANES, Lane, LaneQueues, Pending
from lanes.serving.metrics import LaneSeries, Metrics, Utilization
from lanes.serving.offline_runs import OfflineLane
from lanes.serving.slo import padded_tokens
from lanes.serving.tracing import batch_spans, expired_span
from lanes.tasks.infer import InferItem, stack_runs
from lanes.tracing import Tracing


class BatchObserver:
    """One workload's runs into its series, its lanes' series, its cost model, the
    offline lane's view of the interactive one, and its spans (None: tracing is off).
    `stacks`: the task runs a batch's rows in one model run (False: an infer model whose
    first dim is fixed, which runs each item alone)."""

    def __init__(
        self,
        name: str,
        metrics: Metrics,
        cost: CostModel,
        offline: OfflineLane,
        clock: Callable[[], float],
        tracing: Tracing | None,
        stacks: bool = True,
    ) -> None:
        self.name = name
        self.stacks = stacks
        self.cost = cost
        self.offline = offline
        self.clock = clock
        self.lanes = {lane: LaneSeries.of(metrics, name, lane) for lane in LANES}
        self.utilization = Utilization()
        self._metrics = metrics
        self._tracing = tracing
        # Children looked up once: labels() per observation is measurable at c=1.
        self._utilization = metrics.utilization.labels(name)
        self._queue_wait = metrics.queue_wait.labels(name)
        self._queue_depth = metrics.queue_depth.labels(name)
        self._latency = metrics.request_latency.labels(name)
        self._run_time = metrics.run_time.labels(name)
        self._busy = metrics.busy_seconds.labels(name)
        self._batch_size = metrics.batch_size.labels(name)
        self.stats = metrics.statistics.of(name)

    def answered(self, seconds: float) -> None:
        """A request's latency, from its arrival to its answer."""
        self._latency.observe(seconds)

    def failed(self, request: RequestRecord | None, arrived: float, error: BaseException) -> None:
        """A request that failed (refused, its run failed, its caller went): one whose
        deadline passed in the queue (504) gets its queue wait's span, an error, when
        it is traced."""
        traced = request.trace if request is not None else None
        if self._tracing is None or traced is None or not isinstance(error, DeadlineExceeded):
            return
        expired_span(self._tracing, traced, arrived, self.clock, str(error))

    def depths(self, lanes: LaneQueues) -> None:
        """The queues' depths, both lanes'."""
        self._queue_depth.set(len(lanes.interactive))
        for lane, series in self.lanes.items():
            series.queue_depth.set(len(lanes.of(lane)))

    def ran(
        self,
        batch: list[Pending],
        lane: Lane,
        start: float,
        end: float,
        run_s: float | None,
        answered: Sequence[bool],
    ) -> None:
        """A run from `start` to `end`; `run_s`: the whole run's own time (None when it
        failed or was split), which teaches the cost model; `answered`: per item,
        whether it got its output (none: the run failed whole)."""
        series = self.lanes[lane]
        tokens = padded_tokens([p.item for p in batch]) if run_s is not None else None
        if lane == "interactive":
            for pending in batch:
                self._queue_wait.observe(start - pending.enqueued_at)
            self._batch_size.observe(len(batch))
            self.offline.interactive_ran(start, end, len(batch), tokens)
            self._statistics(batch, start, end, answered)
        self.utilization.record(start, end)  # the gauge is set when /metrics is read
        self._busy.inc(end - start)
        series.busy.inc(end - start)
        series.items.inc(len(batch))
        if run_s is not None and tokens is not None:
            self._run_time.observe(run_s)
            self.cost.observe(len(batch), tokens, run_s)
        if self._tracing is not None:
            batch_spans(self._tracing, self.name, batch, start, end, run_s, self.clock)

    def _statistics(
        self, batch: list[Pending], start: float, end: float, answered: Sequence[bool]
    ) -> None:
        """An interactive run in the workload's Triton statistics, counted as Triton
        counts: the model's executions by their rows when it answered, and each request
        with an item answered in it served once, each row of its items an inference (a
        request of 2 rows is 2, as one of batch size 2 is in Triton)."""
        if not any(answered):
            return
        rows = [rows_of(pending.item) for pending in batch]
        runs = runs_of([pending.item for pending in batch], self.stacks)
        for run in runs:  # their time not told apart: an equal share each
            self.stats.ran(sum(rows[i] for i in run), (end - start) / len(runs))
        inferences: dict[int, int] = {}  # id of each request's record (or lone item) -> rows
        waited: dict[int, float] = {}
        for pending, count, ok in zip(batch, rows, answered, strict=True):
            if ok:
                key = id(pending.request if pending.request is not None else pending)
                inferences[key] = inferences.get(key, 0) + count
                waited[key] = start - pending.enqueued_at
        for key, count in inferences.items():
            self.stats.served(waited[key], end - start, count)

    def stopped(self, given_back: int, start: float, end: float) -> None:
        """A stopped offline run: device time spent, `given_back` items preempted."""
        series = self.lanes["offline"]
        self.utilization.record(start, end)
        self._busy.inc(end - start)
        series.busy.inc(end - start)
        series.preemptions.inc(given_back)

    def busy_fraction(self) -> float:
        """The model's busy share of the last 10 s, on the worker's clock."""
        return self.utilization.fraction(self.clock())

    def refresh(self) -> None:
        """The gauges read when /metrics is: utilization, and the cost model's fit
        (refitted first if a run came since)."""
        self._utilization.set(self.busy_fraction())
        self._metrics.show_cost(self.name, self.cost.fit)


def runs_of(items: list[Any], stacks: bool) -> list[list[int]]:
    """The model runs of a batch of `items`, each as its items' indices: one per item
    where the rows do not stack (`stacks` false), one per shape of infer items'
    inputs (lanes.tasks.infer.stack_runs), else one of every item."""
    if not stacks:
        return [[i] for i in range(len(items))]
    if items and all(isinstance(item, InferItem) for item in items):
        return stack_runs(items)
    return [list(range(len(items)))]


def rows_of(item: Any) -> int:
    """An item's rows in the model's batch, Triton's inferences: an infer item's first
    dim (1 where the model's is fixed), one for an embed text."""
    return item.rows if isinstance(item, InferItem) else 1
