"""Request ids and access lines, read from the logs of a real `lanes serve` process
(JSON lines at DEBUG, an API key set), through the SDK, the openai client and httpx."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import BadRequestError, OpenAI
from typer.testing import CliRunner

import lanes
from lanes.errors import InvalidInput
from lanes.router.cli import app
from tests.gates import SERVER_START_S, wait_until
from tests.servers import free_port, write_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-lanes-SERVERKEY-0c9f3e7a51"
WRONG_KEY = "sk-lanes-WRONGKEY-77d2b1e4c0"
SECRET = "SECRET-BODY-5e1d8a"  # in request bodies: it must never reach a log

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
  flowers:
    mode: interactive
    task: infer
    model: classifier
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    generation: {max_new_tokens: 4, temperature: 0}
"""


class Served:
    """A `lanes serve` subprocess whose log lines (stderr) go to a file."""

    def __init__(self, spec_path: Path, log_path: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.spec_path = spec_path
        environ = {**os.environ, "LANES_PORT": str(self.port), "LANES_API_KEY": KEY, **env}
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path)],
            env=environ,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

        def ready() -> bool:
            assert self.proc.poll() is None, self.text()
            try:
                return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, "the server ready", timeout=SERVER_START_S)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def lines(self) -> list[dict[str, Any]]:
        """Every line logged so far, parsed: each must be JSON."""
        found = []
        for line in self.text().splitlines():
            if line.strip():
                found.append(orjson.loads(line))  # raises on any line that is not JSON
        return found

    def access(self, request_id: str) -> dict[str, Any]:
        """The access line of `request_id`, once it is written."""

        def of() -> list[dict[str, Any]]:
            return [
                line
                for line in self.lines()
                if line["logger"] == "lanes.access" and line.get("request_id") == request_id
            ]

        wait_until(lambda: len(of()) > 0, f"the access line of {request_id}")
        (line,) = of()
        return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        self._log.close()


