"""The OpenAI Batch API on the endpoint, through the official `openai` client, against a
real uvicorn server, a real Prefect server and a real process worker that runs the
batches in the offline lane.

A shard is held open with the FileGate (tests/batch_hooks.py: a text that says HOLD
waits in the worker until the test creates the gate file), never with a timing window;
the completion window passes by the server's injected wall clock.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types import BatchError

from lanes.batches import Batches, public
from lanes.digests import model_key
from lanes.errors import InvalidInput, LanesError
from lanes.jobs import BATCH_PREFIX, Job
from lanes.measurements import Measurements, Throughput
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.batch_hooks import MARK
from tests.flows_fixtures import moto_server, outputs_of, s3_env, text, write_spec
from tests.gates import GATE_FILE_ENV, ManualClock, held_marker, wait_until
from tests.prefect_server import PREFECT, PrefectServer
from tests.servers import ServerThread

pytestmark = pytest.mark.slow

SHARD_LINES = 3
BUCKET = "lanes-batch-store"
WAIT_S = 180.0  # a batch: the worker starts a flow run process and loads the model
# Each look at a batch asks the Prefect server for its run: looking every 10 ms kept the
# server, and this process, busy beside the flow run they wait for.
POLL_S = 0.2
WORKLOADS = {
    "embed-live": {
        "mode": "interactive",
        "task": "embed",
        "model": "enc",
        "handler": "tests.batch_hooks:hold",
    },
    "embed-night": {
        "mode": "offline",
        "task": "embed",
        "model": "enc",
        "input": "in/",
        "output": "out/",
        "schedule": {"cron": "0 3 * * *", "timezone": "UTC"},
        "max_error_rate": 1.0,  # a shard of three lines has one too long
    },
}


@dataclass
class Setup:
    project: Path
    spec: Path
    store: Path
    env: dict[str, str]  # a process's: Prefect, the store
    gate: Path
    clock: ManualClock  # seconds since the epoch, as the server sees them
    api: str  # the Prefect API

    def server(self, store: str | None = None, **batch: Any) -> ServerThread:
        """A server on this setup's store (or `store`), with `batch`'s batch settings too."""
        batch = {"store": store or str(self.store), "shard_lines": SHARD_LINES, **batch}
        return ServerThread(self.spec, now=self.clock, batch=batch, prefect_api_url=self.api)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with started(tmp_path_factory.mktemp("batches")) as ready:
        yield ready


@contextmanager
def started(root: Path) -> Iterator[Setup]:
    """A Prefect server with the spec deployed, its worker, and a store, under `root`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from lanes.router.deploy import deploy

    project = root / "project"
    spec = write_spec(project, WORKLOADS)
    (project / "in").mkdir()
    store, gate = root / "store", root / "gate"
    with (
        PrefectServer(root / "prefect-home") as prefect,
        pytest.MonkeyPatch.context() as env,
        moto_server() as s3,
    ):
        prefect.wait()
        s3_env(env, s3).create_bucket(Bucket=BUCKET)
        env.setenv("LANES_BATCH__STORE", str(store))
        with temporary_settings(updates={PREFECT_API_URL: prefect.api_url}):
            deployed = deploy(load_spec(spec), spec, Settings())
        assert "lanes-offline/openai_batch" in deployed.deployments
        process_env = {
            **prefect.env,
            "LANES_BATCH__STORE": str(store),
            GATE_FILE_ENV: str(gate),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            # The S3 test's store: the worker reads its batches' inputs there and
            # writes their outputs there.
            "LANES_ALLOWED_INPUT_ROOTS": json.dumps([f"s3://{BUCKET}/"]),
            "LANES_ALLOWED_OUTPUT_ROOTS": json.dumps([f"s3://{BUCKET}/"]),
            **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        worker = subprocess.Popen(
            [*PREFECT, "worker", "start", "--pool", "lanes"],
            env=process_env,
            cwd=project,
            stdout=(root / "worker.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            clock = ManualClock(1.9e9)
            yield Setup(project, spec, store, process_env, gate, clock, prefect.api_url)
        finally:
            worker.terminate()
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                # Seen once on a fast machine: Prefect's worker logged the SIGTERM,
                # forwarded it as SIGINT, and never exited with no run in flight.
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)


def lines_for(model: str, texts: list[str], url: str = "/v1/embeddings") -> bytes:
    rows = [
        {"custom_id": f"r{i}", "method": "POST", "url": url, "body": {"model": model, "input": t}}
        for i, t in enumerate(texts)
    ]
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def finished(client: openai.OpenAI, batch_id: str) -> Any:
    final = {"completed", "failed", "expired", "cancelled"}
    return wait_until_value(lambda: _if(client.batches.retrieve(batch_id), final), WAIT_S)


def _if(batch: Any, statuses: set[str]) -> Any:
    return batch if batch.status in statuses else None


def wait_until_value(check: Any, timeout: float) -> Any:
    found: list[Any] = []

    def probe() -> bool:
        value = check()
        if value is not None:
            found.append(value)
        return value is not None

    wait_until(probe, "the batch", timeout, POLL_S)
    return found[-1]


def batch_folder(setup: Setup, batch_id: str) -> Path:
    """Where the batch's input copy and its run's shards are (its record's `_lanes`)."""
    record = json.loads((setup.store / "batches" / f"{batch_id}.json").read_bytes())
    return Path(record["_lanes"]["folder"])


def left_of_run(setup: Setup, batch_id: str) -> set[str]:
    """What an ended batch's folder still holds, apart from its run's manifests."""
    folder = batch_folder(setup, batch_id)
    kept = "out/_manifests/"
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    return {name for name in found if not name.startswith(kept)}


def jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.splitlines() if line.strip()]


def without_ids(line: dict[str, Any], vectors: bool = True) -> dict[str, Any]:
    """A line less what names its run (the request id is made from the shard's URI),
    and without `vectors`, less its embeddings."""
    line = json.loads(json.dumps(line))
    del line["id"]
    if isinstance(line.get("response"), dict):
        del line["response"]["request_id"]
        if not vectors:
            for item in line["response"]["body"].get("data", []):
                del item["embedding"]
    return line


def typed_errors(content: bytes) -> list[BatchError]:
    """Each line's `error` as the openai client types it (a string would not parse)."""
    return [BatchError.model_validate(line["error"]) for line in jsonl(content)]


def vectors(lines: list[dict[str, Any]]) -> list[list[float]]:
    return [line["response"]["body"]["data"][0]["embedding"] for line in lines]


def test_a_batch_runs_in_the_offline_lane_as_lanes_run_does(setup: Setup) -> None:
    texts = [text(i) for i in range(7)] + ["w1 " * 400]  # the last is over max_length
    # Blank lines count in a line's number (editors number them) and hold no request.
    rows = lines_for("embed-night", texts).splitlines(keepends=True)
    body = b"\n" + b"".join(rows[:3]) + b"\n\n" + b"".join(rows[3:])
    (setup.project / "in" / "mine.jsonl").write_bytes(body)
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(file=("mine.jsonl", io.BytesIO(body)), purpose="batch")
        assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (
            len(body),
            "mine.jsonl",
            "batch",
        )
        assert client.files.content(uploaded.id).read() == body
        batch = client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"team": "search"},
        )
        assert batch.status == "in_progress" and batch.request_counts.total == 8
        done = finished(client, batch.id)
        assert done.status == "completed", done.errors
        assert done.metadata == {"team": "search"}
        assert (done.request_counts.completed, done.request_counts.failed) == (7, 1)
        output = jsonl(client.files.content(done.output_file_id).read())
        error_file = client.files.content(done.error_file_id).read()
        errors = jsonl(error_file)
        assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in range(7)]
        assert [(e["custom_id"], e["line"]) for e in errors] == [("r7", 11)]
        (typed,) = typed_errors(error_file)
        # Its shards, and its input's copy, went once its files were saved; the run's
        # manifest (what it cost) stays.
        assert left_of_run(setup, done.id) == set()
        manifest = Job(done.id, Settings(), prefect_api_url=setup.api).manifest()
        assert manifest["outputs"] == 7
        assert client.files.content(done.output_file_id).read()
        assert client.batches.retrieve(done.id).status == "completed"

    # `lanes run` of the same workload over the same file writes the same lines.
    ran_it = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "run", "embed-night", "--output", "out/"],
        env=setup.env,
        cwd=setup.project,
        capture_output=True,
        timeout=300,
    )
    assert ran_it.returncode == 3, ran_it.stderr  # finished, one record rejected
    ran = outputs_of(setup.project / "out")
    # Equal but for the last float bits: shards of other sizes pad their batches otherwise.
    assert [without_ids(x, vectors=False) for x in output] == [
        without_ids(x, vectors=False) for x in ran
    ]
    np.testing.assert_allclose(vectors(output), vectors(ran), atol=1e-6)
    # The same rejection, its error a BatchError object where `lanes run` says a string.
    (ran_error,) = jsonl((setup.project / "out" / "_errors" / "mine.jsonl").read_bytes())
    answered = ran_error["response"]["body"]["error"]
    assert (typed.code, typed.message, typed.param, typed.line) == (
        answered["code"] or "invalid_request",
        ran_error["error"],
        answered["param"],
        11,
    )
    assert errors[0]["id"] == f"batch_req_{errors[0]['response']['request_id']}"
    assert without_ids(errors[0])["response"] == without_ids(ran_error)["response"]

    # client.job(batch id) follows the same run as a submitted job; its lines, once
    # the batch ended, are in the batch's files.
    job = Job(done.id, Settings(), prefect_api_url=setup.api)
    assert job.status() == "COMPLETED_WITH_ERRORS"
    with pytest.raises(LanesError, match=f"its files \\({done.output_file_id} and "):
        list(job.results())
    listed = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "job"],
        env=setup.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    mine = [line.split() for line in listed.stdout.splitlines() if line.startswith(done.id)]
    assert [row[1:3] for row in mine] == [["batch", "COMPLETED_WITH_ERRORS"]]


