"""Failures that tell the truth, end to end under Prefect's test harness: records in
the wrong shape fail a run before any shard runs, a shard over its max_error_rate
fails uncommitted and unretried, as does one whose input is corrupt (a cut .gz or
Parquet file), denied (S3's 403, a moto server's IAM policy; a file's mode) or deleted
after the listing, record errors under it end CompletedWithErrors with `lanes run`
exiting 3, and --retry-errors / --force rerun exactly what they say, each id once,
locally and on S3 through a moto server."""

from __future__ import annotations

import csv
import gzip
import io
import json
import shlex
import shutil
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from lanes.errors import AuthError, JobFailed, PermanentStorageError, StorageError
from lanes.flows import shard_task
from lanes.flows.batch import offline
from lanes.flows.shard import TooManyErrors
from lanes.router.offline_cli import run as run_command
from tests.flows_fixtures import (
    errors_of,
    moto_server,
    outputs_of,
    picky,
    ran_where_modes_bind,
    read_jsonl,
    s3_env,
    text,
    vanishing,
    write_jsonl,
    write_spec,
)


def offline_workload(**fields: Any) -> dict[str, Any]:
    base = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/", "output": "out/"}
    return {**base, "batch_size": 8, "retries": 0, **fields}


def attempts(flow_run: str) -> dict[str, int]:
    """How many times each shard task of the flow run ran (1: no retry)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run)]))
        )
    return {run.name: run.run_count for run in runs}


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
        {
            "tickets": offline_workload(),
            "fixed": offline_workload(output="fixed/", fields={"id": "ticket_id"}),
        },
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


def test_generate_records_without_a_prompt_fail_the_run_before_any_shard(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"answers": offline_workload(task="generate", model="dec")})
    write_jsonl(tmp_path / "in" / "part-0.jsonl", [{"id": i, "question": "why"} for i in range(9)])

    state = offline(workload="answers", spec=str(spec), return_state=True)

    assert state.is_failed()
    message = state.message or ""
    assert "validating the records: 9 of the 9 checked" in message and "no shard ran" in message
    assert 'line 1: missing field "prompt"' in message
    assert "set the workload's `fields.prompt`" in message
    assert not (tmp_path / "out" / "_committed").exists()


def test_a_shard_over_its_max_error_rate_fails_uncommitted_and_is_not_retried(
    prefect_api: str, tmp_path: Path
) -> None:
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
    assert "line 1: text: expected a string, found 0" in message
    out = tmp_path / "out"
    assert (out / "_committed" / "good.json").exists() and (out / "good.jsonl").exists()
    assert not (out / "_committed" / "bad.json").exists()
    assert not (out / "bad.jsonl").exists() and not (out / "_errors" / "bad.jsonl").exists()
    manifest = json.loads((out / "_manifest.json").read_text())
    # retries: 2, unused
    assert attempts(manifest["flow_run"]) == {"shard good.jsonl": 1, "shard bad.jsonl": 1}

    write_jsonl(
        tmp_path / "in" / "bad.jsonl", [{"id": f"b{i}", "text": text(i)} for i in range(40)]
    )
    again = offline(workload="emb", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"], again["total_outputs"]) == (1, 1, 60)


def test_a_corrupt_gzip_or_parquet_shard_fails_at_once_and_the_others_commit(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"emb": offline_workload(retries=2)})
    records = {name: [{"id": f"{name}{i}", "text": text(i)} for i in range(20)] for name in "gcp"}
    write_jsonl(tmp_path / "in" / "good.jsonl", records["g"])
    lines = b"".join(orjson.dumps(r) + b"\n" for r in records["c"])
    whole_gz = gzip.compress(lines, mtime=0)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(records["p"]), sink)
    whole_parquet = sink.getvalue().to_pybytes()
    # Downloads cut short: the same bytes fail the same way on every attempt.
    (tmp_path / "in" / "cut.jsonl.gz").write_bytes(whole_gz[: len(whole_gz) // 2])
    (tmp_path / "in" / "torn.parquet").write_bytes(whole_parquet[: len(whole_parquet) // 2])

    with pytest.raises(JobFailed) as caught:
        offline(workload="emb", spec=str(spec))

    message = str(caught.value)
    assert "2 of 3 shards failed" in message and "the others are committed" in message
    assert f"{tmp_path / 'in' / 'cut.jsonl.gz'}: not a readable gzip file" in message
    assert f"{tmp_path / 'in' / 'torn.parquet'}: not a readable Parquet file" in message
    out = tmp_path / "out"
    manifest = json.loads((out / "_manifest.json").read_text())
    assert attempts(manifest["flow_run"]) == {  # retries: 2, none taken
        "shard good.jsonl": 1,
        "shard cut.jsonl": 1,
        "shard torn.jsonl": 1,
    }
    assert [p.name for p in (out / "_committed").iterdir()] == ["good.json"]

    (tmp_path / "in" / "cut.jsonl.gz").write_bytes(whole_gz)
    (tmp_path / "in" / "torn.parquet").write_bytes(whole_parquet)
    again = offline(workload="emb", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"], again["total_outputs"]) == (2, 1, 60)


def test_a_shard_it_may_not_read_fails_at_once_and_the_others_commit(
    prefect_api: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not ran_where_modes_bind(request, tmp_path):
        return
    spec = write_spec(tmp_path, {"emb": offline_workload(retries=2)})
    for name in ("good", "locked"):
        write_jsonl(
            tmp_path / "in" / f"{name}.jsonl",
            [{"id": f"{name}{i}", "text": text(i)} for i in range(10)],
        )
    locked = tmp_path / "in" / "locked.jsonl"
    locked.chmod(0)
    try:
        with pytest.raises(JobFailed) as caught:
            offline(workload="emb", spec=str(spec))
    finally:
        locked.chmod(0o644)

    message = str(caught.value)
    assert "1 of 2 shards failed" in message and "the others are committed" in message
    assert f"{locked}: permission denied reading it; give the user lanes runs as read" in message
    assert f"chmod a+r {locked}" in message
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    # retries: 2, none taken: a retry would meet the same mode bits
    assert attempts(manifest["flow_run"]) == {"shard good.jsonl": 1, "shard locked.jsonl": 1}

    again = offline(workload="emb", spec=str(spec))  # readable now: that shard alone
    assert (again["shards_run"], again["shards_skipped"], again["total_outputs"]) == (1, 1, 20)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_shard_deleted_after_the_listing_fails_at_once_and_a_rerun_loses_nothing(
    prefect_api: str,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = {name: [{"id": f"{name}{i}", "text": text(i)} for i in range(10)] for name in "ab"}
    bodies = {n: b"".join(orjson.dumps(r) + b"\n" for r in rs) for n, rs in records.items()}
    if where == "s3":
        s3 = s3_env(monkeypatch, request.getfixturevalue("s3_endpoint"))
        s3.create_bucket(Bucket="corpus")
        paths = {"input": "s3://corpus/in/", "output": "s3://corpus/out/"}

        def put(name: str) -> None:
            s3.put_object(Bucket="corpus", Key=f"in/{name}.jsonl", Body=bodies[name])

        def delete_b() -> None:
            s3.delete_object(Bucket="corpus", Key="in/b.jsonl")

        def manifest() -> Any:
            return json.loads(
                s3.get_object(Bucket="corpus", Key="out/_manifest.json")["Body"].read()
            )
    else:
        paths = {"input": "in/", "output": "out/"}

        def put(name: str) -> None:
            (tmp_path / "in").mkdir(exist_ok=True)
            (tmp_path / "in" / f"{name}.jsonl").write_bytes(bodies[name])

        def delete_b() -> None:
            (tmp_path / "in" / "b.jsonl").unlink()

        def manifest() -> Any:
            return json.loads((tmp_path / "out" / "_manifest.json").read_text())

    put("a")
    put("b")
    # One shard at a time, in name order: a's first record deletes b, listed already.
    workload = offline_workload(
        retries=2,
        handler="tests.flows_fixtures:vanishing",
        runner={"kind": "local", "max_concurrent_shards": 1},
        **paths,
    )
    spec = write_spec(tmp_path, {"emb": workload})
    vanishing.vanish = delete_b
    try:
        with pytest.raises(JobFailed) as caught:
            offline(workload="emb", spec=str(spec))
    finally:
        vanishing.vanish = None

    b_uri = "s3://corpus/in/b.jsonl" if where == "s3" else str(tmp_path / "in" / "b.jsonl")
    message = str(caught.value)
    assert "1 of 2 shards failed" in message and "the others are committed" in message
    assert f"{b_uri}: no longer there: deleted or moved after the run listed its input" in message
    assert "run the workload again to list it anew" in message
    # retries: 2, none taken: a retry reads the same name its plan holds
    assert attempts(manifest()["flow_run"]) == {"shard a.jsonl": 1, "shard b.jsonl": 1}

    gone = offline(workload="emb", spec=str(spec))  # listed anew: b is not there
    assert (gone["shards_run"], gone["shards_skipped"], gone["total_outputs"]) == (0, 1, 10)
    put("b")  # back: its records are answered, once, and a's are not redone
    back = offline(workload="emb", spec=str(spec))
    assert (back["shards_run"], back["shards_skipped"], back["total_outputs"]) == (1, 1, 20)


def test_only_a_failure_that_would_repeat_skips_a_shards_retries() -> None:
    from prefect.states import Failed

    def retried(error: Exception) -> bool:
        return shard_task.worth_retrying(shard_task.shard, None, Failed(data=error))

    assert not retried(PermanentStorageError("s3://b/a.jsonl: access denied (AccessDenied)"))
    assert not retried(TooManyErrors("20 of 40 records rejected"))
    assert not retried(AuthError("the endpoint refused the batch: missing or wrong internal key"))
    assert retried(StorageError("s3://b/a.jsonl: cannot read on S3: SlowDown: reduce your rate"))
    assert retried(RuntimeError("the model's device went away"))


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
    assert "1 record was rejected:" in done.output and "--retry-errors" in done.output
    assert "9 outputs" in done.output


def test_a_jobs_rejected_records_are_rerun_by_the_command_its_message_names(
    prefect_api: str, tmp_path: Path, cli: typer.Typer, strict_picky: Any
) -> None:
    workload = offline_workload(handler="tests.flows_fixtures:picky", max_error_rate=0.5)
    spec = write_spec(tmp_path, {"emb": workload})
    write_jsonl(tmp_path / "in" / "own.jsonl", [{"id": "own", "text": text(0)}])
    staged = tmp_path / "in" / "_submitted" / "k1"  # as client.submit stages a job's records
    records = [{"id": f"r{i}", "text": text(i), "flaky": i == 2} for i in range(4)]
    write_jsonl(staged / "records.jsonl", records)
    output = tmp_path / "out" / "jobs" / "k1"

    state = offline(
        workload="emb", spec=str(spec), input=f"{staged}/", output=f"{output}/", return_state=True
    )

    assert state.name == "CompletedWithErrors"
    message = state.message or ""
    # The job's own input and output, not the workload's (`lanes run --retry-errors`).
    command = message.split("rerun them with `", 1)[1].removesuffix("`")
    assert command.startswith(f"lanes run emb --file {spec} --input {staged}/ --output {output}/")
    assert command.endswith(" --retry-errors")
    strict_picky.allow = True  # fixed
    done = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert done.exit_code == 0, done.output
    assert sorted(line["id"] for line in outputs_of(output)) == ["r0", "r1", "r2", "r3"]
    assert not (tmp_path / "out" / "own.jsonl").exists()  # the workload's input: not run


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


def reader_keys(endpoint: str) -> dict[str, str]:
    """An IAM user's keys (moto's, read once its auth is on): it may list the corpus
    bucket and read in/open*, not in/secret*, and do anything in the results bucket."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint)
    iam.create_user(UserName="reader")
    allow = [
        ("s3:List*", "arn:aws:s3:::corpus"),
        ("s3:GetObject", "arn:aws:s3:::corpus/in/open*"),
        ("s3:*", "arn:aws:s3:::results"),
        ("s3:*", "arn:aws:s3:::results/*"),
    ]
    statements = [{"Effect": "Allow", "Action": a, "Resource": r} for a, r in allow]
    policy = {"Version": "2012-10-17", "Statement": statements}
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