@pytest.fixture(scope="module")
def served(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("access")
    spec = write_spec(folder, demo_models, WORKLOADS)
    server = Served(spec, folder / "server.log", LANES_LOG_FORMAT="json", LANES_LOG_LEVEL="DEBUG")
    try:
        yield server
    finally:
        server.stop()


def auth(key: str = KEY, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def test_the_sdks_id_comes_back_on_its_error_and_in_the_servers_log(served: Served) -> None:
    with lanes.Client(served.url, api_key=KEY, spec=served.spec_path) as client:
        assert client.call("search-query", "fine").shape == (384,)
        with pytest.raises(InvalidInput) as caught:
            client.call("search-query", "too many dimensions", dimensions=1000)
    rid = caught.value.request_id
    assert rid is not None and len(rid) == 32  # the SDK made it
    line = served.access(rid)
    assert line["status"] == 400 and line["route"] == "/v1/embeddings"
    assert line["workload"] == "search-query"
    assert line["error"] == caught.value.code
    assert line["latency_ms"] >= 0


def test_an_incoming_id_is_kept_in_the_header_error_body_and_log(served: Served) -> None:
    rid = "trace-42.a:b/c"
    body = {"model": "search-query", "input": 7}
    r = httpx.post(f"{served.url}/v1/embeddings", json=body, headers=auth(**{"X-Request-Id": rid}))
    assert r.status_code == 400
    assert r.headers["x-request-id"] == rid
    assert r.json()["error"]["request_id"] == rid
    assert int(r.headers["content-length"]) == len(r.content)
    assert served.access(rid)["status"] == 400

    # v2's error shape is {"error": "..."}: the id sits beside it.
    r = httpx.post(
        f"{served.url}/v2/models/nowhere/infer",
        json={"inputs": []},
        headers=auth(**{"X-Request-Id": "v2-1"}),
    )
    assert r.status_code == 404 and r.json()["request_id"] == "v2-1"
    assert isinstance(r.json()["error"], str)
    assert served.access("v2-1")["route"] == "/v2/models/{name}/infer"


def test_an_unusable_incoming_id_is_replaced(served: Served) -> None:
    for sent in ("has spaces in it", "x" * 129, "new\\nline"):
        r = httpx.get(f"{served.url}/v1/models", headers=auth(**{"X-Request-Id": sent}))
        made = r.headers["x-request-id"]
        assert made != sent and len(made) == 32
        assert served.access(made)["status"] == 200


def test_a_401_has_an_id_and_an_access_line(served: Served) -> None:
    r = httpx.post(
        f"{served.url}/v1/embeddings",
        json={"model": "search-query", "input": "x"},
        headers=auth(WRONG_KEY),
    )
    assert r.status_code == 401
    rid = r.headers["x-request-id"]
    assert r.json()["error"]["request_id"] == rid
    assert served.access(rid)["status"] == 401


def test_an_unknown_internal_path_lists_no_routes_to_a_caller_without_a_key(
    served: Served,
) -> None:
    # /internal/ paths check their own key: a 404 there must not tell an anonymous
    # caller what the server serves.
    for headers in ({}, auth(WRONG_KEY)):
        r = httpx.get(f"{served.url}/internal/nowhere", headers=headers)
        assert r.status_code in (401, 404)
        assert "/v1/embeddings" not in r.text


def test_refusals_quote_a_long_value_briefly_and_name_its_field(served: Served) -> None:
    body_long = "w" * 100_000  # a body holds it whole; a URL or header, 16 KB at most
    url_long = "w" * 10_000
    answers = {
        "model": httpx.post(
            f"{served.url}/v1/embeddings",
            json={"model": body_long, "input": "x"},
            headers=auth(),
        ),
        "after": httpx.get(f"{served.url}/v1/batches", params={"after": url_long}, headers=auth()),
        "X-Timeout-Ms": httpx.post(
            f"{served.url}/v1/embeddings",
            json={"model": "search-query", "input": "x"},
            headers=auth(**{"X-Timeout-Ms": url_long}),
        ),
        "stop": httpx.post(
            f"{served.url}/v1/completions",
            json={"model": "code-complete", "prompt": "x", "stop": 5 * [body_long]},
            headers=auth(),
        ),
        "v2": httpx.get(f"{served.url}/v2/models/{url_long}", headers=auth()),
    }
    for field, r in answers.items():
        assert 400 <= r.status_code < 500, (field, r.status_code)
        assert len(r.content) < 2000, (field, r.status_code, len(r.content))
        if field != "v2":
            assert field in r.text


def test_readiness_names_the_workloads_only_to_a_caller_with_the_key(served: Served) -> None:
    # The health routes are open for probes, which read the status alone; what the
    # server hosts is no more open there than on /v2/models/{name}/ready.
    for path in ("/readyz", "/v2/health/ready"):
        for key in (None, WRONG_KEY):
            headers = {} if key is None else auth(key)
            anonymous = httpx.get(f"{served.url}{path}", headers=headers)
            assert anonymous.status_code == 200
            assert anonymous.json() == {"status": "ready", "ready": True}
        keyed = httpx.get(f"{served.url}{path}", headers=auth()).json()
        assert set(keyed["workloads"]) == {"search-query", "eights", "flowers", "code-complete"}


def test_the_openai_client_reads_the_id_and_completions_are_named_after_it(
    served: Served,
) -> None:
    client = OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="code-complete", prompt="def fib(n):", max_tokens=3
    )
    completion = raw.parse()
    rid = raw.headers["x-request-id"]
    assert completion.id == f"cmpl-{rid}"
    line = served.access(rid)
    assert line["workload"] == "code-complete" and line["status"] == 200
    assert completion.usage is not None
    assert line["tokens_in"] == completion.usage.prompt_tokens
    assert line["tokens_out"] == completion.usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model="code-complete",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            extra_headers={"X-Request-Id": "chat-stream-1"},
        )
    )
    assert chunks and {c.id for c in chunks} == {"chatcmpl-chat-stream-1"}
    streamed = served.access("chat-stream-1")
    assert streamed["status"] == 200 and streamed["tokens_out"] >= 1

    with pytest.raises(BadRequestError) as caught:
        client.embeddings.create(model="search-query", input=[])
    assert caught.value.request_id is not None
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["request_id"] == caught.value.request_id