def test_an_interactive_workloads_batch_equals_the_endpoint(setup: Setup) -> None:
    texts = [text(i) for i in range(5)]
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(
            file=("live.jsonl", io.BytesIO(lines_for("embed-live", texts))), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        done = finished(client, batch.id)
        assert done.status == "completed" and done.error_file_id is None, done
        output = jsonl(client.files.content(done.output_file_id).read())
        online = client.embeddings.create(model="embed-live", input=texts)
    for line, answer in zip(output, online.data, strict=True):
        vector = line["response"]["body"]["data"][0]["embedding"]
        np.testing.assert_allclose(vector, answer.embedding, atol=1e-6)


def test_an_upload_over_the_file_limit_is_413_by_the_file_not_the_body(setup: Setup) -> None:
    most = 1000
    batch = {"store": str(setup.store), "max_file_bytes": most}
    with ServerThread(setup.spec, batch=batch, prefect_api_url=setup.api) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        fits = lines_for("embed-live", ["w1"])
        assert client.files.create(file=("a.jsonl", fits), purpose="batch").bytes == len(fits)
        over = b"x" * (most + 1)  # the body's bound leaves room for the multipart framing
        with pytest.raises(openai.APIStatusError, match="over the limit of 1000 bytes") as refused:
            client.files.create(file=("b.jsonl", over), purpose="batch")
        assert refused.value.status_code == 413


def test_a_malformed_file_fails_in_validating_naming_the_line(setup: Setup) -> None:
    good = lines_for("embed-live", ["w1 w2"]).decode()
    body = good + "{not json\n" + good.replace("r0", "r1").replace("/v1/embeddings", "/v1/x")
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(file=("bad.jsonl", body.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        assert batch.status == "failed"
        assert batch.errors is not None
        found = [(e.line, e.param) for e in batch.errors.data or []]
        assert found == [(2, None), (3, "url")], batch.errors
        assert "line 2: not JSON" in (batch.errors.data or [])[0].message
        # No such file, a bad window: answered at once, in OpenAI's shape.
        with pytest.raises(openai.NotFoundError):
            client.batches.create(
                input_file_id="file-nope", endpoint="/v1/embeddings", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="soon"
            )
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")


def held_batch(client: openai.OpenAI, setup: Setup) -> Any:
    """A batch of three shards whose second holds at the gate until the test opens it;
    returned once the other two committed."""
    texts = [text(i) for i in range(9)]
    texts[3] = f"{MARK} w1 w2"
    uploaded = client.files.create(
        file=("held.jsonl", lines_for("embed-live", texts)), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="1h"
    )
    wait_until(held_marker(setup.gate).exists, "shard 2 held", WAIT_S)
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed == 6,  # type: ignore[union-attr]
        "shards 1 and 3 committed",
        WAIT_S,
        POLL_S,
    )
    return batch


@pytest.fixture
def closed_gate(setup: Setup) -> Iterator[None]:
    setup.gate.unlink(missing_ok=True)
    held_marker(setup.gate).unlink(missing_ok=True)
    try:
        yield
    finally:
        setup.gate.touch()  # whatever still waits goes on


def test_cancel_mid_run_keeps_the_committed_lines(setup: Setup, closed_gate: None) -> None:
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch = held_batch(client, setup)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = finished(client, batch.id)
        assert done.status == "cancelled", done
        assert left_of_run(setup, batch.id) == set()
        output = jsonl(client.files.content(done.output_file_id).read())
        assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in (0, 1, 2, 6, 7, 8)]
        with pytest.raises(openai.BadRequestError, match="already cancelled"):
            client.batches.cancel(batch.id)
    assert Job(done.id, Settings(), prefect_api_url=setup.api).status() == "CANCELLED"


def test_a_passed_window_expires_the_batch_with_its_finished_lines(
    setup: Setup, closed_gate: None
) -> None:
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch = held_batch(client, setup)
        setup.clock.advance(3601)
        done = finished(client, batch.id)
        assert done.status == "expired", done
        assert done.expired_at is not None
        assert left_of_run(setup, batch.id) == set()
        output = jsonl(client.files.content(done.output_file_id).read())
        errors = jsonl(client.files.content(done.error_file_id).read())
    assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in (0, 1, 2, 6, 7, 8)]
    assert [(e["custom_id"], e["line"]) for e in errors] == [("r3", 4), ("r4", 5), ("r5", 6)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert [e["error"]["line"] for e in errors] == [4, 5, 6]
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 3)

    # `lanes job` says it expired, as /v1/batches does, not that someone cancelled it.
    job = Job(done.id, Settings(), prefect_api_url=setup.api)
    assert job.status() == "EXPIRED"
    assert "completion window passed" in (job.message() or "")
    assert "with 6 lines answered" in (job.message() or "")
    waited = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "job", done.id, "--wait", "--timeout", "30"],
        env=setup.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert waited.returncode == 1, waited.stderr
    assert f"job {done.id}" in waited.stderr and "ended EXPIRED: the batch expired" in waited.stderr
    assert "with 6 lines answered" in waited.stderr


