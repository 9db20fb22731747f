"""The batch store's quota (lanes.filequota) through the official `openai` client,
against real uvicorn servers: an upload over it is refused before it is stored, a
deleted file frees its room, the quota holds across a restart and under concurrent
uploads, and a batch's own files count but are always written.

No batch runs here, so no Prefect API is ever asked.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from lanes.batchstore import BatchStore
from tests.flows_fixtures import moto_server, s3_env, write_spec
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

NOBODY = "http://127.0.0.1:9/api"  # a Prefect API never asked
WORKLOADS = {"embed-live": {"mode": "interactive", "task": "embed", "model": "enc"}}
QUOTA = 1000


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("files-quota") / "project", WORKLOADS)


def serve(spec: Path, store: Path | str) -> ServerThread:
    batch = {"store": str(store), "max_store_bytes": QUOTA}
    return ServerThread(spec, batch=batch, prefect_api_url=NOBODY)


def client_of(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def upload(client: openai.OpenAI, size: int) -> openai.types.FileObject:
    return client.files.create(file=("in.jsonl", b"x" * size), purpose="batch")


def refusal(client: openai.OpenAI, size: int) -> dict[str, object]:
    with pytest.raises(openai.BadRequestError) as refused:
        upload(client, size)
    body = refused.value.body
    assert isinstance(body, dict), body
    return body


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
        store: Path | str = tmp_path / "store"
        if kind == "s3":
            s3 = s3_env(monkeypatch, stack.enter_context(moto_server()))
            s3.create_bucket(Bucket="lanes-quota")
            store = "s3://lanes-quota/batches/"
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
