"""lanes.batchstore's batch records shared by several servers, and lanes.batches' use of
them: in a local folder and on S3 (a moto server over HTTP).

Two `BatchStore`s, or two `Batches`, on one store stand for two servers. The race is
driven, never timed: one server's `change` (or its clock, read between its read and its
write) itself makes the other's whole update, so the first write must meet a conflict.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from lanes import layout
from lanes.batch_claim import CLAIM_S
from lanes.batches import Batches
from lanes.batchfiles import output_file_id
from lanes.batchstore import UPDATE_TRIES, BatchStore
from lanes.errors import StorageError
from lanes.jobs import BATCH_PREFIX, Job
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.uris import join
from tests.flows_fixtures import moto_server, s3_env

BUCKET = "lanes-records"
NOW = 1_900_000_000
NOBODY = "http://127.0.0.1:9/api"  # a Prefect API never asked: the runs read COMPLETED


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(params=["local", "s3"])
def settings(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    if request.param == "local":
        return Settings(batch={"store": str(tmp_path / "store")})
    s3_env(monkeypatch, request.getfixturevalue("endpoint")).create_bucket(Bucket=BUCKET)
    return Settings(batch={"store": f"s3://{BUCKET}/store/"})


def new_record(store: BatchStore) -> dict[str, Any]:
    """An in-progress batch whose one shard is committed with one output line."""
    batch_id = BATCH_PREFIX + uuid.uuid4().hex
    folder = store.batch_folder(uuid.uuid4().hex)
    out = join(folder, "out")
    store.storage.write_bytes(join(out, "part-00000.jsonl"), b'{"custom_id": "r0"}\n')
    marker = orjson.dumps({"outputs": 1, "errors": 0})
    store.storage.write_bytes(join(out, layout.MARKERS, "part-00000.json"), marker)
    record: dict[str, Any] = {
        "id": batch_id,
        "object": "batch",
        "status": "in_progress",
        "errors": None,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": NOW,
        "in_progress_at": NOW,
        "expires_at": NOW + 86400,
        "finalizing_at": None,
        "completed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "request_counts": {"total": 1, "completed": 0, "failed": 0},
        "_lanes": {"folder": folder, "shards": 1, "starts": [1], "flow_run": None},
    }
    store.create_batch(record)
    return record


def setting(key: str, value: Any) -> Callable[[dict[str, Any]], bool]:
    def change(record: dict[str, Any]) -> bool:
        record[key] = value
        return True

    return change


# ---- BatchStore.update_batch --------------------------------------------------------


def test_a_change_another_server_saves_between_a_read_and_a_write_is_kept(
    settings: Settings,
) -> None:
    first, second = BatchStore(settings), BatchStore(settings)
    batch_id = new_record(first)["id"]
    seen: list[Any] = []

    def cancel(record: dict[str, Any]) -> bool:
        seen.append(record["cancelling_at"])
        if len(seen) == 1:  # the other server's whole update, after this one's read
            second.update_batch(batch_id, setting("cancelling_at", NOW + 5))
        record["metadata"] = {"by": "first"}
        return True

    saved = first.update_batch(batch_id, cancel)
    assert seen == [None, NOW + 5]  # the conflict sent it round again, on the new record
    stored = second.batch(batch_id)
    assert stored == saved
    assert (stored["cancelling_at"], stored["metadata"]) == (NOW + 5, {"by": "first"})


def test_a_change_that_declines_writes_nothing(settings: Settings) -> None:
    store = BatchStore(settings)
    batch_id = new_record(store)["id"]
    uri = join(store.root, "batches", f"{batch_id}.json")
    before = store.storage.read_versioned(uri)

    def finished(record: dict[str, Any]) -> bool:
        record["status"] = "scribbled on, then declined"
        return False

    assert store.update_batch(batch_id, finished)["status"] == "scribbled on, then declined"
    assert store.storage.read_versioned(uri) == before


def test_a_record_another_server_keeps_changing_is_a_clear_error(settings: Settings) -> None:
    first, second = BatchStore(settings), BatchStore(settings)
    batch_id = new_record(first)["id"]
    tries: list[int] = []

    def always_overtaken(record: dict[str, Any]) -> bool:
        tries.append(1)
        second.update_batch(batch_id, setting("metadata", {"n": str(len(tries))}))
        record["cancelling_at"] = NOW
        return True

    with pytest.raises(
        StorageError, match=r"another server changed batch \S+ record each of the 10"
    ):
        first.update_batch(batch_id, always_overtaken)
    assert len(tries) == UPDATE_TRIES
    stored = first.batch(batch_id)
    assert (stored["cancelling_at"], stored["metadata"]) == (None, {"n": str(UPDATE_TRIES)})


def test_creating_a_batch_never_replaces_one_of_its_id(settings: Settings) -> None:
    first, second = BatchStore(settings), BatchStore(settings)
    record = new_record(first)
    again = {**record, "status": "failed"}
    with pytest.raises(StorageError, match="exists already, and was kept"):
        second.create_batch(again)
    assert first.batch(record["id"]) == record


# ---- Batches: a mark and a finalize from two servers ------------------------------


class ActingClock:
    """A wall clock that, read for the first time, first runs `act` (another server's
    whole request): Batches read the clock between a record's read and its write."""

    def __init__(self) -> None:
        self.act: Callable[[], Any] = lambda: None
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads == 1:
            self.act()
        return float(NOW + 60)