def test_a_batch_whose_window_passed_before_its_run_reads_expired_everywhere(
    setup: Setup,
) -> None:
    """The server's clock an hour behind the worker's: the run starts past the batch's
    window, starts no shard and ends on its own (no `expire`). /v1/batches, the SDK and
    `lanes job` all say expired, none that it completed."""
    behind = ManualClock(time.time() - 7200)
    batch = {"store": str(setup.store), "shard_lines": SHARD_LINES}
    with ServerThread(setup.spec, now=behind, batch=batch, prefect_api_url=setup.api) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(
            file=("late.jsonl", lines_for("embed-live", [text(i) for i in range(4)])),
            purpose="batch",
        )
        created = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="1h"
        )
        done = finished(client, created.id)
        assert done.status == "expired", done
        errors = jsonl(client.files.content(done.error_file_id).read())
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"r{i}", "batch_expired") for i in range(4)
    ]
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 4)
    job = Job(done.id, Settings(), prefect_api_url=setup.api)
    assert job.status() == "EXPIRED"
    assert "with 0 lines answered" in (job.message() or "")
    listed = subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", "job"],
        env=setup.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    mine = [line.split() for line in listed.stdout.splitlines() if line.startswith(done.id)]
    assert [row[1:3] for row in mine] == [["batch", "EXPIRED"]]


