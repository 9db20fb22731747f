"""The interactive endpoint over real HTTP: a real uvicorn on 127.0.0.1, the demo models,
the official `openai` and `tritonclient` clients."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from openai import AsyncOpenAI, AuthenticationError, OpenAI

from lanes.runtime import Runtime
from lanes.serving.app import route_label
from lanes.settings import Settings
from lanes.tasks import load_task
from tests.gates import GATE_FILE_ENV, HELD, SERVER_START_S, eventually, held_marker, wait_until
from tests.servers import ServerThread, free_port, write_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS = """\
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 32, max_wait_ms: 0}
  flowers:
    mode: interactive
    task: infer
    model: classifier
  flower-labels:
    mode: interactive
    task: infer
    model: classifier
    handler: lanes.demo.labels:handler
  full-batches:                    # a batch runs once 16 requests wait (or after 60 s)
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 16, max_wait_ms: 60000}
  held-lane:                       # its runs wait at tests.gates.HELD while a test holds it
    mode: interactive
    task: embed
    model: minilm
    handler: tests.gates:held
    batching: {max_batch_size: 64, max_wait_ms: 0, max_queue: 4}
  held-one:                        # the same, one item a batch
    mode: interactive
    task: embed
    model: minilm
    handler: tests.gates:held
    batching: {max_batch_size: 1, max_wait_ms: 0, max_queue: 4}
  nightly:
    mode: offline
    task: embed
    model: minilm
    input: in/
    output: out/
"""

TEXTS = [f"request number {i}: " + "lanes batches " * (i % 9) + "the end" for i in range(64)]


@pytest.fixture(scope="module")
def spec_path(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("serving"), demo_models, WORKLOADS)


@pytest.fixture(scope="module")
def server(spec_path: Path) -> Iterator[ServerThread]:
    with ServerThread(spec_path) as running:
        yield running


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """One sample of a Prometheus exposition, by name and labels (else `default`)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(f"{name} {labels} not in metrics")


async def test_64_concurrent_callers_get_their_own_answer(server: ServerThread) -> None:
    task = load_task("full-batches", server.spec, Runtime(Settings()))
    expected = [task.run([task.prepare(t)])[0] for t in TEXTS]
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answers = await asyncio.gather(
        *(client.embeddings.create(model="full-batches", input=t) for t in TEXTS)
    )
    await client.close()
    for want, got in zip(expected, answers, strict=True):
        assert np.allclose(got.data[0].embedding, want, atol=1e-5)
        assert got.usage.prompt_tokens > 0
    body = httpx.get(f"{server.url}/metrics").text
    runs = metric(body, "lanes_batch_size_count", workload="full-batches")
    items = metric(body, "lanes_batch_size_sum", workload="full-batches")
    assert (runs, items) == (4, 64), "64 concurrent requests share four full runs"


def test_openai_list_input_base64_and_models(server: ServerThread) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    floats = client.embeddings.create(model="search-query", input=["one", "two words"])
    packed = client.embeddings.create(model="search-query", input="one", encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1]
    # Asked for explicitly, base64 comes back as the string: little-endian float32 bytes.
    packed_text: Any = packed.data[0].embedding  # typed list[float]; base64 is its str
    unpacked = np.frombuffer(base64.b64decode(packed_text), dtype="<f4")
    assert np.allclose(unpacked, floats.data[0].embedding, atol=1e-6)
    assert len(floats.data[0].embedding) == 384
    ids = {m.id for m in client.models.list().data}
    assert ids == {
        "search-query",
        "flowers",
        "flower-labels",
        "full-batches",
        "held-lane",
        "held-one",
    }


