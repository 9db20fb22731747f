"""Where an offline job reads and writes: never outside its input and output.

Output names come from input names safely (S3 keys with `//`, names that would meet),
an input override must lie under the workload's input or an allowed root, a
read-only output is one line, and a killed run's staging files go with the next run.
Under Prefect's test harness, on tiny real models; S3 through a moto server over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from lanes.errors import InvalidInput, JobFailed, PermanentStorageError, StorageError
from lanes.flows.batch import offline
from lanes.flows.job import plan_job, plan_shards
from lanes.flows.records import output_name
from lanes.flows.shard import run_shard
from lanes.flows.shard_task import loaded_model, shard
from lanes.layout import ERRORS, MARKERS, RUNNING
from lanes.router.offline_cli import run as run_command
from lanes.settings import Settings
from lanes.storage import Storage
from tests.flows_fixtures import (
    moto_server,
    read_jsonl,
    read_only,
    s3_env,
    staging_writer,
    write_jsonl,
    write_spec,
)

ROOT = Path(__file__).resolve().parent.parent


def workload(**fields: Any) -> dict[str, Any]:
    base = {"mode": "offline", "task": "infer", "model": "affine", "input": "in/"}
    return {**base, "output": "out/", "batch_size": 4, "retries": 0, **fields}


def records(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "x": [[i, 0, 0, 0]]} for i in range(n)]


def lanes_run(*args: str) -> Any:
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)  # two commands: typer then wants the command's name
    return CliRunner().invoke(app, ["run", *args])


def files_under(folder: Path) -> dict[str, int]:
    """Every file below `folder` and its number of lines."""
    return {
        p.relative_to(folder).as_posix(): len(p.read_bytes().splitlines())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


# ---- output names -------------------------------------------------------------------------


def test_output_names_stay_relative_and_below_the_output() -> None:
    assert output_name("part-0.jsonl") == "part-0.jsonl"
    assert output_name("sub/part.parquet") == "sub/part.jsonl"
    assert output_name("/tmp/x/evil.jsonl.gz") == "tmp/x/evil.jsonl"
    assert output_name("a//b///c.ndjson") == "a/b/c.jsonl"
    # A file named as the input itself (one part) is read whatever its name; its output
    # is no bookkeeping name, which listings of the output would skip.
    assert output_name("_x.jsonl") == "x.jsonl" and output_name(".h.csv") == "h.jsonl"
    for name in ("../x.jsonl", "a/../../x.jsonl", "./a.jsonl", "_errors/a.jsonl", "a/.h.jsonl"):
        with pytest.raises(StorageError, match="cannot name an output"):
            output_name(name)
    with pytest.raises(StorageError, match="it is empty"):
        output_name("//")


def test_an_s3_key_with_a_double_slash_stays_inside_a_local_output(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`corpus//<abs path>` lists as the name `/<abs path>`: once written outside the
    output, with its errors file over its output and a manifest that did not say so."""
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="lanes-in")
    victim = tmp_path / "victim" / "evil.jsonl"
    lines = [*map(json.dumps, records("e", 3)), "{not json"]
    s3.put_object(Bucket="lanes-in", Key=f"corpus/{victim}", Body="\n".join(lines).encode())
    good = "\n".join(map(json.dumps, records("g", 2))).encode()
    s3.put_object(Bucket="lanes-in", Key="corpus/good.jsonl", Body=good)
    # One bad line in six: above the default max_error_rate, and fine here.
    aff = workload(input="s3://lanes-in/corpus/", max_error_rate=0.5)
    spec = write_spec(tmp_path / "project", {"aff": aff})
    out = tmp_path / "out"
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", json.dumps([str(out)]))

    result = lanes_run("aff", "--file", str(spec), "--output", str(out))

    assert result.exit_code == 3, result.output  # finished, one record rejected
    assert not victim.parent.exists(), "written outside the output folder"
    inside = victim.relative_to("/").with_suffix(".jsonl").as_posix()
    on_disk = files_under(out)
    assert on_disk[inside] == 3 and on_disk[f"_errors/{inside}"] == 1
    assert on_disk["good.jsonl"] == 2 and on_disk["_errors/good.jsonl"] == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert (manifest["outputs"], manifest["errors"]) == (5, 1)
    for stats in manifest["shard_stats"]:
        assert Path(stats["output"]).is_relative_to(out), stats
        assert stats["outputs"] == len(read_jsonl(Path(stats["output"])))
        assert stats["errors"] == len(read_jsonl(Path(stats["errors_file"])))
    assert "5 outputs, 1 errors" in result.output


