"""Offline input in the user's own shape, end to end under Prefect's test harness: a
workload's `fields:` over CSV, JSONL and JSON-array files, a handler's `pre` in a temp
user project seeing whole records, and input files of an unknown format refused."""

from __future__ import annotations

import csv
import importlib
import json
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lanes.errors import StorageError
from lanes.flows.batch import offline
from lanes.flows.job import plan_job
from lanes.flows.sample import first_records
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.storage import Storage
from lanes.tasks import load_task
from tests.flows_fixtures import outputs_of, read_jsonl, text, write_jsonl, write_spec

FIELDS = {"id": "ticket_id", "text": "{subject}\n\n{body}", "keep": ["customer"]}
README = Path(__file__).resolve().parent.parent / "README.md"


def offline_workload(**fields: Any) -> dict[str, Any]:
    base = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/", "output": "out/"}
    return {**base, "batch_size": 4, "retries": 0, **fields}


def ticket(i: int) -> dict[str, Any]:
    return {"subject": text(i), "body": text(i + 3), "customer": f"c{i % 3}", "priority": i}


def reference(spec: Path, workload: str, texts: list[str]) -> list[Any]:
    """The vectors the task itself gives these texts (a workload without a handler)."""
    task = load_task(workload, load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    return [task.run([task.prepare(t)])[0] for t in texts]


def test_fields_read_a_users_tickets_from_csv_jsonl_and_json_arrays(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"tickets": offline_workload(fields=FIELDS)})
    rows = {f"t{i}": ticket(i) for i in range(9)}
    (tmp_path / "in").mkdir()
    with (tmp_path / "in" / "export.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, ["ticket_id", "subject", "body", "customer", "priority"])
        writer.writeheader()
        writer.writerows({"ticket_id": k, **v} for k, v in list(rows.items())[:3])
    write_jsonl(
        tmp_path / "in" / "api.jsonl", [{"ticket_id": k, **v} for k, v in list(rows.items())[3:6]]
    )
    (tmp_path / "in" / "backup.json").write_text(
        json.dumps([{"ticket_id": k, **v} for k, v in list(rows.items())[6:]])
    )

    summary = offline(workload="tickets", spec=str(spec))

    assert (summary["outputs"], summary["errors"], summary["shards_run"]) == (9, 0, 3)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.jsonl")) == [
        "api.jsonl",
        "backup.jsonl",
        "export.jsonl",
    ]
    lines = {line["id"]: line for line in outputs_of(out)}
    assert sorted(lines) == sorted(rows)
    ids = sorted(rows)
    texts = [f"{rows[k]['subject']}\n\n{rows[k]['body']}" for k in ids]
    for key, expected in zip(ids, reference(spec, "tickets", texts), strict=True):
        assert list(lines[key]) == ["id", "customer", "embedding"]
        assert lines[key]["customer"] == rows[key]["customer"]
        np.testing.assert_allclose(lines[key]["embedding"], expected, rtol=1e-5, atol=1e-6)


PROMPTS_CSV = (
    "id,prompt,max_tokens,temperature,seed\n"
    "short,a,1,0,\n"  # one token
    "whole,a,,,\n"  # empty cells: the workload's defaults
    "seeded,a,2,0.7,42\n"
    "bad,a,abc,,\n"
)


def generate_csv(tmp_path: Path) -> Path:
    generation = {"max_new_tokens": 8, "temperature": 0}
    workload = offline_workload(task="generate", model="dec", generation=generation)
    spec = write_spec(tmp_path, {"gen": {**workload, "max_error_rate": 0.5}})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "prompts.csv").write_text(PROMPTS_CSV)
    return spec


