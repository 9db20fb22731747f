"""`lanes top` over a real server's /metrics, and the Grafana dashboard's metric names."""

from __future__ import annotations

import http.server
import io
import json
import math
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from typer.testing import CliRunner

from lanes.router.cli import app
from lanes.router.top import (
    OFFLINE,
    WORKLOAD_WIDTH,
    RouteRow,
    Scrape,
    Series,
    offline_rows,
    quantile,
    render,
    route_rows,
    run,
    scrape,
    workload_rows,
)
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import load_task
from tests import flows_fixtures
from tests.gates import wait_until
from tests.servers import ServerThread, write_spec
from tests.test_backfill import KEY, batch, live, on_endpoint, send_batch

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "infra" / "grafana" / "lanes.json"

WORKLOADS = """\
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 32, max_wait_ms: 0}
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    generation: {max_new_tokens: 4, temperature: 0}
  embed-in-eights-or-late:         # a batch runs once 8 wait (or after 60 s): a deadline 504s
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 8, max_wait_ms: 60000}
"""
LATE = "embed-in-eights-or-late"


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("top"), demo_models, WORKLOADS)
    with ServerThread(spec) as running:
        yield running


def test_quantiles_interpolate_inside_their_bucket() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.99, buckets) == pytest.approx(0.198)
    assert quantile(0.25, buckets) == pytest.approx(0.05)
    # A rank in the +Inf bucket answers the highest finite bound, as Prometheus does.
    assert quantile(0.99, {0.1: 1.0, math.inf: 10.0}) == pytest.approx(0.1)
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.5, {}) is None


