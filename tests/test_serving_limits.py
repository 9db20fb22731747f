"""What no request, sequence of requests or body can do to the endpoint: grow its
metrics without bound, freeze its event loop, leave a request unanswered, reset a
connection instead of answering, or grow its memory batch after batch.

Real uvicorn on 127.0.0.1, the demo models, raw sockets where the bytes on the wire
are the point.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.gates import PARSE_HELD, SERVER_START_S, WAIT_S, wait_until
from tests.servers import ServerThread, free_port, write_spec

pytestmark = pytest.mark.slow

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1024 * 1024  # the servers' max_body_bytes
OFFLOAD = 1024  # and offload_body_bytes: a large body need not be costly to run

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
  parse-held:                      # its inputs' `pre` waits at tests.gates.PARSE_HELD
    mode: interactive
    task: embed
    model: minilm
    handler: tests.gates:parse_held
    batching: {max_batch_size: 32, max_wait_ms: 0}
"""


@pytest.fixture(scope="module")
def spec_path(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("limits"), demo_models, WORKLOADS)


@pytest.fixture(scope="module")
def server(spec_path: Path) -> Iterator[ServerThread]:
    with ServerThread(
        spec_path, api_key=KEY, max_body_bytes=LIMIT, offload_body_bytes=OFFLOAD
    ) as running:
        yield running


def responses(exposition: str) -> dict[tuple[str, str], float]:
    """Every lanes_responses_total sample, by (route, code)."""
    found = {}
    for line in exposition.splitlines():
        if line.startswith("lanes_responses_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            found[labels["route"], labels["code"]] = float(line.rsplit(" ", 1)[1])
    return found


def scrape(server: ServerThread) -> str:
    return httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=WAIT_S).text


# ---- metrics: a fixed set of series, whatever the paths ------------------------------


async def test_route_labels_are_the_apps_templates_whatever_the_path(
    server: ServerThread,
) -> None:
    """Unique paths, with and without the key, add to a fixed set of series."""
    before = responses(scrape(server))
    unique = 30
    async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as client:
        calls = []
        for i in range(unique):
            calls.append(client.get(f"/probe/{i}/x"))  # unauthenticated, no such route
            calls.append(client.get(f"/probe/{i}", headers=AUTH))  # authenticated, none
            calls.append(client.post(f"/v2/models/ghost-{i}/infer", json={}))
            calls.append(client.get(f"/v2/models/m-{i}/versions/{i}/ready", headers=AUTH))
            calls.append(client.get(f"/v1/models/m-{i}", headers=AUTH))
        answers = await asyncio.gather(*calls)
    assert {a.status_code for a in answers} == {401, 404}
    after = responses(scrape(server))
    new = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert new == {
        ("other", "401"): unique,
        ("other", "404"): unique,
        ("/v2/models/{name}/infer", "401"): unique,
        ("/v2/models/{name}/versions/{version}/ready", "404"): unique,
        ("/v1/models/{name}", "404"): unique,
        ("/metrics", "200"): 1,  # the scrape of `before`
    }
    assert not any("probe" in route or "ghost" in route for route, _ in after)


def test_metrics_carry_no_created_series(server: ServerThread) -> None:
    good = {"model": "search-query", "input": "counted"}
    assert httpx.post(f"{server.url}/v1/embeddings", json=good, headers=AUTH).status_code == 200
    exposition = scrape(server)
    assert "lanes_responses_total{" in exposition
    assert "lanes_request_latency_seconds_bucket{" in exposition
    assert "_created" not in exposition


# ---- a body over the limit: always the 413, never a reset ----------------------------


