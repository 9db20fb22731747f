"""workloads.yaml: every bad case reports its line, column, field path and message."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from lanes.errors import SpecError
from lanes.settings import Settings
from lanes.spec import InteractiveWorkload, Spec, in_offline_lane
from lanes.specfile import load_spec
from tests.flows_fixtures import embed_model

README = Path(__file__).resolve().parent.parent / "README.md"


def validate(spec: Path) -> subprocess.CompletedProcess[str]:
    """`lanes validate SPEC` as a user runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "validate", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )


GOOD = """\
version: 1
models:
  enc: {path: enc.onnx, tokenizer: tok.json}
  clf: {path: clf.onnx}
workloads:
  search-query:
    mode: interactive
    task: embed
    model: enc
    batching: {max_batch_size: 8, max_wait_ms: 2}
  nightly:
    mode: offline
    task: embed
    model: enc
    input: in/
    output: out/
    schedule: {cron: "30 1 * * *", timezone: Europe/Paris}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("enc.onnx", "clf.onnx"):
        (tmp_path / name).write_bytes(b"")
    # `lanes validate` loads the tokenizer, as serving it would: a real one, if tiny.
    (tmp_path / "tok.json").write_text(Tokenizer(WordLevel({"a": 0}, "a")).to_str())
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "workloads.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(folder: Path, text: str, settings: Settings | None = None) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_spec(write(folder, text), settings or Settings())
    return [str(p).replace(str(folder / "workloads.yaml"), "W") for p in caught.value.problems]


def test_good_spec_loads_with_defaults(folder: Path) -> None:
    spec = load_spec(write(folder, GOOD), Settings())
    query = spec.workloads["search-query"]
    assert query.batching.max_wait_ms == 2
    assert query.batching.max_queue == 1024
    assert query.generation.max_new_tokens == 128
    assert spec.models["enc"].path == folder / "enc.onnx"
    assert spec.workloads["nightly"].retries == 2
    assert spec.workloads["nightly"].max_error_rate == 0.1
    assert spec.workloads["nightly"].fields.id == "id"


BAD_CASES = [
    # (name, replace this, with this, expected problem line)
    (
        "yaml syntax",
        "task: embed\n    model: enc\n    batching",
        "task: [embed\n    model: enc\n    batching",
        "W:9:10: invalid YAML: expected ',' or ']'",
    ),
    (
        "unknown key",
        "max_wait_ms: 2}",
        "max_wait_ms: 2, max_wiat: 3}",
        "W:10:51: workloads.search-query.batching.max_wiat: unknown key 'max_wiat'",
    ),
    # As `lanes call` says an unknown option: the key meant, or the keys the place takes.
    (
        "a misspelt key",
        "max_batch_size: 8",
        "max_batchsize: 8",
        "W:10:16: workloads.search-query.batching.max_batchsize: unknown key "
        "'max_batchsize'; did you mean 'max_batch_size'?",
    ),
    (
        "an unknown key close to none",
        "timezone: Europe/Paris}",
        "timezone: Europe/Paris, colour: blue}",
        "W:17:60: workloads.nightly.schedule.colour: unknown key 'colour'; expected one "
        "of: cron, finish_by, timezone",
    ),
    (
        "a misspelt key of a model",
        "clf: {path: clf.onnx}",
        "clf: {path: clf.onnx, max_lenght: 8}",
        "W:4:25: models.clf.max_lenght: unknown key 'max_lenght'; did you mean 'max_length'?",
    ),
    (
        "wrong type",
        "max_wait_ms: 2}",
        "max_wait_ms: soon}",
        "W:10:48: workloads.search-query.batching.max_wait_ms: expected a number, found 'soon'",
    ),
    (
        "out of range",
        "max_batch_size: 8",
        "max_batch_size: 0",
        "W:10:32: workloads.search-query.batching.max_batch_size: expected a value > 0, found 0",
    ),
    # Pydantic's lax mode read each of these as a number (`true` as 1): YAML wrote
    # something else, and the message says what.
    (
        "a boolean for an integer",
        "    output: out/\n",
        "    output: out/\n    batch_size: true\n",
        "W:17:17: workloads.nightly.batch_size: expected an integer, found true",
    ),
    (
        "a decimal for an integer",
        "max_batch_size: 8",
        "max_batch_size: 8.0",
        "W:10:32: workloads.search-query.batching.max_batch_size: expected an integer, found 8.0",
    ),
    (
        "a string for an integer",
        "max_batch_size: 8",
        'max_batch_size: "8"',
        "W:10:32: workloads.search-query.batching.max_batch_size: expected an integer, found '8'",
    ),
    (
        "a boolean for a number",
        "max_wait_ms: 2}",
        "max_wait_ms: false}",
        "W:10:48: workloads.search-query.batching.max_wait_ms: expected a number, found false",
    ),
    (
        "a string for a number",
        "max_wait_ms: 2}",
        'max_wait_ms: "2"}',
        "W:10:48: workloads.search-query.batching.max_wait_ms: expected a number, found '2'",
    ),
    (
        "bad cron",
        '"30 1 * * *"',
        '"61 1 * * *"',
        "W:17:22: workloads.nightly.schedule.cron: expected a five-field cron expression",
    ),
    (
        "a cron field out of its range",
        '"30 1 * * *"',
        '"0 25 * * *"',
        "W:17:22: workloads.nightly.schedule.cron: expected a five-field cron expression "
        """like "0 2 * * *", found '0 25 * * *': its hour field, '25', is not within 0-23""",
    ),
    (
        "a cron field misspelt",
        '"30 1 * * *"',
        '"0 2 * * mom"',
        "W:17:22: workloads.nightly.schedule.cron: expected a five-field cron expression "
        """like "0 2 * * *", found '0 2 * * mom': its day of week field, 'mom', is not """
        "within 0-6 or sun-sat",
    ),
    (
        "an input of a scheme lanes does not read",
        "    input: in/\n",
        "    input: gs://bucket/in/\n",
        "W:15:12: workloads.nightly.input: expected a folder, a glob or s3://bucket/prefix/, "
        "found 'gs://bucket/in/'",
    ),
    (
        "an s3 URI missing a slash",
        "    input: in/\n",
        "    input: s3:/bucket/in/\n",
        "W:15:12: workloads.nightly.input: expected a folder, a glob or s3://bucket/prefix/, "
        "found 's3:/bucket/in/'",
    ),
    (
        "an s3 URI without a bucket",
        "    output: out/\n",
        "    output: s3:///out/\n",
        "W:16:13: workloads.nightly.output: expected s3://bucket/prefix/, found 's3:///out/' "
        "(no bucket)",
    ),
    (
        "bad timezone",
        "Europe/Paris",
        "Mars/Olympus",
        "W:17:46: workloads.nightly.schedule.timezone: expected an IANA time zone",
    ),
    (
        "missing model file",
        "clf: {path: clf.onnx}",
        "clf: {path: gone.onnx}",
        "W:4:15: models.clf.path: no model file at",
    ),
    (
        "undeclared model",
        "    model: enc\n    batching",
        "    model: bert\n    batching",
        "W:9:12: workloads.search-query.model: expected the name of a declared model (clf, enc), found 'bert'",
    ),
    (
        "offline without output",
        "    output: out/\n",
        "",
        "W:11:3: workloads.nightly: missing required key 'output' (folder or s3://",
    ),
    (
        "schedule on interactive",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n    schedule: {cron: '0 2 * * *'}\n",
        "W:11:5: workloads.search-query.schedule: `schedule` applies to offline workloads only",
    ),
    (
        "name not DNS-safe",
        "  search-query:",
        "  Search_Query:",
        "W:6:3: workloads.Search_Query: expected a DNS-safe name",
    ),
    (
        "name a route takes",
        "  search-query:",
        "  stats:",
        "W:6:3: workloads.stats: /v2/models/stats is Triton's statistics route",
    ),
    (
        "unknown mode",
        "mode: interactive",
        "mode: realtime",
        "W:7:11: workloads.search-query.mode: expected 'interactive' or 'offline', found 'realtime'",
    ),
    (
        "unknown task",
        "    task: embed\n    model: enc\n    batching",
        "    task: classify\n    model: enc\n    batching",
        "W:8:11: workloads.search-query.task: expected 'embed', 'infer' or 'generate', found 'classify'",
    ),
    (
        "generate without tokenizer",
        "    task: embed\n    model: enc\n    batching",
        "    task: generate\n    model: clf\n    batching",
        "W:9:12: workloads.search-query.model: task 'generate' needs a tokenizer, but model 'clf' declares none",
    ),
    (
        "missing required key",
        "    mode: interactive\n",
        "",
        "W:6:3: workloads.search-query: missing required key 'mode'",
    ),
    (
        "bad handler",
        "    model: enc\n    batching",
        "    model: enc\n    handler: not a handler\n    batching",
        "W:10:14: workloads.search-query.handler: expected module:attribute, e.g. "
        "mypkg.hooks:handler, found 'not a handler'",
    ),
    # Said in words, never as the regular expression behind the check.
    (
        "a bad pod memory",
        "    batching",
        "    deploy: {memory: lots}\n    batching",
        "W:10:22: workloads.search-query.deploy.memory: expected a quantity like 2Gi, "
        "512Mi or 1.5G, found 'lots'",
    ),
    (
        "a Dask address without its scheme",
        "    output: out/\n",
        "    output: out/\n    runner: {kind: dask, address: '10.0.0.5:8786'}\n",
        "W:17:35: workloads.nightly.runner.address: expected an address like "
        "tcp://10.0.0.5:8786, found '10.0.0.5:8786'",
    ),
    (
        "duplicate key",
        "    model: enc\n    batching",
        "    model: enc\n    model: enc\n    batching",
        "W:10:5: workloads.search-query.model: key 'model' appears twice",
    ),
    (
        "wrong version",
        "version: 1",
        "version: 2",
        "W:1:10: version: expected 1, found 2",
    ),
    (
        "a boolean for the version",
        "version: 1",
        "version: true",
        "W:1:10: version: expected 1, found true",
    ),
    (
        "fields: a bad template",
        "    output: out/\n",
        '    output: out/\n    fields: {id: ticket_id, text: "{subject"}\n',
        "W:17:35: workloads.nightly.fields.text: '{' at position 0 of '{subject' opens no field",
    ),
    (
        "fields: keeping the id's name",
        "    output: out/\n",
        "    output: out/\n    fields: {keep: [customer, id]}\n",
        "W:17:20: workloads.nightly.fields.keep: 'id' names the output line's id",
    ),
    (
        "fields: keeping a field of the embed output",
        "    output: out/\n",
        "    output: out/\n    fields: {keep: [customer, embedding]}\n",
        "W:17:20: workloads.nightly.fields.keep: 'embedding' is a field of an embed output "
        "line too, so it would be written twice",
    ),
    (
        "fields: keeping a field of the generate output",
        "    task: embed\n    model: enc\n    input: in/\n    output: out/\n",
        "    task: generate\n    model: enc\n    input: in/\n    output: out/\n"
        "    fields: {prompt: '{body}', keep: [text]}\n",
        "W:17:38: workloads.nightly.fields.keep: 'text' is a field of a generate output line "
        "too, so it would be written twice",
    ),
    (
        "fields: another task's item",
        "    output: out/\n",
        "    output: out/\n    fields: {prompt: body}\n",
        "W:17:14: workloads.nightly.fields.prompt: `fields.prompt` is for task generate; task embed",
    ),
    (
        "fields on interactive",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n    fields: {id: ticket_id}\n",
        "W:11:5: workloads.search-query.fields: `fields` applies to offline workloads only",
    ),
    (
        "generation on embed",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n    generation: {max_new_tokens: 8}\n",
        "W:11:5: workloads.search-query.generation: `generation` applies to generate workloads "
        "only (how tokens are sampled); task 'embed' generates none: remove it, or set "
        "`task: generate`",
    ),
    (
        "generation on infer",
        "    task: embed\n    model: enc\n    input: in/\n    output: out/\n",
        "    task: infer\n    model: clf\n    input: in/\n    output: out/\n"
        "    generation: {temperature: 0}\n",
        "W:17:5: workloads.nightly.generation: `generation` applies to generate workloads only",
    ),
    (
        "a prefill budget on embed",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: {max_batch_size: 8, max_wait_ms: 2, max_prefill_tokens: 64}\n",
        "W:10:51: workloads.search-query.batching.max_prefill_tokens: `max_prefill_tokens` "
        "bounds a generate workload's prefill per step; task 'embed' has none",
    ),
    (
        "a KV budget on embed",
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: {max_batch_size: 8, max_wait_ms: 2, max_kv_bytes: 1000000}\n",
        "W:10:51: workloads.search-query.batching.max_kv_bytes: `max_kv_bytes` bounds a "
        "generate workload's KV cache; task 'embed' has none",
    ),
    (
        "a KV budget on an offline embed workload",
        "    output: out/\n",
        "    output: out/\n    max_kv_bytes: 1000000\n",
        "W:17:5: workloads.nightly.max_kv_bytes: `max_kv_bytes` bounds a generate "
        "workload's KV cache; task 'embed' has none",
    ),
    (
        "offline preemption on generate",
        "    task: embed\n    model: enc\n    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    task: generate\n    model: enc\n"
        "    batching: {max_batch_size: 8, max_wait_ms: 2, preempt_offline: true}\n",
        "W:10:51: workloads.search-query.batching.preempt_offline: `preempt_offline` stops an "
        "embed or infer workload's offline runs",
    ),
    (
        "offline threads on generate",
        "    task: embed\n    model: enc\n    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    task: generate\n    model: enc\n"
        "    batching: {max_batch_size: 8, max_wait_ms: 2, offline_threads: 2}\n",
        "W:10:51: workloads.search-query.batching.offline_threads: `offline_threads` runs an "
        "embed or infer workload's offline batches",
    ),
    (
        "offline beside bound on generate",
        "    task: embed\n    model: enc\n    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    task: generate\n    model: enc\n"
        "    batching: {max_batch_size: 8, max_wait_ms: 2, offline_beside_until: 0.5}\n",
        "W:10:51: workloads.search-query.batching.offline_beside_until: `offline_beside_until` "
        "bounds an embed or infer workload's offline batches",
    ),
    (
        "offline beside bound out of range",
        "    task: embed\n    model: enc\n    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    task: embed\n    model: enc\n"
        "    batching: {max_batch_size: 8, max_wait_ms: 2, offline_beside_until: 0}\n",
        "W:10:73: workloads.search-query.batching.offline_beside_until: expected a value > 0, "
        "found 0",
    ),
    (
        "max_error_rate out of range",
        "    output: out/\n",
        "    output: out/\n    max_error_rate: 1.5\n",
        "W:17:21: workloads.nightly.max_error_rate: expected a value <= 1, found 1.5",
    ),
    (
        # `lanes run` refuses it (flows/job.py): what validates is what runs.
        "output inside the input",
        "    output: out/\n",
        "    output: in/out/\n",
        "W:16:13: workloads.nightly.output: in/out/ is inside the input in/",
    ),
    (
        "a list's item",
        "    output: out/\n",
        "    output: out/\n    fields: {keep: [customer, 3]}\n",
        "W:17:31: workloads.nightly.fields.keep[1]: expected a string, found 3",
    ),
    (
        "top-level unknown key",
        "version: 1",
        "version: 1\nservers: []",
        "W:2:1: servers: unknown key 'servers'",
    ),
]


def test_the_kept_fields_refused_are_the_fields_a_plain_output_line_has() -> None:
    # A generate line is the Completion less `logprobs` (a plain record asks for none).
    from lanes.specrules import _OUTPUT_FIELDS
    from lanes.tasks.decoder import Completion

    made = [f.name for f in dataclasses.fields(Completion) if f.name != "logprobs"]
    assert sorted(_OUTPUT_FIELDS["generate"]) == sorted(made)


@pytest.mark.parametrize(
    ("old", "new", "expected"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_spec_reports_line_path_and_message(
    folder: Path, old: str, new: str, expected: str
) -> None:
    assert old in GOOD, old
    found = problems(folder, GOOD.replace(old, new, 1))
    assert any(p.startswith(expected) for p in found), found


def test_every_problem_is_reported_at_once(folder: Path) -> None:
    text = (
        GOOD.replace("max_batch_size: 8", "max_batch_size: -1")
        .replace("Europe/Paris", "Nowhere")
        .replace("    input: in/\n", "")
    )
    found = problems(folder, text)
    assert len(found) == 3, found
    assert [p.split(":")[1] for p in found] == ["10", "11", "16"]


def test_a_bad_or_missing_mode_hides_none_of_the_workloads_other_problems(
    folder: Path,
) -> None:
    """Each other key is checked as the mode that has it would; nothing that only one
    mode requires (an offline workload's `input`) is asked for."""
    text = (
        GOOD.replace("mode: interactive", "mode: realtime")
        .replace("max_batch_size: 8", "max_batch_size: 0")
        .replace("    mode: offline\n", "")
        .replace(
            "    task: embed\n    model: enc\n    input:",
            "    task: embed\n    model: enc\n    retries: -1\n    input:",
        )
        + "    colour: blue\n"
    )
    assert problems(folder, text) == [
        "W:7:11: workloads.search-query.mode: expected 'interactive' or 'offline', found "
        "'realtime'",
        "W:10:32: workloads.search-query.batching.max_batch_size: expected a value > 0, found 0",
        "W:11:3: workloads.nightly: missing required key 'mode': interactive (someone is "
        "waiting) or offline",
        "W:14:14: workloads.nightly.retries: expected a value >= 0, found -1",
        "W:18:5: workloads.nightly.colour: unknown key 'colour'; expected one of: "
        "batch_size, batching, deploy, description, fields, generation, guard, handler, "
        "idle_unload_s, input, max_error_rate, max_kv_bytes, mode, model, output, retries, "
        "runner, schedule, slo, stream, task, truncate",
    ]


def test_offline_workloads_sharing_an_output_folder_are_refused(folder: Path) -> None:
    """Each workload's commit markers must be its own: one output folder, however
    spelt, or one inside the other, would have each redo and overwrite the other's."""
    offline = "    mode: offline\n    task: embed\n    model: enc\n    input: in2/\n"
    text = GOOD + "".join(
        f"  {name}:\n{offline}    output: {output}\n"
        for name, output in (
            ("same", "./x/../out"),  # line 23
            ("inner", "out/inner/"),  # line 29
            ("s3-a", "s3://bucket/emb/"),
            ("s3-b", "s3://bucket/emb"),  # line 41
            ("s3-c", "s3://bucket/emb2/"),
        )
    )
    (folder / "x").mkdir()
    assert problems(folder, text) == [
        "W:23:13: workloads.same.output: ./x/../out is also the output of workload "
        "nightly (out/): the two would overwrite each other's results; give each offline "
        "workload an output folder of its own",
        "W:29:13: workloads.inner.output: out/inner/ is inside the output of workload "
        "nightly, out/: the two would overwrite each other's results; give each offline "
        "workload an output folder of its own",
        "W:29:13: workloads.inner.output: out/inner/ is inside the output of workload "
        "same, ./x/../out: the two would overwrite each other's results; give each "
        "offline workload an output folder of its own",
        "W:41:13: workloads.s3-b.output: s3://bucket/emb is also the output of workload "
        "s3-a (s3://bucket/emb/): the two would overwrite each other's results; give "
        "each offline workload an output folder of its own",
    ]
    holds = GOOD.replace("    output: out/\n", "    output: out/n/\n") + (
        f"  outer:\n{offline}    output: out\n"
    )
    assert problems(folder, holds) == [
        "W:23:13: workloads.outer.output: out holds the output of workload nightly, "
        "out/n/: the two would overwrite each other's results; give each offline "
        "workload an output folder of its own",
    ]


def test_env_override_changes_effective_value(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS", "5")
    monkeypatch.setenv("LANES_WORKLOADS__NIGHTLY__BATCH_SIZE", "64")
    spec = load_spec(write(folder, GOOD), Settings())
    assert spec.workloads["search-query"].batching.max_wait_ms == 5
    assert spec.workloads["search-query"].batching.max_batch_size == 8  # untouched sibling
    assert spec.workloads["nightly"].batch_size == 64


def test_env_overrides_merge_deeper_over_shallower_in_any_order(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workload's JSON, a section's JSON and one field's variable all apply, the deeper
    over the shallower, whichever the environment lists first."""
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS", "5")
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING", '{"max_wait_ms": 1}')
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY", '{"batching": {"max_batch_size": 4}}')
    monkeypatch.setenv("LANES_WORKLOADS__NIGHTLY", '{"batch_size": 64}')
    spec = load_spec(write(folder, GOOD), Settings())
    batching = spec.workloads["search-query"].batching
    assert (batching.max_batch_size, batching.max_wait_ms) == (4, 5)
    assert spec.workloads["nightly"].batch_size == 64


def test_env_override_is_validated_and_named(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS", "-3")
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QEURY__STREAM", "true")
    found = problems(folder, GOOD)
    assert found[0] == (
        "env LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS: "
        "workloads.search-query.batching.max_wait_ms: expected a value >= 0, found -3"
    )
    assert found[1].startswith(
        "env LANES_WORKLOADS__SEARCH_QEURY: workloads.search_qeury: names no workload"
    )


def test_a_problem_an_override_causes_in_the_file_names_the_override(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file says `mode: interactive`: a problem it now has must say who changed that."""
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__MODE", "offline")
    overridden = " (with workloads.search-query.mode from env LANES_WORKLOADS__SEARCH_QUERY__MODE)"
    assert problems(folder, GOOD) == [
        "W:6:3: workloads.search-query: missing required key 'input' (folder, glob or "
        "s3://bucket/prefix/ of inputs)" + overridden,
        "W:6:3: workloads.search-query: missing required key 'output' (folder or "
        "s3://bucket/prefix/ for outputs)" + overridden,
        "W:10:5: workloads.search-query.batching: `batching` applies to interactive "
        "workloads only; remove it or set `mode: interactive`" + overridden,
    ]


def test_env_override_in_json_names_the_variable_set(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent variable holding JSON is the one to fix, not a child nobody set."""
    monkeypatch.setenv("LANES_WORKLOADS__SEARCH_QUERY__BATCHING", '{"max_wait_ms": -3}')
    monkeypatch.setenv("LANES_WORKLOADS", '{"nightly": {"batch_size": 0}}')
    found = problems(folder, GOOD)
    assert found == [
        "env LANES_WORKLOADS__SEARCH_QUERY__BATCHING: "
        "workloads.search-query.batching.max_wait_ms: expected a value >= 0, found -3",
        "env LANES_WORKLOADS: workloads.nightly.batch_size: expected a value > 0, found 0",
    ]


def test_next_run_honours_timezone(folder: Path) -> None:
    spec = load_spec(write(folder, GOOD), Settings())
    schedule = spec.workloads["nightly"].schedule
    assert schedule is not None
    after = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)
    # 01:30 in Paris (UTC+2 in July) is 23:30 UTC.
    assert schedule.next_run(after).astimezone(UTC) == datetime(2026, 7, 1, 23, 30, tzinfo=UTC)


def test_cli_validate_prints_problems_in_our_words_and_exits_2(folder: Path) -> None:
    """The common mistakes as `lanes validate` prints them: the key's YAML path, what was
    expected and what was found, never pydantic's wording."""
    text = (
        GOOD.replace("max_batch_size: 8, max_wait_ms: 2}", "max_batch_size: eight, max_wiat: 2}")
        .replace("    output: out/\n", "")
        .replace(
            "  nightly:",
            "  weekly:\n    mode: nightly\n    task: embed\n    model: enc\n  nightly:",
        )
    )
    path = write(folder, text)
    done = validate(path)
    assert done.returncode == 2
    assert done.stderr.replace(str(path), "W").splitlines() == [
        "W:10:32: workloads.search-query.batching.max_batch_size: expected an integer, "
        "found 'eight'",
        "W:10:39: workloads.search-query.batching.max_wiat: unknown key 'max_wiat'; "
        "did you mean 'max_wait_ms'?",
        "W:12:11: workloads.weekly.mode: expected 'interactive' or 'offline', found 'nightly'",
        "W:15:3: workloads.nightly: missing required key 'output' (folder or "
        "s3://bucket/prefix/ for outputs)",
        "4 problems found",
    ]


def test_cli_validate_refuses_a_boolean_where_a_number_goes(folder: Path) -> None:
    text = GOOD.replace("    output: out/\n", "    output: out/\n    batch_size: true\n")
    path = write(folder, text)
    done = validate(path)
    assert done.returncode == 2
    # (The empty model files are problems of their own.)
    lines = done.stderr.replace(str(path), "W").splitlines()
    assert "W:17:17: workloads.nightly.batch_size: expected an integer, found true" in lines


def numeric_fields(model: type[BaseModel], seen: set[type] | None = None) -> Iterator[Any]:
    """(model, field name, the field's type with its constraints) for each int or float
    field of `model` and the models under it."""
    seen = seen if seen is not None else set()
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        leaves = list(_leaves(field.annotation))
        for leaf in leaves:
            if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                yield from numeric_fields(leaf, seen)
        if any(leaf in (int, float) for leaf in leaves):
            yield model, name, Annotated[field.annotation, field]


def _leaves(annotation: Any) -> Iterator[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, Annotated, list, dict):
        for arg in typing.get_args(annotation):
            yield from _leaves(arg)
    else:
        yield annotation


def test_every_number_of_the_spec_takes_a_number_alone() -> None:
    """Each integer and number field of workloads.yaml refuses a boolean and a numeric
    string, as lax pydantic would not (`true` read as 1): a new field must be strict too."""
    found = list(numeric_fields(Spec))
    assert len(found) > 20, found  # the walk reaches every model
    for model, name, annotation in found:
        adapter = TypeAdapter(annotation)
        for value in (True, False, "1"):
            with pytest.raises(ValidationError) as refused:
                adapter.validate_python(value)
            kinds = {e["type"] for e in refused.value.errors()}
            assert kinds <= {"int_type", "float_type"}, (model.__name__, name, value, kinds)


BOMB = "".join(
    f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]\n" if n else "l0: &l0 [lol, lol, lol]\n"
    for n in range(9)
)
# (name, the file's bytes made from GOOD, expected problem line): each made the loader
# crash, hang or accept a spec that failed later.
HOSTILE_CASES = [
    (
        "a mapping where a name goes",
        GOOD.replace("    model: enc\n    batching", "    model: {name: enc}\n    batching"),
        "W:9:12: workloads.search-query.model: expected a string, found an object",
    ),
    (
        "a mapping as a key",
        GOOD.replace("  search-query:", "  {search: query}:"),
        "W:6:3: workloads: expected a name as key, found a mapping",
    ),
    ("nested 500 deep", GOOD + "x: " + "[" * 500 + "]" * 500, "W:18:23: nested more than 20 deep"),
    (
        "a 5,000-digit integer",
        GOOD.replace("max_batch_size: 8", "max_batch_size: " + "9" * 5000),
        "W:10:32: workloads.search-query.batching.max_batch_size: an integer of 5000 digits",
    ),
    (
        "a path longer than the file system takes",
        GOOD.replace("clf: {path: clf.onnx}", "clf: {path: " + "a" * 5000 + "}"),
        "W:4:15: models.clf.path: expected a path of at most 4096 characters",
    ),
    (
        "a file name longer than the file system takes",
        GOOD.replace("clf: {path: clf.onnx}", "clf: {path: " + "a" * 300 + ".onnx}"),
        "W:4:15: models.clf.path: expected a path whose every name is at most 255 bytes",
    ),
    (
        "a time zone longer than the file system takes",
        GOOD.replace("Europe/Paris", "Europe/" + "P" * 5000),
        "W:17:46: workloads.nightly.schedule.timezone: expected an IANA time zone",
    ),
    ("an alias bomb", BOMB + GOOD, "W:5:35: more than 20000 keys and values"),
    (
        "an alias inside itself",
        GOOD + "x: &x [*x]\n",
        "W:18:8: alias *x is inside the node it names",
    ),
    (
        "a !!binary model name",
        GOOD.replace("    model: enc\n    batching", "    model: !!binary ZW5j\n    batching"),
        "W:9:12: workloads.search-query.model: the tag !!binary is not plain data",
    ),
    (
        "an explicit !!int",
        GOOD.replace("max_batch_size: 8", "max_batch_size: !!int eight"),
        "W:10:32: workloads.search-query.batching.max_batch_size: the tag !!int is not plain",
    ),
    (
        "a cron that never fires",
        GOOD.replace('"30 1 * * *"', '"* * 31 2 *"'),
        "W:17:22: workloads.nightly.schedule.cron: '* * 31 2 *' never fires",
    ),
    (
        "bytes that are not UTF-8",
        GOOD.replace("  nightly:", "  nightly: # caf\udce9", 1),
        "W:11:17: not UTF-8 text: byte 0xe9",
    ),
    ("a NUL character", GOOD.replace("in/", "in\x00/"), "W:15:14: invalid YAML: character U+0000"),
    (
        "a missing top-level key",
        "version: 1\nmodels: {}\n",
        "W:1:1: missing required key 'workloads'",
    ),
    ("an empty file", "", "W:1:1: missing required key 'models'"),
    (
        "a list for a spec",
        "- version: 1\n",
        "W:1:1: expected a mapping of `version`, `models` and `workloads`, found an array",
    ),
    (
        "a boolean for a spec",
        "true\n",
        "W:1:1: expected a mapping of `version`, `models` and `workloads`, found true",
    ),
    (
        "a key of the other mode (offline)",
        GOOD.replace("    output: out/\n", "    output: out/\n    batching: {max_batch_size: 8}\n"),
        "W:17:5: workloads.nightly.batching: `batching` applies to interactive workloads only",
    ),
    (
        "a key of the other mode (interactive)",
        GOOD.replace("max_wait_ms: 2}\n", "max_wait_ms: 2}\n    retries: 3\n"),
        "W:11:5: workloads.search-query.retries: `retries` applies to offline workloads only",
    ),
    (
        "stream on an offline workload",
        GOOD.replace("    output: out/\n", "    output: out/\n    stream: true\n"),
        "W:17:5: workloads.nightly.stream: `stream` applies to interactive workloads only",
    ),
    (
        "an infinite deadline",
        GOOD.replace("max_wait_ms: 2}", "max_wait_ms: .inf}"),
        "W:10:48: workloads.search-query.batching.max_wait_ms: expected a finite number, found inf",
    ),
    (
        "a key with a newline",
        GOOD.replace(
            "    model: enc\n    batching", '    model: enc\n    "a\\nb": 1\n    batching'
        ),
        "W:10:5: workloads.search-query.'a\\nb': unknown key 'a\\nb'",
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in HOSTILE_CASES], ids=[c[0] for c in HOSTILE_CASES]
)
def test_hostile_spec_is_one_problem_line_not_a_crash(
    folder: Path, text: str, expected: str
) -> None:
    path = folder / "workloads.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(SpecError) as caught:
        load_spec(path, Settings())
    found = [str(p).replace(str(path), "W") for p in caught.value.problems]
    assert any(p.startswith(expected) for p in found), found
    assert all("\n" not in p for p in found), found


def test_what_yaml_would_make_a_date_or_a_bool_stays_as_written(folder: Path) -> None:
    text = GOOD.replace("  search-query:", "  on:").replace(
        "    mode: interactive\n", "    mode: interactive\n    description: 2024-13-45\n"
    )
    spec = load_spec(write(folder, text), Settings())
    assert spec.workloads["on"].description == "2024-13-45"


def test_aliases_and_merge_keys_still_work(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = GOOD.replace(
        "    batching: {max_batch_size: 8, max_wait_ms: 2}\n",
        "    batching: &fast {max_batch_size: 8, max_wait_ms: 2}\n",
    ).replace(
        "  nightly:\n",
        "  second:\n    <<: &query {mode: interactive, task: embed, model: enc}\n"
        "    batching: *fast\n  nightly:\n",
    )
    # An override of one use of an alias changes that use alone.
    monkeypatch.setenv("LANES_WORKLOADS__SECOND__BATCHING__MAX_WAIT_MS", "7")
    spec = load_spec(write(folder, text), Settings())
    second = spec.workloads["second"]
    assert second.mode == "interactive" and second.batching.max_wait_ms == 7
    assert spec.workloads["search-query"].batching.max_wait_ms == 2


@pytest.mark.parametrize("case", ["an alias bomb", "a !!binary model name"])
def test_cli_validate_hostile_spec_exits_2_in_one_line_each(folder: Path, case: str) -> None:
    [text] = [c[1] for c in HOSTILE_CASES if c[0] == case]
    path = write(folder, text)
    done = validate(path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"{path}:") and lines[-1] == "1 problem found", lines
    assert "Traceback" not in done.stderr


def test_a_handler_that_raises_on_reading_is_a_problem_at_its_line(folder: Path) -> None:
    (folder / "hooks_that_raise.py").write_text(
        "class Hooks:\n"
        "    @property\n"
        "    def pre(self):\n"
        "        raise RuntimeError('not today')\n\n\n"
        "handler = Hooks()\n"
    )
    text = GOOD.replace(
        "    model: enc\n    batching",
        "    model: enc\n    handler: hooks_that_raise:handler\n    batching",
    )
    found = problems(folder, text)
    assert found == [
        "W:10:5: workloads.search-query.handler: handler hooks_that_raise:handler: "
        "reading pre/post failed: RuntimeError('not today')"
    ]


def test_post_on_an_interactive_generate_workload_is_a_problem_validate_reports(
    folder: Path,
) -> None:
    """Online, a generate workload answers OpenAI's completion shapes, which a post
    cannot change: rather than ignore it there and apply it offline, the spec refuses it."""
    (folder / "gen_hooks.py").write_text(
        "class Both:\n"
        "    def pre(self, item):\n        return item\n\n"
        "    def post(self, output):\n        return {'text': output.text}\n\n\n"
        "class PreOnly:\n"
        "    def pre(self, item):\n        return item\n\n\n"
        "both = Both()\npre_only = PreOnly()\n"
    )
    text = GOOD + (
        "  code:\n    mode: interactive\n    task: generate\n    model: enc\n"
        "    handler: gen_hooks:both\n"
        "  code-pre:\n    mode: interactive\n    task: generate\n    model: enc\n"
        "    handler: gen_hooks:pre_only\n"
        "  code-nightly:\n    mode: offline\n    task: generate\n    model: enc\n"
        "    input: in/\n    output: out-code/\n    handler: gen_hooks:both\n"
    )
    message = (
        "workloads.code.handler: handler gen_hooks:both: defines post, but an interactive "
        "generate workload answers in OpenAI's completion shapes, which post cannot change "
        "(post shapes offline records only); drop post and post-process on the client, or "
        "declare the workload `mode: offline`"
    )
    assert problems(folder, text) == [f"W:22:5: {message}"]
    model, _ = embed_model(folder / "real")  # validate reads the embed model's inputs
    (folder / "enc.onnx").write_bytes(model.read_bytes())
    done = validate(folder / "workloads.yaml")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"{folder / 'workloads.yaml'}:22:5: {message}",
        "1 problem found",
    ]


def test_a_default_temperature_takes_the_range_a_request_does(tmp_path: Path) -> None:
    """A default beyond what a request may set would make every record that repeats it
    an error line."""
    spec = tmp_path / "workloads.yaml"
    spec.write_text(
        "models:\n  m: {path: m.onnx}\nworkloads:\n  g:\n    model: m\n    task: generate\n"
        "    mode: interactive\n    generation: {temperature: 3}\n"
    )
    with pytest.raises(SpecError, match=r"temperature: expected a value <= 2, found 3"):
        load_spec(spec, Settings(), check_files=False)


def test_the_readmes_workloads_yaml_example_validates(tmp_path: Path) -> None:
    """The reference example under "## workloads.yaml", as written, is a spec `lanes
    validate` takes: each key it shows is one its workload's mode and task take."""
    section = README.read_text().split("## workloads.yaml", 1)[1]
    found = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert found, "the README's workloads.yaml section has no yaml example"
    spec = tmp_path / "workloads.yaml"
    spec.write_text(found.group(1))
    embed_model(tmp_path / ".lanes" / "models" / "minilm")  # the paths it names
    (tmp_path / "mypkg").mkdir()  # and its `handler: mypkg.hooks:handler`
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    hooks = "class Hooks:\n    def pre(self, item):\n        return item\n\nhandler = Hooks()\n"
    (tmp_path / "mypkg" / "hooks.py").write_text(hooks)
    done = validate(spec)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{spec}: ok (2 workloads)"


def test_an_interactive_workloads_batches_keep_its_kv_budget() -> None:
    """The Batch API runs an interactive workload's batch as its offline copy: the copy's
    shards are bounded as its engine is."""
    live = InteractiveWorkload.model_validate(
        {"mode": "interactive", "task": "generate", "model": "dec"}
        | {"batching": {"max_kv_bytes": 4096}}
    )
    assert in_offline_lane(live, "in/", "out/", batch_size=8).max_kv_bytes == 4096