def test_inputs_that_would_write_one_file_are_refused_naming_both(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="lanes-in")
    twice = tmp_path / "v" / "a.jsonl"
    for key in (f"corpus{twice}", f"corpus/{twice}"):  # corpus/tmp/... and corpus//tmp/...
        s3.put_object(Bucket="lanes-in", Key=key, Body=json.dumps(records("a", 1)[0]).encode())
    spec = write_spec(tmp_path / "project", {"aff": workload(input="s3://lanes-in/corpus/")})
    out = tmp_path / "out"
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", json.dumps([str(out)]))
    with pytest.raises(StorageError) as caught:
        offline(workload="aff", spec=str(spec), output=str(out))
    message = str(caught.value)
    assert f"s3://lanes-in/corpus/{twice} and s3://lanes-in/corpus{twice} would both" in message
    assert not twice.exists() and not any(out.rglob("*.jsonl"))


@pytest.mark.parametrize(
    ("first", "second", "clash"),
    [
        ("a.jsonl.gz", "a.jsonl/b.jsonl", "the file a.jsonl and"),  # output file vs folder
        ("a.jsonl", "a.json/b.jsonl", "the file _committed/a.json and"),  # their markers
        ("a.jsonl", "a.parquet", "would both write a.jsonl"),
    ],
)
def test_a_file_one_shard_writes_is_never_a_file_or_folder_of_another(
    tmp_path: Path, first: str, second: str, clash: str
) -> None:
    spec = write_spec(tmp_path, {"aff": workload()})
    for name in (first, second):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(b"")
    settings = Settings()
    job = plan_job("aff", spec, settings)
    with pytest.raises(StorageError, match=clash) as caught:
        plan_shards(job, Storage(settings))
    assert str(tmp_path / "in" / first) in str(caught.value)
    assert str(tmp_path / "in" / second) in str(caught.value)


def test_an_input_file_named_itself_is_read_whatever_its_name(
    prefect_api: str, tmp_path: Path
) -> None:
    """Listings skip `_*` files, as Spark skips `_SUCCESS`: in a folder or glob. A file
    the input names itself is the user's choice, not bookkeeping."""
    spec = write_spec(tmp_path, {"aff": workload(input="in/_x.jsonl")})
    write_jsonl(tmp_path / "in" / "_x.jsonl", records("x", 2))
    summary = offline(workload="aff", spec=str(spec))
    assert (summary["shards_run"], summary["outputs"]) == (1, 2)
    assert [line["id"] for line in read_jsonl(tmp_path / "out" / "x.jsonl")] == ["x0", "x1"]


# ---- inputs -------------------------------------------------------------------------------


