"""A shard's commit key: the same data through the same model is never redone, wherever
the project lies; changed data or a changed model is. Under Prefect's test harness, on
a tiny real model, with a project whose spec names everything relative to itself."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from lanes.errors import JobFailed
from lanes.flows.batch import offline
from lanes.flows.job import plan_job, plan_shards
from lanes.settings import Settings
from lanes.storage import Storage
from tests.flows_fixtures import infer_model, moto_server, read_jsonl, s3_env, write_jsonl


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def project(folder: Path, **fields: str) -> Path:
    infer_model(folder / "models" / "affine")
    spec = {
        "version": 1,
        "models": {"affine": {"path": "models/affine/model.onnx"}},
        "workloads": {
            "aff": {
                "mode": "offline",
                "task": "infer",
                "model": "affine",
                "input": "data/in/",
                "output": "data/out/",
                "batch_size": 4,
                "retries": 0,
                **fields,
            }
        },
    }
    (folder / "workloads.yaml").write_text(yaml.safe_dump(spec))
    for name in ("a", "b"):
        write_jsonl(folder / "data" / "in" / f"{name}.jsonl", records(name, 3))
    return folder / "workloads.yaml"


def records(prefix: str, n: int, shift: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "x": [[i + shift, 0, 0, 0]]} for i in range(n)]


def run(folder: Path) -> dict[str, Any]:
    return offline(workload="aff", spec=str(folder / "workloads.yaml"))


def ids(folder: Path) -> list[str]:
    out = folder / "data" / "out"
    return sorted(line["id"] for name in ("a", "b") for line in read_jsonl(out / f"{name}.jsonl"))


def test_a_moved_or_copied_project_redoes_nothing(prefect_api: str, tmp_path: Path) -> None:
    project(tmp_path / "laptop")
    assert run(tmp_path / "laptop")["shards_run"] == 2
    # Moved (times kept), and copied without its times, as an image build copies to /app.
    shutil.move(tmp_path / "laptop", tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp_path / "app", copy_function=shutil.copy)
    for folder in (tmp_path / "moved", tmp_path / "app"):
        summary = run(folder)
        assert (summary["shards_run"], summary["shards_skipped"]) == (0, 2), folder
        assert ids(folder) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_changed_data_or_a_changed_model_is_redone(prefect_api: str, tmp_path: Path) -> None:
    project(tmp_path)
    run(tmp_path)
    write_jsonl(tmp_path / "data" / "in" / "b.jsonl", records("b", 3, shift=10))
    summary = run(tmp_path)
    assert (summary["shards_run"], summary["shards_skipped"]) == (1, 1)
    (first,) = [r for r in read_jsonl(tmp_path / "data" / "out" / "b.jsonl") if r["id"] == "b0"]
    assert first["y"] == [[21.0, 1.0, 1.0, 1.0]]

    model = tmp_path / "models" / "affine" / "model.onnx"
    data = model.read_bytes()
    assert data.count(b"\x00\x00\x00@") == 1  # the float32 2.0 of y = 2x + 1
    model.write_bytes(data.replace(b"\x00\x00\x00@", b"\x00\x00@@"))  # now 3.0
    summary = run(tmp_path)
    assert (summary["shards_run"], summary["shards_skipped"]) == (2, 0)
    (first,) = [r for r in read_jsonl(tmp_path / "data" / "out" / "b.jsonl") if r["id"] == "b0"]
    assert first["y"] == [[31.0, 1.0, 1.0, 1.0]]


def test_a_changed_handler_is_redone_and_a_changed_batch_size_is_not(
    prefect_api: str, tmp_path: Path
) -> None:
    """The workload keys that decide a record's output count in the commit key (the
    README's Reruns); those that only pace the run do not."""
    spec = project(tmp_path)
    run(tmp_path)

    def edit(**keys: Any) -> None:
        data = yaml.safe_load(spec.read_text())
        data["workloads"]["aff"].update(keys)
        spec.write_text(yaml.safe_dump(data))

    edit(batch_size=2)
    assert run(tmp_path)["shards_skipped"] == 2
    edit(handler="tests.flows_fixtures:held_from_shard_3")  # its pre passes these through
    summary = run(tmp_path)
    assert (summary["shards_run"], summary["shards_skipped"]) == (2, 0)
    assert ids(tmp_path) == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_markers_of_the_previous_format_are_redone_not_refused(
    prefect_api: str, tmp_path: Path
) -> None:
    """Markers as lanes wrote them before `source` (keyed by path and mtime), of a project
    since moved: each shard is redone once, over its own output, and nothing fails."""
    project(tmp_path / "old")
    run(tmp_path / "old")
    markers = tmp_path / "old" / "data" / "out" / "_committed"
    for marker in markers.iterdir():
        data = orjson.loads(marker.read_bytes())
        del data["source"]
        data["key"] = "0" * 64  # a key of the old format never matches a new one
        marker.write_bytes(orjson.dumps(data))
    shutil.move(tmp_path / "old", tmp_path / "new")

    summary = run(tmp_path / "new")
    assert (summary["shards_run"], summary["shards_skipped"]) == (2, 0)
    assert ids(tmp_path / "new") == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert run(tmp_path / "new")["shards_skipped"] == 2