def test_a_failed_run_answers_each_request_it_left_in_the_error_file(
    setup: Setup, closed_gate: None
) -> None:
    """Its run crashed (a pod evicted, a worker killed) with a shard uncommitted: nothing
    is lost, each request of it is an error line."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch = held_batch(client, setup)
        run = uuid.UUID(batch.id.removeprefix(BATCH_PREFIX))  # its flow run's id
        with (
            temporary_settings(updates={PREFECT_API_URL: setup.api}),
            get_client(sync_client=True) as prefect,
        ):
            crashed = Crashed(message="the worker's pod was evicted")
            prefect.set_flow_run_state(run, crashed, force=True)
        done = finished(client, batch.id)
        assert done.status == "failed", done
        output = jsonl(client.files.content(done.output_file_id).read())
        error_file = client.files.content(done.error_file_id).read()
        errors = jsonl(error_file)
    assert sorted(line["custom_id"] for line in output) == [f"r{i}" for i in (0, 1, 2, 6, 7, 8)]
    assert [(e["custom_id"], e["line"]) for e in errors] == [("r3", 4), ("r4", 5), ("r5", 6)]
    assert [(e.code, e.line) for e in typed_errors(error_file)] == [
        ("batch_failed", 4),
        ("batch_failed", 5),
        ("batch_failed", 6),
    ]
    assert "pod was evicted" in errors[0]["error"]["message"]
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 3)


def test_a_restarted_server_still_reports_the_batch(setup: Setup, closed_gate: None) -> None:
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch = held_batch(client, setup)
    setup.gate.touch()
    with setup.server() as again:
        client = openai.OpenAI(base_url=f"{again.url}/v1", api_key="none")
        done = finished(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 9, done


def test_two_replicas_finalizing_one_batch_write_one_set_of_files(setup: Setup) -> None:
    """Two servers over one store see the batch's run ended at once, and both read its
    record unfinished: one claims it and assembles the files, the other answers
    `finalizing` (or, came late, the finished batch), and no file is an orphan."""
    texts = [text(i) for i in range(5)]
    texts[2] = "w1 " * 400  # over max_length: an error file too
    settings = Settings(batch={"store": str(setup.store), "shard_lines": SHARD_LINES})
    with setup.server(sweep_s=0) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(
            file=("race.jsonl", lines_for("embed-live", texts)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        # Ended, not yet finalized: nobody has retrieved it since, nor swept it.
        job = Job(batch.id, settings, prefect_api_url=setup.api)
        ended = {"COMPLETED", "COMPLETED_WITH_ERRORS"}
        wait_until(lambda: job.status() in ended, "the batch's run", WAIT_S, POLL_S)

        # Each replica's every look at the clock waits for the other's: both read the
        # record unfinished (a finalize reads the clock after the record), then both
        # try to claim it.
        together = threading.Barrier(2, timeout=WAIT_S)

        def clock() -> float:
            together.wait()
            return setup.clock()

        spec = load_spec(setup.spec, settings)
        replicas = [Batches(spec, settings, clock, setup.api) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(r.retrieve, batch.id) for r in replicas]
            answers = [f.result(timeout=WAIT_S) for f in running]
        stored = replicas[0].store.batch(batch.id)
        assert "completed" in [a["status"] for a in answers], answers  # the claim's winner
        for answer in answers:
            if answer["status"] == "completed":
                assert answer["output_file_id"] == stored["output_file_id"]
                assert answer["error_file_id"] == stored["error_file_id"] is not None
            else:
                assert answer["status"] == "finalizing", answer
        assert [r.retrieve(batch.id) for r in replicas] == [public(stored)] * 2
        mine = [f for f in replicas[0].store.files() if f.filename.startswith(batch.id)]
        assert sorted(f.id for f in mine) == sorted(
            [stored["output_file_id"], stored["error_file_id"]]
        )

        output = client.files.content(stored["output_file_id"]).read()
        assert sorted(line["custom_id"] for line in jsonl(output)) == ["r0", "r1", "r3", "r4"]
        errors = client.files.content(stored["error_file_id"]).read()
        assert [(e.code, e.line) for e in typed_errors(errors)] == [("context_length_exceeded", 3)]
        listed = [f.id for f in client.files.list()]
        assert stored["output_file_id"] in listed
        retrieved = client.files.retrieve(stored["output_file_id"])
        assert (retrieved.bytes, retrieved.purpose) == (len(output), "batch_output")
        client.files.delete(stored["output_file_id"])
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(stored["output_file_id"])
        assert client.batches.retrieve(batch.id).status == "completed"


class HeldClock:
    """A wall clock whose every reader waits until the test opens it."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.opened = threading.Event()
        self.waiting = 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.waiting += 1
        assert self.opened.wait(WAIT_S), "the test never opened the clock"
        return self.now


