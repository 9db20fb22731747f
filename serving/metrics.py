"""Prometheus metrics of the serving endpoint, in a registry of the app's own."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from lanes.costmodel import Fit
from lanes.serving.model_stats import Statistics

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# lanes_model_loads' reasons: the load at the server's start, and one after an idle unload.
STARTUP = "startup"
WAKE = "wake"


class Utilization:
    """Busy fraction of one executor over a sliding window of recent runs.

    A running sum keeps `record` and `fraction` O(1) amortised: at thousands of
    runs a second, summing the whole window per batch cost more than the model.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._runs: deque[tuple[float, float]] = deque()
        self._busy = 0.0  # sum of end - start over _runs

    def record(self, start: float, end: float) -> None:
        self._runs.append((start, end))
        self._busy += end - start
        self._forget_before(end - self.window_s)  # bounded even if nobody reads the gauge

    def fraction(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        self._forget_before(since)
        if not self._runs:
            self._busy = 0.0  # no float drift survives an idle window
            return 0.0
        first_start = self._runs[0][0]
        busy = self._busy - max(0.0, since - first_start)  # the first run may straddle `since`
        return min(max(busy, 0.0) / self.window_s, 1.0)

    def _forget_before(self, since: float) -> None:
        while self._runs and self._runs[0][1] < since:
            start, end = self._runs.popleft()
            self._busy -= end - start


class Rate:
    """Events per second (a step's tokens, requests) over a sliding window."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def record(self, at: float, count: int = 1) -> None:
        self._events.append((at, count))
        self._total += count
        self._forget_before(at - self.window_s)  # bounded even if nobody reads it

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._forget_before(now - self.window_s)
        return self._total / self.window_s

    def _forget_before(self, since: float) -> None:
        while self._events and self._events[0][0] < since:
            self._total -= self._events.popleft()[1]


class Metrics:
    """Every series the endpoint exports, and each workload's Triton statistics
    (serving/model_stats.py, timed by `now`, the wall clock); one instance per app."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self.statistics = Statistics(now)
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "lanes_request_latency_seconds",
            "Time from a request's arrival to its answer.",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "lanes_queue_wait_seconds",
            "Time a request waited in the queue before its batch ran.",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "lanes_batch_size",
            "Requests per model run.",
            ["workload"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.run_time = Histogram(
            "lanes_batch_run_seconds",
            "Time of one model run.",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("lanes_queue_depth", "Requests waiting.", ["workload"], registry=r)
        self.busy_seconds = Counter(
            "lanes_executor_busy_seconds",
            "Time the model executor spent running.",
            ["workload"],
            registry=r,
        )
        self.utilization = Gauge(
            "lanes_executor_utilization",
            "Busy fraction of the model executor over the last 10 s.",
            ["workload"],
            registry=r,
        )
        # Per lane: interactive requests and offline items (runner kind endpoint) share
        # the model, interactive first (a generate workload's items are sequences).
        self.lane_items = Counter(
            "lanes_lane_items",
            "Items run, by lane (interactive requests' inputs, offline records' items).",
            ["workload", "lane"],
            registry=r,
        )
        self.lane_queue_depth = Gauge(
            "lanes_lane_queue_depth", "Items waiting, by lane.", ["workload", "lane"], registry=r
        )
        self.lane_busy_seconds = Counter(
            "lanes_lane_busy_seconds",
            "Time the model executor spent on each lane's batches.",
            ["workload", "lane"],
            registry=r,
        )
        # Each embed/infer workload's cost model (lanes/costmodel.py): one series each.
        self.cost_fixed = Gauge(
            "lanes_cost_fixed_seconds",
            "Cost model: the fixed time of one run (run = fixed + per item x items + per "
            "token x padded tokens).",
            ["workload"],
            registry=r,
        )
        self.cost_per_item = Gauge(
            "lanes_cost_per_item_seconds",
            "Cost model: the time each item adds to a run.",
            ["workload"],
            registry=r,
        )
        self.cost_per_token = Gauge(
            "lanes_cost_per_token_seconds",
            "Cost model: the time each padded token adds to a run (0 without tokens).",
            ["workload"],
            registry=r,
        )
        self.cost_spread = Gauge(
            "lanes_cost_spread",
            "Cost model: measured over predicted run time at its quantile (upper "
            "estimate = prediction x spread).",
            ["workload"],
            registry=r,
        )
        self.cost_samples = Gauge(
            "lanes_cost_samples",
            "Cost model: the recent runs it is fitted on (0: too few yet, nothing is sized by it).",
            ["workload"],
            registry=r,
        )
        self.lane_preemptions = Counter(
            "lanes_lane_preemptions",
            "Sequences that gave their row up to an interactive one, by lane (a generate "
            "workload's offline sequences; they resume where they were).",
            ["workload", "lane"],
            registry=r,
        )
        self.responses = Counter(
            "lanes_responses",
            "Responses by route and status code.",
            ["route", "code"],
            registry=r,
        )
        self.workload_responses = Counter(
            "lanes_workload_responses",
            "Responses to a workload's requests by status code (those whose workload the "
            "server knew it hosts: not a 401, nor an unknown model's 404).",
            ["workload", "code"],
            registry=r,
        )
        # Scale to zero inside a replica: embed/infer workloads with `idle_unload_s`.
        self.model_loaded = Gauge(
            "lanes_model_loaded",
            "1 while the workload's model session is in memory, 0 while it is unloaded "
            "(idle_unload_s) or loading again, or after its start-up load failed.",
            ["workload"],
            registry=r,
        )
        # Every load counts, the start-up one too: a reader comparing loads with unloads,
        # or looking for a workload that loaded twice, needs both kinds.
        self.model_loads = Counter(
            "lanes_model_loads",
            "Loads of a workload's model, failed ones too, by reason: startup (the server's "
            "start, every interactive workload) or wake (again, after an idle_unload_s "
            "unload).",
            ["workload", "reason"],
            registry=r,
        )
        self.model_unloads = Counter(
            "lanes_model_unloads",
            "Unloads of a model after idle_unload_s without requests.",
            ["workload"],
            registry=r,
        )
        self.model_load_time = Histogram(
            "lanes_model_load_seconds",
            "Time to load a workload's model, by reason as lanes_model_loads (startup "
            "includes the warm-up run; wake is what the first request after an unload "
            "waits for).",
            ["workload", "reason"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # generate workloads (continuous batching)
        self.ttft = Histogram(
            "lanes_time_to_first_token_seconds",
            "Time from a generate request's arrival to its first token.",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "lanes_inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "lanes_generated_tokens", "Tokens generated.", ["workload"], registry=r
        )
        self.tokens_per_second = Gauge(
            "lanes_generated_tokens_per_second",
            "Tokens generated per second over the last 10 s.",
            ["workload"],
            registry=r,
        )
        self.in_flight = Gauge(
            "lanes_sequences_in_flight",
            "Sequences being decoded (rows of the batch).",
            ["workload"],
            registry=r,
        )
        self.kv_reserved = Gauge(
            "lanes_kv_reserved_bytes",
            "KV cache the sequences in flight may take at most: each one's prompt and "
            "max_tokens (at most the context) times the model's bytes per token; "
            "batching.max_kv_bytes bounds it (without one: 0, not counted).",
            ["workload"],
            registry=r,
        )
        self.kv_cache = Gauge(
            "lanes_kv_cache_bytes",
            "Bytes the batch's KV cache arrays hold after the last step: the rows' real "
            "positions, and the padding and holes beside them (the slot layout: its "
            "buffers, every row's whole context).",
            ["workload"],
            registry=r,
        )
        self.kv_cache_peak = Gauge(
            "lanes_kv_cache_peak_bytes",
            "The most bytes the batch's KV cache arrays held at once since the server "
            "started: a decode step holds a group's past and its new present together.",
            ["workload"],
            registry=r,
        )
        self.finished = Counter(
            "lanes_sequences_finished",
            "Sequences that left the batch, by reason (stop, length, abort, deadline, error).",
            ["workload", "reason"],
            registry=r,
        )
        self.prefill_time = Histogram(
            "lanes_prefill_seconds",
            "Time of one prefill run (the joining prompts, left-padded together).",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "lanes_decode_step_seconds",
            "Time of one decode step (one token for every row).",
            ["workload"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_positions = Counter(
            "lanes_decode_positions",
            "Cached positions the rows of decode steps attend over (padding left out), "
            "summed over rows and steps: over lanes_batch_size_sum, a row's mean past.",
            ["workload"],
            registry=r,
        )
        self.guard_blocked = Counter(
            "lanes_guard_blocked",
            "Responses a workload's guard stopped with finish_reason content_filter.",
            ["workload", "mode"],
            registry=r,
        )
        self.price = Gauge(
            "lanes_price_per_device_hour",
            "LANES_PRICE_PER_DEVICE_HOUR, in dollars: busy time per item times it is the "
            "cost per item (the dashboard's $ per 1k items).",
            registry=r,
        )

    def show_cost(self, workload: str, fit: Fit | None) -> None:
        """A workload's current cost fit; without one, 0 samples (the coefficients keep
        the last fit's, and appear with the first)."""
        if fit is None:
            self.cost_samples.labels(workload).set(0)
            return
        self.cost_fixed.labels(workload).set(fit.fixed_s)
        self.cost_per_item.labels(workload).set(fit.per_item_s)
        self.cost_per_token.labels(workload).set(fit.per_token_s)
        self.cost_spread.labels(workload).set(fit.spread)
        self.cost_samples.labels(workload).set(fit.samples)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry's families without their `_created` samples.

    prometheus_client adds one to every child of a counter or histogram: the start
    time of each series, which the text format's scrapers ignore, at the cost of a
    line per series. Its switch to drop them is process-wide; this one is ours.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():  # fresh objects on every collect
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


@dataclass(frozen=True)
class ResidencySeries:
    """One workload's series of loads after an idle unload (reason wake), and of
    unloads, looked up once."""

    loaded: Gauge
    loads: Counter
    unloads: Counter
    load_time: Histogram

    @classmethod
    def of(cls, metrics: Metrics, workload: str) -> ResidencySeries:
        return cls(
            metrics.model_loaded.labels(workload),
            metrics.model_loads.labels(workload, WAKE),
            metrics.model_unloads.labels(workload),
            metrics.model_load_time.labels(workload, WAKE),
        )


@dataclass(frozen=True)
class LaneSeries:
    """One lane's series of one workload, looked up once."""

    items: Counter
    queue_depth: Gauge
    busy: Counter
    preemptions: Counter

    @classmethod
    def of(cls, metrics: Metrics, workload: str, lane: str) -> LaneSeries:
        return cls(
            metrics.lane_items.labels(workload, lane),
            metrics.lane_queue_depth.labels(workload, lane),
            metrics.lane_busy_seconds.labels(workload, lane),
            metrics.lane_preemptions.labels(workload, lane),
        )


@dataclass(frozen=True)
class GenerateSeries:
    """One generate workload's series, looked up once: `labels()` per token adds up."""

    metrics: Metrics
    name: str
    ttft: Histogram
    itl: Histogram
    generated: Counter
    in_flight: Gauge
    kv_reserved: Gauge
    kv_cache: Gauge
    kv_cache_peak: Gauge
    queue_depth: Gauge
    prefill: Histogram
    decode: Histogram
    rows: Histogram
    positions: Counter
    busy: Counter
    rate: Gauge
    utilization: Gauge

    @classmethod
    def of(cls, m: Metrics, name: str) -> GenerateSeries:
        return cls(
            metrics=m,
            name=name,
            ttft=m.ttft.labels(name),
            itl=m.itl.labels(name),
            generated=m.generated_tokens.labels(name),
            in_flight=m.in_flight.labels(name),
            kv_reserved=m.kv_reserved.labels(name),
            kv_cache=m.kv_cache.labels(name),
            kv_cache_peak=m.kv_cache_peak.labels(name),
            queue_depth=m.queue_depth.labels(name),
            prefill=m.prefill_time.labels(name),
            decode=m.decode_time.labels(name),
            rows=m.batch_size.labels(name),
            positions=m.decode_positions.labels(name),
            busy=m.busy_seconds.labels(name),
            rate=m.tokens_per_second.labels(name),
            utilization=m.utilization.labels(name),
        )

    def finished(self, reason: str) -> None:
        self.metrics.finished.labels(self.name, reason).inc()
