"""The offline flow under Prefect's test harness, on tiny real models.

Local files, Parquet and gzip, S3 through a moto server over HTTP, resume after a
SIGKILL, bad records, a broken model, and the Dask runner against the default one.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from lanes.errors import JobFailed, StorageError, WrongMode
from lanes.flows.batch import offline
from lanes.jobs import Job
from lanes.protocols.answers import (
    Choice,
    completion_response,
)
from lanes.protocols.openai import (
    embeddings_response,
)
from lanes.router.client_cli import job as job_command
from lanes.router.offline_cli import run as run_command
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tasks import load_task
from tests.flows_fixtures import (
    errors_of,
    moto_server,
    outputs_of,
    read_jsonl,
    s3_env,
    text,
    wait_until,
    write_jsonl,
    write_spec,
)
from tests.gates import GATE_FILE_ENV, held_marker

ROOT = Path(__file__).resolve().parent.parent


def offline_workload(task: str = "embed", **fields: Any) -> dict[str, Any]:
    model = {"embed": "enc", "infer": "affine", "generate": "dec"}[task]
    base = {"mode": "offline", "task": task, "model": model, "input": "in/", "output": "out/"}
    return {**base, "batch_size": 16, "retries": 0, **fields}


def embed_task(spec_file: Path, workload: str) -> Any:
    return load_task(workload, load_spec(spec_file, Settings()), Runtime(Settings(device="cpu")))


# ---- records and results ----------------------------------------------------------------


def test_embed_job_answers_plain_and_openai_lines_like_the_task(
    prefect_api: str, tmp_path: Path
) -> None:
    # A quarter of shard a is bad on purpose: allow it.
    spec = write_spec(tmp_path, {"emb": offline_workload(max_error_rate=0.5)})
    plain = [{"id": f"d{i}", "text": text(i)} for i in range(40)]
    openai = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "emb", "input": ["w1 w2 w3", "w4"], "encoding_format": "float"},
    }
    bad = [
        "{not json",
        {"text": "no id here"},
        {"id": "d-no-text"},
        {"id": "d-number", "text": 7},
        {"id": "d0", "text": "w1"},  # a duplicate id
        {**openai, "custom_id": "req-empty", "body": {"model": "emb", "input": []}},
        {**openai, "custom_id": "req-url", "url": "/v1/completions"},
    ]
    write_jsonl(tmp_path / "in" / "a.jsonl", [*plain[:20], openai, *bad])
    write_jsonl(tmp_path / "in" / "sub" / "b.jsonl", plain[20:])

    summary = offline(workload="emb", spec=str(spec))

    out = tmp_path / "out"
    lines = outputs_of(out)
    assert sorted(line.get("custom_id") or line["id"] for line in lines) == sorted(
        [p["id"] for p in plain] + ["req-1"]
    )
    task = embed_task(spec, "emb")
    by_id = {line["id"]: line for line in lines if "embedding" in line}
    for record in plain:
        (expected,) = task.run([task.prepare(record["text"])])
        np.testing.assert_allclose(by_id[record["id"]]["embedding"], expected, rtol=1e-5, atol=1e-6)
    (answer,) = [line for line in lines if line.get("custom_id") == "req-1"]
    items = [task.prepare(t) for t in openai["body"]["input"]]
    online = embeddings_response("emb", task.run(items), sum(i.n_tokens for i in items))
    assert answer["response"]["status_code"] == 200
    body = answer["response"]["body"]
    expected_body = orjson.loads(orjson.dumps(online, option=orjson.OPT_SERIALIZE_NUMPY))
    # Padded beside other texts, a vector may differ from the lone run in its last bits.
    vectors = [d.pop("embedding") for d in body["data"]]
    expected_vectors = [d.pop("embedding") for d in expected_body["data"]]
    assert body == expected_body
    np.testing.assert_allclose(vectors, expected_vectors, rtol=1e-5, atol=1e-6)
    assert answer["id"].startswith("batch_req_") and answer["error"] is None

    errors = {e["line"]: e for e in read_jsonl(out / "_errors" / "a.jsonl")}
    assert sorted(errors) == [22, 23, 24, 25, 26, 27, 28]
    assert errors[22]["id"] is None and errors[22]["error"].startswith("malformed JSON")
    assert 'missing field "id"' in errors[23]["error"]
    assert errors[24]["id"] == "d-no-text" and 'missing field "text"' in errors[24]["error"]
    assert errors[25]["error"] == "text: expected a string, found 7"
    assert errors[26]["error"] == "duplicate id 'd0': first on line 1"
    assert errors[27]["response"]["status_code"] == 400
    assert "expected at least one text" in errors[27]["response"]["body"]["error"]["message"]
    assert "is for task 'generate'" in errors[28]["error"]
    assert (out / "_errors" / "sub" / "b.jsonl").read_text() == ""

    assert summary["outputs"] == 41 and summary["errors"] == 7 and summary["shards_run"] == 2
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["provider"] == "CPUExecutionProvider"
    assert manifest["cost_estimate"] == pytest.approx(manifest["device_hours"] * 1.0)
    assert manifest["items_per_second"] > 0 and manifest["started_at"] < manifest["ended_at"]
    assert {s["input"] for s in manifest["shard_stats"]} == {
        str(tmp_path / "in" / "a.jsonl"),
        str(tmp_path / "in" / "sub" / "b.jsonl"),
    }
    assert len(list((out / "_manifests").glob("*.json"))) == 1


def test_generate_answers_completions_and_chat_lines(prefect_api: str, tmp_path: Path) -> None:
    workload = offline_workload(
        "generate", generation={"max_new_tokens": 8, "temperature": 0}, max_error_rate=0.5
    )
    spec = write_spec(tmp_path, {"gen": workload})
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/completions"}
    write_jsonl(
        tmp_path / "in" / "prompts.jsonl",
        [
            {**line, "body": {"model": "gen", "prompt": "a"}},
            {**line, "custom_id": "c2", "body": {"model": "gen", "prompt": "a", "max_tokens": 2}},
            {
                **line,
                "custom_id": "chat",
                "url": "/v1/chat/completions",
                "body": {"model": "gen", "messages": [{"role": "user", "content": "b"}]},
            },
            {**line, "custom_id": "two", "body": {"model": "gen", "prompt": ["a", "b"]}},
            {"id": "plain", "prompt": "c"},
        ],
    )
    summary = offline(workload="gen", spec=str(spec))
    assert (summary["outputs"], summary["errors"]) == (5, 0)
    lines = {line.get("custom_id") or line["id"]: line for line in outputs_of(tmp_path / "out")}
    body = lines["c1"]["response"]["body"]
    created = body["created"]
    id = f"cmpl-{lines['c1']['response']['request_id']}"
    # Three tokens shown and the eos that ended them, counted as vLLM counts it.
    assert body == completion_response(id, created, "gen", [Choice("b c d", "stop")], 1, 4)
    assert lines["c2"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    chat = lines["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "c d"}
    assert lines["plain"]["text"] == "d" and lines["plain"]["finish_reason"] == "stop"
    # A list of prompts: one choice each, in order, as the endpoint answers it.
    two = lines["two"]["response"]["body"]
    assert [(c["index"], c["text"]) for c in two["choices"]] == [(0, "b c d"), (1, "c d")]
    assert two["usage"] == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}


def test_text_over_max_length_is_an_error_line_unless_the_workload_truncates(
    prefect_api: str, tmp_path: Path
) -> None:
    words = [f"w{i % 60}" for i in range(300)]  # 302 tokens with [CLS] and [SEP]
    spec = write_spec(
        tmp_path,
        {
            "strict": offline_workload(max_error_rate=0.5),  # one record in two is too long
            "cut": offline_workload(truncate=True, output="cut/"),
        },
    )
    write_jsonl(
        tmp_path / "in" / "a.jsonl",
        [{"id": "short", "text": "w1 w2"}, {"id": "long", "text": " ".join(words)}],
    )
    offline(workload="strict", spec=str(spec))
    assert [line["id"] for line in outputs_of(tmp_path / "out")] == ["short"]
    (error,) = errors_of(tmp_path / "out")
    assert error["id"] == "long"
    assert error["error"].startswith("text: this model's maximum context length is 256 tokens")
    offline(workload="cut", spec=str(spec))
    cut = {line["id"]: line for line in outputs_of(tmp_path / "cut")}
    assert sorted(cut) == ["long", "short"]
    task = embed_task(spec, "strict")
    (expected,) = task.run([task.prepare(" ".join(words[:254]))])  # what fits beside the specials
    np.testing.assert_allclose(cut["long"]["embedding"], expected, rtol=1e-5, atol=1e-6)


def test_parquet_gzip_and_infer_outputs(prefect_api: str, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"aff": offline_workload("infer", batch_size=4)})
    rows = [{"id": i, "x": [[float(i), 1.0, 2.0, 3.0]]} for i in range(10)]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:5]), tmp_path / "in" / "p.parquet")
    with gzip.open(tmp_path / "in" / "z.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[5:])

    summary = offline(workload="aff", spec=str(spec))

    assert summary["outputs"] == 10 and summary["errors"] == 0
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    assert sorted(lines) == list(range(10))
    assert lines[3]["y"] == [[7.0, 3.0, 5.0, 7.0]]  # y = 2x + 1
    assert sorted(p.name for p in (tmp_path / "out").glob("*.jsonl")) == ["p.jsonl", "z.jsonl"]


def test_ten_thousand_records_with_one_percent_bad(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_MAX_BODY_BYTES", "4096")  # the record size limit too
    spec = write_spec(tmp_path, {"aff": offline_workload("infer", batch_size=512)})
    bad_kinds = [
        lambda i: "{broken json " + str(i),
        lambda i: {"x": [[1.0, 2.0, 3.0, 4.0]]},  # no id
        lambda i: {"id": i, "x": [[1.0, 2.0]]},  # wrong shape
        lambda i: {"id": i, "x": "four floats"},  # wrong type
        lambda i: {"id": i, "x": [[1.0, 2.0, 3.0, 4.0]], "pad": "x" * 5000},  # over-long
    ]
    for shard in range(4):
        lines: list[Any] = []
        for k in range(2500):
            i = shard * 2500 + k
            bad = i % 100 == 7
            lines.append(bad_kinds[i // 100 % 5](i) if bad else {"id": i, "x": [[i, 0, 0, 1]]})
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", lines)

    summary = offline(workload="aff", spec=str(spec))

    outputs = outputs_of(tmp_path / "out")
    errors = errors_of(tmp_path / "out")
    assert (len(outputs), len(errors)) == (9900, 100)
    assert (summary["outputs"], summary["errors"], summary["records"]) == (9900, 100, 10000)
    assert Counter(line["id"] for line in outputs).most_common(1)[0][1] == 1
    assert {e["line"] % 100 for e in errors} == {8}  # line = i % 2500 + 1
    assert sum("over the limit of 4096" in e["error"] for e in errors) == 20


def test_rerun_skips_committed_shards_and_redoes_changed_ones(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    for name in ("a", "b"):
        write_jsonl(
            tmp_path / "in" / f"{name}.jsonl",
            [{"id": f"{name}{i}", "x": [[i, 0, 0, 0]]} for i in range(5)],
        )
    first = offline(workload="aff", spec=str(spec))
    assert (first["shards_run"], first["shards_skipped"]) == (2, 0)

    again = offline(workload="aff", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"]) == (0, 2)
    assert (again["outputs"], again["total_outputs"]) == (0, 10)

    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b9", "x": [[9, 0, 0, 0]]}])
    changed = offline(workload="aff", spec=str(spec))
    assert (changed["shards_run"], changed["shards_skipped"]) == (1, 1)
    assert sorted(line["id"] for line in outputs_of(tmp_path / "out")) == [
        "a0", "a1", "a2", "a3", "a4", "b9",
    ]  # fmt: skip


def test_a_committed_shard_whose_output_or_errors_file_is_gone_is_redone(
    prefect_api: str, tmp_path: Path
) -> None:
    """A marker says the files were published, not that they are still there: one
    deleted since (a cleanup, an S3 lifecycle rule) is written again, never skipped
    with its records unsaid."""
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    for name in ("a", "b", "c"):
        write_jsonl(
            tmp_path / "in" / f"{name}.jsonl",
            [{"id": f"{name}{i}", "x": [[i, 0, 0, 0]]} for i in range(3)],
        )
    offline(workload="aff", spec=str(spec))
    (tmp_path / "out" / "a.jsonl").unlink()
    (tmp_path / "out" / "_errors" / "b.jsonl").unlink()

    again = offline(workload="aff", spec=str(spec))

    assert (again["shards_run"], again["shards_skipped"]) == (2, 1)
    assert (again["outputs"], again["total_outputs"]) == (6, 9)
    ids = [line["id"] for line in outputs_of(tmp_path / "out")]
    assert sorted(ids) == sorted(f"{name}{i}" for name in "abc" for i in range(3))
    assert (tmp_path / "out" / "_errors" / "b.jsonl").exists()


def test_a_run_whose_deadline_passed_with_shards_not_started_reads_expired(
    prefect_api: str, tmp_path: Path
) -> None:
    """Past `finish_by` (a batch's completion window) no shard starts: a run that left
    some is Expired, never Completed, in the SDK and `lanes job` alike, and what its
    committed shards answered stays readable."""
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    folders = {"input": f"{tmp_path / 'in'}/", "output": f"{tmp_path / 'out'}/"}
    records = {n: [{"id": f"{n}{i}", "x": [[i, 0, 0, 0]]} for i in range(5)] for n in "ab"}
    write_jsonl(tmp_path / "in" / "a.jsonl", records["a"])
    offline(workload="aff", spec=str(spec), **folders)  # shard a committed
    write_jsonl(tmp_path / "in" / "b.jsonl", records["b"])
    passed = datetime.now(UTC) - timedelta(minutes=1)
    state = offline(workload="aff", spec=str(spec), finish_by=passed, return_state=True, **folders)
    job = Job(str(state.state_details.flow_run_id), Settings(), prefect_api_url=prefect_api)
    assert job.status() == "EXPIRED"
    assert "with 5 lines answered" in (job.message() or "")
    assert sorted(line["id"] for line in job.results()) == [f"a{i}" for i in range(5)]
    with pytest.raises(JobFailed, match="ended EXPIRED"):
        job.wait(timeout=60)
    summary = state.result()
    counts = ("shards", "shards_skipped", "shards_not_started")
    assert [summary[key] for key in counts] == [2, 1, 1]
    message = state.message or ""
    assert f"1 of 2 shards not started, past its deadline {passed.isoformat()}" in message
    assert "5 records answered, 0 rejected" in message
    app = typer.Typer()
    app.command("job")(job_command)
    app.command("noop")(lambda: None)  # two commands: typer then wants the command's name
    shown = CliRunner().invoke(app, ["job", job.id], catch_exceptions=False)
    assert f"{job.id} EXPIRED" in shown.output, shown.output

    # A rerun without a deadline runs the shard left, once.
    again = offline(workload="aff", spec=str(spec), **folders)
    assert (again["shards_run"], again["shards_not_started"]) == (1, 0)
    assert sorted(line["id"] for line in outputs_of(tmp_path / "out")) == sorted(
        r["id"] for r in records["a"] + records["b"]
    )


def test_lanes_job_says_why_a_failed_job_failed(prefect_api: str, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"key": i, "x": [[i, 0, 0, 0]]} for i in range(3)])
    state = offline(workload="aff", spec=str(spec), return_state=True)
    assert state.is_failed()
    app = typer.Typer()
    app.command("job")(job_command)
    app.command("noop")(lambda: None)  # two commands: typer then wants the command's name
    id = str(state.state_details.flow_run_id)

    shown = CliRunner().invoke(app, ["job", id], catch_exceptions=False)

    assert shown.exit_code == 0  # without --wait it only reports
    assert f"{id} FAILED" in shown.output, shown.output
    assert f"{id}: " in shown.output and "validating the records" in shown.output
    assert 'missing field "id"' in shown.output


def test_a_second_job_with_other_file_names_into_a_committed_output_fails_before_writing(
    prefect_api: str, tmp_path: Path
) -> None:
    """No marker of the second job's own names is there: the others' are read too."""
    for folder, name in (("in", "a"), ("in", "b"), ("in2", "c")):
        records = [{"id": f"{folder}-{name}{i}", "x": [[i, 0, 0, 0]]} for i in range(3)]
        write_jsonl(tmp_path / folder / f"{name}.jsonl", records)
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    offline(workload="aff", spec=str(spec))
    committed = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*.json*")}

    other = offline_workload("infer", input="in2/")
    for workload, rerun in (("other", "uncommitted"), ("aff", "uncommitted"), ("aff", "all")):
        write_spec(tmp_path, {workload: other})
        with pytest.raises(StorageError) as caught:
            offline(workload=workload, spec=str(spec), rerun=rerun)
        message = str(caught.value)
        assert f"{tmp_path}/out/ holds the results of workload aff's shard of " in message
        assert f"{tmp_path}/in/a.jsonl" in message and f"for workload {workload}" in message
        assert f"give this one a different output, or delete {tmp_path}/out/" in message
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*.json*")} == committed

    # Its own input, a file gone from it, and one file of it alone: its own output.
    write_spec(tmp_path, {"aff": offline_workload("infer")})
    (tmp_path / "in" / "b.jsonl").unlink()
    again = offline(workload="aff", spec=str(spec))
    assert (again["shards_run"], again["shards_skipped"]) == (0, 1)
    one = offline(workload="aff", spec=str(spec), input=f"{tmp_path}/in/a.jsonl")
    assert (one["shards_run"], one["shards_skipped"]) == (0, 1)


def test_a_second_job_into_a_committed_output_fails_before_writing_over_it(
    prefect_api: str, tmp_path: Path
) -> None:
    for folder in ("in", "in2"):
        for name in ("a", "b"):
            write_jsonl(
                tmp_path / folder / f"{name}.jsonl",
                [{"id": f"{folder}-{name}{i}", "x": [[i, 0, 0, 0]]} for i in range(3)],
            )
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    offline(workload="aff", spec=str(spec))
    committed = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*.json*")}

    # Another workload, or this one on another input, into the same output (the spec
    # rewritten after validation passed): refused, --force too, and nothing written.
    other = offline_workload("infer", input="in2/")
    for workload, rerun in (("other", "uncommitted"), ("aff", "uncommitted"), ("aff", "all")):
        write_spec(tmp_path, {workload: other})
        with pytest.raises(StorageError) as caught:
            offline(workload=workload, spec=str(spec), rerun=rerun)
        message = str(caught.value)
        assert f"{tmp_path}/out/a.jsonl holds the results of workload aff's shard of " in message
        assert f"{tmp_path}/in/a.jsonl" in message and f"for workload {workload}" in message
        assert f"give this one a different output, or delete {tmp_path}/out/" in message
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*.json*")} == committed

    # Its own input file changed (b): redone; its model written anew with the same
    # bytes is the same model (a stays; test_flows_identity changes a model's bytes).
    write_spec(tmp_path, {"aff": offline_workload("infer")})
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "in-b9", "x": [[9, 0, 0, 0]]}])
    changed = offline(workload="aff", spec=str(spec))
    assert (changed["shards_run"], changed["total_outputs"]) == (1, 4)
    forced = offline(workload="aff", spec=str(spec), rerun="all")
    assert (forced["shards_run"], forced["total_outputs"]) == (2, 4)


def test_sigkill_mid_job_then_rerun_gives_every_id_exactly_once(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = offline_workload(
        "infer",
        handler="tests.flows_fixtures:held_from_shard_3",
        runner={"max_concurrent_shards": 1},
    )
    spec = write_spec(tmp_path, {"slow": workload})
    ids = []
    for shard in range(20):
        records = [{"id": f"s{shard}-{i}", "x": [[i, shard, 0, 0]]} for i in range(30)]
        ids += [r["id"] for r in records]
        write_jsonl(tmp_path / "in" / f"part-{shard:02d}.jsonl", records)
    markers = tmp_path / "out" / "_committed"
    gate = tmp_path / "gate-open"  # it never opens for the first run: shard 3 waits there
    code = f"from flows.batch import offline; offline(workload='slow', spec={str(spec)!r})"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, GATE_FILE_ENV: str(gate)}
    worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    try:
        wait_until(held_marker(gate).exists, 90, "the job held at shard 3")
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
    at_kill = len(list(markers.glob("*.json")))
    assert worker.returncode == -signal.SIGKILL
    assert at_kill == 3, "the kill lands mid-job, after shards 0-2 committed"

    gate.touch()
    monkeypatch.setenv(GATE_FILE_ENV, str(gate))
    summary = offline(workload="slow", spec=str(spec))

    assert summary["shards_skipped"] == at_kill and summary["shards_failed"] == 0
    seen = Counter(line["id"] for line in outputs_of(tmp_path / "out"))
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}
    assert errors_of(tmp_path / "out") == []


def test_a_broken_handler_fails_its_shards_but_not_the_others(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(
        tmp_path,
        {
            "good": offline_workload("infer", output="out-good/"),
            "bad": offline_workload("infer", handler="tests.flows_fixtures:broken"),
        },
    )
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "x": [[i, 0, 0, 0]]} for i in range(3)])
    with pytest.raises(JobFailed, match=r"1 of 1 shards failed .* the post is broken"):
        offline(workload="bad", spec=str(spec))
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    error = manifest["failures"][0]["error"]
    assert manifest["shards_failed"] == 1 and "the post is broken" in error
    # The handler is named, not the model: its output was fine.
    assert "handler tests.flows_fixtures:broken: post failed" in error
    assert not (tmp_path / "out" / "_committed" / "a.json").exists()


def test_refuses_interactive_workloads_and_outputs_inside_inputs(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    interactive = {"mode": "interactive", "task": "infer", "model": "affine"}
    spec = write_spec(tmp_path, {"live": interactive, "aff": offline_workload("infer")})
    with pytest.raises(WrongMode, match="interactive"):
        offline(workload="live", spec=str(spec))
    # Even where a root allows writing there.
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", json.dumps([str(tmp_path / "in")]))
    with pytest.raises(StorageError, match="inside input"):
        offline(workload="aff", spec=str(spec), output=str(tmp_path / "in" / "out"))
    (tmp_path / "in").mkdir()
    with pytest.raises(StorageError, match="no input files"):
        offline(workload="aff", spec=str(spec))


# ---- S3 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def test_s3_in_and_out_through_a_moto_server(
    prefect_api: str, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3 = s3_env(monkeypatch, s3_endpoint)
    s3.create_bucket(Bucket="corpus")
    s3.create_bucket(Bucket="results")
    for shard in range(3):
        body = "".join(
            json.dumps({"id": f"{shard}-{i}", "text": text(i)}) + "\n" for i in range(10)
        )
        s3.put_object(Bucket="corpus", Key=f"in/part-{shard}.jsonl", Body=body.encode())
    spec = write_spec(
        tmp_path,
        {"emb": offline_workload(input="s3://corpus/in/", output="s3://results/emb/")},
    )
    summary = offline(workload="emb", spec=str(spec))
    assert summary["outputs"] == 30

    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="results", Prefix="emb/")["Contents"])
    data = [k for k in keys if not k.split("/")[1].startswith("_")]
    assert data == ["emb/part-0.jsonl", "emb/part-1.jsonl", "emb/part-2.jsonl"]
    assert "emb/_committed/part-0.json" in keys and "emb/_manifest.json" in keys
    lines = s3.get_object(Bucket="results", Key="emb/part-1.jsonl")["Body"].read().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == [f"1-{i}" for i in range(10)]
    again = offline(workload="emb", spec=str(spec))
    assert again["shards_skipped"] == 3


# ---- runners and the command line ---------------------------------------------------


def test_dask_runner_gives_the_same_output_as_the_default(prefect_api: str, tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path,
        {
            "local": offline_workload(output="out-local/"),
            "dask": offline_workload(output="out-dask/", runner={"kind": "dask", "workers": 2}),
        },
    )
    for shard in range(4):
        write_jsonl(
            tmp_path / "in" / f"part-{shard}.jsonl",
            [{"id": f"{shard}-{i}", "text": text(i)} for i in range(25)],
        )
    local = offline(workload="local", spec=str(spec))
    dask = offline(workload="dask", spec=str(spec))
    assert local["outputs"] == dask["outputs"] == 100
    for name in ("part-0.jsonl", "part-3.jsonl"):
        assert (tmp_path / "out-dask" / name).read_bytes() == (
            tmp_path / "out-local" / name
        ).read_bytes()
    manifest = json.loads((tmp_path / "out-dask" / "_manifest.json").read_text())
    assert manifest["shards_run"] == 4


def test_lanes_run_prints_the_manifest_summary(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = write_spec(tmp_path, {"aff": offline_workload("infer")})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "x": [[i, 0, 0, 0]]} for i in range(7)])
    app = typer.Typer()
    app.command("run")(run_command)
    app.command("noop")(lambda: None)  # two commands: typer then wants the command's name
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("LANES_ALLOWED_OUTPUT_ROOTS", json.dumps([str(other)]))
    result = CliRunner().invoke(
        app, ["run", "aff", "--file", str(spec), "--output", str(other)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "7 outputs, 0 errors" in result.output and "CPUExecutionProvider" in result.output
    assert len(outputs_of(other)) == 7
    missing = CliRunner().invoke(app, ["run", "nope", "--file", str(spec)])
    assert missing.exit_code == 2 and "no workload named 'nope'" in missing.output


def test_ensure_work_pool_creates_a_process_pool_once(prefect_api: str) -> None:
    from prefect.client.orchestration import get_client

    from lanes.router.deploy import api_url, ensure_work_pool

    assert api_url() == prefect_api
    assert ensure_work_pool("lanes-test-pool") is True
    assert ensure_work_pool("lanes-test-pool") is False
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("lanes-test-pool")
    assert pool.type == "process" and "job_configuration" in pool.base_job_template