def test_an_input_outside_the_workloads_is_refused_unless_a_setting_allows_it(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    spec = write_spec(project, {"aff": workload()})
    write_jsonl(project / "in" / "sub" / "a.jsonl", records("in", 2))
    write_jsonl(tmp_path / "elsewhere" / "secret.jsonl", records("secret", 3))
    pattern = "../elsewhere/*.jsonl"  # relative: read against the spec's folder

    with pytest.raises(
        InvalidInput, match=r"/\.\./elsewhere/\*\.jsonl \(\S*/elsewhere/\*\.jsonl\) is outside"
    ):
        offline(workload="aff", spec=str(spec), input=pattern)
    refused = lanes_run("aff", "--file", str(spec), "--input", str(tmp_path / "elsewhere"))
    assert refused.exit_code == 2, refused.output
    assert "is outside what this workload reads" in refused.output
    assert "LANES_ALLOWED_INPUT_ROOTS" in refused.output
    assert not (project / "out").exists()

    # Under the workload's own input: as before.
    assert offline(workload="aff", spec=str(spec), input="in/sub/")["outputs"] == 2
    # A root the setting allows (and an output beside the workload's, read against the
    # spec's folder as the input is).
    monkeypatch.setenv("LANES_ALLOWED_INPUT_ROOTS", json.dumps([str(tmp_path / "elsewhere")]))
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", '["out-2/"]')
    summary = offline(workload="aff", spec=str(spec), input=pattern, output="out-2/")
    assert summary["outputs"] == 3


def linked_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project whose `uploads/` folder beside it is allowed, and a `secret/` folder
    that no root allows."""
    spec = write_spec(tmp_path / "project", {"aff": workload()})
    write_jsonl(tmp_path / "project" / "in" / "a.jsonl", records("in", 1))
    write_jsonl(tmp_path / "uploads" / "mine.jsonl", records("mine", 2))
    write_jsonl(tmp_path / "secret" / "keys.jsonl", records("secret", 3))
    monkeypatch.setenv("LANES_ALLOWED_INPUT_ROOTS", json.dumps([str(tmp_path / "uploads")]))
    return spec


def test_a_given_input_never_reads_through_a_link_out_of_its_roots(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link inside an allowed folder (a shared upload folder) to a file, or to a
    folder, outside every root fails the job before any record is read or written."""
    spec = linked_project(tmp_path, monkeypatch)
    uploads, secret = tmp_path / "uploads", tmp_path / "secret"
    (uploads / "stolen.jsonl").symlink_to(secret / "keys.jsonl")
    (uploads / "sub").symlink_to(secret)
    linked = [
        f"{uploads}/stolen.jsonl ({secret}/keys.jsonl)",
        f"{uploads}/sub/keys.jsonl ({secret}/keys.jsonl)",
    ]
    with pytest.raises(InvalidInput) as caught:
        offline(workload="aff", spec=str(spec), input=str(uploads))
    message = str(caught.value)
    assert f"{', '.join(linked)}: a symbolic link to a file outside" in message
    assert "mine.jsonl" not in message and "LANES_ALLOWED_INPUT_ROOTS" in message
    refused = lanes_run("aff", "--file", str(spec), "--input", f"{uploads}/**/*.jsonl")
    assert refused.exit_code == 2, refused.output
    assert f"{', '.join(linked)}: a symbolic link" in refused.output
    # Nothing but the lock a run holds on its output while it runs (lanes.runlock).
    assert files_under(tmp_path / "project" / "out") == {"_running": 0}


def test_links_inside_the_roots_and_the_operators_own_still_read(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link between allowed folders reads; so does a link the operator put in the
    workload's own input, run as declared. Given as a job's input, that folder reads
    the link only once a root allows its target."""
    spec = linked_project(tmp_path, monkeypatch)
    project = tmp_path / "project"
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", '["out-2/", "out-3/"]')
    (tmp_path / "uploads" / "ours.jsonl").symlink_to(project / "in" / "a.jsonl")
    summary = offline(workload="aff", spec=str(spec), input=str(tmp_path / "uploads"))
    assert summary["outputs"] == 3
    (project / "in" / "corpus").symlink_to(tmp_path / "secret")
    assert offline(workload="aff", spec=str(spec), output="out-2/")["outputs"] == 4
    with pytest.raises(InvalidInput, match=r"in/corpus/keys\.jsonl \(\S*/secret/keys\.jsonl\)"):
        offline(workload="aff", spec=str(spec), input="in/", output="out-3/")


def test_a_link_swapped_in_after_planning_fails_its_shard_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file is judged as the job lists it and again as its shard opens it: a file, or
    a folder above it, replaced by a link out of the roots after planning is not read."""
    spec = linked_project(tmp_path, monkeypatch)
    uploads, secret = tmp_path / "uploads", tmp_path / "secret"
    write_jsonl(uploads / "sub" / "keys.jsonl", records("sub", 1))
    settings = Settings()
    storage = Storage(settings)
    job = plan_job("aff", spec, settings, input=str(uploads))
    plans = plan_shards(job, storage)
    assert [plan.input.name for plan in plans] == ["mine.jsonl", "sub/keys.jsonl"]
    (uploads / "mine.jsonl").unlink()
    (uploads / "mine.jsonl").symlink_to(secret / "keys.jsonl")
    (uploads / "sub").rename(tmp_path / "sub-was")
    (uploads / "sub").symlink_to(secret)
    model = loaded_model(job, settings)
    for plan in plans:
        with pytest.raises(PermanentStorageError) as caught:
            run_shard(plan, model, storage, job.batch_size, job.max_record_bytes, job.max_inputs)
        assert f"{plan.input.uri}: now a symbolic link to {secret}/keys.jsonl, outside" in str(
            caught.value
        )
    assert files_under(tmp_path / "project" / "out") == {}


# ---- outputs ------------------------------------------------------------------------------


def submitted_project(tmp_path: Path) -> Path:
    """A project whose workload writes `out/`, with a job's records staged as `submit`
    stages them (in/_submitted/<key>/), and an `elsewhere/` folder beside it."""
    spec = write_spec(tmp_path / "project", {"aff": workload()})
    write_jsonl(
        tmp_path / "project" / "in" / "_submitted" / "k1" / "records.jsonl", records("j", 2)
    )
    (tmp_path / "elsewhere").mkdir()
    return spec


def test_a_flow_run_writing_outside_the_workloads_output_is_refused_unwritten(
    prefect_api: str, tmp_path: Path
) -> None:
    """Whoever creates a flow run names its output; the worker writes it with its own
    credentials. Outside the workload's output folder, nothing is written at all."""
    spec = submitted_project(tmp_path)
    staged, elsewhere = "in/_submitted/k1/", tmp_path / "elsewhere"
    with pytest.raises(InvalidInput) as caught:
        offline(workload="aff", spec=str(spec), input=staged, output=f"{elsewhere}/")
    message = str(caught.value)
    assert f"output {elsewhere}/ is outside where this workload writes (" in message
    assert str(tmp_path / "project" / "out") in message and "LANES_ALLOWED_OUTPUT_ROOTS" in message
    refused = lanes_run("aff", "--file", str(spec), "--output", str(elsewhere / "run"))
    assert refused.exit_code == 2, refused.output
    assert "is outside where this workload writes" in refused.output
    assert "LANES_ALLOWED_OUTPUT_ROOTS" in refused.output
    assert files_under(elsewhere) == {} and not (tmp_path / "project" / "out").exists()


def test_an_output_under_the_workloads_output_or_an_allowed_root_is_written(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `submit` writes (<output>/jobs/<key>/) is the workload's own; a folder
    elsewhere only once LANES_ALLOWED_OUTPUT_ROOTS allows it."""
    spec = submitted_project(tmp_path)
    staged, elsewhere = "in/_submitted/k1/", tmp_path / "elsewhere"
    summary = offline(workload="aff", spec=str(spec), input=staged, output="out/jobs/k1/")
    assert summary["outputs"] == 2
    assert files_under(tmp_path / "project" / "out" / "jobs" / "k1")["records.jsonl"] == 2
    with pytest.raises(InvalidInput, match="LANES_ALLOWED_OUTPUT_ROOTS"):
        offline(workload="aff", spec=str(spec), input=staged, output=str(elsewhere / "k1"))
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", json.dumps([str(elsewhere)]))
    summary = offline(workload="aff", spec=str(spec), input=staged, output=str(elsewhere / "k1"))
    assert summary["outputs"] == 2 and files_under(elsewhere)["k1/records.jsonl"] == 2


def test_an_output_spelt_out_of_the_workloads_output_is_refused(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`..` leads out of a local output folder once resolved; S3 keeps `..` as a key, but
    an HTTP layer may collapse it, so an s3:// output may not hold one at all."""
    spec = submitted_project(tmp_path)
    staged, project = "in/_submitted/k1/", tmp_path / "project"
    for output in ("out/jobs/../../../elsewhere/", f"{project}/out/../elsewhere/"):
        with pytest.raises(InvalidInput, match="is outside where this workload writes"):
            offline(workload="aff", spec=str(spec), input=staged, output=output)
    assert files_under(tmp_path / "elsewhere") == {} and not (project / "elsewhere").exists()

    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="lanes-out")
    spec = write_spec(project, {"aff": workload(output="s3://lanes-out/out/")})
    with pytest.raises(InvalidInput, match=r"output s3://lanes-out/out/\.\./secret/: an s3:// URI"):
        offline(
            workload="aff", spec=str(spec), input=staged, output="s3://lanes-out/out/../secret/"
        )
    assert "Contents" not in s3.list_objects_v2(Bucket="lanes-out")


def test_an_output_folder_linked_out_of_the_workloads_output_is_refused(
    prefect_api: str, tmp_path: Path
) -> None:
    """A job's output folder made a link to another folder before the run is judged by
    where it leads, not by its name."""
    spec = submitted_project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "project" / "out" / "jobs").mkdir(parents=True)
    (tmp_path / "project" / "out" / "jobs" / "k1").symlink_to(elsewhere)
    with pytest.raises(InvalidInput) as caught:
        offline(workload="aff", spec=str(spec), input="in/_submitted/k1/", output="out/jobs/k1/")
    assert f"out/jobs/k1/ ({elsewhere}/) is outside where this workload writes" in str(caught.value)
    assert files_under(elsewhere) == {}


# ---- writing ------------------------------------------------------------------------------


def test_a_read_only_output_is_one_line_for_lanes_run_and_for_a_job(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"aff": workload()})
    write_jsonl(tmp_path / "in" / "a.jsonl", records("a", 2))
    out = tmp_path / "out"
    assert offline(workload="aff", spec=str(spec))["outputs"] == 2  # its folders exist now
    write_jsonl(tmp_path / "in" / "b.jsonl", records("b", 2))  # a new shard to write
    before = files_under(out)

    with read_only(out):
        # The `lanes` command as a person runs it, on this session's Prefect server.
        env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "lanes.router.cli", "run", "aff", "--file", str(spec)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        state = offline(workload="aff", spec=str(spec), return_state=True)

    printed = done.stdout + done.stderr
    assert done.returncode == 1, printed
    assert "Traceback" not in printed and "OSError" not in printed, printed
    (line,) = [x for x in printed.splitlines() if x.startswith("error:")]
    assert str(out) in line and "cannot write in the output folder" in line
    assert "make it writable, or choose another output (--output" in line
    # A job is a flow run: the message its Job reports is that same one line.
    assert state.is_failed() and state.message is not None
    assert "\n" not in state.message and "StorageError" in state.message
    assert line.removeprefix("error: ") in state.message
    assert files_under(out) == before


