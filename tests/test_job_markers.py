"""What `Job.results()` and `errors()` read: only files inside the job's output.

They follow each shard's commit marker to its output and errors file, and whoever may
write in a shared output folder can write a marker or a link: a file named or reached
outside the output is refused, naming it, and none of its lines come back. A real
offline run under the session's Prefect API, on the tiny affine model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lanes.errors import LanesError, PermanentStorageError
from lanes.flows.batch import offline
from lanes.jobs import Job
from lanes.layout import MARKERS
from lanes.settings import Settings
from tests.flows_fixtures import moto_server, s3_env, write_jsonl, write_spec

WORKLOAD = {
    "mode": "offline",
    "task": "infer",
    "model": "affine",
    "input": "in/",
    "output": "out/",
    "batch_size": 4,
    "retries": 0,
    "max_error_rate": 0.5,
}
SECRET = {"id": "stolen", "key": "SECRET-KEY-1"}


def finished_job(prefect_api: str, folder: Path, out: str | None = None) -> Job:
    """A job whose one shard committed two answers and one rejected line, in `out`
    (else `folder`/out/)."""
    out = out or f"{folder / 'out'}/"
    spec = write_spec(folder, {"aff": {**WORKLOAD, "output": out}})
    records: list[Any] = [{"id": f"a{i}", "x": [[i, 0, 0, 0]]} for i in range(2)]
    write_jsonl(folder / "in" / "a.jsonl", [*records, "{not json"])
    output = {"input": f"{folder / 'in'}/", "output": out}
    state = offline(workload="aff", spec=str(spec), return_state=True, **output)
    return Job(str(state.state_details.flow_run_id), Settings(), prefect_api_url=prefect_api)


def test_a_marker_naming_a_file_outside_the_output_is_refused_unread(
    prefect_api: str, tmp_path: Path
) -> None:
    job = finished_job(prefect_api, tmp_path)
    out = tmp_path / "out"
    assert sorted(line["id"] for line in job.results()) == ["a0", "a1"]
    assert [line["line"] for line in job.errors()] == [3]

    secret = tmp_path / "secret" / "keys.jsonl"
    write_jsonl(secret, [SECRET])
    (out / "inside.jsonl").symlink_to(secret)  # inside by spelling, outside by real path
    marker = out / MARKERS / "a.json"
    committed = json.loads(marker.read_text())
    named = [str(secret), f"{out}/../secret/keys.jsonl", str(out / "inside.jsonl")]
    for key, read in [("output", job.results), ("errors_file", job.errors)]:
        for path in named:
            marker.write_text(json.dumps({**committed, key: path}))
            with pytest.raises(LanesError) as caught:
                list(read())
            message = str(caught.value)
            assert f"commit marker {marker} names its {key} {path}, outside" in message
            assert f"job's output {out}/" in message
            assert "SECRET-KEY-1" not in message

    # A manifest made a link to a file elsewhere: refused as it is opened.
    (manifest,) = (out / "_manifests").iterdir()
    manifest.unlink()
    manifest.symlink_to(secret)
    with pytest.raises(PermanentStorageError, match=f"{manifest} is a symbolic link to {secret}"):
        job.manifest()

    # The marker as written, the output it names swapped for a link out: by real path.
    marker.write_text(json.dumps(committed))
    (out / "a.jsonl").unlink()
    (out / "a.jsonl").symlink_to(secret)
    with pytest.raises(LanesError, match=f"names its output {out / 'a.jsonl'}, outside"):
        list(job.results())


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    with moto_server() as endpoint:
        yield s3_env(monkeypatch, endpoint)


def test_a_marker_naming_another_bucket_or_prefix_is_refused_unread(
    prefect_api: str, tmp_path: Path, s3: Any
) -> None:
    """S3 has no links: a marker's file must lie under the output's bucket and prefix as
    spelt, with no `..` part that an HTTP layer could collapse."""
    for bucket in ("lanes-out", "elsewhere"):
        s3.create_bucket(Bucket=bucket)
    job = finished_job(prefect_api, tmp_path, "s3://lanes-out/out/")
    assert sorted(line["id"] for line in job.results()) == ["a0", "a1"]
    for bucket, key in [("lanes-out", "secret.jsonl"), ("elsewhere", "out/a.jsonl")]:
        s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(SECRET).encode())
    key = f"out/{MARKERS}/a.json"
    committed = json.loads(s3.get_object(Bucket="lanes-out", Key=key)["Body"].read())
    for named in [
        "s3://lanes-out/secret.jsonl",
        "s3://elsewhere/out/a.jsonl",
        "s3://lanes-out/out/../secret.jsonl",
        "s3://lanes-out/outside.jsonl",  # the output's prefix, not its folder
        str(tmp_path / "in" / "a.jsonl"),
    ]:
        s3.put_object(Bucket="lanes-out", Key=key, Body=json.dumps({**committed, "output": named}))
        with pytest.raises(LanesError) as caught:
            list(job.results())
        message = str(caught.value)
        assert f"commit marker s3://lanes-out/{key} names its output {named}, outside" in message
        assert "job's output s3://lanes-out/out/" in message