def exchange(port: int, request: bytes) -> tuple[int, bytes, bool]:
    """Send all of `request`, then read one answer: its status, its body, and whether
    the server then closed the connection cleanly (False: it is still open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(request)
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before an answer: {received!r}"
            received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "the connection closed in the middle of the answer"
            body += chunk
        closes = re.search(rb"(?i)connection: close", head) is not None
        if closes:
            assert sock.recv(65536) == b"", "bytes after the answer"  # a reset raises here
        return status, body, closes


def post(
    path: str,
    body: bytes,
    *,
    version: bytes = b"1.1",
    chunked: bool = False,
    extra: bytes = b"",
) -> bytes:
    head = b"POST " + path.encode() + b" HTTP/" + version + b"\r\nHost: test\r\n"
    head += b"Content-Type: application/json\r\n" + extra
    if not chunked:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    step = 64 * 1024
    pieces = [
        b"%x\r\n%s\r\n" % (len(body[i : i + step]), body[i : i + step])
        for i in range(0, len(body), step)
    ]
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(pieces) + b"0\r\n\r\n"


OVERSIZED = orjson.dumps({"model": "search-query", "input": "x" * (4 * LIMIT)})
AUTHORIZED = f"Authorization: Bearer {KEY}\r\n".encode()


@pytest.mark.parametrize(
    ("how", "request_bytes"),
    [
        ("kept alive", post("/v1/embeddings", OVERSIZED, extra=AUTHORIZED)),
        (
            "Connection: close",
            post("/v1/embeddings", OVERSIZED, extra=AUTHORIZED + b"Connection: close\r\n"),
        ),
        ("HTTP/1.0", post("/v1/embeddings", OVERSIZED, version=b"1.0", extra=AUTHORIZED)),
        ("chunked", post("/v1/embeddings", OVERSIZED, chunked=True, extra=AUTHORIZED)),
        (
            "chunked, Connection: close",
            post(
                "/v1/embeddings",
                OVERSIZED,
                chunked=True,
                extra=AUTHORIZED + b"Connection: close\r\n",
            ),
        ),
        (
            "v2, Connection: close",
            post(
                "/v2/models/flowers/infer", OVERSIZED, extra=AUTHORIZED + b"Connection: close\r\n"
            ),
        ),
    ],
)
def test_a_body_over_the_limit_gets_413_never_a_reset(
    server: ServerThread, how: str, request_bytes: bytes
) -> None:
    status, body, _ = exchange(server.settings.port, request_bytes)
    assert status == 413, (how, body[:300])
    assert b"over the limit" in body


@pytest.mark.parametrize(
    ("status", "request_bytes"),
    [
        (401, post("/v1/embeddings", OVERSIZED, extra=b"Connection: close\r\n")),
        (404, post("/nowhere", OVERSIZED, extra=AUTHORIZED + b"Connection: close\r\n")),
    ],
)
def test_a_big_body_answered_unread_gets_its_answer(
    server: ServerThread, status: int, request_bytes: bytes
) -> None:
    got, body, closes = exchange(server.settings.port, request_bytes)
    assert (got, closes) == (status, True), body[:300]


def test_a_body_that_stalls_gets_408_and_its_connection_closes(spec_path: Path) -> None:
    """A client that sends part of its body and then nothing (a slowloris, or a client
    gone without closing its connection) gets 408 in its route's protocol once
    LANES_BODY_TIMEOUT_S passes without more of it, and the connection closes: it holds
    neither a connection nor a stopping server (which waits for its requests) for ever."""
    with ServerThread(spec_path, body_timeout_s=0.5) as server:
        for path in ("/v1/embeddings", "/v1/completions", "/v2/models/flowers/infer"):
            head = post(path, b"").replace(b"Content-Length: 0", b"Content-Length: 100")
            status, body, closes = exchange(server.settings.port, head + b'{"model": ')
            assert status == 408, (path, body)
            assert closes, path
            error = orjson.loads(body)["error"]
            message = error if path.startswith("/v2/") else error["message"]
            assert "LANES_BODY_TIMEOUT_S" in message, body


def test_httpx_gets_413_and_its_connection_stays_usable(server: ServerThread) -> None:
    good = {"model": "search-query", "input": "after the refusal"}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=WAIT_S) as client:
        for headers in ({}, {"Connection": "close"}):
            refused = client.post("/v1/embeddings", content=OVERSIZED, headers=headers)
            assert refused.status_code == 413, refused.text[:300]
            assert "over the limit" in refused.json()["error"]["message"]
            assert client.post("/v1/embeddings", json=good).status_code == 200


# ---- one request's size: bounded inputs, large bodies off the event loop -------------


def test_more_inputs_than_the_limit_is_413_before_any_is_tokenized(server: ServerThread) -> None:
    """The count is checked before tokenizing: with the workload's `pre` held closed,
    the refusal comes at once, and no `pre` ran."""
    with PARSE_HELD.closed():
        passed = PARSE_HELD.passed
        body = {"model": "parse-held", "input": ["x"] * 2049}
        refused = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH, timeout=WAIT_S)
        assert refused.status_code == 413, refused.text[:300]
        error = refused.json()["error"]
        assert error["param"] == "input"
        assert (
            "2049 inputs" in error["message"] and "LANES_MAX_INPUTS_PER_REQUEST" in error["message"]
        )
        v2 = {
            "inputs": [{"name": "text", "shape": [2049], "datatype": "BYTES", "data": ["x"] * 2049}]
        }
        url = f"{server.url}/v2/models/parse-held/infer"
        refused = httpx.post(url, json=v2, headers=AUTH, timeout=WAIT_S)
        assert refused.status_code == 413, refused.text[:300]
        assert "2049 inputs" in refused.json()["error"]
        assert PARSE_HELD.passed == passed


def test_a_body_of_many_tiny_texts_is_refused_before_tokenizing(server: ServerThread) -> None:
    """The issue's case: a body under the size limit of many one-letter texts."""
    tiny = orjson.dumps({"model": "parse-held", "input": ["x"] * 200_000})
    assert len(tiny) < LIMIT
    with PARSE_HELD.closed(), httpx.Client(base_url=server.url, headers=AUTH) as client:
        passed = PARSE_HELD.passed
        refused = client.post("/v1/embeddings", content=tiny, timeout=WAIT_S)
        assert refused.status_code == 413, refused.text[:300]
        assert "200000 inputs" in refused.json()["error"]["message"]
        assert PARSE_HELD.passed == passed


