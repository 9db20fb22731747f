"""The SDK client's interactive half against a real server: a real uvicorn on 127.0.0.1
with an API key, the demo models, `lanes.Client` and `lanes.AsyncClient` over the
network, every error provoked for real, and the CLI twins as subprocesses.

Offline jobs (submit, Job, `lanes submit|job`) are in test_client_jobs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import lanes
from lanes.client import Completion
from tests.flows_fixtures import sum_model
from tests.gates import HELD, Gate, eventually, stepping, wait_until
from tests.servers import ServerThread, free_port, write_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-test-lanes"
GEN_INPUT = '{"prompt": "def f(x):", "max_tokens": 3}'
CHAT_INPUT = '{"messages": [{"role": "user", "content": "a class"}], "max_tokens": 3}'
# The server's decoder runs wait here while a test holds it closed (tests/gates.py).
DECODER = Gate()

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
  code:
    mode: interactive
    task: generate
    model: tinycode
    batching: {max_batch_size: 4}
    generation: {max_new_tokens: 12, temperature: 0}
  full-lane:                       # four places behind a run held at tests.gates.HELD
    mode: interactive
    task: infer
    model: classifier
    handler: tests.gates:held
    batching: {max_batch_size: 64, max_wait_ms: 0, max_queue: 4}
  late-lane:                       # the same, for deadlines (so neither test fills the other)
    mode: interactive
    task: infer
    model: classifier
    handler: tests.gates:held
    batching: {max_batch_size: 64, max_wait_ms: 0, max_queue: 4}
  nightly:
    mode: offline
    task: embed
    model: minilm
    input: in/
    output: out/
  code-streams:                    # streams by default: the SDK's and the CLI's default
    mode: interactive
    task: generate
    model: tinycode
    stream: true
    generation: {max_new_tokens: 12, temperature: 0}
  small-queue:                     # two waiting places: three texts can never fit
    mode: interactive
    task: embed
    model: minilm
    batching: {max_queue: 2}
  pair:                            # a model of two inputs, a and b
    mode: interactive
    task: infer
    model: pair
"""
# The server's `shifted` is an infer workload; the client's spec says embed.
SHIFTED_SERVER = """\
  shifted:
    mode: interactive
    task: infer
    model: classifier
"""
# The client's spec also names a workload this server does not serve.
RETIRED = """\
  retired:
    mode: interactive
    task: embed
    model: minilm
  shifted:
    mode: interactive
    task: embed
    model: minilm
"""
ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@pytest.fixture(scope="module")
def specs(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The server's spec, and the client's (one workload more)."""
    more = {"pair": sum_model(tmp_path_factory.mktemp("pair"))}
    server_spec = write_spec(
        tmp_path_factory.mktemp("server"), demo_models, WORKLOADS + SHIFTED_SERVER, more
    )
    client_spec = write_spec(
        tmp_path_factory.mktemp("client"), demo_models, WORKLOADS + RETIRED, more
    )
    return server_spec, client_spec


@pytest.fixture(scope="module")
def server(specs: tuple[Path, Path]) -> Iterator[ServerThread]:
    with ServerThread(specs[0], gates={"tinycode": DECODER}, api_key=KEY) as running:
        yield running


@pytest.fixture
def client(server: ServerThread, specs: tuple[Path, Path]) -> Iterator[lanes.Client]:
    with lanes.Client(server.url, api_key=KEY, spec=specs[1]) as c:
        yield c


@pytest.fixture
async def aclient(
    server: ServerThread, specs: tuple[Path, Path]
) -> AsyncIterator[lanes.AsyncClient]:
    async with lanes.AsyncClient(server.url, api_key=KEY, spec=specs[1]) as c:
        yield c


def raw(server: ServerThread, path: str, body: dict[str, object]) -> dict[str, object]:
    """The server's own answer, without the SDK."""
    auth = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{server.url}{path}", json=body, headers=auth, timeout=30)
    assert answer.status_code == 200, answer.text
    result: dict[str, object] = answer.json()
    return result


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """One sample from /metrics (0 when the series has none yet)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def queue_depth(server: ServerThread, workload: str) -> float:
    return metric(server, "lanes_queue_depth", workload=workload)


# ---- results ---------------------------------------------------------------------------


def test_call_returns_each_task_s_result(client: lanes.Client, server: ServerThread) -> None:
    vector = client.call("search-query", "how do I reverse a list")
    expected = raw(
        server, "/v1/embeddings", {"model": "search-query", "input": "how do I reverse a list"}
    )
    assert vector.dtype == np.float32 and vector.shape == (384,)
    assert np.allclose(vector, expected["data"][0]["embedding"], atol=1e-6)  # type: ignore[index]
    both = client.call("search-query", ["how do I reverse a list", "sort a dict"])
    assert both.shape == (2, 384) and np.allclose(both[0], vector, atol=1e-5)

    logits = client.call("flowers", {"features": ROWS})
    assert set(logits) == {"logits"} and logits["logits"].shape == (2, 3)
    assert logits["logits"].dtype == np.float32
    tensor = {
        "name": "features",
        "shape": [2, 4],
        "datatype": "FP32",
        "data": ROWS.ravel().tolist(),
    }
    answer = raw(server, "/v2/models/flowers/infer", {"inputs": [tensor]})
    flat = np.asarray(answer["outputs"][0]["data"])  # type: ignore[index]
    assert np.allclose(logits["logits"].ravel(), flat, atol=1e-6)
    labels = client.call("flower-labels", {"features": ROWS.tolist()})  # lists go as FP32
    assert [row["label"] for row in labels["result"]] == ["setosa", "virginica"]

    done = client.call("code", "def fib(n):", max_tokens=8)
    plain = raw(
        server, "/v1/completions", {"model": "code", "prompt": "def fib(n):", "max_tokens": 8}
    )
    assert isinstance(done, Completion)
    assert done.text == plain["choices"][0]["text"]  # type: ignore[index]
    assert done.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chat = client.call("code", [{"role": "user", "content": "a class"}], max_tokens=6)
    assert isinstance(chat, Completion) and chat.usage.completion_tokens <= 6


def test_a_prompt_of_token_ids_travels_as_ids(client: lanes.Client, server: ServerThread) -> None:
    ids = [5, 17, 42, 7]
    plain = raw(server, "/v1/completions", {"model": "code", "prompt": ids, "max_tokens": 5})
    done = client.call("code", ids, max_tokens=5)
    assert done.text == plain["choices"][0]["text"]  # type: ignore[index]
    assert done.usage.prompt_tokens == len(ids)
    assert client.call("code", tuple(ids), max_tokens=5) == done
    assert client.call("code", np.array(ids, dtype=np.int64), max_tokens=5) == done
    assert "".join(client.stream("code", ids, max_tokens=5)) == done.text
    assert client.call("code-streams", ids, max_tokens=5) == done


def test_a_calls_logprobs_come_back_whole_or_gathered_from_a_stream(
    client: lanes.Client,
) -> None:
    whole = client.call("code", "def fib(n):", max_tokens=6, logprobs=2)
    assert whole.logprobs is not None
    assert "".join(whole.logprobs["tokens"]) == whole.text
    assert len(whole.logprobs["token_logprobs"]) == whole.usage.completion_tokens
    gathered = client.call("code-streams", "def fib(n):", max_tokens=6, logprobs=2)
    assert gathered.text == whole.text
    assert gathered.logprobs is not None
    assert gathered.logprobs["tokens"] == whole.logprobs["tokens"]
    assert gathered.logprobs["text_offset"] == whole.logprobs["text_offset"]
    assert gathered.logprobs["token_logprobs"] == pytest.approx(
        whole.logprobs["token_logprobs"], abs=1e-5
    )
    chat = [{"role": "user", "content": "a class"}]
    scored = client.call("code-streams", chat, max_tokens=4, logprobs=True, top_logprobs=1)
    assert [t["token"] for t in scored.logprobs["content"]] != []
    assert client.call("code", "def fib(n):", max_tokens=6).logprobs is None


def test_a_bad_list_of_token_ids_is_invalid_input(
    client: lanes.Client, server: ServerThread
) -> None:
    before = metric(server, "lanes_responses_total", route="/v1/completions", code="400")
    with pytest.raises(lanes.InvalidInput, match=r"prompt\[1\]: expected a token id") as negative:
        client.call("code", [5, -1, 7])
    assert (negative.value.param, negative.value.code) == ("prompt[1]", "invalid_value")
    with pytest.raises(lanes.InvalidInput, match="found an empty array") as empty:
        client.call("code", [])  # neither ids nor messages: never a chat of no messages
    assert (empty.value.param, empty.value.code) == ("prompt", "empty_array")
    assert metric(server, "lanes_responses_total", route="/v1/completions", code="400") == before
    # Beyond the vocabulary only the server knows: its 400, typed.
    with pytest.raises(lanes.InvalidInput, match="prompt: expected token ids from 0 to") as far:
        client.call("code", [5, 10**9])
    assert far.value.param == "prompt"


async def test_call_sends_numbers_as_the_model_s_datatype(
    client: lanes.Client, aclient: lanes.AsyncClient
) -> None:
    """The server takes only the model's datatypes: the clients learn them from the
    workload's metadata and send Python ints (and numpy's default int64 and float64) as
    the model's FP32; an explicit dtype goes as it is, and the server names a mismatch."""
    ints = [[5, 3, 1, 0], [7, 3, 5, 2]]
    want = client.call("flowers", {"features": np.array(ints, dtype=np.float32)})["logits"]
    assert np.array_equal(client.call("flowers", {"features": ints})["logits"], want)
    got = await aclient.call("flowers", {"features": np.array(ints)})
    assert np.array_equal(got["logits"], want)
    got = await aclient.call("flowers", {"features": np.array(ints, dtype=np.float64)})
    assert np.array_equal(got["logits"], want)
    with pytest.raises(lanes.InvalidInput, match="the model takes FP32, found INT32"):
        client.call("flowers", {"features": np.array(ints, dtype=np.int32)})