def servers(settings: Settings) -> tuple[Batches, Batches, ActingClock]:
    spec = Spec(models={}, workloads={})
    clock = ActingClock()
    return (
        Batches(spec, settings, clock, NOBODY),
        Batches(spec, settings, lambda: NOW, NOBODY),
        clock,
    )


def job(record: dict[str, Any], settings: Settings) -> Job:
    return Job(record["id"], settings, prefect_api_url=NOBODY)


def test_a_cancel_saved_while_another_server_finalizes_is_kept(settings: Settings) -> None:
    finalizing, cancelling, clock = servers(settings)
    record = new_record(finalizing.store)
    # Between its read and its claim, the other server marks the batch cancelling.
    clock.act = lambda: cancelling._mark(record["id"], lambda r: r.update(cancelling_at=NOW + 1))

    done = finalizing._finalize(record, "COMPLETED", job(record, settings))

    stored = cancelling.store.batch(record["id"])
    assert stored == done
    assert (stored["status"], stored["cancelling_at"]) == ("completed", NOW + 1)
    assert stored["output_file_id"] == output_file_id(record["id"])
    assert stored["request_counts"] == {"total": 1, "completed": 1, "failed": 0}


def test_an_expiry_saved_while_another_server_finalizes_decides_the_status(
    settings: Settings,
) -> None:
    finalizing, expiring, clock = servers(settings)
    record = new_record(finalizing.store)
    clock.act = lambda: expiring._mark(record["id"], lambda r: r["_lanes"].update(expiring=True))

    done = finalizing._finalize(record, "COMPLETED", job(record, settings))

    assert done["status"] == "expired" and done["expired_at"] == NOW + 60
    assert expiring.store.batch(record["id"]) == done


def test_a_finalize_saved_while_another_server_marks_is_never_undone(
    settings: Settings,
) -> None:
    marking, finalizing, _ = servers(settings)
    record = new_record(marking.store)
    seen: list[str] = []

    def cancel(current: dict[str, Any]) -> None:
        seen.append(current["status"])
        if len(seen) == 1:  # the other server finishes the batch after this read
            finalizing._finalize(record, "COMPLETED", job(record, settings))
        current["cancelling_at"] = NOW + 1

    answer = marking._mark(record["id"], cancel)

    assert seen == ["in_progress"]  # read again, the record was final: left as it is
    stored = marking.store.batch(record["id"])
    assert answer == stored
    assert (stored["status"], stored["cancelling_at"]) == ("completed", None)


def test_only_the_claims_winner_assembles_and_a_stale_claim_is_taken_over(
    settings: Settings,
) -> None:
    first, second, _ = servers(settings)
    record = new_record(first.store)
    claim = {"status": "expired", "message": None, "by": "a server"}

    def claimed(current: dict[str, Any]) -> bool:
        current.update(status="finalizing", finalizing_at=NOW - CLAIM_S + 1)
        current["_lanes"]["finalizing"] = claim
        return True

    first.store.update_batch(record["id"], claimed)
    # Another server's fresh claim: this one answers `finalizing` and writes no file.
    answer = second._finalize(record, "COMPLETED", job(record, settings))
    assert answer["status"] == "finalizing" and answer["_lanes"]["finalizing"] == claim
    assert [f.id for f in second.store.files()] == []

    first.store.update_batch(record["id"], setting("finalizing_at", NOW - CLAIM_S))
    # Its server gone past CLAIM_S: taken over, and ended as that claim decided.
    done = second._finalize(record, "COMPLETED", job(record, settings))
    assert done["status"] == "expired" and done["_lanes"]["finalizing"]["by"] != "a server"
    assert [f.id for f in second.store.files()] == [output_file_id(record["id"])]
