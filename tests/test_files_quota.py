"""The batch store's quota (lanes.filequota) through the official `openai` client,
against real uvicorn servers: an upload over it is refused as its bytes pass the room
left, before it is stored; a deleted file frees its room; the quota holds across a
restart and under concurrent uploads; a batch's own files count but are always
written; a batch's copy of its input counts until the batch ends.

No batch runs here. Most servers point at no Prefect API (a create that passes the
quota would fail there); the batches that must be made are made on a real Prefect
server with their deployment and no worker, so they stay scheduled until cancelled.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from lanes.batchstore import BatchStore
from lanes.errors import StorageError
from lanes.prefectapi import FLOW_NAME
from lanes.storage import Storage
from lanes.uris import join
from tests.flows_fixtures import moto_server, s3_env, text, write_spec
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

NOBODY = "http://127.0.0.1:9/api"  # a Prefect API never asked
WORKLOADS = {"embed-live": {"mode": "interactive", "task": "embed", "model": "enc"}}
QUOTA = 1000


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("files-quota") / "project", WORKLOADS)


def serve(spec: Path, store: Path | str, prefect_api_url: str = NOBODY) -> ServerThread:
    batch = {"store": str(store), "max_store_bytes": QUOTA}
    return ServerThread(spec, batch=batch, prefect_api_url=prefect_api_url)


def a_store(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack) -> str:
    """A batch store of `kind`: a local folder, or a bucket on an S3 server that `stack`
    stops."""
    if kind == "folder":
        return str(tmp_path / "store")
    s3 = s3_env(monkeypatch, stack.enter_context(moto_server()))
    s3.create_bucket(Bucket="lanes-quota")
    return "s3://lanes-quota/batches/"


def client_of(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def upload(client: openai.OpenAI, size: int) -> openai.types.FileObject:
    return client.files.create(file=("in.jsonl", b"x" * size), purpose="batch")


def refused(call: Callable[[], object]) -> dict[str, object]:
    """The body of the 400 that `call` (an upload, a batch create) is refused with."""
    with pytest.raises(openai.BadRequestError) as refusal:
        call()
    body = refusal.value.body
    assert isinstance(body, dict), body
    return body


def refusal(client: openai.OpenAI, size: int) -> dict[str, object]:
    return refused(lambda: upload(client, size))


def requests(size: int) -> bytes:
    """Three batch lines for `embed-live`, `size` bytes in all with the last newline."""
    lines = [
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": b})
        for i, b in enumerate({"model": "embed-live", "input": text(i)} for i in range(3))
    ]
    body = "\n".join(lines)
    assert len(body) < size, f"{size} bytes hold the three requests"
    return (body + " " * (size - 1 - len(body)) + "\n").encode()  # JSON takes the padding


def create_batch(client: openai.OpenAI, file_id: str) -> openai.types.Batch:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )


def batch_refusal(client: openai.OpenAI, file_id: str) -> dict[str, object]:
    return refused(lambda: create_batch(client, file_id))


def copies(server: ServerThread) -> list[int]:
    """The bytes of each shard of the batches' input copies in the store."""
    shards = join(server.settings.batch_store(), "batches", "*", "in", "*")
    try:
        return [f.size for f in Storage(server.settings).list_files(shards, ("",))]
    except StorageError:
        return []  # no batch folder at all