async def test_infer_of_one_input_takes_its_value_alone(
    client: lanes.Client, aclient: lanes.AsyncClient
) -> None:
    """As `lanes predict`: a model of one input takes its value without the name, a
    handler's `pre` the flat row it takes (the row is named for v2, not changed)."""
    named = client.call("flowers", {"features": ROWS})["logits"]
    assert np.array_equal(client.call("flowers", ROWS)["logits"], named)
    assert np.array_equal((await aclient.call("flowers", ROWS.tolist()))["logits"], named)
    (label,) = client.call("flower-labels", ROWS[1].tolist())["result"]
    assert label["label"] == "virginica"
    sums = client.call("pair", {"a": [[1, 2]], "b": [[3, 4]]})["s"]
    assert sums.tolist() == [[4, 6]]


async def test_infer_of_several_inputs_needs_their_names(
    client: lanes.Client, aclient: lanes.AsyncClient, server: ServerThread
) -> None:
    route = "/v2/models/{name}/infer"
    before = metric(server, "lanes_responses_total", route=route, code="400")
    message = (
        "input: workload 'pair' takes 2 inputs ('a', 'b'): send a mapping of input name -> "
        "array, like {'a': [...], 'b': [...]}; found an array"
    )
    with pytest.raises(lanes.InvalidInput) as refused:
        client.call("pair", [[1, 2]])
    assert str(refused.value) == message and refused.value.param == "input"
    array = message.replace("an array", "a float64 array of shape [1, 2]")
    with pytest.raises(lanes.InvalidInput, match=re.escape(array)):
        await aclient.call("pair", np.ones((1, 2)))
    # The article agrees with the dtype's name: "an int64", "an object" array.
    for dtype in ("int64", "object"):
        array = message.replace("an array", f"an {dtype} array of shape [1, 2]")
        with pytest.raises(lanes.InvalidInput, match=re.escape(array)):
            client.call("pair", np.ones((1, 2), dtype=dtype))
    after = metric(server, "lanes_responses_total", route=route, code="400")
    assert after == before, "refused before the infer request was sent"