def test_a_stale_record_is_never_saved_over_a_finished_batch(
    setup: Setup, closed_gate: None
) -> None:
    """One server reads a running batch, then (held at its clock) sees the window passed
    or is asked to cancel it, while another finalizes it: the finished record stays."""
    settings = Settings(batch={"store": str(setup.store), "shard_lines": SHARD_LINES})
    spec = load_spec(setup.spec, settings)
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        batch = held_batch(client, setup)
        held = HeldClock(setup.clock() + 3601)  # past the batch's 1h window
        late = Batches(spec, settings, held, setup.api)
        with ThreadPoolExecutor(2) as pool:
            expiring = pool.submit(late.retrieve, batch.id)  # holds after the run's state
            cancelling = pool.submit(late.cancel, batch.id)  # holds after reading it
            wait_until(lambda: held.waiting == 2, "both held at the clock", WAIT_S)
            setup.gate.touch()
            job = Job(batch.id, settings, prefect_api_url=setup.api)
            ended = {"COMPLETED", "COMPLETED_WITH_ERRORS"}
            wait_until(lambda: job.status() in ended, "the batch's run", WAIT_S, POLL_S)
            done = Batches(spec, settings, setup.clock, setup.api).retrieve(batch.id)
            assert done["status"] == "completed", done
            held.opened.set()
            assert expiring.result(timeout=WAIT_S)["status"] == "completed"
            with pytest.raises(InvalidInput, match="already completed"):
                cancelling.result(timeout=WAIT_S)
        after = client.batches.retrieve(batch.id)
    assert (after.status, after.output_file_id) == ("completed", done["output_file_id"])
    assert after.cancelling_at is None and after.request_counts.completed == 9  # type: ignore[union-attr]