def test_a_shard_denied_its_s3_input_fails_at_once_and_the_others_commit(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    for bucket in ("corpus", "results"):
        s3.create_bucket(Bucket=bucket)
    for name in ("open", "secret"):
        body = b"".join(
            orjson.dumps({"id": f"{name}{i}", "text": text(i)}) + b"\n" for i in range(10)
        )
        s3.put_object(Bucket="corpus", Key=f"in/{name}.jsonl", Body=body)
    workload = offline_workload(retries=2, input="s3://corpus/in/", output="s3://results/emb/")
    spec = write_spec(tmp_path, {"emb": workload})
    for name, value in reader_keys(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    reset_auth = f"{s3_endpoint}/moto-api/reset-auth"
    httpx.post(reset_auth, content=b"0", timeout=10).raise_for_status()  # the policy binds
    try:
        with pytest.raises(JobFailed) as caught:
            offline(workload="emb", spec=str(spec))
    finally:
        httpx.post(reset_auth, content=b"inf", timeout=10).raise_for_status()

    message = str(caught.value)
    assert "1 of 2 shards failed" in message and "the others are committed" in message
    assert "s3://corpus/in/secret.jsonl: access denied (AccessDenied) to read" in message
    raw = s3.get_object(Bucket="results", Key="emb/_manifest.json")["Body"].read()
    assert attempts(json.loads(raw)["flow_run"]) == {"shard open.jsonl": 1, "shard secret.jsonl": 1}
    listed = s3.list_objects_v2(Bucket="results", Prefix="emb/_committed/")["Contents"]
    assert [o["Key"] for o in listed] == ["emb/_committed/open.json"]

    again = offline(workload="emb", spec=str(spec))  # access granted: the denied shard alone
    assert (again["shards_run"], again["shards_skipped"], again["total_outputs"]) == (1, 1, 20)


def user_keys(endpoint: str, user: str, statements: list[dict[str, Any]]) -> dict[str, str]:
    """Keys of a new IAM user of moto's with `statements` as its policy."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint)
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": statements}
    iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


@pytest.mark.parametrize("shards", ["one fails", "all commit"])
def test_a_manifest_that_cannot_be_written_leaves_the_state_to_the_shards(
    prefect_api: str,
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    shards: str,
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    corpus, results = f"corpus-{len(shards)}", f"out-bucket-{len(shards)}"
    for bucket in (corpus, results):
        s3.create_bucket(Bucket=bucket)
    names = ["open", "secret"] if shards == "one fails" else ["open"]
    for name in names:
        body = b"".join(
            orjson.dumps({"id": f"{name}{i}", "text": text(i)}) + b"\n" for i in range(10)
        )
        s3.put_object(Bucket=corpus, Key=f"in/{name}.jsonl", Body=body)
    workload = offline_workload(input=f"s3://{corpus}/in/", output=f"s3://{results}/emb/")
    spec = write_spec(tmp_path, {"emb": workload})
    # The shards may read in/open* and write anything but the manifests.
    allow = [
        ("s3:List*", f"arn:aws:s3:::{corpus}"),
        ("s3:GetObject", f"arn:aws:s3:::{corpus}/in/open*"),
        ("s3:*", f"arn:aws:s3:::{results}"),
        ("s3:*", f"arn:aws:s3:::{results}/*"),
    ]
    statements = [{"Effect": "Allow", "Action": a, "Resource": r} for a, r in allow]
    deny = {
        "Effect": "Deny",
        "Action": "s3:PutObject",
        "Resource": f"arn:aws:s3:::{results}/emb/_manifest*",
    }
    for name, value in user_keys(
        s3_endpoint, shards.replace(" ", "-"), [*statements, deny]
    ).items():
        monkeypatch.setenv(name, value)
    reset_auth = f"{s3_endpoint}/moto-api/reset-auth"
    httpx.post(reset_auth, content=b"0", timeout=10).raise_for_status()  # the policy binds
    try:
        state = offline(workload="emb", spec=str(spec), return_state=True)
    finally:
        httpx.post(reset_auth, content=b"inf", timeout=10).raise_for_status()

    message = state.message or ""
    unwritten = (
        f"the manifest could not be written under s3://{results}/emb/ (s3://{results}/emb/_manifest"
    )
    assert unwritten in message and "access denied" in message, message
    if shards == "one fails":
        assert state.is_failed()
        assert "1 of 2 shards failed" in message and "the others are committed" in message
        assert f"s3://{corpus}/in/secret.jsonl: access denied (AccessDenied) to read" in message
    else:
        assert state.is_completed() and state.name == "Completed"
        assert message.startswith("10 records answered; the outputs are complete, but ")
        assert message.endswith(": run again to write it (every shard is skipped)")
    listed = s3.list_objects_v2(Bucket=results, Prefix="emb/")["Contents"]
    assert "emb/_committed/open.json" in [o["Key"] for o in listed]
    assert not [o["Key"] for o in listed if "_manifest" in o["Key"]]