def test_a_csv_generate_record_sets_its_own_max_tokens_and_sampling(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = generate_csv(tmp_path)

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (3, 1)
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    assert (lines["short"]["text"], lines["short"]["finish_reason"]) == ("b", "length")
    assert (lines["whole"]["text"], lines["whole"]["finish_reason"]) == ("b c d", "stop")
    assert len(lines["seeded"]["tokens"]) == 2 and lines["seeded"]["finish_reason"] == "length"
    (error,) = read_jsonl(tmp_path / "out" / "_errors" / "prompts.jsonl")
    assert error == {
        "id": "bad",
        "line": 5,
        "error": "max_tokens: expected an integer, found 'abc'",
    }


def test_a_generate_record_takes_the_sampling_ranges_an_openai_request_does(
    prefect_api: str, tmp_path: Path
) -> None:
    """A plain record is refused what /v1/completions refuses (temperature <= 2, not
    the spec's <= 10), with the same message, by its line; vLLM's top_k -1 is no cut."""
    workload = offline_workload(task="generate", model="dec", generation={"max_new_tokens": 8})
    spec = write_spec(tmp_path, {"gen": {**workload, "max_error_rate": 0.9}})
    records = [
        {"id": 5, "prompt": "a", "temperature": 5},
        {"id": 6, "prompt": "a", "top_p": 1.5},
        {"id": 7, "prompt": "a", "temperature": 0, "top_k": -1},
    ]
    write_jsonl(tmp_path / "in" / "prompts.jsonl", records)

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (1, 2)
    (line,) = outputs_of(tmp_path / "out")
    assert (line["id"], line["text"], line["finish_reason"]) == (7, "b c d", "stop")
    assert read_jsonl(tmp_path / "out" / "_errors" / "prompts.jsonl") == [
        {"id": 5, "line": 1, "error": "temperature: expected a value <= 2, found 5"},
        {"id": 6, "line": 2, "error": "top_p: expected a value <= 1, found 1.5"},
    ]


def test_a_deadlines_sample_of_csv_records_reads_them_as_the_shard_does(tmp_path: Path) -> None:
    spec = generate_csv(tmp_path)
    settings = Settings()
    sample = first_records(plan_job("gen", spec, settings), Storage(settings), 10)
    empty = {"temperature": None, "seed": None}
    assert sample == [
        {"id": "short", "prompt": "a", "max_tokens": 1, "temperature": 0, "seed": None},
        {"id": "whole", "prompt": "a", "max_tokens": None, **empty},
        {"id": "seeded", "prompt": "a", "max_tokens": 2, "temperature": 0.7, "seed": 42},
        {"id": "bad", "prompt": "a", "max_tokens": "abc", "temperature": "", "seed": ""},
    ]


HOOKS = """\
class Hooks:
    def __init__(self):
        self.seen = []

    def pre(self, record):
        self.seen.append(dict(record))
        return f"{record['subject']} {record['body']}"


hooks = Hooks()
"""


def test_pre_gets_each_whole_record_in_a_user_project(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"ticket_hooks_{uuid.uuid4().hex[:8]}"  # a user's module beside workloads.yaml
    (tmp_path / f"{module}.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = write_spec(
        tmp_path,
        {
            "tickets": offline_workload(handler=f"{module}:hooks", fields={"id": "ticket_id"}),
            "plain": offline_workload(output="out-plain/"),
        },
    )
    records = [{"ticket_id": 100 + i, **ticket(i)} for i in range(6)]
    write_jsonl(tmp_path / "in" / "a.jsonl", records)

    summary = offline(workload="tickets", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (6, 0)
    seen = importlib.import_module(module).hooks.seen
    assert sorted(seen, key=lambda r: r["ticket_id"]) == records  # whole, id and all
    lines = {line["id"]: line for line in read_jsonl(tmp_path / "out" / "a.jsonl")}
    texts = [f"{r['subject']} {r['body']}" for r in records]
    for record, expected in zip(records, reference(spec, "plain", texts), strict=True):
        np.testing.assert_allclose(
            lines[record["ticket_id"]]["embedding"], expected, rtol=1e-5, atol=1e-6
        )


def test_an_unclosed_quote_in_csv_rejects_every_line_it_takes_in(
    prefect_api: str, tmp_path: Path
) -> None:
    """100 records whose 6th (line 7) opens a quote it never closes: the lines from 7 to
    the end are counted and named as rejected, and once the quote is fixed a retry of
    the errors answers every one of them."""
    spec = write_spec(tmp_path, {"emb": offline_workload(max_error_rate=1.0)})
    (tmp_path / "in").mkdir()
    rows = [f"b{i},{text(i)}" for i in range(100)]
    broken = [*rows[:5], 'b5,"unterminated', *rows[6:]]
    source = tmp_path / "in" / "a.csv"
    source.write_text("id,text\n" + "\n".join(broken) + "\n")

    summary = offline(workload="emb", spec=str(spec))

    assert (summary["records"], summary["outputs"], summary["errors"]) == (100, 5, 95)
    errors = read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")
    assert [e["line"] for e in errors] == list(range(7, 102))
    assert errors[0] == {
        "id": None,
        "line": 7,
        "error": "a quoted field opened on line 7 or later is never closed: it takes in the "
        "rest of the file, lines 7 to 101 (95 lines), none read as a record; close the "
        'quote (a quote inside a quoted field is written "")',
    }
    assert errors[1]["error"].startswith("inside the quoted field opened on line 7")

    source.write_text("id,text\n" + "\n".join(rows) + "\n")
    retried = offline(workload="emb", spec=str(spec), rerun="errors")
    assert (retried["records"], retried["outputs"], retried["errors"]) == (100, 100, 0)
    assert sorted(line["id"] for line in outputs_of(tmp_path / "out")) == sorted(
        f"b{i}" for i in range(100)
    )


def test_an_openai_line_naming_another_model_is_answered_by_the_workload_run(
    prefect_api: str, tmp_path: Path
) -> None:
    """A file written for another provider names its models: the workload run answers
    every line, and its answers name that workload, not a model that did not answer."""
    spec = write_spec(tmp_path, {"emb": offline_workload()})
    line = {"method": "POST", "url": "/v1/embeddings"}
    write_jsonl(
        tmp_path / "in" / "a.jsonl",
        [
            {**line, "custom_id": "mine", "body": {"model": "emb", "input": "w1"}},
            {**line, "custom_id": "theirs", "body": {"model": "other", "input": "w1"}},
        ],
    )

    summary = offline(workload="emb", spec=str(spec))

    assert (summary["records"], summary["outputs"], summary["errors"]) == (2, 2, 0)
    answers = {o["custom_id"]: o["response"]["body"] for o in outputs_of(tmp_path / "out")}
    assert {k: a["model"] for k, a in answers.items()} == {"mine": "emb", "theirs": "emb"}
    assert answers["mine"]["data"] == answers["theirs"]["data"]


def test_an_empty_csv_id_is_rejected_as_other_bad_ids(prefect_api: str, tmp_path: Path) -> None:
    """An empty id cannot tell outputs apart."""
    spec = write_spec(tmp_path, {"emb": offline_workload(max_error_rate=1.0)})
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.csv").write_text("id,text\nfull,w1\n,empty id\n")

    summary = offline(workload="emb", spec=str(spec))

    assert (summary["records"], summary["outputs"], summary["errors"]) == (2, 1, 1)
    assert [line["id"] for line in outputs_of(tmp_path / "out")] == ["full"]
    (empty,) = read_jsonl(tmp_path / "out" / "_errors" / "b.jsonl")
    assert empty == {
        "id": None,
        "line": 3,
        "error": 'field "id" (the id): expected a non-empty id, found an empty string',
    }


def test_an_input_file_of_an_unknown_format_fails_the_run_naming_it(
    prefect_api: str, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"emb": offline_workload()})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(3)])
    (tmp_path / "in" / "notes.txt").write_text("not records")
    (tmp_path / "in" / "_SUCCESS").write_text("")  # bookkeeping: never data
    with pytest.raises(StorageError) as caught:
        offline(workload="emb", spec=str(spec))
    message = str(caught.value)
    assert str(tmp_path / "in" / "notes.txt") in message and "_SUCCESS" not in message
    assert "JSONL (.jsonl, .ndjson), CSV (.csv), JSON arrays (.json)" in message
    assert "narrow the workload's input with a glob" in message
    assert not (tmp_path / "out" / "a.jsonl").exists()

    summary = offline(workload="emb", spec=str(spec), input=str(tmp_path / "in" / "*.jsonl"))
    assert summary["outputs"] == 3