def test_batches_list_paginates(setup: Setup) -> None:
    with setup.server() as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(file=("p.jsonl", b"{}\n"), purpose="batch")
        made = []
        for _ in range(3):
            setup.clock.advance(1)  # newest first: by creation time
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
            )
            made.append(batch.id)
        seen = [b.id for b in client.batches.list(limit=2)]  # the iterator follows `after`
        first = client.batches.list(limit=2)
        assert first.has_more and len(first.data) == 2
        assert [i for i in seen if i in made] == made[::-1]
        listed = httpx.get(f"{server.url}/v1/files", timeout=10).json()
        assert uploaded.id in [f["id"] for f in listed["data"]]
        client.files.delete(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)


def test_a_batch_whose_run_is_gone_reads_failed_and_the_list_answers_the_rest(
    setup: Setup, tmp_path: Path
) -> None:
    """A batch whose flow run was deleted from Prefect reads `failed`, saying so, alone
    and in the list, which answers every other batch. Never stored: a server pointed at
    the wrong Prefect API must not fail every batch for good."""
    from lanes.batchstore import new_id
    from lanes.prefectapi import PrefectApi

    now = time.time()
    # A run due at the off-peak window (no measured rate): the worker leaves it alone.
    settings = Settings(batch={"store": str(tmp_path / "store"), "start": "latest"})
    batches = Batches(load_spec(setup.spec), settings, lambda: now, setup.api)
    made = []
    for content in (lines_for("embed-live", ["w1"]), b"{bad\n"):
        uploaded = batches.store.put_file(new_id("file-"), "in.jsonl", "batch", iter([content]))
        assert uploaded is not None
        body = {"input_file_id": uploaded.id, "endpoint": "/v1/embeddings"}
        made.append(batches.create({**body, "completion_window": "24h"}))
    lost, other = made
    assert (lost["status"], other["status"]) == ("in_progress", "failed")
    with PrefectApi(setup.api).client() as prefect:
        prefect.delete_flow_run(uuid.UUID(lost["id"].removeprefix(BATCH_PREFIX)))

    page = batches.page(None, 20)

    assert [b["id"] for b in page["data"]] == [other["id"], lost["id"]]
    assert page["data"][0] == other
    gone = page["data"][1]
    assert (gone["status"], gone["failed_at"]) == ("failed", int(now))
    (error,) = gone["errors"]["data"]
    assert error["code"] == "batch_run_missing"
    assert f"flow run is not on the Prefect API at {setup.api}: deleted there" in error["message"]
    assert batches.retrieve(lost["id"]) == gone
    assert batches.store.batch(lost["id"])["status"] == "in_progress"
    # Cancelled, it reads the same: no run is left to cancel, and no "no job" 404.
    assert batches.cancel(lost["id"])["errors"] == gone["errors"]