def test_the_next_run_removes_a_killed_runs_staging_files(prefect_api: str, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"aff": workload()})
    write_jsonl(tmp_path / "in" / "a.jsonl", records("a", 2))
    with staging_writer(str(tmp_path / "out" / "a.jsonl")) as (killed, left):
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
    assert left.exists()
    assert offline(workload="aff", spec=str(spec))["outputs"] == 2
    assert not left.exists()
    assert sorted(files_under(tmp_path / "out")) == [
        "_committed/a.json",
        "_errors/a.jsonl",
        "_manifest.json",
        *[f"_manifests/{p.name}" for p in (tmp_path / "out" / "_manifests").iterdir()],
        "_running",
        "a.jsonl",
    ]


# ---- links inside an output ---------------------------------------------------------------


def two_shards(tmp_path: Path) -> Path:
    """A project reading in/a.jsonl and in/sub/b.jsonl into out/, and an `elsewhere/`
    folder beside it that no root allows."""
    spec = write_spec(tmp_path, {"aff": workload()})
    write_jsonl(tmp_path / "in" / "a.jsonl", records("a", 2))
    write_jsonl(tmp_path / "in" / "sub" / "b.jsonl", records("b", 2))
    (tmp_path / "elsewhere").mkdir()
    return spec


@pytest.mark.parametrize(("link", "failed"), [(f"{ERRORS}/sub", 1), (MARKERS, 2)])
def test_a_link_planted_in_the_output_fails_the_shards_it_would_take_out(
    prefect_api: str, tmp_path: Path, link: str, failed: int
) -> None:
    """Whoever may write in a shared output folder can make a folder there a link out of
    it: the shards that would write through it fail, naming it, and write nothing where
    it leads; the others commit as ever."""
    spec = two_shards(tmp_path)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / link).parent.mkdir(parents=True, exist_ok=True)
    (out / link).symlink_to(elsewhere)
    with pytest.raises(JobFailed) as caught:
        offline(workload="aff", spec=str(spec))
    message = str(caught.value)
    assert f"{failed} of 2 shards failed" in message
    assert f"{out / link} is a symbolic link to {elsewhere}, outside this job's output" in message
    assert files_under(elsewhere) == {}
    written = files_under(out)
    if failed == 1:
        assert written["a.jsonl"] == 2 and "_committed/a.json" in written
    assert "_committed/sub/b.json" not in written