def test_a_trailing_slash_is_served_as_without_it(server: ServerThread) -> None:
    """vLLM's FastAPI redirects `/v1/models/` to `/v1/models`; lanes answers it as that
    route at once, never with an empty-bodied 307 (which httpx, by default, and
    tritonclient do not follow). A path no route serves is a 404 in its protocol."""
    embed = {"model": "search-query", "input": "one"}
    row = {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as client:
        before = client.get("/metrics").text
        for path in ("/v1/models", "/v1/models/search-query", "/v2/models/flowers", "/healthz"):
            bare, slashed = client.get(path), client.get(path + "/")
            assert slashed.status_code == 200, (path, slashed.status_code, slashed.text)
            assert slashed.json() == bare.json(), path
        answers = [client.post(p, json=embed) for p in ("/v1/embeddings", "/v1/embeddings/")]
        assert [a.status_code for a in answers] == [200, 200], answers[1].text
        assert answers[1].json()["data"] == answers[0].json()["data"]
        bare = client.post("/v2/models/flowers/infer", json={"inputs": [row]})
        slashed = client.post("/v2/models/flowers/infer//", json={"inputs": [row]})
        assert slashed.status_code == 200, slashed.text
        assert slashed.json()["outputs"] == bare.json()["outputs"]
        missing = client.get("/v1/nowhere/")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"].startswith("Invalid URL (GET /v1/nowhere)")
        ghost = client.get("/v2/models/ghost/")
        assert ghost.status_code == 404 and isinstance(ghost.json()["error"], str)
        after = client.get("/metrics").text
    # Counted as the route they reached, not as `other`.
    for route, more in (("/v1/models", 2), ("/v1/embeddings", 2)):
        then = metric(before, "lanes_responses_total", default=0.0, route=route, code="200")
        now = metric(after, "lanes_responses_total", route=route, code="200")
        assert now - then == more, route


def test_tritonclient_infer_and_metadata(server: ServerThread) -> None:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("flowers")
    meta = client.get_model_metadata("flowers")
    assert meta["inputs"][0]["name"] == "features"
    rows = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)
    tensor = triton.InferInput("features", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows, binary_data=False)
    result = client.infer(
        "flowers", [tensor], outputs=[triton.InferRequestedOutput("logits", binary_data=False)]
    )
    logits = result.as_numpy("logits")
    task = load_task("flowers", server.spec, Runtime(Settings()))
    expected = task.run([task.prepare({"features": rows})])[0]["logits"]
    assert np.allclose(logits, expected, atol=1e-5)


def test_handler_turns_logits_into_labels(server: ServerThread) -> None:
    body = {
        "inputs": [
            {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}
        ]
    }
    answer = httpx.post(f"{server.url}/v2/models/flower-labels/infer", json=body).json()
    [output] = answer["outputs"]
    assert output["name"] == "result" and output["datatype"] == "BYTES"
    assert '"label"' in output["data"][0]


def queue_depth(server: ServerThread, workload: str) -> float:
    return metric(
        httpx.get(f"{server.url}/metrics").text, "lanes_queue_depth", 0.0, workload=workload
    )


def run_items(server: ServerThread, workload: str) -> float:
    """Requests that reached the model (the sum of its batch sizes)."""
    body = httpx.get(f"{server.url}/metrics").text
    return metric(body, "lanes_batch_size_sum", 0.0, workload=workload)


async def test_full_queue_answers_503_with_retry_after(server: ServerThread) -> None:
    url = f"{server.url}/v1/embeddings"
    async with httpx.AsyncClient(timeout=30) as client:

        def send(text: str) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(client.post(url, json={"model": "held-lane", "input": text}))

        with HELD.closed():
            running = send("on the model")
            await asyncio.to_thread(HELD.wait_held)
            waiting = [send(f"t{i}") for i in range(4)]
            await eventually(lambda: queue_depth(server, "held-lane") == 4, "a full queue")
            refused = await client.post(url, json={"model": "held-lane", "input": "one too many"})
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
        answers = await asyncio.gather(running, *waiting)
        assert [r.status_code for r in answers] == [200] * 5


async def test_expired_deadline_answers_504_and_never_reaches_the_model(
    server: ServerThread,
) -> None:
    """The deadline fires while the batch before it still runs (held at the gate)."""
    url = f"{server.url}/v1/embeddings"
    before = run_items(server, "held-lane")
    async with httpx.AsyncClient(timeout=30) as client:
        with HELD.closed():
            running = asyncio.create_task(
                client.post(url, json={"model": "held-lane", "input": "on the model"})
            )
            await asyncio.to_thread(HELD.wait_held)
            late = await client.post(
                url,
                json={"model": "held-lane", "input": "too late"},
                headers={"X-Timeout-Ms": "100"},
            )
            assert late.status_code == 504
            # What scales replicas (KEDA on lanes_queue_depth) sees it gone, at once.
            body = httpx.get(f"{server.url}/metrics").text
            assert metric(body, "lanes_queue_depth", workload="held-lane") == 0
            assert (
                metric(body, "lanes_lane_queue_depth", workload="held-lane", lane="interactive")
                == 0
            )
        assert (await running).status_code == 200
    assert run_items(server, "held-lane") == before + 1


