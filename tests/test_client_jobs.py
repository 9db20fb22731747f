"""The SDK client's offline half on a real Prefect server: `lanes deploy` (router.deploy)
registers the deployments, `client.submit` creates flow runs, one `prefect worker
--run-once` runs them, and jobs are followed by id from other processes (`lanes
submit`, `lanes job`) and from both clients. The README's usage example runs here too,
as written.

One Prefect server for the module (10-30 s to start): it boots while the serving
models load.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import lanes
from lanes.jobs import AsyncJob, Job
from lanes.schedule import Schedule
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.flows_fixtures import moto_server, s3_env
from tests.prefect_server import PREFECT, PrefectServer, call_api
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CRON, ZONE = "30 3 * * *", "Europe/Berlin"
BUCKET = "lanes-jobs"

WORKLOADS = f"""\
  search-query:
    mode: interactive
    task: embed
    model: minilm
  code-complete:
    mode: interactive
    task: generate
    model: tinycode
    generation: {{max_new_tokens: 32, temperature: 0}}
  embed-corpus:
    mode: offline
    task: embed
    model: minilm
    input: in/
    output: out/
    schedule: {{cron: "{CRON}", timezone: {ZONE}}}
    max_error_rate: 0.5          # GOOD and BAD: one record in four is rejected
  embed-s3:
    mode: offline
    task: embed
    model: minilm
    input: s3://{BUCKET}/in/
    output: s3://{BUCKET}/out/
    schedule: {{cron: "{CRON}", timezone: {ZONE}}}   # no cron run falls due in a test
"""
# The client's spec knows one offline workload that was never deployed.
GHOST = """\
  ghost:
    mode: offline
    task: embed
    model: minilm
    input: in/
    output: out-ghost/
"""
GOOD = [{"id": f"r{i}", "text": f"record number {i}"} for i in range(3)]
BAD = {"id": "r-bad", "txt": "a misspelt field"}
TICKETS = [{"ticket_id": i, "text": f"ticket {i}"} for i in range(3)]  # no `id`


@dataclass(frozen=True)
class Setup:
    project: Path
    spec: Path  # the deployed spec
    client_spec: Path  # the same and `ghost`, in another folder
    env: dict[str, str]  # what a process needs to reach both servers
    api: str  # the Prefect API
    endpoint: str  # the serving endpoint


@pytest.fixture(scope="module")
def setup(demo_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from lanes.router.deploy import deploy

    root = tmp_path_factory.mktemp("jobs")
    project, other = root / "project", root / "client"
    project.mkdir()
    other.mkdir()
    spec = write_spec(project, demo_models, WORKLOADS)
    client_spec = write_spec(other, demo_models, WORKLOADS + GHOST)
    with PrefectServer(root / "prefect-home") as prefect, ServerThread(spec) as server:
        env = {**prefect.wait(), "LANES_ENDPOINT": server.url, "LANES_SPEC": str(spec)}
        # `lanes deploy`, in this process: compile, make the work pool, prefect deploy --all.
        with temporary_settings(updates={PREFECT_API_URL: prefect.api_url}):
            deployed = deploy(load_spec(spec), spec, Settings())
        assert deployed.deployments == [
            "lanes-offline/embed-corpus",
            "lanes-offline/embed-s3",
            "lanes-offline/openai_batch",
        ]
        yield Setup(project, spec, client_spec, env, prefect.api_url, server.url)


def run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen[str], timeout: float = 120, code: int = 0) -> tuple[str, str]:
    """Its stdout and stderr, once it exited with `code`."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == code, f"{process.args} ended {process.returncode}:\n{out}{err}"
    return out, err


def lanes_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lanes.router.cli", *args]


def flow_run(setup: Setup, id: str) -> dict[str, Any]:
    """The flow run as Prefect's REST API has it."""
    result: dict[str, Any] = call_api("GET", f"{setup.api}/flow_runs/{id}").json()
    return result


def due_submissions(setup: Setup) -> int:
    """Submitted runs that are scheduled and due within a minute."""
    soon = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    body = {
        "flow_runs": {
            "tags": {"all_": ["lanes-submit"]},
            "state": {"type": {"any_": ["SCHEDULED"]}},
            "expected_start_time": {"before_": soon},
        }
    }
    count: int = call_api("POST", f"{setup.api}/flow_runs/count", json=body).json()
    return count


