"""`lanes top`: a running server's /metrics as a table per workload, refreshed each second.

Each frame covers a window: the time since the previous scrape (the first frame: since
the server started, with no rates). Per workload: requests/s, p50 and p99 latency
interpolated from the histogram's buckets as Prometheus' `histogram_quantile` does, queue depth, mean batch size,
executor utilization, tokens/s and sequences in flight (generate), and errors/s: its
5xx answers (a 503 or a 504 too; a stream that fails after its 200 is counted in
`lanes_sequences_finished_total{reason="error"}` instead); per route: responses/s and
4xx/5xx per second.

Under a workload whose offline lane has run (a shared endpoint: its
`lanes_lane_*{lane="offline"}` series are not all zero), a second row, `↳ offline`, in
the same columns: offline items/s under req/s, items waiting under queue, the share of
the window its batches kept the model busy under util, and, once an offline run has
been stopped for an interactive one, preemptions/s in a column of their own.

The workload column is as wide as the longest name (up to WORKLOAD_WIDTH characters);
on a narrow terminal the cells' padding goes first.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from lanes.errors import LanesError
from lanes.wire import endpoint_root

# The most characters of a workload's name shown; a longer one ends in an ellipsis.
WORKLOAD_WIDTH = 24
# The name cell of a workload's offline row, under the workload's own: short, so that no
# name is cut for it.
OFFLINE = "↳ offline"


@dataclass(frozen=True)
class Series:
    """One workload's series (and its lane, where the server labels one)."""

    workload: str
    lane: str | None = None