async def test_a_request_on_the_model_is_answered_though_its_other_items_outwait_its_deadline(
    server: ServerThread,
) -> None:
    """One item a batch: the request's first input holds the model past its deadline
    while its second waits. It is on the model, so it is answered, both inputs."""
    url = f"{server.url}/v1/embeddings"
    deadline = {"X-Timeout-Ms": "300"}
    async with httpx.AsyncClient(timeout=30) as client:
        with HELD.closed():
            both = asyncio.create_task(
                client.post(
                    url, json={"model": "held-one", "input": ["one", "two"]}, headers=deadline
                )
            )
            await asyncio.to_thread(HELD.wait_held)  # "one" is on the model, "two" waits
            alone = {"model": "held-one", "input": "queued after"}
            witness = await client.post(url, json=alone, headers=deadline)
            assert witness.status_code == 504  # so the deadline of both has passed
        answer = await both
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2


BAD_REQUESTS: list[tuple[str, str, object, int]] = [
    ("POST", "/v1/embeddings", b"{not json", 400),
    ("POST", "/v1/embeddings", b"", 400),
    ("POST", "/v1/embeddings", [], 400),
    ("POST", "/v1/embeddings", {"input": "no model"}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query"}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query", "input": 42}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query", "input": ""}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query", "input": []}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query", "input": ["ok", None]}, 400),
    (
        "POST",
        "/v1/embeddings",
        {"model": "search-query", "input": "x", "encoding_format": "hex"},
        400,
    ),
    ("POST", "/v1/embeddings", {"model": "nope", "input": "x"}, 404),
    ("POST", "/v1/embeddings", {"model": "flowers", "input": "x"}, 400),
    ("POST", "/v1/embeddings", {"model": "nightly", "input": "x"}, 400),
    ("POST", "/v1/embeddings", {"model": "search-query", "input": "x" * 9_000_000}, 413),
    ("GET", "/v1/embeddings", None, 405),
    ("POST", "/v2/models/infer", None, 405),  # a model named "infer": GET only
    ("POST", "/v2/models/flowers/infer", {"inputs": []}, 400),
    (  # Triton's timeout in microseconds: true is no number (bool is int in Python)
        "POST",
        "/v2/models/flowers/infer",
        {
            "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}],
            "parameters": {"timeout": True},
        },
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3]}]},
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {"inputs": [{"name": "colour", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "data": ["a", "b", "c", "d"],
                }
            ]
        },
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {
            "inputs": [
                {"name": "features", "shape": [1, 4], "datatype": "COMPLEX", "data": [1, 2, 3, 4]}
            ]
        },
        400,
    ),
    (
        "POST",
        "/v2/models/flowers/infer",
        {
            "inputs": [
                {"name": "features", "shape": [-1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
            ]
        },
        400,
    ),
    (
        "POST",
        "/v2/models/ghost/infer",
        {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]},
        404,
    ),
    (
        "POST",
        "/v2/models/search-query/infer",
        {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1]}]},
        400,
    ),
    (
        "POST",
        "/v2/models/search-query/infer",
        {"inputs": [{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
        400,
    ),
    # JSON has no NaN: null, or a number beyond FP16's range, is no FP16 value.
    *(
        (
            "POST",
            "/v2/models/flower-labels/infer",  # its handler's pre takes any float type
            {"inputs": [{"name": "features", "shape": [1, 4], "datatype": d, "data": data}]},
            400,
        )
        for d, data in (
            ("FP32", [None, 1, 2, 3]),
            ("FP32", [1e39, 1, 2, 3]),
            ("FP16", [7e4, 1, 2, 3]),
        )
    ),
    ("GET", "/v2/models/ghost", None, 404),
    ("GET", "/nowhere", None, 404),
]


def test_more_texts_than_the_queue_holds_is_a_413_naming_the_tensor(server: ServerThread) -> None:
    texts = {"name": "text", "shape": [5], "datatype": "BYTES", "data": ["x"] * 5}
    answer = httpx.post(f"{server.url}/v2/models/held-lane/infer", json={"inputs": [texts]})
    assert answer.status_code == 413, answer.text
    assert answer.json()["param"] == "inputs.text", answer.text
    assert "max_queue" in answer.json()["error"]


def test_server_survives_bad_requests(server: ServerThread) -> None:
    assert len(BAD_REQUESTS) >= 20
    with httpx.Client(base_url=server.url, timeout=10) as client:
        before = client.get("/metrics").text
        for method, path, body, status in BAD_REQUESTS:
            if isinstance(body, bytes) or body is None:
                answer = client.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
            else:
                answer = client.request(method, path, json=body)
            assert answer.status_code == status, (
                path,
                body if not isinstance(body, dict) else str(body)[:200],
                answer.text,
            )
            if status != 405 and path != "/nowhere":
                error = answer.json()["error"]
                message = error["message"] if path.startswith("/v1") else error
                assert isinstance(message, str) and len(message) > 10
        # A bad X-Timeout-Ms is refused whether or not parameters.timeout is given too.
        v2 = {
            "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}],
            "parameters": {"timeout": 5_000_000},
        }
        both = client.post("/v2/models/flowers/infer", json=v2, headers={"X-Timeout-Ms": "abc"})
        assert both.status_code == 400 and "X-Timeout-Ms" in both.json()["error"], both.text
        counted = [("/v2/models/{name}/infer", "400")]
        good = client.post("/v1/embeddings", json={"model": "search-query", "input": "still here"})
        assert good.status_code == 200
        after = client.get("/metrics").text
    # Every answer is counted by route and status, whichever path served it.
    counts = Counter((route_label(path), str(status)) for _, path, _, status in BAD_REQUESTS)
    counts[("/v1/embeddings", "200")] += 1
    counts.update(counted)
    for (route, code), count in counts.items():
        now = metric(after, "lanes_responses_total", route=route, code=code)
        then = metric(before, "lanes_responses_total", default=0.0, route=route, code=code)
        assert now - then == count, (route, code)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "search-query", "input": "café"}),
        (
            "/v2/models/flowers/infer",
            {"id": "café", "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32"}]},
        ),
    ],
)
def test_a_body_that_is_not_utf8_is_a_400_naming_the_byte(
    server: ServerThread, path: str, body: dict[str, Any]
) -> None:
    # Latin-1, as a client that does not encode its text as UTF-8 sends it: "é" is 0xe9.
    raw = json.dumps(body, ensure_ascii=False).encode("latin-1")
    answer = httpx.post(
        f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    message = error["message"] if path.startswith("/v1") else error
    offset = raw.index(b"\xe9")
    assert message.startswith("body: expected JSON in UTF-8, found byte 0xe9 at offset "), message
    assert f"offset {offset}," in message and "surrogates" not in message, message


def test_api_key_guards_everything_but_health(spec_path: Path) -> None:
    with ServerThread(spec_path, api_key="s3cret") as guarded:
        assert httpx.get(f"{guarded.url}/healthz").status_code == 200
        assert httpx.get(f"{guarded.url}/v2/health/ready").status_code == 200
        refused = httpx.get(f"{guarded.url}/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.get(
                f"{guarded.url}/metrics", headers={"Authorization": "Bearer wrong"}
            ).status_code
            == 401
        )
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).embeddings.create(
                model="search-query", input="x"
            )
        ok = OpenAI(base_url=f"{guarded.url}/v1", api_key="s3cret", max_retries=0)
        assert len(ok.embeddings.create(model="search-query", input="x").data) == 1
        # A v2 401 is a v2 error like any other: its code beside the message, the same
        # code as the OpenAI shape's.
        for path in ("/v2/models/search-query", "/v2/models/search-query/ready", "/v2"):
            v2 = httpx.get(f"{guarded.url}{path}")
            assert v2.status_code == 401
            assert v2.json()["code"] == refused.json()["error"]["code"] == "invalid_api_key"
            assert "API key" in v2.json()["error"]