def test_the_readmes_fields_example_reads_a_ticket_export(prefect_api: str, tmp_path: Path) -> None:
    section = README.read_text().split("## Offline records", 1)[1]
    found = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert found, "the README's offline records section has no yaml example"
    (example,) = yaml.safe_load(found.group(1)).values()
    spec = write_spec(tmp_path, {"triage": {**example, "model": "enc"}})
    export = tmp_path / example["input"]
    export.parent.mkdir(parents=True)
    export.write_text(f"ticket_id,subject,body,customer\nT-17,{text(1)},{text(2)},acme\n")

    assert offline(workload="triage", spec=str(spec))["outputs"] == 1

    (line,) = read_jsonl(tmp_path / example["output"] / "tickets.jsonl")
    assert list(line) == ["id", "customer", "embedding"]
    assert (line["id"], line["customer"]) == ("T-17", "acme")
    (expected,) = reference(spec, "triage", [f"{text(1)}\n\n{text(2)}"])
    np.testing.assert_allclose(line["embedding"], expected, rtol=1e-5, atol=1e-6)


def test_an_openai_line_over_the_endpoints_request_limits_is_rejected_alone(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch line meets the limits a request to the endpoint meets (one check, in
    lanes/protocols): its prompts, and its prompts times n, at most
    LANES_MAX_INPUTS_PER_REQUEST; a line over them is rejected alone with the
    endpoint's status and message, the lines beside it answered."""
    monkeypatch.setenv("LANES_MAX_INPUTS_PER_REQUEST", "4")
    workload = offline_workload(task="generate", model="dec", generation={"max_new_tokens": 2})
    spec = write_spec(tmp_path, {"gen": {**workload, "max_error_rate": 0.9}})
    chat = {"model": "gen", "messages": [{"role": "user", "content": "a"}]}
    bodies = {
        "prompts": {"model": "gen", "prompt": ["a", "b", "c", "d", "e"]},
        "choices": {"model": "gen", "prompt": ["a", "b"], "n": 3},
        "chat": {**chat, "n": 5},
        "most-n": {"model": "gen", "prompt": "a", "n": 129},
        "fits": {"model": "gen", "prompt": ["a", "b"], "n": 2},
        "chat-fits": {**chat, "n": 4},
    }
    url = {"chat": "/v1/chat/completions", "chat-fits": "/v1/chat/completions"}
    lines = [
        {"custom_id": k, "method": "POST", "url": url.get(k, "/v1/completions"), "body": b}
        for k, b in bodies.items()
    ]
    write_jsonl(tmp_path / "in" / "a.jsonl", lines)

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (2, 4)
    answered = {o["custom_id"]: o["response"]["body"] for o in outputs_of(tmp_path / "out")}
    assert {k: len(a["choices"]) for k, a in answered.items()} == {"fits": 4, "chat-fits": 4}
    errors = {e["custom_id"]: e for e in read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")}
    assert sorted(errors) == ["chat", "choices", "most-n", "prompts"]
    status = {k: e["response"]["status_code"] for k, e in errors.items()}
    assert status == {"prompts": 413, "choices": 400, "chat": 400, "most-n": 400}
    found = {k: e["response"]["body"]["error"] for k, e in errors.items()}
    assert found["prompts"]["param"] == "prompt"
    assert errors["prompts"]["error"] == (
        "body.prompt: 5 inputs is over the limit of 4 per request "
        "(LANES_MAX_INPUTS_PER_REQUEST); split them into requests of at most 4"
    )
    where = "the inputs a request may carry (LANES_MAX_INPUTS_PER_REQUEST)"
    assert (found["choices"]["param"], found["choices"]["message"]) == (
        "n",
        f"n: 2 prompt(s) times n = 3 is 6 sequences, over 4, {where}; "
        "expected n at most 2, or more requests",
    )
    assert found["chat"]["param"] == "n"
    assert "1 prompt(s) times n = 5 is 5 sequences, over 4" in found["chat"]["message"]
    assert found["most-n"]["param"] == "n"


def test_an_embeddings_line_over_the_endpoints_input_limit_is_rejected_alone(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_MAX_INPUTS_PER_REQUEST", "2")
    spec = write_spec(tmp_path, {"emb": {**offline_workload(), "max_error_rate": 0.9}})
    line = {"method": "POST", "url": "/v1/embeddings"}
    bodies = {"many": ["w1", "w2", "w3"], "two": ["w1", "w2"]}
    write_jsonl(
        tmp_path / "in" / "a.jsonl",
        [{**line, "custom_id": k, "body": {"model": "emb", "input": v}} for k, v in bodies.items()],
    )

    summary = offline(workload="emb", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (1, 1)
    (answer,) = outputs_of(tmp_path / "out")
    assert (answer["custom_id"], len(answer["response"]["body"]["data"])) == ("two", 2)
    (error,) = read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")
    assert (error["custom_id"], error["response"]["status_code"]) == ("many", 413)
    assert error["error"] == (
        "body.input: 3 inputs is over the limit of 2 per request "
        "(LANES_MAX_INPUTS_PER_REQUEST); split them into requests of at most 2"
    )


def test_a_record_whose_prompt_fields_make_keeps_its_own_generation_options(
    prefect_api: str, tmp_path: Path
) -> None:
    """With `fields.prompt`, a record's fields named as generation options still set its
    request, read and checked as a record's without it (a CSV cell as a number, the
    endpoint's ranges): none is ignored without a word."""
    generation = {"max_new_tokens": 8, "temperature": 0}
    workload = offline_workload(task="generate", model="dec", generation=generation)
    fields = {"id": "key", "prompt": "{question}", "keep": ["topic"]}
    spec = write_spec(tmp_path, {"gen": {**workload, "fields": fields, "max_error_rate": 0.9}})
    records = [
        {"key": "short", "question": "a", "topic": "x", "max_tokens": 1},
        {"key": "whole", "question": "a", "topic": "x"},
        {"key": "hot", "question": "a", "topic": "x", "temperature": 5},
    ]
    write_jsonl(tmp_path / "in" / "a.jsonl", records)
    (tmp_path / "in" / "b.csv").write_text(
        "key,question,topic,max_tokens\ncsv-short,a,y,1\ncsv-whole,a,y,\ncsv-bad,a,y,one\n"
    )

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (4, 2)
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    answers = {k: (v["text"], v["finish_reason"], v["topic"]) for k, v in lines.items()}
    assert answers == {
        "short": ("b", "length", "x"),
        "whole": ("b c d", "stop", "x"),
        "csv-short": ("b", "length", "y"),
        "csv-whole": ("b c d", "stop", "y"),
    }
    errors = read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")
    errors += read_jsonl(tmp_path / "out" / "_errors" / "b.jsonl")
    assert errors == [
        {"id": "hot", "line": 3, "error": "temperature: expected a value <= 2, found 5"},
        {"id": "csv-bad", "line": 4, "error": "max_tokens: expected an integer, found 'one'"},
    ]


def test_a_kept_prompt_or_generation_option_is_applied_and_copied(
    prefect_api: str, tmp_path: Path
) -> None:
    """`fields.keep` copies a field into the output line; a field the request reads (the
    prompt, a generation option) stays the request's: keeping a record's max_tokens
    writes the budget beside the completion it bounded, never drops it unsaid."""
    generation = {"max_new_tokens": 8, "temperature": 0}
    workload = offline_workload(task="generate", model="dec", generation=generation)
    fields = {"keep": ["prompt", "max_tokens", "topic"]}
    spec = write_spec(tmp_path, {"gen": {**workload, "fields": fields}})
    records = [
        {"id": "short", "prompt": "a", "topic": "x", "max_tokens": 1},
        {"id": "whole", "prompt": "a", "topic": "y", "max_tokens": 8},
    ]
    write_jsonl(tmp_path / "in" / "a.jsonl", records)

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (2, 0)
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    kept = {k: (v["prompt"], v["max_tokens"], v["topic"]) for k, v in lines.items()}
    assert kept == {"short": ("a", 1, "x"), "whole": ("a", 8, "y")}
    answers = {k: (v["text"], v["finish_reason"]) for k, v in lines.items()}
    assert answers == {"short": ("b", "length"), "whole": ("b c d", "stop")}


def test_a_parquet_map_column_is_a_generate_records_logit_bias(
    prefect_api: str, tmp_path: Path
) -> None:
    """Parquet's way to write an object is a MAP column (token ids as integers here):
    read as the object a JSONL record's logit_bias is, it biases the record's tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    generation = {"max_new_tokens": 8, "temperature": 0}
    workload = offline_workload(task="generate", model="dec", generation=generation)
    spec = write_spec(tmp_path, {"gen": workload})
    (tmp_path / "in").mkdir()
    bias = pa.array([[(0, 100.0)], None, [(3, 100.0)]], pa.map_(pa.int64(), pa.float64()))
    table = pa.table({"id": ["eos", "none", "c"], "prompt": ["a"] * 3, "logit_bias": bias})
    pq.write_table(table, tmp_path / "in" / "prompts.parquet")

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (3, 0)
    lines = {line["id"]: line for line in outputs_of(tmp_path / "out")}
    answers = {k: (v["text"], v["finish_reason"]) for k, v in lines.items()}
    # eos (token 0) made likeliest ends at once; c (3) likeliest repeats to the budget.
    assert answers == {
        "eos": ("", "stop"),
        "none": ("b c d", "stop"),
        "c": ("c " * 7 + "c", "length"),
    }


STREAM_USAGE = {"stream_options": {"include_usage": True}}


def test_an_openai_line_asking_for_a_stream_is_refused_not_answered_whole(
    prefect_api: str, tmp_path: Path
) -> None:
    """A batch answers whole, in its output file: a line with `stream: true` is that
    line's 400 naming `stream` (OpenAI's Batch API refuses it too), `stream: false` is
    answered, and the lines beside it are too."""
    workload = offline_workload(task="generate", model="dec", generation={"max_new_tokens": 8})
    spec = write_spec(tmp_path, {"gen": {**workload, "max_error_rate": 0.9}})
    chat = {"model": "gen", "messages": [{"role": "user", "content": "a"}]}
    completions = {"model": "gen", "prompt": "a"}
    lines = [
        ("streamed", "/v1/completions", {**completions, "stream": True}),
        ("usage", "/v1/chat/completions", {**chat, "stream": True} | STREAM_USAGE),
        ("whole", "/v1/completions", {**completions, "stream": False}),
        ("chat", "/v1/chat/completions", chat),
    ]
    write_jsonl(
        tmp_path / "in" / "a.jsonl",
        [{"custom_id": k, "method": "POST", "url": u, "body": b} for k, u, b in lines],
    )

    summary = offline(workload="gen", spec=str(spec))

    assert (summary["outputs"], summary["errors"]) == (2, 2)
    answered = {o["custom_id"]: o["response"]["body"] for o in outputs_of(tmp_path / "out")}
    assert answered["whole"]["choices"][0]["text"] == "b c d"
    assert answered["chat"]["choices"][0]["message"]["content"] == "b c d"
    errors = {e["custom_id"]: e for e in read_jsonl(tmp_path / "out" / "_errors" / "a.jsonl")}
    assert sorted(errors) == ["streamed", "usage"]
    detail = (
        "a batch line is answered whole, in the output file, never streamed; "
        "send false or leave it out"
    )
    for error in errors.values():
        assert error["error"] == f"body.stream: {detail}"
        assert error["response"]["status_code"] == 400
        body = error["response"]["body"]["error"]
        assert (body["param"], body["code"]) == ("stream", "unsupported_value")
