"""What a real `lanes serve` process sends on the wire, read with a raw socket: the
framing of a streamed answer to an HTTP/1.0 client (LANES_HTTP, serving/server.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.servers import write_spec
from tests.test_access import KEY, Served

pytestmark = pytest.mark.slow

WORKLOADS = """\
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    generation: {max_new_tokens: 4, temperature: 0}
"""
STREAMED = {"model": "code-complete", "prompt": "def f(x", "max_tokens": 3, "stream": True}
READ_CAP_S = 120.0  # a generous cap on each read: the answer ends the test, not a clock


@pytest.fixture(scope="module")
def served_h11(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("http10")
    spec = write_spec(folder, demo_models, WORKLOADS)
    server = Served(spec, folder / "server.log", LANES_HTTP="h11", LANES_DRAIN_S="0")
    try:
        yield server
    finally:
        server.stop()


def http10_post(port: int, path: str, body: dict[str, object]) -> bytes:
    """Everything the server sends an HTTP/1.0 request, up to its closing the connection
    (how an HTTP/1.0 client reads an answer without a length)."""
    data = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_CAP_S) as conn:
        conn.sendall(head.encode() + data)
        while chunk := conn.recv(65536):
            received += chunk
    return received


def test_an_http10_client_reads_a_stream_unchunked_ended_by_the_close(
    served_h11: Served,
) -> None:
    """HTTP/1.0 has no chunked coding: with LANES_HTTP=h11 a stream goes to such a
    client as its bare events, and the closed connection ends it."""
    received = http10_post(served_h11.port, "/v1/completions", STREAMED)
    head, _, body = received.partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
    assert status.split(" ")[1] == "200", received[:500]
    assert "transfer-encoding" not in headers, headers
    assert "content-length" not in headers and headers["connection"].lower() == "close"
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    # An HTTP/1.1 client still gets the stream as before, from the same server.
    with httpx.stream(
        "POST",
        f"{served_h11.url}/v1/completions",
        json=STREAMED,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=READ_CAP_S,
    ) as answer:
        assert answer.headers["transfer-encoding"] == "chunked"
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    again = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in again) == text  # greedy: the same