async def test_embed_takes_numpy_arrays_of_texts_and_token_ids(
    client: lanes.Client, aclient: lanes.AsyncClient
) -> None:
    texts = ["how do I reverse a list", "sort a dict"]
    want = client.call("search-query", texts)
    for array in (np.array(texts), np.array(texts, dtype=object)):
        assert np.allclose(client.call("search-query", array), want, atol=1e-5)
        assert np.allclose(await aclient.call("search-query", array), want, atol=1e-5)
    ids = [[101, 7592, 102], [101, 2088, 102]]
    assert np.array_equal(
        client.call("search-query", np.array(ids)), client.call("search-query", ids)
    )
    for bad in (np.zeros((2, 3)), np.array([texts]), np.array(["a", 1], dtype=object)):
        with pytest.raises(lanes.InvalidInput, match="input: a numpy array of ") as refused:
            client.call("search-query", bad)
        assert refused.value.param == "input"


def held_chunks(chunks: Iterator[str]) -> list[str]:
    """Every chunk of a stream whose first step (the prefill) ran alone: the server
    sends whatever a client has not read yet as one chunk, so on a fast machine a
    short answer would otherwise come whole."""
    with DECODER.closed():
        DECODER.allow(1)
        first = next(chunks)
    return [first, *chunks]


async def held_achunks(chunks: AsyncIterator[str]) -> list[str]:
    """`held_chunks` of an async stream."""
    with DECODER.closed():
        DECODER.allow(1)
        first = await anext(chunks)
    return [first, *[c async for c in chunks]]


def test_stream_yields_the_same_text_in_chunks(client: lanes.Client) -> None:
    whole = client.call("code", "import os\ndef main(", max_tokens=10)
    chunks = held_chunks(client.stream("code", "import os\ndef main(", max_tokens=10))
    assert len(chunks) > 1 and all(isinstance(c, str) and c for c in chunks)
    assert "".join(chunks) == whole.text
    chat = list(client.stream("code", [{"role": "user", "content": "a class"}], max_tokens=6))
    assert (
        "".join(chat)
        == client.call("code", [{"role": "user", "content": "a class"}], max_tokens=6).text
    )


async def test_async_client_calls_and_streams(
    aclient: lanes.AsyncClient, client: lanes.Client
) -> None:
    texts = [f"question {i}" for i in range(8)]
    vectors = await asyncio.gather(*(aclient.call("search-query", t) for t in texts))
    assert np.allclose(np.stack(vectors), client.call("search-query", texts), atol=1e-5)
    logits = await aclient.call("flowers", {"features": ROWS})
    assert logits["logits"].shape == (2, 3)
    done = await aclient.call("code", "def fib(n):", max_tokens=8)
    chunks = await held_achunks(aclient.stream("code", "def fib(n):", max_tokens=8))
    assert len(chunks) > 1 and "".join(chunks) == done.text


