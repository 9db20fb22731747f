"""Overload: every request gets an answer, and those the workload cannot serve in time
get it at once (503 with Retry-After), before their bodies are read.

Real uvicorn on 127.0.0.1; the model's runs wait at a gate (tests/gates.py), so "the
queue is full" and "the model is busy" hold as long as a test needs, whatever the
machine's speed. The goodput such shedding keeps under real overload is a figure for
bench/overload.py, not for a test.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from tests.gates import HELD, WAIT_S, JumpClock, eventually
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

QUEUE = 4
# The only embed workload, so that /v1/embeddings (whose body names the workload) is
# shed while its queue is full. One input per run: each queued request is a run.
WORKLOADS = f"""\
  held-embed:                      # its runs wait at tests.gates.HELD
    mode: interactive
    task: embed
    model: minilm
    handler: tests.gates:held
    batching: {{max_batch_size: 1, max_wait_ms: 0, max_queue: {QUEUE}}}
"""
CLOCK = JumpClock()
V1 = "/v1/embeddings", {"model": "held-embed", "input": "an embedding, please"}
V2 = (
    "/v2/models/held-embed/infer",
    {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["an embedding"]}]},
)


@pytest.fixture(scope="module")
def server(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    spec = write_spec(tmp_path_factory.mktemp("overload"), demo_models, WORKLOADS)
    with ServerThread(spec, clock=CLOCK) as running:
        yield running


def worker(server: ServerThread) -> BatchWorker:
    state: ServingState = server.app.state
    return state.workers["held-embed"]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    body = await reader.readexactly(int(headers["content-length"]))
    return Answer(int(status_line.split(" ")[1]), headers, body)


async def answered_before_its_body(port: int, path: str, payload: object) -> Answer:
    """POST `payload` to `path` but send only the head: the answer must come without
    the body. Then send the body and another request on the same connection: the
    answer sent before the body was read leaves the connection usable."""
    body = orjson.dumps(payload)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = await asyncio.wait_for(read_answer(reader), WAIT_S)
        writer.write(body + b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        after = await asyncio.wait_for(read_answer(reader), WAIT_S)
        assert after.status == 200, after
    finally:
        writer.close()
    return answer


async def test_a_full_queue_answers_the_rest_503_at_once_and_serves_those_it_took(
    server: ServerThread,
) -> None:
    """10x what the workload can hold: one run on the model and a full queue, held at
    the gate; forty more requests (v1 and v2) each get 503 with Retry-After while the
    gate stays closed, without their bodies being read. Once the gate opens, every
    request the workload took is answered 200."""
    executor = worker(server)
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        with HELD.closed():
            passed = HELD.passed
            running = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await asyncio.to_thread(HELD.wait_held)
            taken = [running]
            for i in range(QUEUE):
                path, body = (V1, V2)[i % 2]
                taken.append(asyncio.create_task(client.post(path, json=body)))
            await eventually(lambda: len(executor.queue) == QUEUE, "the queue is full")
            extra = [
                answered_before_its_body(server.settings.port, *(V1, V2)[i % 2])
                for i in range(10 * (QUEUE + 1) - len(taken))
            ]
            refused = await asyncio.gather(*extra)
            assert not any(t.done() for t in taken)
            assert HELD.passed == passed
        answers = await asyncio.gather(*taken)
    assert [a.status_code for a in answers] == [200] * len(taken), [a.text for a in answers]
    assert len(answers[0].json()["data"][0]["embedding"]) == 384
    assert {a.status for a in refused} == {503}, refused[:3]
    for answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        assert b"queue full" in answer.body, answer.body
    assert "queue full" in orjson.loads(refused[0].body)["error"]["message"]  # OpenAI's shape
    assert isinstance(orjson.loads(refused[1].body)["error"], str)  # v2's shape


async def sent_then_gone(port: int, path: str, payload: object, queued: Callable[[], bool]) -> None:
    """POST `payload` to `path` whole, wait until its inputs are `queued()`, then close
    the connection without reading the answer."""
    body = orjson.dumps(payload)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await eventually(queued, "its inputs are queued")
    finally:
        writer.close()
        await writer.wait_closed()


async def test_a_client_that_leaves_while_queued_takes_its_inputs_out_of_the_queue(
    server: ServerThread,
) -> None:
    """With the model held on one request, a request of three inputs (v1) and one of one
    (v2) queue, and their clients disconnect: their inputs leave the queue at once and
    never reach the model (a model's time is not spent on answers nobody reads, as a
    generate stream's row is freed). The held request is still answered."""
    executor = worker(server)
    registry = server.app.state.metrics.registry
    gone = {"workload": "held-embed", "code": "499"}
    before = registry.get_sample_value("lanes_workload_responses_total", gone) or 0
    three = {"model": "held-embed", "input": ["one", "two", "three"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        with HELD.closed():
            passed = HELD.passed
            running = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await asyncio.to_thread(HELD.wait_held)
            port = server.settings.port
            await sent_then_gone(port, V1[0], three, lambda: len(executor.queue) == 3)
            await eventually(lambda: len(executor.queue) == 0, "the v1 inputs left")
            await sent_then_gone(port, *V2, lambda: len(executor.queue) == 1)
            await eventually(lambda: len(executor.queue) == 0, "the v2 input left")
            await eventually(
                lambda: (
                    registry.get_sample_value("lanes_workload_responses_total", gone) == before + 2
                ),
                "both counted as 499",
            )
        answer = await running
    assert answer.status_code == 200, answer.text
    assert HELD.passed == passed + 1  # the held request's run alone


async def test_a_request_the_queue_cannot_serve_by_its_deadline_gets_503_not_504(
    server: ServerThread,
) -> None:
    """With one run measured at 100 s (the clock jumps while it is held), the model
    busy again and one request queued, a request with a 1 s deadline would wait about
    100 s: it is refused at once with a Retry-After of that wait, never queued to fail
    at its deadline. Requests without a deadline are still taken, and served once the
    model is free."""
    executor = worker(server)
    one_second = {"X-Timeout-Ms": "1000"}
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        with HELD.closed():
            measured = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await asyncio.to_thread(HELD.wait_held)
            CLOCK.jump(100.0)
        assert (await measured).status_code == 200
        with HELD.closed():
            busy = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await asyncio.to_thread(HELD.wait_held)
            queued = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await eventually(lambda: len(executor.queue) == 1, "one request queued")
            for path, body in (V1, V2):
                refused = await client.post(path, json=body, headers=one_second)
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["retry-after"]) >= 50, refused.headers
                assert re.search(r"expected wait, about \d+ ms", refused.text), refused.text
            patient = asyncio.create_task(client.post(V1[0], json=V1[1]))
            await eventually(lambda: len(executor.queue) == 2, "the request without a deadline")
            assert not busy.done()
        answers = await asyncio.gather(busy, queued, patient)
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
