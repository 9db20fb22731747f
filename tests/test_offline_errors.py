"""Failures that tell the truth, end to end under Prefect's test harness: records in
the wrong shape fail a run before any shard runs, a shard over its max_error_rate
fails uncommitted and unretried, record errors under it end CompletedWithErrors with
`lanes run` exiting 3, and --retry-errors / --force rerun exactly what they say,
each id once, locally and on S3 through a moto server."""

from __future__ import annotations

import csv
import io
import json
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from lanes.errors import JobFailed
from lanes.flows.batch import offline
from lanes.router.offline_cli import run as run_command
from tests.flows_fixtures import (
    errors_of,
    moto_server,
    outputs_of,
    picky,
    read_jsonl,
    s3_env,
    text,
    write_jsonl,
    write_spec,
)


def offline_workload(**fields: Any) -> dict[str, Any]:
    base = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/", "output": "out/"}
    return {**base, "batch_size": 8, "retries": 0, **fields}


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)  # two commands: typer then wants the command's name
    return app


@pytest.fixture
def strict_picky() -> Iterator[Any]:
    picky.allow = False
    yield picky
    picky.allow = False


def test_records_in_the_wrong_shape_fail_the_run_before_any_shard(
    prefect_api: str, tmp_path: Path, cli: typer.Typer
) -> None:
    spec = write_spec(
        tmp_path,
        {"tickets": offline_workload(), "fixed": offline_workload(fields={"id": "ticket_id"})},
    )
    for shard in range(3):
        records = [{"ticket_id": shard * 100 + i, "text": text(i)} for i in range(100)]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", records)

    state = offline(workload="tickets", spec=str(spec), return_state=True)

    assert state.is_failed()
    message = state.message or ""
    assert "validating the records: 300 of the 300 checked" in message
    assert f'{tmp_path / "in" / "part-0.jsonl"} line 1: missing field "id"' in message
    assert "set the workload's `fields.id`" in message and "no shard ran" in message
    assert not (tmp_path / "out" / "_committed").exists()
    assert outputs_of(tmp_path / "out") == []
    done = CliRunner().invoke(cli, ["run", "tickets", "--file", str(spec)])
    assert done.exit_code == 1 and "validating the records" in done.output

    fixed = offline(workload="fixed", spec=str(spec), return_state=True)
    assert fixed.is_completed() and fixed.name == "Completed"
    assert fixed.result()["outputs"] == 300