def test_another_inputs_marker_is_still_refused(prefect_api: str, tmp_path: Path) -> None:
    """The shard's `source` names its input inside the project: a marker of another
    input file found in the output still means two jobs share it."""
    spec = project(tmp_path)
    settings = Settings()
    storage = Storage(settings)
    plans = plan_shards(plan_job("aff", spec, settings), storage)
    a, b = plans
    assert (a.source, b.source) == ("data/in/a.jsonl", "data/in/b.jsonl")
    marker = {"key": b.key, "workload": "aff", "source": b.source, "input": "/elsewhere/b"}
    Path(a.marker).parent.mkdir(parents=True)
    Path(a.marker).write_bytes(orjson.dumps(marker))
    state = offline(workload="aff", spec=str(spec), return_state=True)
    assert state.is_failed() and "two jobs write this output" in str(state.message)


def test_a_job_at_another_folder_shares_the_laptops_commits_on_s3(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same S3 input and output, the same model bytes: a Job whose image holds the
    project at /app (here: a copy elsewhere, its model files' times new) redoes nothing
    the laptop's `lanes run` committed."""
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="corpus")
    for name in ("a", "b"):
        body = "\n".join(json.dumps(r) for r in records(name, 3)).encode()
        s3.put_object(Bucket="corpus", Key=f"in/{name}.jsonl", Body=body)
    folders = {"input": "s3://corpus/in/", "output": "s3://corpus/out/"}
    project(tmp_path / "laptop", **folders)
    assert run(tmp_path / "laptop")["shards_run"] == 2
    shutil.copytree(tmp_path / "laptop", tmp_path / "app", copy_function=shutil.copy)
    summary = run(tmp_path / "app")
    assert (summary["shards_run"], summary["shards_skipped"]) == (0, 2)


def test_two_projects_of_one_model_run_each_by_its_own_declaration(
    prefect_api: str, tmp_path: Path
) -> None:
    """The same model bytes under the same workload name in one process: each run takes
    its own workload's max_error_rate, not the task loaded for the other."""
    for name, rate in (("lenient", 0.5), ("strict", 0.0)):
        project(tmp_path / name, max_error_rate=rate)  # type: ignore[arg-type]
        write_jsonl(tmp_path / name / "data" / "in" / "b.jsonl", [*records("b", 3), {"id": "bad"}])
    assert run(tmp_path / "lenient")["errors"] == 1
    with pytest.raises(JobFailed, match="max_error_rate 0 allows"):
        run(tmp_path / "strict")