def test_settings_come_from_the_environment(
    server: ServerThread, specs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_ENDPOINT", server.url)
    monkeypatch.setenv("LANES_API_KEY", KEY)
    monkeypatch.setenv("LANES_SPEC", str(specs[1]))
    with lanes.Client() as client:
        assert client.endpoint == server.url
        assert client.call("search-query", "hello").shape == (384,)


@pytest.fixture
def not_lanes() -> Iterator[str]:
    """Another HTTP service where LANES_ENDPOINT points: it answers POST with an HTML
    501 page and GET of any path with an HTML 404 page, as Python's http.server does."""
    import http.server

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test reads what the client raised, not the server's log

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_endpoint_that_is_no_lanes_server_is_said_in_one_line(
    not_lanes: str, specs: tuple[Path, Path]
) -> None:
    """Its HTML error page is no message, and its 404 no unknown workload."""
    with lanes.Client(not_lanes, spec=specs[1], max_retries=0) as client:
        with pytest.raises(lanes.LanesError) as posted:
            client.call("search-query", "hello")
        with pytest.raises(lanes.LanesError) as missing:
            client.call("flowers", [[5.1, 3.5, 1.4, 0.2]])  # reads its metadata first: GET
    assert type(missing.value) is lanes.LanesError  # not UnknownWorkload
    for caught, status in ((posted, 501), (missing, 404)):
        message = str(caught.value)
        assert message.startswith(f"{not_lanes} answered HTTP {status} with no lanes error (")
        assert message.endswith(
            "check that LANES_ENDPOINT (or Client(endpoint=...)) is a lanes "
            "server or a proxy in front of one"
        )
        assert "\n" not in message and "<" not in message


@pytest.mark.parametrize(("status", "raised"), [(429, lanes.Overloaded), (502, lanes.Unavailable)])
def test_a_proxys_rate_limit_and_bad_gateway_are_retried(
    status: int, raised: type[lanes.LanesError], specs: tuple[Path, Path]
) -> None:
    """A proxy in front of the endpoint answers 429 (its rate limit) or 502 (a replica
    restarting): waited out and retried as a full queue is, not a caller's bad input."""
    import http.server

    hits: list[str] = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hits.append(self.path)
            self.send_response(status)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        with lanes.Client(url, spec=specs[1], max_retries=2) as client, pytest.raises(raised):
            client.call("search-query", "hello")
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert hits == ["/v1/embeddings"] * 3


def test_jobs_follow_the_prefect_api_url_setting(
    specs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANES_PREFECT_API_URL names the Prefect API the endpoint's batches run on; the
    client follows jobs and batches there too, not "none is set"."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    monkeypatch.setenv("LANES_PREFECT_API_URL", api)
    with (
        temporary_settings(restore_defaults={PREFECT_API_URL}),
        lanes.Client(spec=specs[1]) as client,
        pytest.raises(lanes.Unavailable, match=f"cannot reach the Prefect API at {api}"),
    ):
        client.jobs()


async def test_the_async_client_lists_jobs_too(
    specs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncClient has Client's methods, awaited: `jobs` as well."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    monkeypatch.setenv("LANES_PREFECT_API_URL", api)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        async with lanes.AsyncClient(spec=specs[1]) as client:
            with pytest.raises(lanes.Unavailable, match=f"cannot reach the Prefect API at {api}"):
                await client.jobs()


# ---- early close ------------------------------------------------------------------------

LONG = {"max_tokens": 400, "ignore_eos": True}


def test_closing_a_stream_early_frees_its_slot(client: lanes.Client, server: ServerThread) -> None:
    aborted = metric(server, "lanes_sequences_finished_total", workload="code", reason="abort")
    with DECODER.closed():
        DECODER.allow(1)  # the prefill: the first chunk; the row's next step waits
        for chunk in client.stream("code", "def f(x", **LONG):
            assert chunk
            DECODER.wait_held()
            assert metric(server, "lanes_sequences_in_flight", workload="code") == 1
            break  # the loop drops the iterator: it closes, and so does its connection
        # The server aborts the sequence at its next step (the runs held meanwhile are
        # let through one at a time: the abort may reach it after the held step's plan).
        wait_until(
            stepping(
                DECODER,
                lambda: (
                    metric(
                        server, "lanes_sequences_finished_total", workload="code", reason="abort"
                    )
                    == aborted + 1
                ),
            ),
            "the server aborting the sequence",
        )
        assert metric(server, "lanes_sequences_in_flight", workload="code") == 0


async def test_async_stream_aclose_frees_its_slot(
    aclient: lanes.AsyncClient, server: ServerThread
) -> None:
    aborted = metric(server, "lanes_sequences_finished_total", workload="code", reason="abort")
    with DECODER.closed():
        DECODER.allow(1)
        chunks = aclient.stream("code", "class Foo:", **LONG)
        assert await anext(chunks)
        await asyncio.to_thread(DECODER.wait_held)
        assert metric(server, "lanes_sequences_in_flight", workload="code") == 1
        await chunks.aclose()  # type: ignore[attr-defined]
        free = stepping(
            DECODER, lambda: metric(server, "lanes_sequences_in_flight", workload="code") == 0
        )
        await eventually(free, "a free row")  # at the server's next step
        assert (
            metric(server, "lanes_sequences_finished_total", workload="code", reason="abort")
            == aborted + 1
        )
    # The pool still works: the closed connection was replaced, not reused.
    assert (await aclient.call("code", "x", max_tokens=2)).usage.completion_tokens <= 2


# ---- typed errors --------------------------------------------------------------------------


def test_input_errors_carry_the_server_s_message_and_are_never_retried(
    client: lanes.Client, server: ServerThread
) -> None:
    before = metric(server, "lanes_responses_total", route="/v1/embeddings", code="400")
    with pytest.raises(lanes.InvalidInput, match="input: "):
        client.call("search-query", "")  # the server refuses an empty text
    after = metric(server, "lanes_responses_total", route="/v1/embeddings", code="400")
    assert after == before + 1, "a 4xx is answered once, not retried"
    with pytest.raises(lanes.InvalidInput, match="features"):
        client.call("flowers", {"features": [[1.0, 2.0, 3.0]]})  # v2's {"error": "..."} shape
    # The model's one input, unnamed: a flat row is still no rows (without a handler's pre).
    with pytest.raises(lanes.InvalidInput, match=r"input 'features': expected rank 2 \("):
        client.call("flowers", [1, 2, 3, 4])


def test_errors_come_back_typed_with_the_server_s_param_and_code(
    client: lanes.Client, server: ServerThread
) -> None:
    with pytest.raises(lanes.InvalidInput, match="max_tokens: ") as bad:
        client.call("code", "x", max_tokens=0)
    assert (bad.value.param, bad.value.code) == ("max_tokens", "integer_below_min_value")
    with pytest.raises(lanes.WrongMode, match="is an infer workload") as wrong:
        client.call("shifted", "hello")  # a 400 from the server, read back as WrongMode
    assert (wrong.value.param, wrong.value.code) == ("model", "wrong_mode")
    with pytest.raises(lanes.UnknownWorkload) as unknown:
        client.call("retired", "hello")
    assert unknown.value.code == "model_not_found"
    before = metric(server, "lanes_responses_total", route="/v1/embeddings", code="413")
    with pytest.raises(lanes.RequestTooLarge, match="at most 2 per request"):
        client.call("small-queue", ["one", "two", "three"])
    after = metric(server, "lanes_responses_total", route="/v1/embeddings", code="413")
    assert after == before + 1, "a request that can never fit is not retried"
    assert client.call("small-queue", ["one", "two"]).shape == (2, 384)


def test_what_json_cannot_carry_is_invalid_input_before_anything_is_sent(
    client: lanes.Client, server: ServerThread, specs: tuple[Path, Path]
) -> None:
    before = metric(server, "lanes_responses_total", route="/v1/embeddings", code="200")
    for value in ({"a", "b"}, b"hello"):
        with pytest.raises(lanes.InvalidInput, match="input: cannot be sent as JSON") as bad:
            client.call("search-query", value)
        assert bad.value.param == "input"
    with pytest.raises(lanes.InvalidInput, match="features: cannot be sent as JSON"):
        client.call("flowers", {"features": [[float("nan"), 1.0, 2.0, 3.0]]})
    with pytest.raises(lanes.InvalidInput, match="timeout_ms: expected a number"):
        client.call("search-query", "x", timeout_ms="100")  # type: ignore[arg-type]
    for ms in (0, -5, float("nan"), float("inf")):  # the argument named, not its header
        with pytest.raises(lanes.InvalidInput, match=r"^timeout_ms: expected a positive") as late:
            client.call("search-query", "x", timeout_ms=ms)
        assert late.value.param == "timeout_ms"
    for prompt in (5, {"prompt": "x"}, ["a", "b"]):
        with pytest.raises(
            lanes.InvalidInput, match="prompt: expected a string, a list of token ids, or a list of"
        ):
            client.call("code", prompt)
    with pytest.raises(lanes.InvalidInput, match="records: expected a list of records") as one:
        client.submit("nightly", {"id": "1", "text": "x"})  # type: ignore[dict-item]
    with pytest.raises(lanes.InvalidInput, match=r"records\[1\]: .*, found 'x'$") as text:
        client.submit("nightly", [{"id": "1", "text": "x"}, "x"])  # type: ignore[list-item]
    with pytest.raises(lanes.InvalidInput, match=r"records\[0\]: not JSON-serialisable") as odd:
        client.submit("nightly", [{"id": "1", "text": {1, 2}}])
    assert (one.value.param, text.value.param, odd.value.param) == (
        "records",
        "records[1]",
        "records[0]",
    )
    # Not staged as null, as a JSON encoder that takes NaN would write it.
    nan = {"id": "2", "rows": [[1.0, 2.0], {"x": [float("nan")]}]}
    with pytest.raises(lanes.InvalidInput, match="cannot be sent as JSON") as bad:
        client.submit("nightly", [{"id": "1", "text": None}, nan])
    assert bad.value.param == "records[1].rows[1].x[0]"
    after = metric(server, "lanes_responses_total", route="/v1/embeddings", code="200")
    assert after == before, "nothing reached the server"
    for endpoint in ("http://[::1", "localhost:8000", f"{server.url}/v1"):
        with pytest.raises(lanes.InvalidInput, match="endpoint: "):
            lanes.Client(endpoint, spec=specs[1])


async def test_an_option_the_request_does_not_define_is_refused_before_sending(
    specs: tuple[Path, Path],
) -> None:
    """The server ignores fields it does not know (as vLLM does), so the SDK refuses
    them: a misspelt option would otherwise be dropped without a word. Nothing listens
    at the endpoint: an error other than InvalidInput would mean it tried to send."""
    nobody = f"http://127.0.0.1:{free_port()}"
    with lanes.Client(nobody, spec=specs[1], max_retries=0) as client:
        with pytest.raises(lanes.InvalidInput) as misspelt:
            client.call("code", "def f(x):", max_token=3)
        with pytest.raises(lanes.InvalidInput, match="unknown option 'tempreature'"):
            list(client.stream("code", "x", tempreature=0.5))
        with pytest.raises(lanes.InvalidInput, match=r"unknown option 'suffix'.*\(it takes: "):
            client.call("code", [{"role": "user", "content": "hi"}], suffix="x")  # not chat's
        with pytest.raises(lanes.InvalidInput, match="unknown option 'max_tokens'") as embed:
            client.call("search-query", "x", max_tokens=3)
        with pytest.raises(lanes.InvalidInput, match="unknown option 'temperature'"):
            client.call("flowers", {"features": ROWS}, temperature=0)
        with pytest.raises(lanes.InvalidInput, match=r"call\(\) sets 'model' itself"):
            client.call("code", "x", model="other")
    async with lanes.AsyncClient(nobody, spec=specs[1], max_retries=0) as aclient:
        with pytest.raises(lanes.InvalidInput, match="unknown option 'max_token'"):
            await aclient.call("code", "x", max_token=3)
    error = misspelt.value
    assert (error.param, error.code) == ("max_token", "unknown_parameter")
    assert "did you mean 'max_tokens'?" in str(error)
    assert "max_tokens, min_p" in str(error) and "stop_token_ids" in str(error)
    assert "dimensions, normalize, truncate_prompt_tokens, user)" in str(embed.value)


async def test_several_choices_are_refused_before_sending(specs: tuple[Path, Path]) -> None:
    """`call` returns one Completion and `stream` one text: `n` choices would lose all
    but the first, or interleave their chunks into one garbled text. Nothing listens at
    the endpoint: an error other than InvalidInput would mean it tried to send."""
    nobody = f"http://127.0.0.1:{free_port()}"
    chat = [{"role": "user", "content": "hi"}]
    with lanes.Client(nobody, spec=specs[1], max_retries=0) as client:
        with pytest.raises(lanes.InvalidInput, match=r"^n: call\(\) returns one") as bad:
            client.call("code", "x", n=2)
        with pytest.raises(lanes.InvalidInput, match=r"^n: stream\(\) yields one"):
            list(client.stream("code", chat, n=3))
        with pytest.raises(lanes.InvalidInput, match=r"^n: call\(\) returns one"):
            client.call("code-streams", [1, 2], n=2)
        with pytest.raises(lanes.Unavailable):
            client.call("code", "x", n=1)  # one choice is what it returns: sent
    assert (bad.value.param, bad.value.code) == ("n", "unsupported_value")
    async with lanes.AsyncClient(nobody, spec=specs[1], max_retries=0) as aclient:
        with pytest.raises(lanes.InvalidInput, match=r"^n: "):
            await aclient.call("code", "x", n=2)


def test_stream_refuses_logprobs_it_would_drop(specs: tuple[Path, Path]) -> None:
    """`stream` yields text alone: logprobs asked of it would be computed and dropped
    without a word; `call` returns them on its Completion. Nothing listens at the
    endpoint: an error other than InvalidInput would mean it tried to send."""
    nobody = f"http://127.0.0.1:{free_port()}"
    chat = [{"role": "user", "content": "hi"}]
    with lanes.Client(nobody, spec=specs[1], max_retries=0) as client:
        with pytest.raises(lanes.InvalidInput, match=r"^logprobs: stream\(\) yields") as bad:
            list(client.stream("code", "x", logprobs=0))  # the chosen tokens' alone
        assert (bad.value.param, bad.value.code) == ("logprobs", "unsupported_value")
        with pytest.raises(lanes.InvalidInput, match="use call"):
            list(client.stream("code", chat, logprobs=True, top_logprobs=2))
        with pytest.raises(lanes.Unavailable):  # none asked: sent
            list(client.stream("code", chat, logprobs=False))


def test_call_sets_its_stream_options_itself(specs: tuple[Path, Path]) -> None:
    """A call's Completion always carries usage: a caller's `stream_options` would
    drop it from a streamed answer (or be a 400 where the call does not stream)."""
    nobody = f"http://127.0.0.1:{free_port()}"
    with lanes.Client(nobody, spec=specs[1], max_retries=0) as client:
        for workload in ("code-streams", "code"):
            with pytest.raises(lanes.InvalidInput, match=r"call\(\) sets 'stream_options'") as bad:
                client.call(workload, "x", stream_options={"include_usage": False})
            assert bad.value.param == "stream_options"
        with pytest.raises(lanes.Unavailable):  # stream() has no usage to lose: sent
            list(client.stream("code", "x", stream_options={"include_usage": True}))


async def test_call_travels_as_the_workload_streams_and_returns_one_completion(
    client: lanes.Client, aclient: lanes.AsyncClient
) -> None:
    whole = client.call("code", "def fib(n):")
    assert client.call("code-streams", "def fib(n):") == whole
    assert await aclient.call("code-streams", "def fib(n):") == whole
    assert whole.usage.completion_tokens == 12


def test_unknown_workloads_and_wrong_modes(client: lanes.Client) -> None:
    with pytest.raises(lanes.UnknownWorkload, match="no workload named 'retired'; interactive"):
        client.call("retired", "hello")  # in the client's spec, not on the server: 404
    with pytest.raises(lanes.UnknownWorkload, match="no workload named 'nope'; known: "):
        client.call("nope", "hello")  # in neither: refused before any request
    with pytest.raises(lanes.WrongMode, match=r"offline: submit its records with client\.submit"):
        client.call("nightly", "hello")
    with pytest.raises(lanes.WrongMode, match=r"offline: .*client\.submit"):
        client.stream("nightly", "hello")
    with pytest.raises(lanes.WrongMode, match=r"embed workload: use client\.call"):
        client.stream("search-query", "hello")
    with pytest.raises(lanes.WrongMode, match=r"interactive: use client\.call\('code'"):
        client.submit("code", [{"id": 1, "prompt": "x"}])


async def test_a_wrong_or_missing_key_is_an_auth_error(
    server: ServerThread, specs: tuple[Path, Path]
) -> None:
    with (
        lanes.Client(server.url, api_key="sk-wrong", spec=specs[1]) as client,
        pytest.raises(lanes.AuthError, match="missing or wrong API key"),
    ):
        client.call("search-query", "hello")
    async with lanes.AsyncClient(server.url, spec=specs[1]) as aclient:
        with pytest.raises(lanes.AuthError, match="missing or wrong API key") as refused:
            await aclient.call("flowers", {"features": ROWS})
        assert f"{server.url} refused a request without a key" in str(refused.value)
        assert "set LANES_API_KEY" in str(refused.value)
        with pytest.raises(lanes.AuthError):
            await anext(aclient.stream("code", "x"))


async def test_deadlines_on_the_server_and_in_the_client(
    client: lanes.Client, aclient: lanes.AsyncClient, server: ServerThread, specs: tuple[Path, Path]
) -> None:
    """A run held at the gate keeps late-lane busy: the requests behind it wait."""
    ran = metric(server, "lanes_batch_size_sum", workload="late-lane")
    with HELD.closed():
        running = asyncio.create_task(aclient.call("late-lane", {"features": ROWS}))
        await asyncio.to_thread(HELD.wait_held)
        with pytest.raises(lanes.DeadlineExceeded, match="deadline"):
            client.call("late-lane", {"features": ROWS}, timeout_ms=100)  # 504 from the server
        with pytest.raises(lanes.DeadlineExceeded):
            await aclient.call("late-lane", {"features": ROWS}, timeout_ms=100)
        # A client timeout that passes while it waits: no answer in time, and no retry.
        with (
            lanes.Client(server.url, api_key=KEY, spec=specs[1], timeout=0.3) as hasty,
            pytest.raises(lanes.DeadlineExceeded, match="within the client's timeout"),
        ):
            hasty.call("late-lane", {"features": ROWS})
        # The client that gave up closed its connection: the server takes its request
        # out of the queue before the gate opens, so it never reaches the model.
        await eventually(lambda: queue_depth(server, "late-lane") == 0, "a queue left empty")
    assert (await running)["logits"].shape == (2, 3)
    await eventually(
        lambda: metric(server, "lanes_batch_size_sum", workload="late-lane") == ran + 1,
        "the held request runs; the late ones and the one its client gave up on never",
    )


@contextlib.asynccontextmanager
async def full_lane(
    server: ServerThread, client: lanes.AsyncClient
) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """full-lane's queue full: one run held at the gate and four requests behind it
    (its max_queue); yields their calls, answered once the gate opens on leaving."""
    with HELD.closed():
        running = asyncio.create_task(client.call("full-lane", {"features": ROWS}))
        await asyncio.to_thread(HELD.wait_held)
        places = [
            asyncio.create_task(client.call("full-lane", {"features": ROWS})) for _ in range(4)
        ]
        await eventually(lambda: queue_depth(server, "full-lane") == 4, "a full queue")
        yield [running, *places]


async def test_a_full_queue_is_overloaded_and_retries_honour_retry_after(
    server: ServerThread, specs: tuple[Path, Path]
) -> None:
    route = "/v2/models/{name}/infer"
    before = metric(server, "lanes_responses_total", route=route, code="503")
    settings = {"api_key": KEY, "spec": specs[1]}
    async with (
        lanes.AsyncClient(server.url, max_retries=0, **settings) as once,  # type: ignore[arg-type]
        lanes.AsyncClient(server.url, max_retries=3, **settings) as patient,  # type: ignore[arg-type]
    ):
        async with full_lane(server, once) as queued:
            with pytest.raises(lanes.Overloaded, match="full") as refused:
                await once.call("full-lane", {"features": ROWS})
            assert refused.value.retry_after == 1.0
            with (
                lanes.Client(server.url, max_retries=0, **settings) as sync,  # type: ignore[arg-type]
                pytest.raises(lanes.Overloaded),
            ):
                sync.call("full-lane", {"features": ROWS})
            # Refused now too; it retries after Retry-After (1 s), once the gate is open.
            started = time.monotonic()
            later = asyncio.create_task(patient.call("full-lane", {"features": ROWS}))
            await eventually(
                lambda: (
                    metric(server, "lanes_responses_total", route=route, code="503") == before + 3
                ),
                "the patient client's first try refused",
            )
        assert (await later)["logits"].shape == (2, 3)
        assert time.monotonic() - started >= 1.0
        assert all(r["logits"].shape == (2, 3) for r in await asyncio.gather(*queued))
    refusals = metric(server, "lanes_responses_total", route=route, code="503")
    assert refusals - before >= 3  # once, sync, and at least the patient client's first try


async def test_a_retry_never_outlives_the_call_s_deadline(
    server: ServerThread, specs: tuple[Path, Path]
) -> None:
    """A 503 whose Retry-After (1 s) is past what is left of the call's timeout_ms
    (0.5 s): the call fails with it at once, rather than retry with a fresh deadline."""
    route = "/v2/models/{name}/infer"
    settings = {"api_key": KEY, "spec": specs[1]}
    async with (
        lanes.AsyncClient(server.url, max_retries=0, **settings) as once,  # type: ignore[arg-type]
        lanes.AsyncClient(server.url, max_retries=3, **settings) as patient,  # type: ignore[arg-type]
    ):
        async with full_lane(server, once) as queued:
            before = metric(server, "lanes_responses_total", route=route, code="503")
            with pytest.raises(lanes.Overloaded) as refused:
                await patient.call("full-lane", {"features": ROWS}, timeout_ms=500)
            after = metric(server, "lanes_responses_total", route=route, code="503")
        assert refused.value.retry_after == 1.0
        assert after == before + 1, "no retry past the deadline"
        assert all(r["logits"].shape == (2, 3) for r in await asyncio.gather(*queued))


def test_a_retry_carries_what_is_left_of_the_deadline(specs: tuple[Path, Path]) -> None:
    with lanes.Client("http://lanes.test", spec=specs[1]) as client:
        core = client._core
        request = core.call_request("flowers", {"features": ROWS}, 5000, {})
        exact = core.call_request("flowers", {"features": ROWS}, 1234567, {})
    first = core.attempt_headers(request, 0, time.monotonic())
    retry = core.attempt_headers(request, 1, time.monotonic() - 0.3)  # started 0.3 s ago
    assert float(first["X-Timeout-Ms"]) == 5000 and 0 < float(retry["X-Timeout-Ms"]) <= 4700
    assert float(exact.headers["X-Timeout-Ms"]) == 1234567  # not 1.23457e+06


class _Hangup:
    """A TCP server that accepts each connection and closes it at once, counting them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.sock.settimeout(0.1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()


def test_connection_errors_are_retried_a_bounded_number_of_times(
    specs: tuple[Path, Path],
) -> None:
    hangup = _Hangup()
    try:
        with lanes.Client(hangup.url, spec=specs[1], max_retries=2) as client:
            with pytest.raises(lanes.LanesError, match=r"connection to .* failed"):
                client.call("flowers", {"features": ROWS})
            assert hangup.accepted == 3  # the first try and two retries
    finally:
        hangup.close()


async def test_an_endpoint_that_is_down_is_unavailable(specs: tuple[Path, Path]) -> None:
    """Refused, or no connection within the connect timeout: nothing ran, so it is an
    Unavailable (an Overloaded: a caller's retry of a full queue catches it too), once
    the client's own retries are spent, and it says what to start or point where."""
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with lanes.Client(nobody, spec=specs[1], max_retries=1) as client:
        with pytest.raises(lanes.Overloaded) as stream_error:
            list(client.stream("code", "x"))
        with pytest.raises(lanes.Overloaded) as call_error:
            client.call("flowers", {"features": ROWS})
    async with lanes.AsyncClient(nobody, spec=specs[1], max_retries=0) as aclient:
        with pytest.raises(lanes.Overloaded) as async_error:
            await aclient.call("search-query", "x")
    for error in (stream_error.value, call_error.value, async_error.value):
        assert type(error) is lanes.Unavailable, error
        assert f"cannot reach the lanes endpoint at {nobody}" in str(error)
        assert "start `lanes serve` there" in str(error) and "LANES_ENDPOINT" in str(error)
    assert "2 attempts" in str(call_error.value) and "1 attempt)" in str(async_error.value)

    tries: list[httpx.Request] = []

    def never_connects(request: httpx.Request) -> httpx.Response:
        tries.append(request)
        raise httpx.ConnectTimeout("timed out", request=request)

    transport = httpx.MockTransport(never_connects)
    with (
        lanes.Client(nobody, spec=specs[1], max_retries=2, transport=transport) as client,
        pytest.raises(lanes.Unavailable, match="cannot reach the lanes endpoint"),
    ):
        client.call("flowers", {"features": ROWS})
    assert len(tries) == 3  # a connect timeout is retried as a refusal is


# ---- CLI twins -----------------------------------------------------------------------------


def test_cli_call_and_stream(server: ServerThread, specs: tuple[Path, Path]) -> None:
    env = {
        **os.environ,
        "LANES_ENDPOINT": server.url,
        "LANES_API_KEY": KEY,
        "LANES_SPEC": str(specs[1]),
    }
    commands = {
        "embed": ["call", "search-query", "-i", "how do I reverse a list"],
        "stream": ["stream", "code", "def fib(n):", "--max-tokens", "8"],
        "call streams": ["call", "code-streams", "-i", "def fib(n):"],
        "call whole": ["call", "code-streams", "-i", "def fib(n):", "--no-stream"],
        "offline": ["call", "nightly", "-i", "hello"],
        "wrong key": ["call", "search-query", "-i", "x"],
        "row": ["call", "flower-labels", "-i", json.dumps(ROWS[0].tolist())],
        "row in-process": ["predict", "flower-labels", "-i", json.dumps(ROWS[0].tolist())],
        # A generate input as `lanes predict` takes it: the prompt and the request's options.
        "options": ["call", "code", "-i", GEN_INPUT],
        "options in-process": ["predict", "code", "-i", GEN_INPUT],
        "chat options": ["call", "code-streams", "-i", CHAT_INPUT],
        "no prompt": ["call", "code", "-i", '{"max_tokens": 3}'],
        "misspelt": ["call", "code", "-i", '{"prompt": "x", "max_tokenz": 3}'],
        # A stream prints text alone: asked for logprobs, call prints the whole answer.
        "logprobs": ["call", "code-streams", "-i", '{"prompt": "def f(x):", "logprobs": 1}'],
    }
    running = {
        what: subprocess.Popen(
            [sys.executable, "-m", "lanes.router.cli", *args],
            env={**env, "LANES_API_KEY": "nope"} if what == "wrong key" else env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for what, args in commands.items()
    }
    done = {what: (p.wait(timeout=120), *p.communicate()) for what, p in running.items()}
    code, out, err = done["embed"]
    assert code == 0, err
    assert len(json.loads(out)) == 384
    code, out, err = done["stream"]
    assert code == 0, err
    with lanes.Client(server.url, api_key=KEY, spec=specs[1]) as client:
        assert out == client.call("code", "def fib(n):", max_tokens=8).text + "\n"
        whole = client.call("code-streams", "def fib(n):")
    # `lanes call` on a workload that streams prints its text as it is made.
    code, out, err = done["call streams"]
    assert code == 0, err
    assert out == whole.text + "\n"
    code, out, err = done["call whole"]
    assert code == 0, err
    assert json.loads(out)["text"] == whole.text
    code, out, err = done["offline"]
    assert code == 2 and "`lanes submit nightly RECORDS`" in err and out == ""
    code, out, err = done["wrong key"]
    assert code == 1 and err.splitlines()[-1] == (
        f"error: {server.url} refused the API key sent (missing or wrong API key: send "
        "Authorization: Bearer <key>): set LANES_API_KEY to the server's key, or pass "
        "Client(api_key=...)"
    )
    code, out, err = done["row"]
    assert code == 0, err
    code, in_process, err = done["row in-process"]
    assert code == 0, err
    # {"result": [one row's label]} through the server, the row's label in-process.
    assert json.loads(out)["result"] == json.loads(in_process)
    assert json.loads(in_process)[0]["label"] == "setosa"
    with lanes.Client(server.url, api_key=KEY, spec=specs[1]) as client:
        three = client.call("code", "def f(x):", max_tokens=3)
        chat = client.call("code-streams", [{"role": "user", "content": "a class"}], max_tokens=3)
    assert three.usage.completion_tokens == 3 and chat.usage.completion_tokens == 3
    code, out, err = done["options"]
    assert code == 0, err
    assert json.loads(out)["text"] == three.text
    assert json.loads(out)["usage"]["completion_tokens"] == 3
    code, in_process, err = done["options in-process"]
    assert code == 0, err
    assert json.loads(in_process)["text"] == three.text
    code, out, err = done["chat options"]  # streams, as the workload does
    assert code == 0, err
    assert out == chat.text + "\n"
    code, out, err = done["no prompt"]
    assert code == 2 and out == "", err
    assert "--input: a generate workload's object needs one of 'prompt' or 'messages'" in err
    # The CLI's user wrote no call(): the option is a field of their --input.
    code, out, err = done["misspelt"]
    assert code == 2 and out == "", err
    assert err.startswith(
        "error: --input: unknown option 'max_tokenz' for workload 'code'; "
        "did you mean 'max_tokens'?"
    ), err
    code, out, err = done["logprobs"]
    assert code == 0, err
    assert (
        len(json.loads(out)["logprobs"]["tokens"]) == json.loads(out)["usage"]["completion_tokens"]
    )
