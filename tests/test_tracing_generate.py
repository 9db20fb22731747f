"""Generate requests' spans with the real SDK and its in-memory exporter: an HTTP request
-> its queue wait -> the prefill run it rode in -> its decode window; a prefill run of
several requests links each; a guard's scoring is a span of the request."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from lanes.tracing import Tracing
from tests.gates import Gate, wait_until
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

GATE = Gate()  # the decoder's runs wait here while a test holds it closed
GREEDY = "generation: {max_new_tokens: 16, temperature: 0}"
WORKLOADS = f"""\
  code:
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: 16}}
    {GREEDY}
  guarded:                    # the demo's blocklist: the demo model's code passes it
    mode: interactive
    task: generate
    model: tinycode
    {GREEDY}
    guard: {{handler: "lanes.demo.guard:blocklist", mode: buffer}}
"""


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(
    demo_models: Path, tmp_path_factory: pytest.TempPathFactory, exporter: InMemorySpanExporter
) -> Iterator[ServerThread]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spec = write_spec(tmp_path_factory.mktemp("tracing-generate"), demo_models, WORKLOADS)
    with ServerThread(spec, gates={"tinycode": GATE}, tracing=Tracing(provider)) as running:
        yield running


def request_span(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan | None:
    """The SERVER span of the request answered with `request_id` (once it has ended)."""
    for span in exporter.get_finished_spans():
        attributes = span.attributes or {}
        if span.kind == SpanKind.SERVER and attributes.get("lanes.request_id") == request_id:
            return span
    return None


def spans_of(exporter: InMemorySpanExporter, trace_id: int, name: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.context.trace_id == trace_id and s.name == name
    ]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def linked(span: ReadableSpan) -> set[int]:
    return {link.context.span_id for link in span.links}


def test_a_streamed_completion_is_request_queue_prefill_decode(
    server: ServerThread, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "code", "prompt": "def ", "max_tokens": 6, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as answer:
        assert answer.status_code == 200
        request_id = answer.headers["x-request-id"]
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    wait_until(lambda: request_span(exporter, request_id) is not None, "the request's span")
    request = request_span(exporter, request_id)
    assert request is not None and request.attributes is not None
    assert request.attributes["lanes.workload"] == "code"
    trace_id, request_id_ = request.context.trace_id, request.context.span_id
    (queue,) = spans_of(exporter, trace_id, "queue")
    (prefill,) = spans_of(exporter, trace_id, "prefill")
    (decode,) = spans_of(exporter, trace_id, "decode")
    assert parent_of(queue) == parent_of(prefill) == parent_of(decode) == request_id_
    assert linked(prefill) == {request_id_}
    assert linked(decode) == {prefill.context.span_id}
    assert prefill.attributes is not None and decode.attributes is not None
    assert prefill.attributes["lanes.workload"] == "code"
    assert prefill.attributes["lanes.batch_size"] == 1
    # ignore_eos: every one of the 6 tokens is made; the first by the prefill, the
    # other 5 by one decode step each.
    assert decode.attributes["lanes.tokens_out"] == 6
    assert decode.attributes["lanes.steps"] == 5
    assert decode.attributes["lanes.finish_reason"] == "length"
    # In order, inside the request: queued, prefilled, decoded.
    times = [request.start_time, queue.start_time, queue.end_time, prefill.start_time]
    times += [prefill.end_time, decode.start_time, decode.end_time, request.end_time]
    assert None not in times
    assert times == sorted(times)  # type: ignore[type-var]
    # No span per token: these four are the whole trace.
    names = sorted(s.name for s in exporter.get_finished_spans() if s.context.trace_id == trace_id)
    assert names == sorted(["POST /v1/completions", "queue", "prefill", "decode"])


async def test_requests_prefilled_together_link_to_the_one_prefill_run(
    server: ServerThread, exporter: InMemorySpanExporter
) -> None:
    engine = server.app.state.engines["code"]
    body = {"model": "code", "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        with GATE.closed():  # the first request's prefill waits: the next two queue behind it
            first = asyncio.create_task(
                client.post(f"{server.url}/v1/completions", json={**body, "prompt": "def "})
            )
            await asyncio.to_thread(GATE.wait_held)
            others = [
                asyncio.create_task(
                    client.post(f"{server.url}/v1/completions", json={**body, "prompt": p})
                )
                for p in ("import os\n", "class A:\n")
            ]
            await asyncio.to_thread(
                wait_until, lambda: engine.queue_depth == 2, "the two queued behind the first"
            )
        answers = [await first, *await asyncio.gather(*others)]
    assert [a.status_code for a in answers] == [200] * 3
    ids = [a.headers["x-request-id"] for a in answers]
    wait_until(
        lambda: all(request_span(exporter, i) is not None for i in ids), "the three requests"
    )
    requests = [request_span(exporter, i) for i in ids]
    lone, *together = [r.context.span_id for r in requests if r is not None]
    prefills = [s for s in exporter.get_finished_spans() if s.name == "prefill"]
    (shared,) = [p for p in prefills if linked(p) & set(together)]
    assert linked(shared) == set(together)
    assert parent_of(shared) in together
    assert shared.attributes is not None and shared.attributes["lanes.batch_size"] == 2
    (alone,) = [p for p in prefills if lone in linked(p)]
    assert linked(alone) == {lone}
    decodes = [s for s in exporter.get_finished_spans() if s.name == "decode"]
    for request in together:
        (decode,) = [d for d in decodes if parent_of(d) == request]
        assert linked(decode) == {shared.context.span_id}
        assert decode.attributes is not None and decode.attributes["lanes.tokens_out"] == 4


async def test_a_request_whose_deadline_passes_in_the_queue_has_an_error_queue_span(
    server: ServerThread, exporter: InMemorySpanExporter
) -> None:
    engine = server.app.state.engines["code"]
    body = {"model": "code", "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        with GATE.closed():  # the first request's prefill waits: the late one queues
            first = asyncio.create_task(
                client.post("/v1/completions", json={**body, "prompt": "a"})
            )
            await asyncio.to_thread(GATE.wait_held)
            late = asyncio.create_task(
                client.post(
                    "/v1/completions",
                    json={**body, "prompt": "b"},
                    headers={"X-Timeout-Ms": "50"},
                )
            )
            await asyncio.to_thread(wait_until, lambda: engine.queue_depth == 1, "it queued")
            # The server's clock, in this process: it arrived (its deadline's start) before
            # now. Deadlines expire as the next step is planned: once 50 ms surely passed.
            queued = time.monotonic()
            await asyncio.to_thread(wait_until, lambda: time.monotonic() > queued + 0.06, "50 ms")
        answers = [await first, await late]
    assert [a.status_code for a in answers] == [200, 504]
    request_id = answers[1].headers["x-request-id"]
    wait_until(lambda: request_span(exporter, request_id) is not None, "the request's span")
    request = request_span(exporter, request_id)
    assert request is not None
    (queue,) = spans_of(exporter, request.context.trace_id, "queue")
    assert parent_of(queue) == request.context.span_id
    assert queue.status.status_code == StatusCode.ERROR
    assert queue.attributes is not None and queue.attributes["lanes.finish_reason"] == "deadline"
    assert queue.start_time is not None and queue.end_time is not None
    assert queue.end_time - queue.start_time >= 50_000_000, "it waited past its deadline"


def test_a_guarded_request_has_its_guard_span(
    server: ServerThread, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "guarded", "prompt": "def ", "max_tokens": 6}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
    request_id = answer.headers["x-request-id"]
    wait_until(lambda: request_span(exporter, request_id) is not None, "the request's span")
    request = request_span(exporter, request_id)
    assert request is not None
    (guard,) = spans_of(exporter, request.context.trace_id, "guard")
    assert parent_of(guard) == request.context.span_id
    assert guard.attributes is not None
    assert guard.attributes["lanes.guard.handler"] == "lanes.demo.guard:blocklist"
    assert guard.attributes["lanes.guard.mode"] == "buffer"
    assert guard.attributes["lanes.guard.passed"] is True
    assert guard.attributes["lanes.guard.chars"] == len(answer.json()["choices"][0]["text"])
    (decode,) = spans_of(exporter, request.context.trace_id, "decode")
    assert guard.start_time is not None and decode.end_time is not None
    assert decode.end_time <= guard.start_time  # buffer: the whole text, once it is made


def test_tracing_off_imports_nothing_of_opentelemetry(demo_models: Path, tmp_path: Path) -> None:
    """Off, a streamed and a guarded completion build no span: OpenTelemetry is never
    even imported (in a fresh process, since this one has the SDK loaded)."""
    spec = write_spec(tmp_path, demo_models, WORKLOADS)
    script = f"""
import sys
import httpx
from pathlib import Path
from tests.servers import ServerThread

with ServerThread(Path({str(spec)!r})) as server:
    for model, stream in (("code", True), ("guarded", False)):
        body = {{"model": model, "prompt": "def ", "max_tokens": 4, "stream": stream}}
        answer = httpx.post(f"{{server.url}}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "LANES_TRACING": "false"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