SIGTERM_WORKLOADS = """\
  held-lane:                       # its runs wait for the file $TESTS_GATE_FILE
    mode: interactive
    task: embed
    model: minilm
    handler: tests.gates:held_by_file
    batching: {max_batch_size: 64, max_wait_ms: 0}
"""


def accepting(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_sigterm_finishes_queued_work_then_exits(demo_models: Path, tmp_path: Path) -> None:
    """One request held on the model (at a gate file), two queued behind it, then
    SIGTERM: the server stops accepting, and once the gate opens it answers all three."""
    spec_path = write_spec(tmp_path, demo_models, SIGTERM_WORKLOADS)
    gate = tmp_path / "open"
    port = free_port()
    env = {**os.environ, "LANES_PORT": str(port), GATE_FILE_ENV: str(gate)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, "the server ready", timeout=SERVER_START_S)

        def queued() -> float:
            body = httpx.get(f"{url}/metrics", timeout=10).text
            return metric(body, "lanes_queue_depth", 0.0, workload="held-lane")

        async def queued_then_terminated() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                calls = [
                    asyncio.create_task(
                        client.post(
                            f"{url}/v1/embeddings", json={"model": "held-lane", "input": f"q{i}"}
                        )
                    )
                    for i in range(3)
                ]
                await eventually(
                    lambda: held_marker(gate).exists() and queued() == 2,
                    "one request held on the model and two queued",
                )
                proc.send_signal(signal.SIGTERM)
                await eventually(lambda: not accepting(port), "the server to stop accepting")
                gate.touch()
                return [r.status_code for r in await asyncio.gather(*calls)]

        assert asyncio.run(queued_then_terminated()) == [200, 200, 200]
        # uvicorn re-raises the signal once its graceful shutdown is done.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