async def test_a_batch_of_eight_tells_each_request_its_batch_and_queue_wait(
    served: Served,
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        calls = [
            client.post(
                f"{served.url}/v1/embeddings",
                json={"model": "eights", "input": f"text {i}"},
                headers=auth(**{"X-Request-Id": f"eights-{i}"}),
            )
            for i in range(8)
        ]
        answers = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * 8
    for i in range(8):
        line = served.access(f"eights-{i}")
        assert line["workload"] == "eights" and line["batch_size"] == 8
        assert line["queue_wait_ms"] >= 0


def test_every_line_is_json_and_none_holds_a_key_or_a_body(served: Served) -> None:
    secret_calls = [
        ("/v1/embeddings", {"model": "search-query", "input": SECRET}, KEY),
        ("/v1/embeddings", {"model": "search-query", "input": {"text": SECRET}}, KEY),
        ("/v1/embeddings", {"model": SECRET, "input": SECRET}, KEY),
        ("/v1/embeddings", {"model": "search-query", "input": SECRET}, WRONG_KEY),
        ("/v1/completions", {"model": "code-complete", "prompt": SECRET, "max_tokens": 2}, KEY),
        ("/v1/completions", {"model": "code-complete", "prompt": SECRET, "max_tokens": -1}, KEY),
        ("/v2/models/flowers/infer", {"inputs": [{"name": SECRET}]}, KEY),
        ("/v1/nowhere", {"secret": SECRET}, KEY),
    ]
    ids = []
    for i, (path, body, key) in enumerate(secret_calls):
        rid = f"secret-{i}"
        httpx.post(f"{served.url}{path}", json=body, headers=auth(key, **{"X-Request-Id": rid}))
        ids.append(rid)
    httpx.post(
        f"{served.url}/v1/embeddings",
        content=b'{"model": "search-query", "input": "' + SECRET.encode(),  # malformed JSON
        headers=auth(**{"X-Request-Id": "secret-malformed"}),
    )
    ids.append("secret-malformed")
    for rid in ids:
        served.access(rid)
    text = served.text()
    lines = served.lines()  # every line parses as JSON
    assert any(line["level"] == "DEBUG" for line in lines) or len(lines) > len(ids)
    assert SECRET not in text
    for key in (KEY, WRONG_KEY, KEY[8:], WRONG_KEY[8:]):
        assert key not in text


def test_an_error_body_gives_its_code_to_the_access_line_in_either_shape() -> None:
    from lanes.serving.access import with_request_id

    openai = b'{"error": {"message": "m", "type": "invalid_request_error", "code": "c1"}}'
    body, code = with_request_id(openai, "r1")
    assert code == "c1" and orjson.loads(body)["error"]["request_id"] == "r1"
    body, code = with_request_id(b'{"error": "m", "param": "inputs", "code": "c2"}', "r2")
    assert code == "c2" and orjson.loads(body)["request_id"] == "r2"
    assert with_request_id(b'{"error": "m"}', "r3")[1] is None


@pytest.mark.parametrize("key", [f"{KEY}\n", f" {KEY}"])
def test_a_key_with_whitespace_around_it_is_refused_at_start(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No client can send it (the header's token is read without the whitespace around
    it), so the server would answer 401 to every call while its health routes say 200:
    a Kubernetes Secret made from a file with its last newline gives one."""
    monkeypatch.chdir(ROOT)
    # No such spec: were the key taken, serve would stop there, not serve.
    command = ["serve", "no-such-workloads.yaml"]
    done = CliRunner().invoke(app, command, env={"LANES_API_KEY": key}, prog_name="lanes")
    assert done.exit_code == 2, done.output
    assert done.stderr.startswith(
        "env LANES_API_KEY: expected a key without whitespace around it"
    ), done.stderr
    assert KEY not in done.stderr