def test_a_run_lock_linked_out_of_the_output_is_refused_untouched(
    prefect_api: str, tmp_path: Path
) -> None:
    """The run's lock file made a link to a file elsewhere: opening it to write would
    truncate that file."""
    spec = two_shards(tmp_path)
    out, notes = tmp_path / "out", tmp_path / "elsewhere" / "notes.txt"
    notes.write_text("keep\n")
    out.mkdir()
    (out / RUNNING).symlink_to(notes)
    with pytest.raises(PermanentStorageError) as caught:
        offline(workload="aff", spec=str(spec))
    assert f"{out / RUNNING} is a symbolic link to {notes}, outside" in str(caught.value)
    assert notes.read_text() == "keep\n" and [p.name for p in out.iterdir()] == [RUNNING]


def test_an_output_linked_away_after_planning_is_not_written(tmp_path: Path) -> None:
    """A job's output is judged by its real path where the job is planned; a shard
    writes only where that leads, whatever was swapped in since. The workload's own
    output may itself be a link (an operator's data disk): its real folder is written."""
    spec = two_shards(tmp_path)
    disk, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    (disk / "out").mkdir(parents=True)
    (tmp_path / "out").symlink_to(disk / "out")
    settings = Settings()
    job = plan_job("aff", spec, settings)
    plans = plan_shards(job, Storage(settings))
    shard.fn(job, plans[0], settings)
    assert sorted(files_under(disk / "out")) == ["_committed/a.json", "_errors/a.jsonl", "a.jsonl"]
    (tmp_path / "out").unlink()
    (tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(PermanentStorageError) as caught:
        shard.fn(job, plans[1], settings)
    assert f"{tmp_path / 'out'} is a symbolic link to {elsewhere}, outside" in str(caught.value)
    assert files_under(elsewhere) == {}


def committed_with_an_error(tmp_path: Path) -> tuple[Path, Path]:
    """A project whose in/a.jsonl committed with one rejected record (so that
    --retry-errors reruns it), and a secret file beside it that no root allows."""
    spec = write_spec(tmp_path, {"aff": workload(max_error_rate=0.5)})
    write_jsonl(tmp_path / "in" / "a.jsonl", [*records("a", 2), "{not json"])
    assert offline(workload="aff", spec=str(spec))["total_errors"] == 1
    secret = tmp_path / "secret" / "keys.jsonl"
    write_jsonl(secret, [{"id": "stolen", "key": "SECRET-KEY-1"}])
    return spec, secret


def holds_secret(folder: Path) -> bool:
    """Whether a file of `folder` (not a link planted there) holds the secret."""
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return any(b"SECRET-KEY-1" in p.read_bytes() for p in files)


@pytest.mark.parametrize("name", ["a.jsonl", f"{ERRORS}/a.jsonl"])
def test_a_retry_never_reads_a_committed_file_made_a_link_out_of_the_output(
    prefect_api: str, tmp_path: Path, name: str
) -> None:
    """--retry-errors copies a shard's old output into its new one: its output (or
    errors file) made a link to a file elsewhere would copy that file into an output
    whoever planted the link may read. The shard fails naming the link, unread."""
    spec, secret = committed_with_an_error(tmp_path)
    out = tmp_path / "out"
    (out / name).unlink()
    (out / name).symlink_to(secret)
    with pytest.raises(JobFailed) as caught:
        offline(workload="aff", spec=str(spec), rerun="errors")
    assert f"{out / name} is a symbolic link to {secret}, outside this job's output" in str(
        caught.value
    )
    assert "nothing was read from it" in str(caught.value)
    assert (out / name).is_symlink() and not holds_secret(out)


@pytest.mark.parametrize("marker", ["a.json", "other.json"])
def test_a_commit_marker_made_a_link_out_of_the_output_is_refused_unread(
    prefect_api: str, tmp_path: Path, marker: str
) -> None:
    """The run reads its shards' commit markers (and any other in `_committed`, to
    find another job's): one made a link to a file elsewhere is refused, and nothing
    of that file shows, in the output or in the message."""
    spec, _ = committed_with_an_error(tmp_path)
    out = tmp_path / "out"
    secret = tmp_path / "secret" / "marker.json"
    secret.write_text(json.dumps({"input": "SECRET-KEY-1", "key": "SECRET-KEY-1"}))
    (out / MARKERS / marker).unlink(missing_ok=True)
    (out / MARKERS / marker).symlink_to(secret)
    with pytest.raises(PermanentStorageError) as caught:
        offline(workload="aff", spec=str(spec), rerun="errors")
    message = str(caught.value)
    assert f"{out / MARKERS / marker} is a symbolic link to {secret}, outside" in message
    assert "SECRET-KEY-1" not in message and not holds_secret(out)


def test_links_within_the_output_are_read_where_they_lead(prefect_api: str, tmp_path: Path) -> None:
    """A committed output that is a link to a file inside the output is read as ever."""
    spec, _ = committed_with_an_error(tmp_path)
    out = tmp_path / "out"
    (out / "a.jsonl").rename(out / "kept.jsonl")
    (out / "a.jsonl").symlink_to(out / "kept.jsonl")
    retried = offline(workload="aff", spec=str(spec), rerun="errors")
    assert (retried["shards_retried"], retried["total_outputs"]) == (1, 2)
    assert sorted(line["id"] for line in read_jsonl(out / "a.jsonl")) == ["a0", "a1"]