async def test_offpeak_submit_is_scheduled_at_the_next_window(setup: Setup) -> None:
    schedule = Schedule(cron=CRON, timezone=ZONE)
    async with lanes.AsyncClient(spec=setup.spec, prefect_api_url=setup.api) as client:
        first = schedule.next_run()
        job = await client.submit("embed-corpus", GOOD)  # the default: offpeak
        windows = {first, schedule.next_run()}  # two only if a window began meanwhile
        assert isinstance(job, AsyncJob) and await job.status() == "SCHEDULED"
        window = await job.scheduled_time()
        assert window in windows
    # Read back from Prefect itself: the run's time and parameters.
    run = flow_run(setup, job.id)
    assert datetime.fromisoformat(run["next_scheduled_start_time"]) == window
    assert run["deployment_id"] == flow_run_deployment(setup)
    parameters = run["parameters"]
    assert parameters["workload"] == "embed-corpus"
    staged = Path(parameters["input"])
    assert staged.parent == setup.project / "in" / "_submitted"
    assert [json.loads(x) for x in (staged / "records.jsonl").read_text().splitlines()] == GOOD
    same = Job(job.id, prefect_api_url=setup.api)  # the sync handle, by id
    assert same.output == parameters["output"]
    assert Path(same.output).parent == setup.project / "out" / "jobs"
    with pytest.raises(lanes.LanesError, match=r"has no outputs at .* yet \(it is SCHEDULED\)"):
        list(same.results())
    with pytest.raises(lanes.LanesError, match=r"no manifest yet \(it is SCHEDULED\)"):
        same.manifest()
    assert list(same.errors()) == []

    waited = subprocess.run(
        lanes_cli("job", job.id, "--wait", "--timeout", "0.2"),
        env=setup.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert waited.returncode == 4, waited.stderr  # still scheduled: timed out waiting
    assert "is still SCHEDULED after 0.2 s" in waited.stderr

    assert same.cancel() == "CANCELLED"
    assert await job.status() == "CANCELLED"
    with pytest.raises(lanes.JobFailed, match="ended CANCELLED"):
        same.wait(5)


def test_a_job_cancelled_while_its_process_starts_has_ended(setup: Setup) -> None:
    """A worker took the run (PENDING, its process starting) when the job was cancelled:
    Prefect keeps it CANCELLING and never lets it run, and with workers' cancellation
    off (Prefect's default) nobody marks it CANCELLED. The job has ended all the same."""
    with lanes.Client(spec=setup.spec, prefect_api_url=setup.api) as client:
        job = client.submit("embed-corpus", GOOD)  # off-peak: it stays scheduled
    set_state = f"{setup.api}/flow_runs/{job.id}/set_state"
    call_api("POST", set_state, json={"state": {"type": "PENDING"}})  # as a worker does
    assert job.cancel() == "CANCELLED"
    assert flow_run(setup, job.id)["state"]["type"] == "CANCELLING"
    with pytest.raises(lanes.JobFailed, match="ended CANCELLED"):
        job.wait(5)
    # Its process then asks to run, and Prefect refuses: it never does.
    running = call_api("POST", set_state, json={"state": {"type": "RUNNING"}}).json()
    assert running["status"] == "REJECT"
    assert job.status() == "CANCELLED"


def test_a_traced_submit_hands_its_trace_to_the_flow_run(setup: Setup) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lanes.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    with lanes.Client(spec=setup.spec, prefect_api_url=setup.api, tracing=tracing) as client:
        job = client.submit("embed-corpus", GOOD)  # off-peak: it stays scheduled
    try:
        (span,) = [s for s in exporter.get_finished_spans() if s.name == "submit embed-corpus"]
        parameters = flow_run(setup, job.id)["parameters"]
        _, trace_id, span_id, _ = parameters["trace"]["traceparent"].split("-")
        assert int(trace_id, 16) == span.context.trace_id
        assert int(span_id, 16) == span.context.span_id
    finally:
        job.cancel()
    # Untraced, the run has no trace parameter: the flow's default.
    with lanes.Client(spec=setup.spec, prefect_api_url=setup.api) as client:
        plain = client.submit("embed-corpus", GOOD)
    try:
        assert "trace" not in flow_run(setup, plain.id)["parameters"]
    finally:
        plain.cancel()


def flow_run_deployment(setup: Setup) -> str:
    answer = call_api("GET", f"{setup.api}/deployments/name/lanes-offline/embed-corpus")
    return str(answer.json()["id"])


async def test_jobs_run_on_a_worker_and_are_followed_by_id_from_other_processes(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocking calls on the event loop are fine here: nothing else runs on it."""
    processes: list[subprocess.Popen[str]] = []

    def launch(args: list[str], cwd: Path = ROOT) -> subprocess.Popen[str]:
        processes.append(start(args, setup.env, cwd))
        return processes[-1]

    readme = launch([sys.executable, "-c", readme_example()], setup.project)
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in [*GOOD, BAD]))
    cli_submit = launch(lanes_cli("submit", "embed-corpus", str(records), "--now"))
    try:
        # An input folder that does not exist: the job fails on the worker.
        (setup.project / "in").mkdir(exist_ok=True)
        monkeypatch.chdir(setup.project / "in")
        with lanes.Client(spec=setup.spec, prefect_api_url=setup.api) as client:
            before = datetime.now(UTC)
            failing = client.submit("embed-corpus", "missing-folder/", when="now")
            clean = client.submit("embed-corpus", GOOD, when="now")
            # Records in another shape: the records check fails the job before it runs.
            shapeless = client.submit("embed-corpus", TICKETS, when="now")
            after = datetime.now(UTC)
        assert failing.status() == "SCHEDULED"
        scheduled = failing.scheduled_time()
        assert scheduled is not None and before <= scheduled <= after
        missing = flow_run(setup, failing.id)["parameters"]["input"]
        assert missing == str(setup.project / "in" / "missing-folder") + "/"  # made absolute here
        # A flow run made past `submit`, reading outside the workload's input: refused
        # where it runs, whatever its maker checked.
        secret = tmp_path / "elsewhere" / "secret.jsonl"
        secret.parent.mkdir()
        secret.write_text(json.dumps({"id": "secret", "text": "not yours"}) + "\n")
        bypass = create_run(
            setup, {"input": str(secret.parent) + "/", "output": str(tmp_path / "b")}
        )
        out, err = finish(cli_submit)
        job = Job(out.strip(), prefect_api_url=setup.api)  # submitted by `lanes submit`
        assert f"job {job.id}: embed-corpus, scheduled for " in err

        deadline = time.monotonic() + 60
        while due_submissions(setup) < 6:  # the README's job too
            assert readme.poll() is None, readme.communicate()
            assert time.monotonic() < deadline, "the README example did not submit in 60 s"
            time.sleep(0.2)
        run([*PREFECT, "worker", "start", "--pool", "lanes", "--run-once"], setup.env, ROOT, 240)

        # Two more processes follow the job by id: this one, and `lanes job`.
        shown = launch(lanes_cli("job", job.id, "--wait", "--timeout", "30", "--results"))
        shown_clean = launch(lanes_cli("job", clean.id, "--wait", "--timeout", "30"))
        shown_shapeless = launch(lanes_cli("job", shapeless.id, "--wait", "--timeout", "30"))
        assert job.wait(30) is job and job.status() == "COMPLETED_WITH_ERRORS"
        assert (job.message() or "").startswith("1 record rejected, 3 answered")
        assert clean.wait(30).status() == "COMPLETED"
        assert clean.message() == "3 records answered"
        results = sorted(job.results(), key=lambda r: r["id"])
        assert [r["id"] for r in results] == ["r0", "r1", "r2"]
        assert all(len(r["result"]) == 384 for r in results)
        (error,) = job.errors()
        assert error["id"] == "r-bad" and 'missing field "text"' in error["error"]
        manifest = job.manifest()
        assert (manifest["records"], manifest["outputs"], manifest["errors"]) == (4, 3, 1)

        async with lanes.AsyncClient(spec=setup.spec, prefect_api_url=setup.api) as aclient:
            same = aclient.job(job.id)
            assert await same.wait(10) is same
            assert await same.status() == "COMPLETED_WITH_ERRORS"
            assert sorted([r["id"] async for r in same.results()]) == ["r0", "r1", "r2"]
            assert [e["id"] async for e in same.errors()] == ["r-bad"]
            assert (await same.manifest())["outputs"] == 3
            # An ended job stays as it ended.
            assert await same.cancel() == "COMPLETED_WITH_ERRORS"
            failed = aclient.job(failing.id)
            with pytest.raises(lanes.JobFailed, match=r"ended FAILED: .*missing-folder"):
                await failed.wait(30)
            with pytest.raises(
                lanes.JobFailed, match=r"InvalidInput: input .*/elsewhere/ is outside"
            ):
                await aclient.job(bypass).wait(30)
        assert not (tmp_path / "b").exists()

        # `lanes job --wait` exits 3 with record errors, 0 without, 1 for a failed job.
        out, err = finish(shown, code=3)
        assert f"{job.id} COMPLETED_WITH_ERRORS" in err and "1 record rejected" in err
        assert sorted(json.loads(line)["id"] for line in out.splitlines()) == ["r0", "r1", "r2"]
        out, err = finish(shown_clean)
        assert f"{clean.id} COMPLETED" in out + err
        out, err = finish(shown_shapeless, code=1)
        assert "ended FAILED" in err and "validating the records" in err
        assert 'line 1: missing field "id"' in err
        out, err = finish(readme)
        assert out.rstrip().endswith("['q1']")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


def test_a_run_of_the_workload_as_declared_is_followed_by_id_too(
    setup: Setup, tmp_path: Path
) -> None:
    """A run with no output of its own (the cron's, `prefect deployment run`, `lanes
    run`) writes the workload's declared output: `lanes job ID --results` reads its
    committed shards there, and not the submitted jobs' outputs beside them (jobs/)."""
    (setup.project / "in").mkdir(exist_ok=True)
    (setup.project / "in" / "declared.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in GOOD)
    )
    done = run(lanes_cli("run", "embed-corpus"), setup.env, setup.project, 240)
    (flow_run_id,) = set(re.findall(r"/flow-run/([0-9a-f-]{36})", done))
    assert not flow_run(setup, flow_run_id)["parameters"].get("output")
    # A submitted job's output, inside the workload's: another job's lines.
    other = setup.project / "out" / "jobs" / "someone-elses"
    other.mkdir(parents=True, exist_ok=True)
    (other / "records.jsonl").write_text(json.dumps({"id": "theirs", "result": []}) + "\n")
    shown = run(lanes_cli("job", flow_run_id, "--results"), setup.env, tmp_path)
    ids = [json.loads(line)["id"] for line in shown.splitlines() if line.startswith("{")]
    assert sorted(ids) == ["r0", "r1", "r2"]
    job = Job(flow_run_id, Settings(spec=setup.spec), prefect_api_url=setup.api)
    assert job.output == str(setup.project / "out") + "/"
    # A later run of the same output: each run's manifest is still its own.
    later = run(lanes_cli("run", "embed-corpus"), setup.env, setup.project, 240)
    assert flow_run_id not in later
    assert job.manifest()["flow_run"] == flow_run_id
    assert (job.manifest()["shards_run"], job.manifest()["outputs"]) == (1, 3)


def create_run(setup: Setup, parameters: dict[str, str]) -> str:
    """A flow run of embed-corpus made through Prefect's REST API, due now, as a job."""
    body = {
        "parameters": {"workload": "embed-corpus", **parameters},
        "tags": ["lanes-submit"],
        "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": None}},
    }
    deployment = flow_run_deployment(setup)
    answer = call_api("POST", f"{setup.api}/deployments/{deployment}/create_flow_run", json=body)
    return str(answer.json()["id"])


def flow_runs(setup: Setup) -> int:
    count: int = call_api("POST", f"{setup.api}/flow_runs/count", json={}).json()
    return count


def test_submit_refuses_an_input_outside_the_workloads_own(setup: Setup, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "part.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    before = flow_runs(setup)
    command = lanes_cli("submit", "embed-corpus", "../../elsewhere/*.jsonl", "--now")
    refused = subprocess.run(command, env=setup.env, cwd=cwd, capture_output=True, text=True)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"error: input ../../elsewhere/*.jsonl ({elsewhere}/*.jsonl) is outside" in (
        refused.stderr
    )
    assert "LANES_ALLOWED_INPUT_ROOTS" in refused.stderr
    with lanes.Client(spec=setup.spec, prefect_api_url=setup.api) as client:
        for workload, uri in [
            ("embed-corpus", str(elsewhere)),
            ("embed-corpus", str(setup.project / "in" / ".." / "out")),
            ("embed-s3", f"s3://{BUCKET}/out/"),
            ("embed-s3", f"s3://{BUCKET}/in/../out/"),
        ]:
            with pytest.raises(lanes.InvalidInput, match=r"is outside|may not hold"):
                client.submit(workload, uri, when="now")
    assert flow_runs(setup) == before, "a refused submit makes no flow run"

    # Allowed where it is submitted (and it must be where it runs, too).
    env = {**setup.env, "LANES_ALLOWED_INPUT_ROOTS": json.dumps([str(elsewhere)])}
    out, _ = finish(start(command, env, cwd))
    job = Job(out.strip(), prefect_api_url=setup.api)
    assert flow_run(setup, job.id)["parameters"]["input"] == f"{elsewhere}/*.jsonl"
    assert job.cancel() == "CANCELLED"


def test_records_are_staged_on_s3_when_the_input_is_there(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_server() as endpoint:
        s3 = s3_env(monkeypatch, endpoint)
        s3.create_bucket(Bucket=BUCKET)
        with lanes.Client(spec=setup.spec, prefect_api_url=setup.api) as client:
            job = client.submit("embed-s3", GOOD)
        parameters = flow_run(setup, job.id)["parameters"]
        assert parameters["input"].startswith(f"s3://{BUCKET}/in/_submitted/")
        assert job.output.startswith(f"s3://{BUCKET}/out/jobs/")
        key = parameters["input"].removeprefix(f"s3://{BUCKET}/") + "records.jsonl"
        staged = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode()
        assert [json.loads(line) for line in staged.splitlines()] == GOOD
        assert job.cancel() == "CANCELLED"


def test_submit_errors(setup: Setup) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    client = lanes.Client(spec=setup.client_spec, prefect_api_url=setup.api)
    client.close()  # submit and job need no connection to the endpoint
    with pytest.raises(lanes.LanesError, match=r"no deployment lanes-offline/ghost .*lanes deploy"):
        client.submit("ghost", GOOD, when="now")
    assert not (setup.client_spec.parent / "in").exists(), "a refused submit stages nothing"
    with pytest.raises(lanes.WrongMode, match=r"interactive: use client\.call\('search-query'"):
        client.submit("search-query", GOOD)
    with pytest.raises(lanes.InvalidInput, match='when: expected "offpeak" or "now"') as when:
        client.submit("embed-corpus", GOOD, when="tonight")  # type: ignore[arg-type]
    with pytest.raises(lanes.InvalidInput, match="records: expected at least one record") as none:
        client.submit("embed-corpus", [], when="now")
    assert (when.value.param, none.value.param) == ("when", "records")
    with pytest.raises(lanes.InvalidInput, match="job id: expected a UUID"):
        client.job("12")
    with pytest.raises(lanes.NotFound, match=r"no job .* on the Prefect API"):
        client.job(str(uuid.uuid4())).status()
    with (
        temporary_settings(restore_defaults={PREFECT_API_URL}),
        pytest.raises(lanes.LanesError, match="set PREFECT_API_URL"),
    ):
        lanes.Client(spec=setup.client_spec).submit("ghost", GOOD)  # no URL here or in Prefect


def readme_example() -> str:
    """The first Python block of the README's "Using the SDK client" section."""
    section = README.read_text().split("## Using the SDK client", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found, "the README's client section has no python example"
    return found.group(1)


def test_the_readme_example_is_ten_lines() -> None:
    assert len(readme_example().splitlines()) <= 10