def test_an_upload_over_the_quota_is_refused_unstored_until_a_file_is_deleted(
    spec: Path, tmp_path: Path
) -> None:
    with serve(spec, tmp_path / "store") as server:
        client = client_of(server)
        first = upload(client, 600)
        error = refusal(client, 500)
        assert (error["param"], error["code"]) == ("file", "storage_quota_exceeded")
        message = str(error["message"])
        assert "quota of 1000 bytes" in message and "of which 600 are used" in message, message
        assert "DELETE /v1/files/{file_id}" in message, message
        # Nothing of the refused upload is stored: no file object, no data, no stage.
        assert [f.id for f in client.files.list()] == [first.id]
        stored = sorted(p.name for p in (tmp_path / "store" / "files").iterdir())
        assert stored == [f"{first.id}.data", f"{first.id}.json"]

        client.files.delete(first.id)
        assert upload(client, 500).bytes == 500


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_the_quota_holds_after_a_restart(
    spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with ExitStack() as stack:
        store = a_store(kind, tmp_path, monkeypatch, stack)
        with serve(spec, store) as server:
            upload(client_of(server), 600)
        with serve(spec, store) as server:
            error = refusal(client_of(server), 500)
            assert "of which 600 are used" in str(error["message"]), error
            assert upload(client_of(server), 400).bytes == 400  # exactly the quota


def test_concurrent_uploads_cannot_go_over_the_quota(spec: Path, tmp_path: Path) -> None:
    """Eight uploads of 400 bytes, each of which fits alone, sent at once: two are
    stored, and the other six refused, however their checks interleave."""
    tries = 8
    start = threading.Barrier(tries)

    def one(client: openai.OpenAI) -> str:
        start.wait(timeout=30)
        try:
            upload(client, 400)
        except openai.BadRequestError as err:
            assert isinstance(err.body, dict) and err.body["code"] == "storage_quota_exceeded"
            return "refused"
        return "stored"

    with serve(spec, tmp_path / "store") as server:
        client = client_of(server)
        with ThreadPoolExecutor(tries) as pool:
            outcomes = list(pool.map(one, [client] * tries, timeout=60))
        assert sorted(outcomes) == ["refused"] * 6 + ["stored"] * 2
        assert sum(f.bytes for f in client.files.list()) == 800
        assert BatchStore(server.settings).quota.used() == 800


def test_a_batchs_output_file_is_written_over_the_quota_and_counts(
    spec: Path, tmp_path: Path
) -> None:
    """OpenAI counts a batch's output files in the storage limit. One is never refused
    (its batch ran); it only keeps later uploads out until files are deleted."""
    with serve(spec, tmp_path / "store") as server:
        client = client_of(server)
        output = BatchStore(server.settings).put_file(
            "file-batch_x-output", "batch_x_output.jsonl", "batch_output", iter([b"y" * 1500])
        )
        assert output is not None and output.bytes == 1500
        error = refusal(client, 1)
        assert "of which 1500 are used" in str(error["message"]), error
        client.files.delete(output.id)
        assert upload(client, 1).bytes == 1


def test_an_upload_is_refused_as_its_bytes_pass_the_room_left(spec: Path, tmp_path: Path) -> None:
    """Counted as they arrive, as the per-file limit is: the refusal names how many of
    the file's bytes had come, fewer than it has (the server read no further), and
    nothing of it is stored."""
    with serve(spec, tmp_path / "store") as server:
        client = client_of(server)
        first = upload(client, 600)
        size = 4 * 1024 * 1024
        error = refusal(client, size)
        assert (error["param"], error["code"]) == ("file", "storage_quota_exceeded")
        message = str(error["message"])
        counted = re.search(r"the upload's first (\d+) bytes would already take", message)
        assert counted is not None, message
        assert 400 < int(counted.group(1)) < size, message
        assert "quota of 1000 bytes" in message and "of which 600 are used" in message, message
        assert [f.id for f in client.files.list()] == [first.id]
        stored = sorted(p.name for p in (tmp_path / "store" / "files").iterdir())
        assert stored == [f"{first.id}.data", f"{first.id}.json"]
        assert upload(client, 400).bytes == 400  # exactly the room that was left


def test_a_batch_whose_copy_would_go_over_is_refused_with_nothing_split(
    spec: Path, tmp_path: Path
) -> None:
    """A batch keeps a copy of its input file: one that would take the store over the
    quota is refused before any of it is written (and before Prefect is asked)."""
    store = tmp_path / "store"
    with serve(spec, store) as server:
        client = client_of(server)
        given = client.files.create(file=("in.jsonl", requests(600)), purpose="batch")
        error = batch_refusal(client, given.id)
        assert (error["param"], error["code"]) == ("input_file_id", "storage_quota_exceeded")
        message = str(error["message"])
        assert f"the batch's copy of file {given.id} (up to 601 bytes" in message, message
        assert "quota of 1000 bytes" in message and "of which 600 are used" in message, message
        assert "POST /v1/batches/{batch_id}/cancel" in message, message
        assert client.batches.list().data == []
        assert list(store.glob("batches/**/*")) == []
        assert BatchStore(server.settings).quota.used() == 600


def test_a_batch_that_fails_validating_keeps_no_copy(spec: Path, tmp_path: Path) -> None:
    """A bad file's batch has ended as it is made: its copy goes at once."""
    with serve(spec, tmp_path / "store") as server:
        client = client_of(server)
        given = client.files.create(file=("in.jsonl", b"not json\n" * 30), purpose="batch")
        assert create_batch(client, given.id).status == "failed"
        assert copies(server) == []
        assert BatchStore(server.settings).quota.used() == 270


@pytest.fixture
def deployed(prefect_api: str) -> Iterator[str]:
    """The `openai_batch` deployment on a real Prefect server, with no worker: its
    batches stay scheduled until cancelled. Removed after the test."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        flow = client.create_flow_from_name(FLOW_NAME)
        deployment = client.create_deployment(flow, "openai_batch")
        try:
            yield prefect_api
        finally:
            client.delete_deployment(deployment)


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_a_batchs_copy_counts_until_it_ends(
    spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deployed: str, kind: str
) -> None:
    """The copy takes room as an upload does, so one file batched again and again cannot
    fill the store; a cancelled batch's copy is deleted, and its room free again, while
    the input file stays."""
    with ExitStack() as stack:
        store = a_store(kind, tmp_path, monkeypatch, stack)
        server = stack.enter_context(serve(spec, store, deployed))
        client = client_of(server)
        given = client.files.create(file=("in.jsonl", requests(400)), purpose="batch")
        first = create_batch(client, given.id)
        assert first.status == "in_progress"
        assert copies(server) == [400]
        assert BatchStore(server.settings).quota.used() == 800
        error = batch_refusal(client, given.id)
        assert "of which 800 are used" in str(error["message"]), error
        assert refusal(client, 201)["code"] == "storage_quota_exceeded"
        assert len(copies(server)) == 1  # the refused create split nothing

        assert client.batches.cancel(first.id).status == "cancelled"
        assert copies(server) == []
        assert client.files.retrieve(given.id).bytes == 400
        second = create_batch(client, given.id)  # its room is free again
        assert client.batches.cancel(second.id).status == "cancelled"
        assert BatchStore(server.settings).quota.used() == 400
