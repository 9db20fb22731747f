"""The `lanes` CLI as a person runs it: a real subprocess, real files (the settings
matrix runs the same app in this process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from lanes.router.cli import app
from lanes.runtime import detect_gpu
from tests.failing_models import lookup_model
from tests.flows_fixtures import decoder_model
from tests.servers import free_port, write_spec

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS = """\
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {max_batch_size: 16, max_wait_ms: 2}
  flower-classify:
    mode: interactive
    task: infer
    model: classifier
    handler: lanes.demo.labels:handler
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
  nightly-embed:
    mode: offline
    task: embed
    model: minilm
    input: data/
    output: out/
    schedule: {cron: "15 3 * * 1", timezone: Europe/Berlin}
  weekly:
    mode: offline
    task: embed
    model: minilm
    input: data/
    output: out2/
"""


def lanes(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.fixture(scope="module")
def spec_path(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spec(tmp_path_factory.mktemp("cli"), demo_models, WORKLOADS)


@pytest.mark.slow
def test_models_build_puts_the_demo_models_where_the_demo_spec_reads_them(
    demo_models: Path, tmp_path: Path
) -> None:
    """LANES_HOME moves job state, not the models: the build follows the spec."""
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (project / "workloads.yaml").write_bytes((ROOT / "workloads.yaml").read_bytes())
    folder = project / ".lanes" / "models"
    folder.mkdir(parents=True)
    for name in ("minilm", "tinycode", "classifier"):  # built already: the build skips them
        (folder / name).symlink_to(demo_models / name, target_is_directory=True)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lanes.router.cli", *args],
            capture_output=True,
            text=True,
            cwd=project,
            env={**os.environ, "LANES_HOME": str(home), "PYTHONPATH": str(ROOT)},
            timeout=120,
        )

    built = run("models", "build")
    assert built.returncode == 0, built.stderr
    printed = built.stdout.splitlines()[-3:]  # after the progress bar: the model folders
    assert printed == [str(folder.resolve() / n) for n in ("minilm", "tinycode", "classifier")]
    assert not (home / "models").exists()
    checked = run("validate")
    assert checked.returncode == 0, checked.stderr

    from tests.flows_fixtures import write_spec as write_tiny_spec

    other = write_tiny_spec(tmp_path / "other", {})  # its models are none of the demo's
    refused = CliRunner().invoke(app, ["models", "build"], env={"LANES_SPEC": str(other)})
    assert refused.exit_code == 2
    assert one_line_error(refused) == (
        f"error: {other}: names no demo model (minilm, tinycode, classifier) as "
        "FOLDER/NAME/model.onnx, so there is nowhere it would find them; pass --dest, or "
        "set LANES_SPEC to the spec that uses them"
    )


@pytest.mark.slow
def test_plan_json_routes_every_workload(spec_path: Path) -> None:
    done = lanes("plan", str(spec_path), "--json")
    assert done.returncode == 0, done.stderr
    routes = {r["workload"]: r for r in json.loads(done.stdout)}
    assert routes["search-query"]["endpoints"][0] == "POST /v1/embeddings"
    assert routes["search-query"]["batching"]["max_wait_ms"] == 2
    assert routes["flower-classify"]["endpoints"][0] == "POST /v2/models/flower-classify/infer"
    assert "POST /v1/chat/completions" in routes["code-complete"]["endpoints"]
    nightly = routes["nightly-embed"]
    assert nightly["deployment"] == "lanes-offline/nightly-embed"
    assert nightly["schedule"] == "15 3 * * 1 (Europe/Berlin)"
    assert nightly["next_run"].endswith(("+01:00", "+02:00"))
    assert routes["weekly"]["schedule_is_default"] is True


@pytest.mark.slow
def test_plan_table_and_env_override(spec_path: Path) -> None:
    done = lanes(
        "plan", str(spec_path), env={"LANES_WORKLOADS__SEARCH_QUERY__BATCHING__MAX_WAIT_MS": "7"}
    )
    assert done.returncode == 0, done.stderr
    assert "max_wait_ms=7.0" in done.stdout
    assert "lanes-offline/nightly-embed" in done.stdout


@pytest.mark.slow
def test_predict_runs_each_task_in_process(spec_path: Path) -> None:
    embed = lanes("predict", "search-query", "--input", '"hello world"', "--file", str(spec_path))
    assert embed.returncode == 0, embed.stderr
    vector = np.asarray(json.loads(embed.stdout))
    assert vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-4

    labels = lanes(
        "predict",
        "flower-classify",
        "--file",
        str(spec_path),
        "--input",
        '{"features": [[5.1, 3.5, 1.4, 0.2]]}',
    )
    assert labels.returncode == 0, labels.stderr
    [row] = json.loads(labels.stdout)
    assert set(row) == {"label", "score"}

    text = lanes(
        "predict",
        "code-complete",
        "--file",
        str(spec_path),
        "--input",
        '{"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}',
    )
    assert text.returncode == 0, text.stderr
    assert json.loads(text.stdout)["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_predict_bad_input_names_the_field(spec_path: Path) -> None:
    done = lanes("predict", "search-query", "--input", "42", "--file", str(spec_path))
    assert done.returncode == 2
    assert "input: expected a string" in done.stderr
    assert "Traceback" not in done.stderr
    unknown = lanes("predict", "nope", "--input", '"x"', "--file", str(spec_path))
    assert unknown.returncode == 2 and "no workload named 'nope'" in unknown.stderr


def test_predict_takes_a_plain_text_input_as_a_string_as_call_does(spec_path: Path) -> None:
    """One rule for --input: JSON, or a plain text taken as a string."""
    runner = CliRunner()
    given = {
        text: runner.invoke(app, ["predict", "search-query", "-i", text, "-f", str(spec_path)])
        for text in ("hello world", '"hello world"')
    }
    for text, done in given.items():
        assert done.exit_code == 0, (text, done.output)
    plain, quoted = (json.loads(done.stdout) for done in given.values())
    assert plain == quoted


@pytest.mark.parametrize("command", ["predict", "call"])
def test_predict_and_call_refuse_nan_as_the_endpoint_does(spec_path: Path, command: str) -> None:
    """Python's json reads NaN, JSON has none: the endpoint refuses it, and predict, which
    would print it back as NaN, no JSON at all, must too. Text that begins as JSON does
    is JSON gone wrong, not a plain text: call says so before it sends anything."""
    given = [command, "flower-classify", "-i", "[NaN, 2, 3, 4]", "-f", str(spec_path)]
    done = CliRunner().invoke(app, given, prog_name="lanes")
    assert done.exit_code == 2, done.output
    assert one_line_error(done) == (
        "error: --input: expected JSON, found '[NaN, 2, 3, 4]' (NaN is not JSON); to send "
        """a text that begins so, give it as a JSON string, e.g. '"[x] y"'"""
    )


# ---- one line, not a traceback ---------------------------------------------------------


@pytest.mark.slow
def test_predict_a_model_that_fails_prints_one_error_line(tmp_path: Path) -> None:
    """onnxruntime's own error (a Gather index past the table) is a message, not a trace."""
    model = lookup_model(tmp_path / "lookup")
    spec = {
        "version": 1,
        "models": {"lookup": {"path": str(model)}},
        "workloads": {"look": {"mode": "interactive", "task": "infer", "model": "lookup"}},
    }
    path = tmp_path / "workloads.yaml"
    path.write_text(json.dumps(spec))
    done = lanes("predict", "look", "--input", '{"i": [[99]]}', "--file", str(path))
    assert done.returncode == 1
    line = one_line_error(done)
    assert line.startswith("error: workload 'look': model 'lookup' failed on this input: ")