def test_the_store_on_s3(setup: Setup) -> None:
    import boto3

    texts = [text(i) for i in range(4)]
    with setup.server(f"s3://{BUCKET}/store/") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(
            file=("s3.jsonl", lines_for("embed-live", texts)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        done = finished(client, batch.id)
        assert done.status == "completed", done.errors
        output = jsonl(client.files.content(done.output_file_id).read())
    assert sorted(line["custom_id"] for line in output) == ["r0", "r1", "r2", "r3"]
    listed = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="store/files/")
    keys = {obj["Key"] for obj in listed["Contents"]}
    assert f"store/files/{uploaded.id}.data" in keys
    assert f"store/files/{done.output_file_id}.data" in keys
    assert not list(setup.store.glob(f"**/{uploaded.id}*"))


def test_the_readme_example_runs(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## Batch API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    polls: list[float] = []

    def sleep(seconds: float) -> None:  # the example's poll, bounded and short
        assert len(polls) < WAIT_S * 4, "the README's batch never ended"
        polls.append(seconds)
        time.sleep(0.25)

    with setup.server() as server:
        code = block.replace("http://127.0.0.1:8000", server.url).replace(
            '"search-query"', '"embed-live"'
        )
        code = code.replace("time.sleep(5)", "sleep(5)")
        exec(compile(code, "README.md", "exec"), {"sleep": sleep})
    printed = jsonl(capsys.readouterr().out.encode())
    assert sorted(line["custom_id"] for line in printed) == ["q0", "q1"]


def test_start_latest_schedules_the_run_before_the_deadline(setup: Setup) -> None:
    now = time.time()
    batch_settings = {"store": str(setup.store), "shard_lines": SHARD_LINES, "start": "latest"}
    server = ServerThread(
        setup.spec, now=lambda: now, batch=batch_settings, prefect_api_url=setup.api
    )
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        uploaded = client.files.create(
            file=("late.jsonl", lines_for("embed-live", ["w1 w2"])), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        run = Job(batch.id, Settings(), prefect_api_url=setup.api).scheduled_time()
        assert run is not None
        assert now + 60 < run.timestamp() <= batch.expires_at
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        assert finished(client, batch.id).status == "cancelled"


def test_start_latest_plans_on_the_rate_of_the_model_as_it_is_now(setup: Setup) -> None:
    """A rate measured on another model (the workload's model since replaced) is not
    this model's: the flow plans by the model's key, and so does the Batch API."""
    now = time.time()
    settings = Settings()
    spec = load_spec(setup.spec)
    own = model_key(spec, spec.workloads["embed-live"], settings)
    batch_settings = {"store": str(setup.store), "shard_lines": SHARD_LINES, "start": "latest"}
    server = ServerThread(
        setup.spec, now=lambda: now, batch=batch_settings, prefect_api_url=setup.api
    )
    store = Measurements(settings.home)
    saved: list[Path] = []

    def scheduled_after_slow_rate(key: str) -> float:
        """When a batch runs after a rate of `key` too slow to finish it was measured."""
        saved.append(
            store.save(
                Throughput(
                    workload="embed-live",
                    model_key=key,
                    lane="offline",
                    items_per_second=1e-6,
                    measured_at=datetime.now(UTC),
                    source="a test",
                )
            )
        )
        uploaded = client.files.create(
            file=("rated.jsonl", lines_for("embed-live", ["w1 w2"])), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        run = Job(batch.id, settings, prefect_api_url=setup.api).scheduled_time()
        assert run is not None
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        assert finished(client, batch.id).status == "cancelled"
        return run.timestamp()

    try:
        with server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
            # Another model's rate is no rate: the run waits for the off-peak window.
            assert scheduled_after_slow_rate("another model") > now + 60
            # This model's rate says the batch cannot finish in time: it starts at once.
            assert scheduled_after_slow_rate(own) <= now + 60
    finally:
        for path in saved:
            path.unlink()


def test_a_server_without_a_prefect_api_refuses_a_batch_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch runs as a Prefect flow: a server that has no Prefect API says so to its
    operator, at once, and splits nothing."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from lanes.batchstore import new_id
    from lanes.errors import NotConfigured

    spec = write_spec(tmp_path / "project", WORKLOADS)
    monkeypatch.setenv("LANES_BATCH__STORE", str(tmp_path / "store"))
    monkeypatch.delenv("LANES_PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        batches = Batches(load_spec(spec), Settings())
        line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}
        line["body"] = {"model": "embed-night", "input": "x"}
        uploaded = batches.store.put_file(
            new_id("file"), "in.jsonl", "batch", iter([json.dumps(line).encode() + b"\n"])
        )
        body = {"input_file_id": uploaded.id, "endpoint": "/v1/embeddings"}
        with pytest.raises(NotConfigured, match="PREFECT_API_URL") as refused:
            batches.create({**body, "completion_window": "24h"})
    assert refused.value.status == 503 and refused.value.repeats  # not the caller's to retry
    assert "lanes deploy" in str(refused.value)
    assert batches.store.batch_ids() == []


def test_a_batch_with_the_prefect_api_down_is_503_to_retry_and_leaves_no_input(
    tmp_path: Path,
) -> None:
    """A Prefect API that does not answer is the server's dependency down, not a fault
    of the request: 503 with Retry-After (the openai client waits it out), and the
    split input goes with the failed create, or each retry would leave a copy."""
    from tests.servers import free_port

    spec = write_spec(tmp_path / "project", WORKLOADS)
    store = tmp_path / "store"
    port = free_port()  # nothing listens there
    down = f"http://127.0.0.1:{port}/api"
    batch = {"store": str(store), "shard_lines": SHARD_LINES}
    # A password in the API's URL (a proxy's basic auth) is never told to a client.
    with_password = f"http://lanes:PASSWORD-9f2c@127.0.0.1:{port}/api"
    with ServerThread(spec, batch=batch, prefect_api_url=with_password) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        body = lines_for("embed-night", [text(i) for i in range(7)])
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(body)), purpose="batch")
        request = {"input_file_id": uploaded.id, "endpoint": "/v1/embeddings"}
        answer = httpx.post(
            f"{server.url}/v1/batches", json={**request, "completion_window": "24h"}
        )
        assert answer.status_code == 503, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert error["code"] == "service_unavailable"
        assert f"cannot reach the Prefect API at {down}:" in error["message"]
        assert "PASSWORD" not in answer.text
        with pytest.raises(openai.InternalServerError) as refused:
            client.batches.create(**request, completion_window="24h")  # type: ignore[arg-type]
        assert refused.value.status_code == 503
        assert client.batches.list().data == []
    batches = store / "batches"
    assert not batches.exists() or list(batches.iterdir()) == []