def test_a_shard_over_its_max_error_rate_fails_uncommitted_and_is_not_retried(
    prefect_api: str, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    spec = write_spec(tmp_path, {"emb": offline_workload(retries=2)})
    write_jsonl(
        tmp_path / "in" / "good.jsonl", [{"id": f"g{i}", "text": text(i)} for i in range(20)]
    )
    # The shape fits (the records check passes); half the texts are not strings.
    bad = [{"id": f"b{i}", "text": text(i) if i % 2 else i} for i in range(40)]
    write_jsonl(tmp_path / "in" / "bad.jsonl", bad)

    with pytest.raises(JobFailed) as caught:
        offline(workload="emb", spec=str(spec))

    message = str(caught.value)
    assert "1 of 2 shards failed" in message
    assert "20 of 40 records rejected, more than max_error_rate 0.1 allows" in message
    assert "line 1: text: expected a string, found int" in message
    out = tmp_path / "out"
    assert (out / "_committed" / "good.json").exists() and (out / "good.jsonl").exists()
    assert not (out / "_committed" / "bad.json").exists()
    assert not (out / "bad.jsonl").exists() and not (out / "_errors" / "bad.jsonl").exists()
    manifest = json.loads((out / "_manifest.json").read_text())
    run_id = uuid.UUID(manifest["flow_run"])
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    attempts = {run.name: run.run_count for run in runs}
    assert attempts == {"shard good.jsonl": 1, "shard bad.jsonl": 1}  # retries: 2, unused

    write_jsonl(
        tmp_path / "in" / "bad.jsonl", [{"id": f"b{i}", "text": text(i)} for i in range(40)]
    )
    again = offline(workload="emb", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"], again["total_outputs"]) == (1, 1, 60)


def test_record_errors_under_the_threshold_say_so_in_the_state_and_the_exit_code(
    prefect_api: str, tmp_path: Path, cli: typer.Typer
) -> None:
    spec = write_spec(tmp_path, {"emb": offline_workload(max_error_rate=0.2)})
    records: list[Any] = [{"id": i, "text": text(i)} for i in range(9)] + [{"id": 9}]
    write_jsonl(tmp_path / "in" / "a.jsonl", records)

    state = offline(workload="emb", spec=str(spec), return_state=True)

    assert state.is_completed() and state.name == "CompletedWithErrors"
    assert (state.message or "").startswith("1 record rejected, 9 answered")
    assert str(tmp_path / "out" / "_errors") in (state.message or "")
    done = CliRunner().invoke(cli, ["run", "emb", "--file", str(spec)])
    assert done.exit_code == 3, done.output  # nothing left to run; the outputs hold an error
    assert "1 records were rejected" in done.output and "--retry-errors" in done.output
    assert "9 outputs" in done.output


def test_retry_errors_reruns_only_the_rejected_records_each_id_once(
    prefect_api: str, tmp_path: Path, strict_picky: Any
) -> None:
    workload = offline_workload(handler="tests.flows_fixtures:picky", max_error_rate=0.5)
    spec = write_spec(tmp_path, {"emb": workload})
    a: list[Any] = [{"id": f"a{i}", "text": text(i), "flaky": i in (3, 7)} for i in range(20)]
    a.insert(10, "{not json")  # line 11
    a.insert(14, {"id": "a0", "text": "w1"})  # line 15: a duplicate
    write_jsonl(tmp_path / "in" / "a.jsonl", a)
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": f"b{i}", "text": text(i)} for i in range(5)])
    out = tmp_path / "out"
    every_id = sorted([f"a{i}" for i in range(20)] + [f"b{i}" for i in range(5)])

    first = offline(workload="emb", spec=str(spec))
    assert (first["total_outputs"], first["total_errors"]) == (23, 4)
    before = {p: p.read_bytes() for p in [out / "b.jsonl", out / "_committed" / "b.json"]}
    saved = tmp_path / "saved"
    saved.mkdir()
    for path in (out / "_errors" / "a.jsonl", out / "_committed" / "a.json"):
        shutil.copy(path, saved / f"{path.parent.name}-{path.name}")

    strict_picky.allow = True  # what was wrong is fixed, the input unchanged
    retry = offline(workload="emb", spec=str(spec), rerun="errors")

    assert (retry["shards_retried"], retry["shards_skipped"]) == (1, 1)
    assert (retry["retried"], retry["recovered"]) == (4, 2)
    assert (retry["total_outputs"], retry["total_errors"]) == (25, 2)
    seen = Counter(line["id"] for line in outputs_of(out))
    assert sorted(seen) == every_id and set(seen.values()) == {1}
    errors = sorted(read_jsonl(out / "_errors" / "a.jsonl"), key=lambda e: e["line"])
    assert [e["line"] for e in errors] == [11, 15]
    assert errors[1]["error"] == "duplicate id 'a0': first on line 1"
    assert all(p.read_bytes() == data for p, data in before.items()), "b is not rerun"

    # A retry killed after publishing its output, before its errors file and marker.
    shutil.copy(saved / "_errors-a.jsonl", out / "_errors" / "a.jsonl")
    shutil.copy(saved / "_committed-a.json", out / "_committed" / "a.json")
    again = offline(workload="emb", spec=str(spec), rerun="errors")
    assert (again["retried"], again["recovered"], again["total_outputs"]) == (4, 2, 25)
    seen = Counter(line["id"] for line in outputs_of(out))
    assert sorted(seen) == every_id and set(seen.values()) == {1}
    assert len(errors_of(out)) == 2

    forced = offline(workload="emb", spec=str(spec), rerun="all")
    assert (forced["shards_run"], forced["shards_skipped"], forced["shards_retried"]) == (2, 0, 0)
    assert (forced["records"], forced["outputs"], forced["errors"]) == (27, 25, 2)
    seen = Counter(line["id"] for line in outputs_of(out))
    assert sorted(seen) == every_id and set(seen.values()) == {1}
    assert offline(workload="emb", spec=str(spec))["shards_skipped"] == 2


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def test_lanes_run_retry_errors_and_force_on_s3_csv(
    prefect_api: str,
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    cli: typer.Typer,
    strict_picky: Any,
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="tickets")
    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(["ticket_id", "subject", "body", "flaky"])
    writer.writerows([f"t{i}", text(i), text(i + 1), "yes" if i == 4 else ""] for i in range(12))
    s3.put_object(Bucket="tickets", Key="in/export.csv", Body=rows.getvalue().encode())
    workload = offline_workload(
        input="s3://tickets/in/",
        output="s3://tickets/out/",
        handler="tests.flows_fixtures:picky",
        fields={"id": "ticket_id", "text": "{subject} {body}"},
    )
    spec = write_spec(tmp_path, {"tickets": workload})

    def run(*flags: str) -> Any:
        return CliRunner().invoke(cli, ["run", "tickets", "--file", str(spec), *flags])

    def output_ids() -> list[str]:
        body = s3.get_object(Bucket="tickets", Key="out/export.jsonl")["Body"].read()
        return sorted(json.loads(line)["id"] for line in body.splitlines())

    first = run()
    assert first.exit_code == 3, first.output
    assert "11 outputs, 1 errors" in first.output and "--retry-errors" in first.output
    assert output_ids() == sorted(f"t{i}" for i in range(12) if i != 4)

    strict_picky.allow = True
    both = run("--retry-errors", "--force")
    assert both.exit_code == 2 and "choose one" in both.output
    retried = run("--retry-errors")
    assert retried.exit_code == 0, retried.output
    assert "1 records, 1 answered now" in retried.output
    assert output_ids() == sorted(f"t{i}" for i in range(12))
    errors = s3.get_object(Bucket="tickets", Key="out/_errors/export.jsonl")["Body"].read()
    assert errors == b""
    forced = run("--force")
    assert forced.exit_code == 0 and "1 run, 0 already done" in forced.output
    assert output_ids() == sorted(f"t{i}" for i in range(12))
