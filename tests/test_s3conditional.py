"""lanes.s3conditional: a store that ignores S3's conditional writes is refused before a
run takes its lease or the Batch API writes a record there.

The stores are real: moto over HTTP, which honours the conditions, and the same moto
behind a proxy on 127.0.0.1 that forwards every request but drops a condition's header
first, as an S3-compatible store that ignores it does (moto checks no signature, so the
dropped signed header goes unnoticed).
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import pytest

from lanes.errors import PermanentStorageError
from lanes.settings import Settings
from lanes.storage import Storage
from tests.flows_fixtures import moto_server, s3_env

OUT = "s3://results/out/"
# What a store that ignores conditions drops: "If-Match when missing" drops If-Match
# only where there is no object yet (the bug of MinIO issue #21526).
# "If-Match on delete" drops it from deletes only; "no conditions" answers every
# conditional request 501 NotImplemented, as a store that takes none does.
IF_NONE_MATCH, IF_MATCH, IF_MATCH_WHEN_MISSING, IF_MATCH_ON_DELETE, NO_CONDITIONS = (
    "If-None-Match",
    "If-Match",
    "If-Match when missing",
    "If-Match on delete",
    "no conditions",
)
_NOT_IMPLEMENTED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented"
    b"</Message></Error>"
)
_HOP_BY_HOP = frozenset({"connection", "transfer-encoding", "keep-alive"})


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(moto: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    client = s3_env(monkeypatch, moto)
    client.create_bucket(Bucket="results")
    return client


class _Forwarding(http.server.BaseHTTPRequestHandler):
    """Sends each request on to the server's upstream without the headers it drops,
    and notes it."""

    protocol_version = "HTTP/1.1"
    server: _Proxy

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        self.server.seen.append(f"{self.command} {self.path}")
        if NO_CONDITIONS in self.server.drop and {"If-Match", "If-None-Match"} & set(headers):
            self._answer(501, [("Content-Type", "application/xml")], _NOT_IMPLEMENTED)
            return
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        try:
            for name in self.server.drop:
                if name == IF_MATCH_ON_DELETE:
                    if self.command == "DELETE":
                        headers.pop("If-Match", None)
                elif name == IF_MATCH_WHEN_MISSING:
                    if "If-Match" in headers and self._missing(upstream):
                        del headers["If-Match"]
                else:
                    headers.pop(name, None)
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        length_out = answer.getheader("Content-Length") if self.command == "HEAD" else None
        self._answer(answer.status, answer.getheaders(), data, length_out)

    def _answer(
        self,
        status: int,
        headers: list[tuple[str, str]],
        data: bytes,
        length: str | None = None,
    ) -> None:
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP | {"content-length"}:
                self.send_header(name, value)
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _missing(self, upstream: http.client.HTTPConnection) -> bool:
        upstream.request("HEAD", self.path)
        answer = upstream.getresponse()
        answer.read()
        return answer.status == 404

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Proxy(http.server.ThreadingHTTPServer):
    def __init__(self, upstream: str, drop: tuple[str, ...]) -> None:
        super().__init__(("127.0.0.1", 0), _Forwarding)
        self.upstream, self.drop = upstream, drop
        self.seen: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def proxy(upstream_url: str, drop: tuple[str, ...] = ()) -> Iterator[_Proxy]:
    """A proxy on 127.0.0.1 to `upstream_url` that drops the headers `drop` names."""
    server = _Proxy(urlparse(upstream_url).netloc, drop)
    serving = threading.Thread(target=server.serve_forever, name="s3 proxy", daemon=True)
    serving.start()
    try:
        yield server
    finally:
        server.shutdown()
        serving.join()
        server.server_close()


def _keys(s3: Any, bucket: str) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _refusal(uri: str, endpoint: str, wrong: str) -> str:
    return (
        f"{uri}: the S3 store at {endpoint} {wrong}, which lanes needs to keep one run per output (its _running lease) "
        "and one writer per Batch API record; nothing was written there. Use a store that "
        "honours S3's conditional writes (AWS S3, or a MinIO or Ceph RGW release whose "
        "PutObject supports If-None-Match and If-Match), or, where one process at a time "
        "writes each output and the Batch API's store, set "
        "LANES_S3_CHECK_CONDITIONAL_WRITES=false"
    )


@pytest.mark.parametrize(
    ("dropped", "wrong"),
    [
        (
            IF_NONE_MATCH,
            "ignored a conditional write (If-None-Match: * on an object that exists: it "
            "wrote anyway)",
        ),
        (
            IF_MATCH,
            "ignored a conditional write (If-Match on another version of an object: it "
            "wrote anyway)",
        ),
        (
            IF_MATCH_WHEN_MISSING,
            "ignored a conditional write (If-Match on an object that does not exist: it "
            "wrote anyway)",
        ),
        (
            IF_MATCH_ON_DELETE,
            "ignored a conditional write (If-Match on a delete of another version of an "
            "object: it deleted anyway)",
        ),
        (NO_CONDITIONS, "does not support conditional writes (it answered NotImplemented)"),
    ],
)
def test_a_run_is_refused_its_lease_on_a_store_that_ignores_a_condition(
    s3: Any, moto: str, dropped: str, wrong: str
) -> None:
    with proxy(moto, drop=(dropped,)) as store:
        storage = Storage(Settings(s3_endpoint=store.url))
        with pytest.raises(PermanentStorageError) as refused:
            storage.exclusive(OUT, "run A")
    assert str(refused.value) == _refusal("s3://results/out/_running", store.url, wrong)
    assert _keys(s3, "results") == [], "neither the lease nor a probe was left"


def test_a_batch_record_is_refused_on_a_store_that_ignores_conditions(s3: Any, moto: str) -> None:
    s3.create_bucket(Bucket="records")
    uri = "s3://records/batches/batch_1.json"
    with proxy(moto, drop=(IF_NONE_MATCH, IF_MATCH)) as store:
        storage = Storage(Settings(s3_endpoint=store.url))
        with pytest.raises(PermanentStorageError) as refused:
            storage.write_if(uri, b"{}", None)
        asked = len(store.seen)
        with pytest.raises(PermanentStorageError):  # again, without asking the store
            storage.write_if(uri, b"{}", None)
        assert len(store.seen) == asked
    assert str(refused.value) == _refusal(
        uri,
        store.url,
        "ignored a conditional write (If-None-Match: * on an object that exists: it wrote anyway)",
    )
    assert _keys(s3, "records") == []


def test_a_store_that_honours_conditions_is_probed_once_per_bucket(s3: Any, moto: str) -> None:
    with proxy(moto) as store:
        storage = Storage(Settings(s3_endpoint=store.url))
        with storage.exclusive(OUT, "run A"):
            pass
        assert storage.write_if("s3://results/records/b.json", b"1", None)
        assert not storage.write_if("s3://results/records/b.json", b"2", None)
        puts = [r for r in store.seen if r.startswith("PUT ")]
    probes = [r for r in puts if "_lanes-probe-" in r]
    assert len(probes) == 4, "create, create again, replace another version, replace none"
    assert all(r.startswith("PUT /results/out/_lanes-probe-") for r in probes)
    assert [r for r in puts if r not in probes] == [
        "PUT /results/out/_running",
        "PUT /results/records/b.json",
        "PUT /results/records/b.json",
    ]
    assert _keys(s3, "results") == ["records/b.json"], "the probes went, the lease too"


def test_the_check_can_be_turned_off_where_one_process_writes(s3: Any, moto: str) -> None:
    with proxy(moto, drop=(IF_NONE_MATCH, IF_MATCH)) as store:
        settings = Settings(s3_endpoint=store.url, s3_check_conditional_writes=False)
        with Storage(settings).exclusive(OUT, "the only run"):
            assert _keys(s3, "results") == ["out/_running"]
        assert not [r for r in store.seen if "_lanes-probe-" in r]