def large_body(route: str) -> tuple[str, dict[str, object]]:
    """A request to parse-held whose body is over offload_body_bytes."""
    texts = [f"text {i} " + "lanes " * 20 for i in range(12)]
    if route == "v1":
        return "/v1/embeddings", {"model": "parse-held", "input": texts}
    tensor = {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}
    return "/v2/models/parse-held/infer", {"inputs": [tensor]}


@pytest.mark.parametrize("route", ["v1", "v2"])
async def test_the_loop_serves_others_while_a_large_body_is_tokenized(
    server: ServerThread, route: str
) -> None:
    """A large body's inputs are prepared off the event loop: with its `pre` held at
    a gate, /healthz and a small embedding are answered; once the gate opens, the
    large request is answered too."""
    path, body = large_body(route)
    assert len(orjson.dumps(body)) > server.settings.offload_body_bytes
    small = {"model": "search-query", "input": "a small request meanwhile"}
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=WAIT_S) as client:
        with PARSE_HELD.closed():
            large = asyncio.create_task(client.post(path, json=body))
            await asyncio.to_thread(PARSE_HELD.wait_held)  # its first text's `pre` is held
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.post("/v1/embeddings", json=small)).status_code == 200
            assert not large.done()
        answer = await large
    assert answer.status_code == 200, answer.text[:300]
    if route == "v1":
        assert len(answer.json()["data"]) == 12
    else:
        assert answer.json()["outputs"][0]["shape"] == [12, 384]


# ---- memory: large bad bodies, batch after batch, leave RSS where it was -------------

RSS_LIMIT = 2 * 1024 * 1024  # the memory server's max_body_bytes
RSS_ROUNDS = 10


def bad_batch() -> list[tuple[str, bytes, int]]:
    """Large bodies that each fail (path, body, expected status). The costliest in
    memory is the long non-ASCII text: tokenizing it builds over a hundred times its
    size in `tokenizers` (offsets, alignments), all freed when it is refused."""
    big = RSS_LIMIT - 4096
    long_text = " ".join(["naïve"] * (big // 7))  # non-ASCII: `tokenizers`, not the fast path
    return [
        ("/v1/embeddings", orjson.dumps({"model": "search-query", "input": long_text}), 400),
        ("/v1/embeddings", b'{"model": "search-query", "input": "' + b"x" * big, 400),
        ("/v1/embeddings", orjson.dumps({"model": "search-query", "input": ["x"] * 300_000}), 413),
    ]


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
def test_rss_stays_bounded_over_repeated_batches_of_large_bad_bodies(spec_path: Path) -> None:
    """The same batch of large bad bodies, ten times, to `lanes serve` in a process of
    its own: every one is refused with its 400/413, and the server's RSS after each
    round stays near where it was before the first (freed memory goes back to the
    system), rather than at the peak of the largest request, creeping up."""
    port = free_port()
    env = {
        **os.environ,
        "LANES_PORT": str(port),
        "LANES_MAX_BODY_BYTES": str(RSS_LIMIT),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "the server ready", timeout=SERVER_START_S)
        batch = bad_batch()
        before = vm_rss_mb(proc.pid)
        after = []
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:
            for _ in range(RSS_ROUNDS):
                for path, body, status in batch:
                    answer = client.post(
                        path, content=body, headers={"Content-Type": "application/json"}
                    )
                    assert answer.status_code == status, (path, answer.text[:300])
                after.append(vm_rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rounds = ", ".join(f"{mb:.0f}" for mb in after)
    # The long text's tokenizing alone peaks over 200 MB above `before`: kept by the
    # allocator, RSS stays at that peak (and creeps up from it, round after round).
    assert max(after) - before < 120, f"RSS {before:.0f} MB before, then {rounds}"
    assert max(after[RSS_ROUNDS // 2 :]) - max(after[: RSS_ROUNDS // 2]) < 50, rounds
