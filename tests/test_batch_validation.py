"""The Batch API's answers that need no batch run: a create refused, or a batch failed
in validating, through the official `openai` client against one real uvicorn server.

Its Prefect API is never asked (nothing here starts a run), so none is started: the
runs themselves are tests/test_batch_api.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from lanes.batchstore import BatchStore
from tests.flows_fixtures import write_spec
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

NOBODY = "http://127.0.0.1:9/api"  # a Prefect API never asked
WORKLOADS = {"embed-live": {"mode": "interactive", "task": "embed", "model": "enc"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("batch-validation")
    spec = write_spec(root / "project", WORKLOADS)
    batch = {"store": str(root / "store")}
    with ServerThread(spec, batch=batch, prefect_api_url=NOBODY) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def request_line(custom_id: str, text: str) -> bytes:
    body = {"model": "embed-live", "input": text}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def create(client: openai.OpenAI, content: bytes, **more: object) -> openai.types.Batch:
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        **more,  # type: ignore[arg-type]
    )


def test_a_line_not_in_utf8_names_the_byte_and_where_it_is(client: openai.OpenAI) -> None:
    latin1 = request_line("r1", "café").decode().encode("latin-1")
    batch = create(client, request_line("r0", "w1") + latin1)
    assert batch.status == "failed" and batch.errors is not None
    (error,) = batch.errors.data or []
    assert error.line == 2
    message, at = error.message or "", latin1.index(b"\xe9")
    assert f"byte 0xe9 in position {at}" in message and "encoded as UTF-8" in message, message


def test_metadata_over_16_keys_says_how_many_it_found(client: openai.OpenAI) -> None:
    metadata = {f"k{i}": "v" for i in range(17)}
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, request_line("r0", "w1"), metadata=metadata)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "metadata"
    assert error["message"] == "metadata: expected at most 16 keys, found 17", error


def test_a_batchs_output_file_is_refused_as_an_input(
    server: ServerThread, client: openai.OpenAI
) -> None:
    """OpenAI takes as a batch's input only a file uploaded with purpose "batch"."""
    output = BatchStore(server.settings).put_file(
        "file-batch_x-output", "batch_x_output.jsonl", "batch_output", iter([b"{}\n"])
    )
    assert output is not None
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=output.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "input_file_id"
    assert "purpose 'batch_output'" in error["message"] and '"batch"' in error["message"]


def test_a_file_with_more_bad_lines_than_listed_says_how_many_more(
    client: openai.OpenAI,
) -> None:
    batch = create(client, b"{bad\n" * 103)
    assert batch.status == "failed" and batch.errors is not None
    listed = batch.errors.data or []
    assert [e.line for e in listed[:-1]] == list(range(1, 101))
    last = listed[-1]
    assert (last.code, last.line) == ("invalid_request", None)
    assert "3 more errors" in (last.message or ""), last


def test_lists_keep_the_creation_order_within_one_second(client: openai.OpenAI) -> None:
    """OpenAI lists newest first. `created_at` is whole seconds, so objects made in one
    second (here until six are) must keep their order by a finer creation time, in
    every page that `after` reaches."""
    files: list[str] = []
    batches: list[openai.types.Batch] = []

    def one_second_holds_six() -> bool:
        return len(batches) >= 6 and len({b.created_at for b in batches[-6:]}) == 1

    while len(batches) < 30 and not one_second_holds_six():
        uploaded = client.files.create(file=("in.jsonl", b"{bad\n"), purpose="batch")
        files.append(uploaded.id)
        batches.append(
            client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        )
    made = [b.id for b in batches]
    listed = [b.id for b in client.batches.list(limit=2)]  # the iterator follows `after`
    assert [i for i in listed if i in made] == made[::-1]
    listed = [f.id for f in client.files.list(limit=2)]
    assert [i for i in listed if i in files] == files[::-1]
    listed = [f.id for f in client.files.list(limit=2, order="asc")]
    assert [i for i in listed if i in files] == files


def test_an_unknown_after_is_one_400_naming_after_on_both_lists(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as batches:
        client.batches.list(after="batch_0123")
    with pytest.raises(openai.BadRequestError) as files:
        client.files.list(after="file-0123")
    for refused, kind, id in ((batches, "batch", "batch_0123"), (files, "file", "file-0123")):
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "after", error
        assert error["message"] == f"after: no {kind} with id {id!r}", error


def test_metadata_keys_over_64_and_values_over_512_characters_are_refused_by_key(
    client: openai.OpenAI,
) -> None:
    """OpenAI's metadata: keys of at most 64 characters, values of at most 512."""
    content = b"{bad\n"  # a batch failed in validating, were its metadata taken
    long_key = "k" * 65
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, content, metadata={"ok": "v", long_key: "v"})
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "metadata", error
    assert error["message"] == (
        f"metadata: key {long_key[:64]!r}... is 65 characters; expected at most 64"
    ), error
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, content, metadata={"ok": "v", "note": "v" * 513})
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "metadata.note", error
    assert error["message"] == "metadata.note: expected at most 512 characters, found 513"
    widest = {"k" * 64: "v" * 512}
    assert create(client, content, metadata=widest).metadata == widest