@pytest.mark.slow
def test_validate_says_what_serve_would_of_a_decoder_declared_as_embed(tmp_path: Path) -> None:
    """From the graph's inputs alone: the decoder's weights are never loaded in a session."""
    model, tokenizer = decoder_model(tmp_path / "dec")
    spec = {
        "version": 1,
        "models": {"dec": {"path": str(model), "tokenizer": str(tokenizer)}},
        "workloads": {
            "vec": {"mode": "interactive", "task": "embed", "model": "dec"},
            "chat": {"mode": "interactive", "task": "generate", "model": "dec"},
        },
    }
    path = tmp_path / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = lanes("validate", str(path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"{path}:9:11: workloads.vec.task: model {model} cannot serve task 'embed': embed "
        "feeds input_ids, attention_mask, token_type_ids only, but the model also requires "
        "position_ids, past_key_values.0.key, past_key_values.0.value; it takes "
        "past_key_values inputs, so it is a decoder: declare `task: generate` on the "
        "workload (or export an encoder for embed)",
        "1 problem found",
    ]


def test_validate_reads_the_tokenizer_as_serve_would(demo_models: Path, tmp_path: Path) -> None:
    """A file that is no tokenizer.json (here, records) passed validate and failed the
    workload's load in serve."""
    records = tmp_path / "records.jsonl"
    records.write_text('{"id": 1, "text": "a"}\n')
    spec = {
        "version": 1,
        "models": {
            "enc": {"path": str(demo_models / "minilm" / "model.onnx"), "tokenizer": str(records)}
        },
        "workloads": {"vec": {"mode": "interactive", "task": "embed", "model": "enc"}},
    }
    path = tmp_path / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = CliRunner().invoke(app, ["validate", str(path)], prog_name="lanes")
    assert done.exit_code == 2, done.stderr
    line = one_line_error(done)
    assert line.startswith(f"{path}:5:16: models.enc.tokenizer: cannot load tokenizer {records}: ")
    assert line.endswith("; expected a tokenizers tokenizer.json")


@pytest.mark.slow
def test_predict_refuses_a_decoder_declared_as_embed_in_one_line(tmp_path: Path) -> None:
    model, tokenizer = decoder_model(tmp_path / "dec")
    spec = {
        "version": 1,
        "models": {"dec": {"path": str(model), "tokenizer": str(tokenizer)}},
        "workloads": {"vec": {"mode": "interactive", "task": "embed", "model": "dec"}},
    }
    path = tmp_path / "workloads.yaml"
    path.write_text(json.dumps(spec))
    done = lanes("predict", "vec", "--input", '"a b"', "--file", str(path))
    assert done.returncode == 1
    line = one_line_error(done)
    assert "cannot serve task 'embed'" in line and "declare `task: generate`" in line


def test_models_build_into_a_folder_it_cannot_make_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    dest = tmp_path / "a-file" / "models"
    done = CliRunner().invoke(app, ["models", "build", "--dest", str(dest)], prog_name="lanes")
    assert done.exit_code == 1, done.output
    assert one_line_error(done) == (
        f"error: cannot write the demo models into {dest} (Not a directory): make it "
        "writable, or pass --dest a folder that is"
    )


def test_calibrate_refuses_a_home_it_cannot_store_in_before_it_measures(
    spec_path: Path, tmp_path: Path
) -> None:
    home = tmp_path / "a-file"
    home.write_text("")
    command = ["calibrate", "search-query", "-f", str(spec_path)]
    done = CliRunner().invoke(app, command, env={"LANES_HOME": str(home)}, prog_name="lanes")
    assert done.exit_code == 1, done.output
    assert one_line_error(done) == (
        f"error: cannot store measurements under {home / 'measurements'} (Not a "
        "directory): make LANES_HOME writable, or set it to a folder that is"
    )


def test_tune_refuses_a_chart_it_cannot_write_before_it_loads(
    spec_path: Path, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    png = tmp_path / "a-file" / "chart.png"
    command = ["tune", "search-query", "-f", str(spec_path), "--png", str(png)]
    done = CliRunner().invoke(app, command, prog_name="lanes")
    assert done.exit_code == 1, done.output
    assert one_line_error(done) == (
        f"error: --png: cannot write {png} (its folder is a file): make its folder "
        "writable, or name another"
    )


def one_line_error(done: subprocess.CompletedProcess[str] | Result) -> str:
    """The error a command printed, checked to be a message without a traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, done.stderr  # the problem (and "1 problem found")
    return lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LANES_PORT", "eighty", "env LANES_PORT: expected an integer, found 'eighty'"),
        (
            "LANES_MAX_BODY_BYTES",
            "0",
            "env LANES_MAX_BODY_BYTES: expected a value > 0, found '0'",
        ),
        (
            "LANES_DEVICE",
            "gpu",
            "env LANES_DEVICE: expected 'auto', 'cpu', 'cuda' or 'tensorrt', found 'gpu'",
        ),
        # $inf per 1k items, and --json's Infinity is no JSON.
        (
            "LANES_PRICE_PER_DEVICE_HOUR",
            "inf",
            "env LANES_PRICE_PER_DEVICE_HOUR: expected a finite number, found 'inf'",
        ),
        ("LANES_DRAIN_S", "nan", "env LANES_DRAIN_S: expected a finite number, found 'nan'"),
        ("LANES_SPEC", "", "env LANES_SPEC: expected a path, found an empty value"),
        ("LANES_OFFPEAK__CRON", "* * 31 2 *", "env LANES_OFFPEAK__CRON: '* * 31 2 *' never fires"),
        ("LANES_ALLOWED_INPUT_ROOTS", "/data/", "env LANES_ALLOWED_INPUT_ROOTS: expected JSON"),
        # boto3 would take it and fail at the first S3 call with a traceback.
        (
            "LANES_S3_ENDPOINT",
            "127.0.0.1:9000",
            "env LANES_S3_ENDPOINT: expected an http:// or https:// URL, found '127.0.0.1:9000'",
        ),
        # The variable that was set, and the place in its JSON value.
        (
            "LANES_ALLOWED_INPUT_ROOTS",
            '["/data/", 7]',
            "env LANES_ALLOWED_INPUT_ROOTS: [1]: expected a string, found 7",
        ),
        # The root at fault, not "found an array" (the whole value).
        (
            "LANES_ALLOWED_INPUT_ROOTS",
            '["/data/", "/data/*.jsonl"]',
            "env LANES_ALLOWED_INPUT_ROOTS: expected folders and s3:// prefixes without "
            "wildcards, found '/data/*.jsonl'",
        ),
        (
            "LANES_ALLOWED_OUTPUT_ROOTS",
            '["s3://results/*"]',
            "env LANES_ALLOWED_OUTPUT_ROOTS: expected folders and s3:// prefixes without "
            "wildcards, found 's3://results/*'",
        ),
        # compile would write it into every deployment; Prefect refuses it only at deploy.
        (
            "LANES_WORK_POOL",
            "",
            "env LANES_WORK_POOL: expected a Prefect work pool name (not blank, none of / % & < >)",
        ),
        # An empty key would leave the server open to everyone, silently.
        ("LANES_API_KEY", "", "env LANES_API_KEY: expected a key, found an empty value"),
        ("LANES_INTERNAL_KEY", " ", "env LANES_INTERNAL_KEY: expected a key, found an empty"),
        # A nested setting given whole as its parent's JSON: LANES_BATCH__SHARD_LINES was
        # never set, so naming it would send the user to fix a variable that is not there.
        (
            "LANES_BATCH",
            '{"shard_lines": 0}',
            "env LANES_BATCH: shard_lines: expected a value > 0, found 0",
        ),
        (
            "LANES_OFFPEAK",
            '{"cron": "2am"}',
            "env LANES_OFFPEAK: cron: expected a five-field cron expression",
        ),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["validate"],
        ["run", "nightly-embed"],
        ["call", "search-query", "-i", "hi"],
        # No such spec: were the setting taken, serve would stop there, not serve.
        ["serve", "no-such-workloads.yaml"],
    ],
    ids=["validate", "run", "call", "serve"],
)
def test_a_bad_setting_is_one_line_and_exit_2(
    command: list[str], variable: str, value: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process (the same app `lanes` runs; a process each would only pay the
    imports again): the other tests here run the CLI as a subprocess and read its
    one-line errors the same way."""
    monkeypatch.chdir(ROOT)
    done = CliRunner().invoke(app, command, env={variable: value}, prog_name="lanes")
    # An exception out of the command is a traceback in a real process: exit_code 1.
    assert isinstance(done.exception, SystemExit | None), done.exception
    assert done.exit_code == 2, done.stderr
    assert one_line_error(done).startswith(expected)
    for leak in ("should be", "Field required", "Extra inputs", "pydantic"):
        assert leak not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["call", "nightly-embed", "-i", "hello"],
            "error: workload 'nightly-embed' is offline: submit its records with "
            "`lanes submit nightly-embed RECORDS` instead of call",
        ),
        (
            ["stream", "search-query", "hi"],
            "error: workload 'search-query' is an embed workload: use "
            "`lanes call search-query -i INPUT`, not stream",
        ),
        (
            ["submit", "code-complete", "records.jsonl"],
            "error: workload 'code-complete' is interactive: use "
            "`lanes call code-complete -i INPUT` (or `lanes stream`), not submit",
        ),
        (
            ["call", "search-query", "-i", "hi", "--timeout-ms", "-5"],
            "Invalid value for '--timeout-ms': expected a positive number of milliseconds, "
            "found -5.0",
        ),
        # The SDK's own arguments: among call()'s **options they were a TypeError (a traceback).
        (
            ["call", "code-complete", "-i", '{"prompt": "x", "timeout_ms": 5}'],
            "error: --input: 'timeout_ms' is not an option here; use --timeout-ms",
        ),
        (
            ["call", "code-complete", "-i", '{"messages": [], "input": "x"}'],
            "error: --input: 'input' is not an option here; use 'prompt' or 'messages'",
        ),
        (
            ["call", "code-complete", "-i", '{"prompt": "x", "max_tokenz": 3}'],
            "error: --input: unknown option 'max_tokenz' for workload 'code-complete'; "
            "did you mean 'max_tokens'?",
        ),
        (
            ["call", "code-complete", "--no-stream", "-i", '{"prompt": "x", "stream_options": {}}'],
            "error: --input: lanes call sets 'stream_options' itself; leave it out",
        ),
    ],
    ids=[
        "call offline",
        "stream embed",
        "submit interactive",
        "timeout",
        "timeout_ms field",
        "input field",
        "unknown field",
        "field the SDK sets",
    ],
)
def test_the_client_commands_name_the_command_not_the_sdk_method(
    spec_path: Path, command: list[str], expected: str
) -> None:
    """The SDK's WrongMode names its method (client.submit), its timeout_ms the
    argument: a person at the command line is told the command, and the option."""
    env = {"LANES_SPEC": str(spec_path), "LANES_ENDPOINT": "http://127.0.0.1:9"}
    done = CliRunner().invoke(app, command, env=env, prog_name="lanes")
    assert done.exit_code == 2, done.output
    said = " ".join(done.stderr.replace("│", " ").split())  # unwrapped from click's box
    assert expected in said, said


