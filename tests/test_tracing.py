"""OpenTelemetry spans with the real SDK and its in-memory exporter: one SDK call is one
connected trace client -> server -> queue -> batch -> model; a batch links its requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import lanes
from lanes.errors import LanesError
from lanes.settings import Settings
from lanes.tracing import Tracing
from tests.gates import wait_until
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

WORKLOADS = """\
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 32, max_wait_ms: 0}
  eights:                          # a batch runs once 8 requests wait (or after 60 s)
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 8, max_wait_ms: 60000}
"""


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider)


@pytest.fixture(scope="module")
def server(
    demo_models: Path, tmp_path_factory: pytest.TempPathFactory, tracing: Tracing
) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("tracing"), demo_models, WORKLOADS)
    with ServerThread(spec, tracing=tracing) as running:
        yield running


def spans_of(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    (found,) = [s for s in spans if s.name == name]
    return found


def test_one_sdk_call_is_one_connected_trace(
    server: ServerThread, tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    with lanes.Client(server.url, spec=server.spec.root / "workloads.yaml", tracing=tracing) as c:
        c.call("search-query", "a traced request")
    (client,) = [
        s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.CLIENT and s.name == "POST /v1/embeddings"
    ]
    trace_id = client.context.trace_id
    wait_until(lambda: len(spans_of(exporter, trace_id)) >= 5, "the trace's five spans")
    spans = spans_of(exporter, trace_id)
    server_span = next(s for s in spans if s.kind == SpanKind.SERVER)
    queue, batch, model = one(spans, "queue"), one(spans, "batch"), one(spans, "model")
    assert server_span.parent is not None and server_span.parent.span_id == client.context.span_id
    assert queue.parent is not None and queue.parent.span_id == server_span.context.span_id
    assert batch.parent is not None and batch.parent.span_id == server_span.context.span_id
    assert model.parent is not None and model.parent.span_id == batch.context.span_id
    assert [link.context.span_id for link in batch.links] == [server_span.context.span_id]
    assert server_span.attributes is not None and batch.attributes is not None
    assert server_span.attributes["http.response.status_code"] == 200
    assert server_span.attributes["lanes.workload"] == "search-query"
    assert client.attributes is not None
    assert server_span.attributes["lanes.request_id"] == client.attributes["lanes.request_id"]
    assert batch.attributes["lanes.batch_size"] == 1
    for span in (queue, batch, model):
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time <= span.end_time
    assert server_span.start_time is not None and queue.start_time is not None
    assert client.start_time is not None and client.end_time is not None
    assert client.start_time <= server_span.start_time


@pytest.mark.parametrize(
    ("workload", "options", "status"),
    [
        ("search-query", {"dimensions": 1000}, 400),
        ("eights", {"timeout_ms": 50}, 504),  # its batch waits for 8 (or 60 s)
    ],
    ids=["400", "504"],
)
def test_a_failed_call_is_an_error_span_where_it_failed(
    server: ServerThread,
    tracing: Tracing,
    exporter: InMemorySpanExporter,
    workload: str,
    options: dict[str, float],
    status: int,
) -> None:
    """The CLIENT span errs on any failure; the SERVER span on a 5xx only (a 4xx is the
    caller's error), as OTel's HTTP conventions say."""
    with (
        lanes.Client(server.url, spec=server.spec.root / "workloads.yaml", tracing=tracing) as c,
        pytest.raises(LanesError),
    ):
        c.call(workload, "x", **options)
    client = exporter.get_finished_spans()[-1]
    assert client.kind == SpanKind.CLIENT and not client.status.is_ok
    wait_until(lambda: len(spans_of(exporter, client.context.trace_id)) >= 2, "the server span")
    server_span = next(
        s for s in spans_of(exporter, client.context.trace_id) if s.kind == SpanKind.SERVER
    )
    assert server_span.attributes is not None
    assert server_span.attributes["http.response.status_code"] == status
    expected = StatusCode.ERROR if status >= 500 else StatusCode.UNSET
    assert server_span.status.status_code == expected
    if status == 504:  # its deadline passed in the queue: the wait is its trace's story
        (queue,) = [s for s in spans_of(exporter, client.context.trace_id) if s.name == "queue"]
        assert queue.parent is not None and queue.parent.span_id == server_span.context.span_id
        assert queue.status.status_code == StatusCode.ERROR
        assert queue.status.description and "deadline" in queue.status.description
        assert queue.start_time is not None and queue.end_time is not None
        assert queue.end_time - queue.start_time >= 45_000_000, "it waited out its 50 ms"


async def test_a_batch_of_eight_links_its_eight_requests(
    server: ServerThread, exporter: InMemorySpanExporter
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        calls = [
            client.post(f"{server.url}/v1/embeddings", json={"model": "eights", "input": f"t{i}"})
            for i in range(8)
        ]
        answers = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * 8
    ids = {a.headers["x-request-id"] for a in answers}

    def requests() -> list[ReadableSpan]:
        return [
            s
            for s in exporter.get_finished_spans()
            if s.kind == SpanKind.SERVER
            and s.attributes is not None
            and s.attributes.get("lanes.request_id") in ids
        ]

    def batches() -> list[ReadableSpan]:
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == "batch" and s.attributes and s.attributes["lanes.workload"] == "eights"
        ]

    wait_until(lambda: len(requests()) == 8 and len(batches()) == 1, "eight requests, one batch")
    (batch,) = batches()
    linked = {link.context.span_id for link in batch.links}
    assert linked == {s.context.span_id for s in requests()}
    assert batch.attributes is not None and batch.attributes["lanes.batch_size"] == 8
    # Eight traces, one per request (no caller sent a traceparent), each with its queue wait.
    assert len({s.context.trace_id for s in requests()}) == 8
    queues = [s for s in exporter.get_finished_spans() if s.name == "queue"]
    for request in requests():
        assert any(
            q.parent is not None and q.parent.span_id == request.context.span_id for q in queues
        )


def test_tracing_is_off_by_default() -> None:
    assert Tracing.from_settings(Settings()) is None


# ---- offline: the flow run, its shards, their batches -------------------------------------


@pytest.fixture(scope="module")
def process_exporter() -> InMemorySpanExporter:
    """The exporter of this process's global tracer provider, which LANES_TRACING uses."""
    from opentelemetry import trace

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_an_offline_run_continues_its_callers_trace(
    prefect_api: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    process_exporter: InMemorySpanExporter,
) -> None:
    from opentelemetry import trace

    from lanes.flows.batch import offline
    from tests.flows_fixtures import text, write_jsonl
    from tests.flows_fixtures import write_spec as write_offline_spec

    monkeypatch.setenv("LANES_TRACING", "true")
    workload = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/"}
    spec = write_offline_spec(tmp_path, {"emb": {**workload, "output": "out/", "batch_size": 4}})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"a{i}", "text": text(i)} for i in range(6)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b0", "text": "w1"}])
    caller_side = Tracing(trace.get_tracer_provider())
    with caller_side.span("caller") as caller:
        carrier = caller_side.carrier()
    offline(workload="emb", spec=str(spec), trace=carrier)

    spans = spans_of(process_exporter, caller.get_span_context().trace_id)
    run = one(spans, "offline emb")
    assert run.parent is not None and run.parent.span_id == caller.get_span_context().span_id
    # Ours, by their attribute: Prefect may trace its task runs under the same names.
    ours = [s for s in spans if s.attributes is not None and "lanes.shard" in s.attributes]
    shards = {s.name: s for s in ours}
    assert sorted(shards) == ["shard a.jsonl", "shard b.jsonl"] and len(ours) == 2
    for shard in shards.values():
        assert shard.parent is not None and shard.parent.span_id == run.context.span_id
    sizes: dict[str, list[int]] = {name: [] for name in shards}
    for batch in (s for s in spans if s.name == "batch"):
        assert batch.parent is not None and batch.attributes is not None
        (name,) = [n for n, s in shards.items() if s.context.span_id == batch.parent.span_id]
        sizes[name].append(int(str(batch.attributes["lanes.batch_size"])))
    assert sorted(sizes["shard a.jsonl"]) == [2, 4] and sizes["shard b.jsonl"] == [1]
