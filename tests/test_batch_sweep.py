"""The server's sweep (serving/batch_sweep.py): a batch nobody polls still ends, its
files listed and its folder deleted, on tests/test_batch_api.py's real Prefect server
and worker. Nothing here retrieves or lists a batch before the sweep has ended it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from lanes.jobs import BATCH_PREFIX, Job
from lanes.settings import Settings
from tests.flows_fixtures import text
from tests.gates import wait_until
from tests.test_batch_api import POLL_S, WAIT_S, Setup, left_of_run, lines_for, started

pytestmark = pytest.mark.slow

SWEEP_S = 0.2
# Once its run has ended, a batch is swept within SWEEP_S; this bounds a loaded machine.
SWEPT_S = 60.0
ENDED = {"COMPLETED", "COMPLETED_WITH_ERRORS"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with started(tmp_path_factory.mktemp("sweep")) as ready:
        yield ready


def stored(setup: Setup, batch_id: str) -> dict[str, Any]:
    """The batch's record as the store holds it, read without asking the server."""
    record: dict[str, Any] = json.loads((setup.store / "batches" / f"{batch_id}.json").read_bytes())
    return record


def created(client: openai.OpenAI, name: str) -> str:
    """A batch of three lines, created and never looked at again: its id."""
    lines = lines_for("embed-live", [text(i) for i in range(3)])
    uploaded = client.files.create(file=(name, lines), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    return batch.id


def wait_swept(client: openai.OpenAI, setup: Setup, batch_id: str) -> dict[str, Any]:
    """The batch's stored record once its run ended and its output file is listed."""
    job = Job(batch_id, Settings(), prefect_api_url=setup.api)
    wait_until(lambda: job.status() in ENDED, "the batch's run", WAIT_S, POLL_S)

    def listed() -> bool:
        return any(f.filename.startswith(batch_id) for f in client.files.list())

    wait_until(listed, "the batch's output file, swept", SWEPT_S, POLL_S)
    return stored(setup, batch_id)


def test_a_batch_nobody_polls_ends_its_files_listed_and_its_folder_gone(setup: Setup) -> None:
    with setup.server(sweep_s=SWEEP_S) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch_id = created(client, "unpolled.jsonl")
        record = wait_swept(client, setup, batch_id)
        assert record["status"] == "completed", record
        assert record["completed_at"] is not None
        assert record["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        outputs = [f for f in client.files.list() if f.id == record["output_file_id"]]
        assert [f.purpose for f in outputs] == ["batch_output"]
        assert left_of_run(setup, batch_id) == set()


def test_a_batch_that_fails_its_sweep_stops_neither_the_sweep_nor_the_others(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A record the store holds broken (its sweep raises every time) sorts before every
    batch (its id is the lowest): the sweep logs it by its id and ends the batch after it."""
    broken = BATCH_PREFIX + "0" * 32
    broken_record = setup.store / "batches" / f"{broken}.json"
    broken_record.parent.mkdir(parents=True, exist_ok=True)
    broken_record.write_bytes(b'{"id": "')
    caplog.set_level(logging.WARNING, logger="lanes.serving")
    try:
        with setup.server(sweep_s=SWEEP_S) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
            batch_id = created(client, "after-broken.jsonl")
            record = wait_swept(client, setup, batch_id)
            assert record["status"] == "completed", record
            assert left_of_run(setup, batch_id) == set()
    finally:
        broken_record.unlink()
    failed = [r for r in caplog.records if r.name == "lanes.serving" and broken in r.getMessage()]
    assert failed, "the broken batch's failure was not logged with its id"
    assert failed[0].exc_info is not None
    # Its traceback once; each later sweep's failure is one line.
    assert [r.exc_info is not None for r in failed] == [True] + [False] * (len(failed) - 1)