@dataclass(frozen=True)
class Scrape:
    """Every sample of one /metrics read, by sample name, and when it was read."""

    at: float
    samples: Mapping[str, list[Sample]]

    @classmethod
    def parse(cls, text: str, at: float) -> Scrape:
        samples: dict[str, list[Sample]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append(sample)
        return cls(at, dict(samples))

    def by_series(self, name: str, **match: str) -> dict[Series, float]:
        """The samples called `name` whose labels include `match`, summed per series."""
        found: dict[Series, float] = defaultdict(float)
        for s in self.samples.get(name, ()):
            if "workload" in s.labels and all(s.labels.get(k) == v for k, v in match.items()):
                found[Series(s.labels["workload"], s.labels.get("lane"))] += s.value
        return dict(found)

    def server_errors(self) -> dict[Series, float]:
        """Each workload's 5xx answers (`lanes_workload_responses_total`)."""
        found: dict[Series, float] = defaultdict(float)
        for s in self.samples.get("lanes_workload_responses_total", ()):
            if s.labels.get("code", "").startswith("5"):
                found[Series(s.labels["workload"])] += s.value
        return dict(found)

    def buckets(self, name: str) -> dict[Series, dict[float, float]]:
        """A histogram's cumulative bucket counts per series, by upper bound."""
        found: dict[Series, dict[float, float]] = defaultdict(dict)
        for s in self.samples.get(f"{name}_bucket", ()):
            if "workload" in s.labels:
                key = Series(s.labels["workload"], s.labels.get("lane"))
                le = float(s.labels["le"])
                found[key][le] = found[key].get(le, 0.0) + s.value
        return dict(found)


@dataclass(frozen=True)
class WorkloadRow:
    series: Series
    requests: float  # answered in the window
    requests_per_s: float | None  # None in a first frame: no window to divide by
    p50_s: float | None  # None: nothing answered in the window
    p99_s: float | None
    queue_depth: float | None
    batch_size: float | None  # mean requests per run in the window
    utilization: float | None
    tokens_per_s: float | None
    in_flight: float | None
    errors_per_s: float | None


@dataclass(frozen=True)
class OfflineRow:
    """A workload's offline lane in the window (rates None in a first frame)."""

    workload: str
    items: float  # run in the window
    items_per_s: float | None
    queue_depth: float
    busy_share: float | None  # busy seconds over the window's; above 1 with threads beside
    preemptions_per_s: float | None
    preempted: float  # since the server started: the preempt/s column shows once one is


@dataclass(frozen=True)
class RouteRow:
    route: str
    responses_per_s: float | None
    responses: float
    client_errors: float  # 4xx in the window
    server_errors: float  # 5xx in the window


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of cumulative bucket counts (upper bound -> count), interpolated
    linearly inside its bucket as Prometheus' histogram_quantile does; None when empty.
    A rank in the +Inf bucket answers the highest finite bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


K = TypeVar("K")


def _delta(now: Mapping[K, float], before: Mapping[K, float] | None) -> dict[K, float]:
    """What each counter gained in the window (all of it without a `before`). A counter
    that went down means the server restarted: its value is the window."""
    if before is None:
        return dict(now)
    return {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in now.items()}


def workload_rows(now: Scrape, before: Scrape | None = None) -> list[WorkloadRow]:
    """One row per workload for the window from `before` (or the start) to `now`."""
    seconds = now.at - before.at if before is not None else None
    per_s = seconds if seconds is not None and seconds > 0 else None

    def window(name: str, **match: str) -> dict[Series, float]:
        old = before.by_series(name, **match) if before is not None else None
        return _delta(now.by_series(name, **match), old)

    def rate(values: Mapping[Series, float], key: Series) -> float | None:
        return values.get(key, 0.0) / per_s if per_s is not None else None

    latency_now = now.buckets("lanes_request_latency_seconds")
    latency_before = before.buckets("lanes_request_latency_seconds") if before else {}
    counts = window("lanes_request_latency_seconds_count")
    runs = window("lanes_batch_size_count")
    run_sizes = window("lanes_batch_size_sum")
    errors = _delta(now.server_errors(), before.server_errors() if before else None)
    depth = now.by_series("lanes_queue_depth")
    utilization = now.by_series("lanes_executor_utilization")
    tokens = now.by_series("lanes_generated_tokens_per_second")
    in_flight = now.by_series("lanes_sequences_in_flight")
    keys = {*counts, *depth, *utilization, *tokens, *in_flight, *errors}
    rows = []
    for key in sorted(keys, key=lambda k: (k.workload, k.lane or "")):
        old = latency_before.get(key, {}) if before is not None else None
        buckets = _delta(latency_now.get(key, {}), old)
        n_runs = runs.get(key, 0.0)
        rows.append(
            WorkloadRow(
                series=key,
                requests=counts.get(key, 0.0),
                requests_per_s=rate(counts, key),
                p50_s=quantile(0.5, buckets),
                p99_s=quantile(0.99, buckets),
                queue_depth=depth.get(key),
                batch_size=run_sizes.get(key, 0.0) / n_runs if n_runs > 0 else None,
                utilization=utilization.get(key),
                tokens_per_s=tokens.get(key),
                in_flight=in_flight.get(key),
                errors_per_s=rate(errors, key),
            )
        )
    return rows


def offline_rows(now: Scrape, before: Scrape | None = None) -> dict[str, OfflineRow]:
    """Each workload whose offline lane has run since the server started, by name."""
    seconds = now.at - before.at if before is not None else None
    per_s = seconds if seconds is not None and seconds > 0 else None

    def lane(scrape: Scrape, name: str) -> dict[str, float]:
        return {k.workload: v for k, v in scrape.by_series(name, lane="offline").items()}

    def window(name: str) -> dict[str, float]:
        return _delta(lane(now, name), lane(before, name) if before is not None else None)

    def rate(values: Mapping[str, float], workload: str) -> float | None:
        return values.get(workload, 0.0) / per_s if per_s is not None else None

    items = window("lanes_lane_items_total")
    busy = window("lanes_lane_busy_seconds_total")
    preemptions = window("lanes_lane_preemptions_total")
    depth = lane(now, "lanes_lane_queue_depth")
    preempted = lane(now, "lanes_lane_preemptions_total")
    totals = (lane(now, "lanes_lane_items_total"), lane(now, "lanes_lane_busy_seconds_total"))
    # The server makes every workload's series at its start, at 0: only a lane that ran.
    active = {w for values in (*totals, depth, preempted) for w, v in values.items() if v > 0}
    return {
        w: OfflineRow(
            workload=w,
            items=items.get(w, 0.0),
            items_per_s=rate(items, w),
            queue_depth=depth.get(w, 0.0),
            busy_share=rate(busy, w),
            preemptions_per_s=rate(preemptions, w),
            preempted=preempted.get(w, 0.0),
        )
        for w in sorted(active)
    }


def route_rows(now: Scrape, before: Scrape | None = None) -> list[RouteRow]:
    """Responses per route in the window, and how many were 4xx and 5xx."""

    def by_route(scrape: Scrape) -> dict[tuple[str, str], float]:
        return {
            (s.labels["route"], s.labels["code"]): s.value
            for s in scrape.samples.get("lanes_responses_total", ())
        }

    current = by_route(now)
    old = by_route(before) if before is not None else {}
    seconds = now.at - before.at if before is not None else 0.0
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for (route, code), value in current.items():
        earlier = old.get((route, code), 0.0)
        n = value - earlier if value >= earlier else value
        total = totals[route]
        total[0] += n
        total[1] += n if code.startswith("4") else 0.0
        total[2] += n if code.startswith("5") else 0.0
    return [
        RouteRow(route, t[0] / seconds if seconds > 0 else None, t[0], t[1], t[2])
        for route, t in sorted(totals.items())
    ]


def _num(value: float | None, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


@dataclass(frozen=True)
class Workloads:
    """The workloads' table, fitted to the width it is drawn at: the workload column
    keeps its width (the longest name, up to WORKLOAD_WIDTH), and where the table
    would not fit, the cells' padding goes before any column is squeezed."""

    rows: list[WorkloadRow]
    title: str
    offline: Mapping[str, OfflineRow]  # by workload: drawn under its row

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = self.table((0, 1))
        wide = Measurement.get(console, options.update(width=10_000), table).maximum
        yield table if wide <= options.max_width else self.table((0, 0))

    def table(self, padding: tuple[int, int]) -> Table:
        rows = self.rows
        table = Table(title=self.title, title_justify="left", padding=padding)
        longest = max((len(r.series.workload) for r in rows), default=0)
        name_width = min(max(longest, len("workload"), len(OFFLINE)), WORKLOAD_WIDTH)
        table.add_column("workload", min_width=name_width, max_width=WORKLOAD_WIDTH, no_wrap=True)
        columns = ["req/s", "p50", "p99", "queue"]
        columns += ["batch", "util", "tok/s", "in flight", "err/s"]
        # Only runs that can be stopped are (generate, `preempt_offline`): a column of
        # zeros would cost a narrow terminal its width for nothing.
        preempted = any(o.preempted > 0 for o in self.offline.values())
        columns += ["preempt/s"] if preempted else []
        for column in columns:
            table.add_column(column, justify="right")
        for r in rows:
            cells = [r.series.workload]
            cells += [
                _num(r.requests_per_s),
                _num(r.p50_s, 1, 1000, " ms"),
                _num(r.p99_s, 1, 1000, " ms"),
                _num(r.queue_depth, 0),
                _num(r.batch_size),
                _num(r.utilization, 0, 100, "%"),
                _num(r.tokens_per_s, 0),
                _num(r.in_flight, 0),
                _num(r.errors_per_s, 2),
            ]
            table.add_row(*cells, *(["-"] if preempted else []))
            lane = self.offline.get(r.series.workload)
            if lane is not None:
                cells = [OFFLINE, _num(lane.items_per_s)]
                cells += ["", "", _num(lane.queue_depth, 0), "", _num(lane.busy_share, 0, 100, "%")]
                cells += ["", "", "", *([_num(lane.preemptions_per_s, 2)] if preempted else [])]
                table.add_row(*cells)
        return table


def render(now: Scrape, before: Scrape | None, endpoint: str) -> Group:
    """The frame: a table of workloads, a table of routes, and what window they cover."""
    title = f"lanes top: {endpoint}"
    table = Workloads(workload_rows(now, before), title, offline_rows(now, before))
    routes = Table(title="responses by route", title_justify="left")
    for column in ("route", "resp/s", "responses", "4xx", "5xx"):
        routes.add_column(column, justify="left" if column == "route" else "right")
    for route in route_rows(now, before):
        routes.add_row(
            route.route,
            _num(route.responses_per_s),
            f"{route.responses:.0f}",
            f"{route.client_errors:.0f}",
            f"{route.server_errors:.0f}",
        )
    if before is None:
        note = "since the server started (rates from the next frame on)"
    else:
        note = f"over the last {now.at - before.at:.1f} s"
    return Group(table, routes, Text(note, style="dim"))


def scrape(
    client: httpx.Client, endpoint: str, clock: Callable[[], float] = time.monotonic
) -> Scrape:
    """Read `endpoint`/metrics once; a clear LanesError when it cannot."""
    url = f"{endpoint.rstrip('/')}/metrics"
    try:
        response = client.get(url)
    except httpx.TransportError as e:
        raise LanesError(
            f"cannot read {url} ({type(e).__name__}): is `lanes serve` running there? "
            "Pass --endpoint or set LANES_ENDPOINT"
        ) from None
    if response.status_code == 401:
        raise LanesError(f"{url} wants an API key: set LANES_API_KEY to the server's")
    if response.status_code != 200:
        raise LanesError(f"{url} answered HTTP {response.status_code}")
    try:
        return Scrape.parse(response.text, clock())
    except ValueError as e:  # prometheus_client's parser, on what is not its format
        raise LanesError(
            f"{url} is not Prometheus metrics ({e}): is this a lanes server? "
            "Pass --endpoint or set LANES_ENDPOINT"
        ) from None


def run(
    endpoint: str,
    api_key: str | None,
    interval_s: float = 1.0,
    once: bool = False,
    frames: Iterable[int] | None = None,
    console: Console | None = None,
) -> None:
    """Show frames until interrupted (`frames` bounds them); `once`: print one frame of
    the window `interval_s` long, then return."""
    console = console or Console()
    endpoint = endpoint_root(endpoint)  # as the clients check it: a URL, the server's root
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=10) as client:
        if once:
            before = scrape(client, endpoint)
            time.sleep(interval_s)
            console.print(render(scrape(client, endpoint), before, endpoint))
            return
        before = scrape(client, endpoint)
        with Live(render(before, None, endpoint), console=console, auto_refresh=False) as live:
            for _ in frames if frames is not None else itertools.count():
                time.sleep(interval_s)
                try:
                    now = scrape(client, endpoint)
                except LanesError as e:
                    live.update(Text(f"{e}; retrying", style="red"), refresh=True)
                    continue
                live.update(render(now, before, endpoint), refresh=True)
                before = now