@pytest.mark.slow
def test_a_window_of_traffic_reads_back_as_rows(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = scrape(client, server.url)
        for i in range(5):
            r = client.post("/v1/embeddings", json={"model": "search-query", "input": f"t {i}"})
            assert r.status_code == 200
        r = client.post("/v1/embeddings", json={"model": "nowhere", "input": "x"})
        assert r.status_code == 404
        r = client.post(
            "/v1/completions", json={"model": "code-complete", "prompt": "def f", "max_tokens": 3}
        )
        assert r.status_code == 200

        def counted() -> Scrape:
            return scrape(client, server.url)

        # The responses counter moves once the answer has been sent.
        wait_until(
            lambda: sum(r.responses for r in route_rows(counted(), before)) >= 7, "the counts"
        )
        after = counted()
    rows = {r.series: r for r in workload_rows(after, before)}
    embed = rows[Series("search-query")]
    seconds = after.at - before.at
    assert embed.requests == 5
    assert embed.requests_per_s == pytest.approx(5 / seconds)
    assert embed.p50_s is not None and embed.p99_s is not None
    assert 0 < embed.p50_s <= embed.p99_s <= 30
    assert embed.batch_size == 1  # one at a time
    assert embed.queue_depth == 0
    assert embed.utilization is not None and 0 <= embed.utilization <= 1
    generate = rows[Series("code-complete")]
    assert generate.requests == 1 and generate.tokens_per_s is not None
    assert generate.tokens_per_s > 0 and generate.errors_per_s == 0

    routes = {r.route: r for r in route_rows(after, before)}
    assert routes["/v1/embeddings"].responses == 6
    assert routes["/v1/embeddings"].client_errors == 1
    assert routes["/v1/embeddings"].server_errors == 0
    assert routes["/v1/completions"].responses == 1

    # The first frame has no window: totals since the start, no rates.
    first = {r.series: r for r in workload_rows(after)}
    assert first[Series("search-query")].requests >= 5
    assert first[Series("search-query")].requests_per_s is None


@pytest.mark.slow
def test_errors_per_second_are_a_workload_s_5xx_answers(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        before = scrape(client, server.url)
        late = client.post(
            "/v1/embeddings", json={"model": LATE, "input": "x"}, headers={"X-Timeout-Ms": "50"}
        )
        assert late.status_code == 504
        body = {"model": "search-query", "input": "x", "dimensions": 1000}
        assert client.post("/v1/embeddings", json=body).status_code == 400  # the caller's

        def embeddings(now: Scrape) -> RouteRow:
            (row,) = [r for r in route_rows(now, before) if r.route == "/v1/embeddings"]
            return row

        # The responses counter moves once the answer has been sent.
        wait_until(lambda: embeddings(scrape(client, server.url)).responses >= 2, "the two counted")
        after = scrape(client, server.url)
    rows = {r.series: r for r in workload_rows(after, before)}
    assert rows[Series(LATE)].errors_per_s == pytest.approx(1 / (after.at - before.at))
    assert rows[Series("search-query")].errors_per_s == 0
    assert rows[Series("code-complete")].errors_per_s == 0
    assert embeddings(after).server_errors == 1


@pytest.mark.slow
def test_lanes_top_at_80_columns_shows_whole_workload_names(server: ServerThread) -> None:
    result = CliRunner().invoke(
        app,
        ["top", "--once", "--endpoint", server.url, "--interval", "0.1"],
        env={"COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    for name in (LATE, "search-query", "code-complete", "req/s", "err/s"):
        assert name in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_a_name_past_the_bound_ends_in_an_ellipsis_and_the_headers_stay_whole() -> None:
    name = "w" * (WORKLOAD_WIDTH + 10)
    text = f'# TYPE lanes_queue_depth gauge\nlanes_queue_depth{{workload="{name}"}} 0\n'
    out = io.StringIO()
    Console(file=out, width=80).print(render(Scrape.parse(text, 1.0), None, "http://x"))
    assert "w" * (WORKLOAD_WIDTH - 1) + "…" in out.getvalue()
    assert "w" * WORKLOAD_WIDTH not in out.getvalue()
    for header in ("req/s", "p50", "p99", "queue", "batch", "util", "tok/s", "err/s"):
        assert header in out.getvalue()


@pytest.mark.slow
def test_lanes_top_once_prints_every_workload_and_route(server: ServerThread) -> None:
    httpx.post(f"{server.url}/v1/embeddings", json={"model": "search-query", "input": "x"})
    result = CliRunner().invoke(
        app,
        ["top", "--once", "--endpoint", server.url, "--interval", "0.1"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    for name in ("search-query", "code-complete", "/v1/embeddings", "req/s", "p99", "tok/s"):
        assert name in result.output


@pytest.mark.slow
def test_the_live_view_redraws_each_frame(server: ServerThread) -> None:
    out = io.StringIO()
    run(server.url, None, 0.05, frames=range(2), console=Console(file=out, width=200))
    assert out.getvalue().count("over the last") >= 1


@pytest.mark.slow
def test_an_offline_batch_on_the_endpoint_shows_as_a_row_under_its_workload(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    spec = flows_fixtures.write_spec(
        tmp_path, {"search": live(), "corpus": batch(runner=on_endpoint())}
    )
    task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    items = [task.prepare(flows_fixtures.text(i)) for i in range(12)]
    with serve(spec, internal_key=KEY) as server, httpx.Client(timeout=60) as client:
        before = scrape(client, server.url)
        assert send_batch(server, "search", items, KEY).status_code == 200
        after = scrape(client, server.url)  # the batch's items are counted before its answer
        result = CliRunner().invoke(
            app, ["top", "--once", "--endpoint", server.url, "--interval", "0.1"]
        )
    row = offline_rows(after, before)["search"]
    assert row.items == 12 and row.items_per_s == pytest.approx(12 / (after.at - before.at))
    assert row.busy_share is not None and row.busy_share > 0
    assert row.queue_depth == 0 and row.preemptions_per_s == 0
    out = io.StringIO()
    Console(file=out, width=80).print(render(after, before, server.url))
    (line,) = [line for line in out.getvalue().splitlines() if OFFLINE in line]
    assert f"{row.items_per_s:.1f}" in line, out.getvalue()
    assert "preempt/s" not in out.getvalue(), "nothing was preempted: no column of zeros"
    # `lanes top --once`: the offline row right under its workload's.
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "search" in line]
    assert OFFLINE in lines[at + 1], result.output


@pytest.mark.slow
def test_a_workload_whose_offline_lane_never_ran_has_no_offline_row(server: ServerThread) -> None:
    with httpx.Client(timeout=60) as client:
        lanes = scrape(client, server.url).by_series("lanes_lane_items_total", lane="offline")
    assert lanes and set(lanes.values()) == {0.0}, "the series are there, at zero"
    result = CliRunner().invoke(
        app, ["top", "--once", "--endpoint", server.url, "--interval", "0.1"]
    )
    assert result.exit_code == 0, result.output
    assert "search-query" in result.output and "offline" not in result.output


def test_lanes_top_without_a_server_says_where_it_looked() -> None:
    result = CliRunner().invoke(app, ["top", "--once", "--endpoint", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert "cannot read http://127.0.0.1:9/metrics" in result.output


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9", "http://127.0.0.1:9/v1"])
def test_lanes_top_refuses_an_endpoint_as_lanes_call_does(endpoint: str) -> None:
    """Not a URL (no http://), or an API's path: exit 2 and `lanes call`'s message,
    before any request."""
    top = CliRunner().invoke(app, ["top", "--once", "--endpoint", endpoint])
    call = CliRunner().invoke(app, ["call", "search-query", "-i", "hi", "--endpoint", endpoint])
    assert (top.exit_code, top.output) == (call.exit_code, call.output)
    assert top.exit_code == 2 and top.output.startswith("error: endpoint: "), top.output


def test_lanes_top_on_a_server_that_is_not_lanes_says_so() -> None:
    class Page(http.server.BaseHTTPRequestHandler):  # answers 200 on every path, as SPAs do
        def do_GET(self) -> None:
            body = b"<html>hi</html>"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{other.server_address[1]}"
        result = CliRunner().invoke(app, ["top", "--once", "--endpoint", url])
        other.shutdown()
    assert result.exit_code == 1, result.output
    assert f"{url}/metrics is not Prometheus metrics" in result.output
    assert "Traceback" not in result.output


# ---- infra/grafana/lanes.json ----------------------------------------------------------


def _expressions(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def _served_names(text: str) -> set[str]:
    """Every series name a scrape of this /metrics can have, by each family's type."""
    suffixes = {
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "counter": ("_total", "_created"),
        "gauge": ("",),
    }
    names = set()
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def _groupings(expr: str) -> Iterator[tuple[set[str], str]]:
    """Each `by (labels) (...)` of a PromQL expression: its labels and what it groups."""
    for match in re.finditer(r"\bby \(([^)]*)\)\s*\(", expr):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        yield {label.strip() for label in match[1].split(",")}, expr[match.end() : end - 1]


@pytest.mark.slow
def test_the_dashboard_groups_only_by_labels_its_metrics_have(server: ServerThread) -> None:
    """A `sum by (lane)` over a series without a `lane` label draws one unlabelled line:
    the panel would not show what its title says. A family without samples yet (a
    guard's blocks here) shows no labels, and is left to the test above."""
    completion = {"model": "code-complete", "prompt": "def f(", "max_tokens": 2}
    httpx.post(f"{server.url}/v1/completions", json=completion, timeout=60).raise_for_status()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    wrong = [
        f"{name} has no {sorted(by - labels[name])} in: {expr}"
        for expr in _expressions(json.loads(DASHBOARD.read_text()))
        for by, grouped in _groupings(expr)
        for name in re.findall(r"\blanes_[a-z_]+\b", grouped)
        if name in labels and not by <= labels[name]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_the_dashboard_queries_only_metrics_the_server_exports(server: ServerThread) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["panels"]
    expressions = list(_expressions(dashboard))
    assert len(expressions) >= 10
    served = _served_names(httpx.get(f"{server.url}/metrics").text)
    used = {name for expr in expressions for name in re.findall(r"\blanes_[a-z_]+\b", expr)}
    assert used, expressions
    assert used <= served, f"not exported: {sorted(used - served)}"
    # Latency panels read quantiles from the histograms, not averages.
    quantiles = [e for e in expressions if "histogram_quantile" in e]
    for metric in (
        "lanes_request_latency_seconds_bucket",
        "lanes_time_to_first_token_seconds_bucket",
        "lanes_inter_token_latency_seconds_bucket",
    ):
        assert any(metric in e for e in quantiles), metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
