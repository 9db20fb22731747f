"""One run at a time per output folder (lanes.runlock), on a real Prefect API: a second
run of a workload whose run is still going refuses, naming it, instead of redoing every
shard that run has not committed yet. On S3 (a moto server over HTTP) the lock is a
lease (lanes.s3lock): a killed run's is taken over, and a renewal never takes back one
another run took over."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from lanes.errors import OutputBusy
from lanes.flows.batch import offline
from lanes.s3lock import S3Lease
from lanes.settings import Settings
from lanes.storage import Storage
from tests.flows_fixtures import (
    moto_server,
    outputs_of,
    s3_env,
    wait_until,
    write_jsonl,
    write_spec,
)
from tests.gates import HELD, WAIT_S


def test_a_second_run_of_an_output_being_written_is_refused_naming_the_first(
    prefect_api: str, tmp_path: Path
) -> None:
    held = {"mode": "offline", "task": "infer", "model": "affine", "handler": "tests.gates:held"}
    spec = write_spec(tmp_path, {"held": {**held, "input": "in/", "output": "out/", "retries": 0}})
    for shard in range(2):
        records = [{"id": f"{shard}-{i}", "x": [[i, 0, 0, 0]]} for i in range(3)]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", records)
    first: dict[str, Any] = {}
    second: list[Exception] = []

    def run_second() -> None:
        try:
            offline(workload="held", spec=str(spec))
        except Exception as err:
            second.append(err)

    running = threading.Thread(
        target=lambda: first.update(offline(workload="held", spec=str(spec)))
    )
    refusing = threading.Thread(target=run_second)
    HELD.close()
    try:
        running.start()  # it holds the output while its model waits at the gate
        HELD.wait_held()
        # Without the lock, the second would wait for the gate too, and redo both shards.
        refusing.start()
        refusing.join(WAIT_S)
        assert second, "the second run did not refuse while the first was running"
    finally:
        HELD.open()
        for thread in (running, refusing):
            if thread.is_alive():
                thread.join(WAIT_S)

    out = tmp_path / "out"
    assert first["shards_run"] == 2, first
    manifests = list((out / "_manifests").iterdir())
    assert len(manifests) == 1, "the refused run wrote no manifest"
    first_run = json.loads(manifests[0].read_text())["flow_run"]
    (refused,) = second
    assert isinstance(refused, OutputBusy), refused
    message = str(refused)
    assert f"{out} is being written by another run (flow run " in message
    assert f"({first_run}) on host " in message and "wrote nothing" in message
    seen = Counter(line["id"] for line in outputs_of(out))
    assert set(seen.values()) == {1} and len(seen) == 6

    # Released when the first ended: the next run goes, and redoes nothing.
    again = offline(workload="held", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"]) == (0, 2)


# ---- S3: a lease ----------------------------------------------------------------------

OUT = "s3://results/out/"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def _keys(s3: Any) -> list[str]:
    return [o["Key"] for o in s3.list_objects_v2(Bucket="results").get("Contents", [])]


def _holder(s3: Any) -> str:
    body = s3.get_object(Bucket="results", Key="out/_running")["Body"].read()
    return str(json.loads(body)["holder"])


def test_a_run_of_an_s3_output_another_run_holds_is_refused_naming_it(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="results")
    aff = {"mode": "offline", "task": "infer", "model": "affine", "input": "in/", "output": OUT}
    spec = write_spec(tmp_path, {"aff": {**aff, "retries": 0}})
    write_jsonl(
        tmp_path / "in" / "part-0.jsonl", [{"id": i, "x": [[i, 0, 0, 0]]} for i in range(3)]
    )
    first = "flow run first (7e57) on host elsewhere, pid 7, since 2026-12-07T20:00:00+00:00"

    with Storage(Settings()).exclusive(OUT, first):
        # Without the lease, this run would run the shard the first has not committed.
        with pytest.raises(OutputBusy) as refused:
            offline(workload="aff", spec=str(spec))
        assert _keys(s3) == ["out/_running"], "the refused run wrote nothing"
    assert str(refused.value).startswith(
        f"s3://results/out is being written by another run ({first}); this run wrote nothing"
    )

    # Released when the first ended: the next run goes, and gives the lease back.
    again = offline(workload="aff", spec=str(spec))
    assert again["shards_run"] == 1
    assert "out/_running" not in _keys(s3) and "out/part-0.jsonl" in _keys(s3)


def test_a_lease_its_holder_stopped_renewing_is_taken_over(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="results")
    # A killed run's lease: half a second, never renewed.
    killed = {"holder": "flow run killed (dead) on host gone", "lease_s": 0.5, "token": "x"}
    s3.put_object(Bucket="results", Key="out/_running", Body=json.dumps(killed).encode())

    def age_on_s3() -> float:
        # S3's clock on both ends, as the lease's: stale once 1 s (its dates' resolution)
        # older than its lease.
        head = s3.head_object(Bucket="results", Key="out/_running")
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        return float((now - head["LastModified"]).total_seconds())

    wait_until(lambda: age_on_s3() >= 2, 10, "the killed run's lease to run out on S3")
    with Storage(Settings()).exclusive(OUT, "the next run") as held:
        assert _holder(s3) == "the next run"
        assert held.lost is None
    assert "out/_running" not in _keys(s3), "released when the block ended"


def test_a_renewal_never_takes_back_a_lease_another_run_took_over(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="results")
    with Storage(Settings(s3_lease_s=0.3)).exclusive(OUT, "run A") as held:
        # Run B took the lease over (as it may once A stalls past its lease): A's next
        # renewal finds B's, and leaves it.
        taken = {"holder": "run B", "lease_s": 60, "token": "b"}
        s3.put_object(Bucket="results", Key="out/_running", Body=json.dumps(taken).encode())
        lost = wait_until(lambda: held.lost, 10, "run A's renewal to find run B's lease")
    assert lost == "lost the lease of s3://results/out/_running: another run holds it (run B)"
    assert _holder(s3) == "run B", "neither A's renewals nor its release touched B's lease"


def test_a_renewal_changes_the_lease_so_a_taker_that_judged_it_stale_loses(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A taker reads the lease, judges it stale, and writes with If-Match on what it read.
    # Had the holder renewed in between (it was late, not dead), that write must fail:
    # so a renewal must change the object's ETag, not rewrite the same bytes.
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="results")
    lease = S3Lease(s3, "s3://results/out/_running", "run A", s3_endpoint, lease_s=60)
    lease.acquire()
    judged = s3.head_object(Bucket="results", Key="out/_running")["ETag"]
    assert lease.renew()
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket="results", Key="out/_running", Body=b"run B", IfMatch=judged)
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert _holder(s3) == "run A"
    lease.release()


def test_a_run_that_lost_its_lease_starts_no_further_shard_and_fails(
    prefect_api: str,
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="results")
    monkeypatch.setenv("LANES_S3_LEASE_S", "0.3")  # renewed every 0.1 s
    held = {"mode": "offline", "task": "infer", "model": "affine", "handler": "tests.gates:held"}
    one_at_a_time = {"kind": "local", "max_concurrent_shards": 1}
    workload = {**held, "input": "in/", "output": OUT, "retries": 0, "runner": one_at_a_time}
    spec = write_spec(tmp_path, {"held": workload})
    for shard in range(2):
        records = [{"id": f"{shard}-{i}", "x": [[i, 0, 0, 0]]} for i in range(3)]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", records)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            offline(workload="held", spec=str(spec))
        except BaseException as err:
            ended.append(err)

    running = threading.Thread(target=run)
    HELD.close()
    try:
        running.start()
        HELD.wait_held()  # its first shard runs; the second waits for it
        taken = {"holder": "run B", "lease_s": 60, "token": "b"}
        s3.put_object(Bucket="results", Key="out/_running", Body=json.dumps(taken).encode())
        wait_until(lambda: "lost the lease" in caplog.text, WAIT_S, "a renewal to find run B's")
    finally:
        HELD.open()
        running.join(WAIT_S)

    (error,) = ended
    assert isinstance(error, OutputBusy), error
    assert str(error).startswith(
        "lost the lease of s3://results/out/_running: another run holds it (run B); this "
        "run committed 1 shards and started no other (1 not started)"
    )
    keys = _keys(s3)
    assert "out/part-0.jsonl" in keys and "out/part-1.jsonl" not in keys
    assert _holder(s3) == "run B"