@pytest.mark.parametrize("command", [["validate"], ["serve"], ["run", "nightly-embed"]])
def test_a_missing_spec_says_where_it_looked(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run in another folder than the spec's (a container's workdir, a cron job's
    home): the folder it looked in, and how to point at the spec."""
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, command, env={"LANES_SPEC": None}, prog_name="lanes")
    assert done.exit_code == 2, done.stderr
    assert one_line_error(done) == (
        f"workloads.yaml: cannot read the spec: no such file ({Path.cwd() / 'workloads.yaml'}); "
        "pass its path or set LANES_SPEC"
    )


@pytest.mark.slow
def test_run_with_prefect_down_is_one_line(spec_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    done = lanes("run", "nightly-embed", "--file", str(spec_path), env={"PREFECT_API_URL": url})
    assert done.returncode == 1, done.stderr
    message = one_line_error(done)
    assert message.startswith(f"error: cannot reach the Prefect API at {url}")
    assert "unset PREFECT_API_URL" in message


@pytest.mark.slow
def test_serve_on_a_port_it_cannot_have_is_one_line(spec_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = lanes("serve", str(spec_path), "--port", str(port))
    assert done.returncode == 1, done.stderr
    assert one_line_error(done).startswith(f"error: cannot listen on 127.0.0.1:{port} (")
    done = lanes("serve", str(spec_path), "--port", "70000")
    assert done.returncode == 2 and "--port" in done.stderr, done.stderr


def test_serve_on_a_device_this_machine_lacks_is_one_line(spec_path: Path) -> None:
    """LANES_DEVICE=cuda without a GPU fails every workload alike: serve exits, rather
    than listening with none of them loaded."""
    if detect_gpu().present:
        pytest.skip("this machine has a GPU: cuda is a device it can give")
    done = lanes("serve", str(spec_path), "--port", "0", env={"LANES_DEVICE": "cuda"})
    assert done.returncode == 1, done.stderr
    assert "listening on" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "error: device is cuda but no GPU is present; set LANES_DEVICE=auto (or cpu) to run "
        "without it"
    )


def test_serve_with_nothing_to_serve_exits_2_before_listening(tmp_path: Path) -> None:
    """Only offline workloads: a server would listen, ready at once, 404 everywhere."""
    from tests.flows_fixtures import write_spec as write_tiny_spec

    offline = {"mode": "offline", "task": "embed", "model": "enc", "input": "in/", "output": "o/"}
    path = write_tiny_spec(tmp_path, {"nightly": offline})
    command = [sys.executable, "-m", "lanes.router.cli", "serve", str(path), "--port", "0"]
    with subprocess.Popen(
        command, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    ) as process:
        assert process.stderr is not None
        printed = []
        # Until it exits, or says it listens (then it would never exit by itself).
        for line in process.stderr:
            printed.append(line)
            if "listening on" in line:
                process.terminate()
                break
        returncode = process.wait(timeout=120)
    stderr = "".join(printed)
    assert "listening on" not in stderr, stderr
    assert returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "error: nothing to serve: the spec declares no interactive workload; declare one "
        "(`mode: interactive`) to serve it (an offline workload with `runner: {kind: "
        "endpoint}` runs on one), or run offline workloads with `lanes run` or `lanes deploy`"
    ]


@pytest.mark.slow
def test_run_checks_the_workload_before_any_prefect_starts(spec_path: Path) -> None:
    # A Prefect API nobody serves: reaching for it would be another error.
    url = f"http://127.0.0.1:{free_port()}/api"
    for workload, expected in (
        ("nope", "error: no workload named 'nope'"),
        ("search-query", "error: workload 'search-query' is interactive"),
    ):
        done = lanes("run", workload, "--file", str(spec_path), env={"PREFECT_API_URL": url})
        assert done.returncode == 2, done.stderr
        assert one_line_error(done).startswith(expected)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["render", "k8s", "--image", "i:1", "--worker-image", "w:1", "--out"],
            "error: --out: cannot write into {where} (",
        ),
        (["submit", "nightly-embed"], "error: {where}: no such file here, nor an input"),
    ],
    ids=["render --out", "submit"],
)
def test_a_file_where_a_folder_is_wanted_or_none_at_all_is_one_line(
    spec_path: Path,
    tmp_path: Path,
    command: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    where = spec_path if command[0] == "render" else tmp_path / "missing.jsonl"
    env = {"LANES_SPEC": str(spec_path)}
    done = CliRunner().invoke(app, [*command, str(where)], env=env, prog_name="lanes")
    assert isinstance(done.exception, SystemExit | None), done.exception
    assert done.exit_code == 2, done.stderr
    assert one_line_error(done).startswith(expected.format(where=where))


def test_validate_tells_the_demo_to_build_and_a_users_files_what_they_should_be(
    tmp_path: Path,
) -> None:
    """Only a path where the demo keeps its models is told to build them; a user's own
    is told what file it should name (and, for a folder, which file in it), relative to
    the spec file as it is named."""
    (tmp_path / "models" / "emb").mkdir(parents=True)
    (tmp_path / "models" / "emb" / "tokenizer.json").write_text("{}")
    (tmp_path / "models" / "empty").mkdir()
    spec = tmp_path / "prod.yaml"
    spec.write_text(
        "version: 1\n"
        "models:\n"
        "  mine: {path: models/nothere.onnx, tokenizer: models/emb}\n"
        "  other: {path: models/empty, tokenizer: models/empty}\n"
        "  minilm: {path: .lanes/models/minilm/model.onnx}\n"
        "workloads: {}\n"
    )
    done = CliRunner().invoke(app, ["validate", str(spec)], prog_name="lanes")
    assert done.exit_code == 2, done.output
    models = tmp_path / "models"
    assert done.stderr.splitlines() == [
        f"{spec}:3:16: models.mine.path: no model file at {models / 'nothere.onnx'}; "
        "expected the path of an .onnx file (relative to prod.yaml): fix it",
        f"{spec}:3:48: models.mine.tokenizer: {models / 'emb'} is a folder; expected a "
        f"tokenizer.json file: point at {models / 'emb' / 'tokenizer.json'}",
        f"{spec}:4:17: models.other.path: {models / 'empty'} is a folder with no .onnx "
        "file in it; expected an .onnx file",
        f"{spec}:4:42: models.other.tokenizer: {models / 'empty'} is a folder with no "
        "tokenizer.json file in it; expected a tokenizer.json file",
        f"{spec}:5:18: models.minilm.path: no model file at "
        f"{tmp_path / '.lanes' / 'models' / 'minilm' / 'model.onnx'}; build the demo "
        "models with `lanes models build`, or fix the path",
        "5 problems found",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["missing/prefect.yaml", "."], ids=["no folder", "a folder"])
def test_compile_into_a_missing_folder_is_one_line(
    spec_path: Path, tmp_path: Path, where: str
) -> None:
    output = tmp_path / where
    done = lanes("compile", str(spec_path), "-o", str(output))
    assert done.returncode == 2, done.stderr
    message = one_line_error(done)
    assert message.startswith(f"error: {output}") and "folder" in message
    assert not (tmp_path / "missing").exists()


@pytest.mark.slow
def test_run_on_dask_advances_the_bar_on_one_prefect_server(tmp_path: Path) -> None:
    """`lanes run` on an embedded Prefect with a local Dask cluster: the shards run in
    the worker processes, the bar counts them in this one, and the workers report to
    the run's own server instead of starting one each."""
    from tests.flows_fixtures import text, write_jsonl
    from tests.flows_fixtures import write_spec as write_tiny_spec

    workload = {
        "mode": "offline",
        "task": "embed",
        "model": "enc",
        "input": "in/",
        "output": "out/",
        "runner": {"kind": "dask", "workers": 2},
    }
    spec = write_tiny_spec(tmp_path, {"spread": workload})
    for shard in range(4):
        rows = [{"id": f"{shard}-{i}", "text": text(i)} for i in range(25)]
        write_jsonl(tmp_path / "in" / f"part-{shard}.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    done = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "run", "spread", "--file", str(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    bar = [line for line in done.stderr.splitlines() if line.startswith("shards (")]
    assert bar and "4/4" in bar[-1] and "100 records" in bar[-1], done.stderr
    assert done.stderr.count("Starting temporary server") == 1, done.stderr


@pytest.mark.slow
def test_compile_names_every_deployment_it_writes_and_a_refusal_is_a_bad_argument(
    spec_path: Path, tmp_path: Path
) -> None:
    output = tmp_path / "prefect.yaml"
    command = ["compile", str(spec_path), "-o", str(output)]
    done = CliRunner().invoke(app, command, prog_name="lanes")
    assert done.exit_code == 0, done.output
    # The Batch API's deployment too: the spec has interactive workloads.
    assert f"{output}: 3 deployment(s) (nightly-embed, weekly, openai_batch)" in done.stdout
    output.write_text("deployments: []\n")  # a prefect.yaml of the user's own
    refused = CliRunner().invoke(app, command, prog_name="lanes")
    assert refused.exit_code == 2, refused.output  # fix: --output elsewhere, or --force
    assert one_line_error(refused).startswith(f"error: {output} was not written by lanes")


def test_an_unknown_job_id_is_a_bad_argument(prefect_api: str) -> None:
    unknown = "00000000-0000-4000-8000-000000000000"
    done = CliRunner().invoke(app, ["job", unknown], prog_name="lanes")
    assert done.exit_code == 2, done.output
    assert one_line_error(done).startswith(f"error: no job {unknown} on the Prefect API at ")
