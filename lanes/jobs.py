"""Offline jobs from the SDK: stage records, schedule a flow run, follow it by id.

A job is a Prefect flow run of the workload's deployment ("lanes-offline/<name>")
with its own `input` and `output`, so the records of one `submit` never mix with
the workload's scheduled inputs or another job's outputs. Everything a Job needs is
in the flow run (its parameters hold the output location), so `Job(id)` works from
any process that reaches the same Prefect API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson

from lanes import layout
from lanes.errors import InvalidInput, JobFailed, LanesError, StorageError
from lanes.settings import Settings
from lanes.spec import Workload
from lanes.storage import Storage, is_s3, join

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

FLOW_NAME = "lanes-offline"  # flows.FLOW_NAME; lanes cannot import the flows wing
FAILED_STATES = frozenset({"FAILED", "CRASHED", "CANCELLED", "CANCELLING"})
POLL_S = 0.5


def submit(
    workload: Workload,
    name: str,
    records: Sequence[Mapping[str, Any]] | str,
    when: Literal["offpeak", "now"],
    settings: Settings,
    base: Path,
) -> Job:
    """Stage `records` beside the workload's input (or take an input URI as it is), and
    create a flow run of its deployment at the next off-peak window or now."""
    from prefect.deployments import run_deployment

    if workload.input is None or workload.output is None:
        raise InvalidInput(f"workload {name!r} has no input/output; it cannot take jobs")
    key = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
    storage = Storage(settings)
    if isinstance(records, str):
        source = records
    else:
        source = join(_folder(workload.input, base), layout.SUBMITTED, key) + "/"
        storage.write_bytes(join(source, "records.jsonl"), _jsonl(records))
    output = join(_folder(workload.output, base), layout.JOBS, key) + "/"
    if when == "now":
        scheduled = None
    else:
        schedule = workload.schedule or settings.offpeak
        scheduled = schedule.next_run()
    # Called outside any event loop (AsyncClient uses a thread): Prefect runs it sync.
    run: FlowRun = run_deployment(  # type: ignore[assignment]
        f"{FLOW_NAME}/{name}",
        parameters={"workload": name, "input": source, "output": output},
        scheduled_time=scheduled,
        timeout=0,
        tags=["lanes-submit"],
    )
    return Job(str(run.id), settings)


class Job:
    """One submitted offline job: `status()`, `wait()`, `results()`, `errors()`,
    `manifest()`, `cancel()`. Reads Prefect for its state and storage for its files."""

    def __init__(self, id: str, settings: Settings | None = None) -> None:
        self.id = id
        self.settings = settings or Settings()

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def _run(self) -> FlowRun:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                return client.read_flow_run(uuid.UUID(self.id))
            except (ObjectNotFound, ValueError):
                raise LanesError(f"no job {self.id!r} in the Prefect API") from None

    def status(self) -> str:
        """The flow run's state: SCHEDULED, PENDING, RUNNING, COMPLETED, FAILED, ..."""
        state = self._run().state
        return state.type.value if state else "UNKNOWN"

    @property
    def scheduled_time(self) -> datetime | None:
        run = self._run()
        return run.next_scheduled_start_time or run.expected_start_time

    @property
    def output(self) -> str:
        return str(self._run().parameters["output"])

    def wait(self, timeout: float = 3600.0) -> Job:
        """Block until the job ends; raises JobFailed if it did not complete, TimeoutError
        if it is still going after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            run = self._run()
            state = run.state.type.value if run.state else "UNKNOWN"
            if state == "COMPLETED":
                return self
            if state in FAILED_STATES:
                message = run.state.message if run.state else ""
                raise JobFailed(f"job {self.id} ended {state}: {message}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {state} after {timeout} s")
            time.sleep(POLL_S)

    def results(self) -> Iterator[dict[str, Any]]:
        """Every output line, `{"id", <result>}` (or the OpenAI batch output shape)."""
        yield from self._lines(self.output)

    def errors(self) -> Iterator[dict[str, Any]]:
        """Every rejected record: `{"id", "line", "error", ...}`."""
        folder = join(self.output, layout.ERRORS)
        try:
            yield from self._lines(folder)
        except StorageError:
            return  # no errors folder: no errors

    def manifest(self) -> dict[str, Any]:
        data = Storage(self.settings).read_bytes(join(self.output, layout.LATEST))
        if data is None:
            raise LanesError(f"job {self.id} has no manifest yet (status {self.status()})")
        manifest: dict[str, Any] = orjson.loads(data)
        return manifest

    def cancel(self) -> None:
        """Cancel the job if it has not ended; committed shards stay committed."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(uuid.UUID(self.id), Cancelled(), force=True)

    def _lines(self, folder: str) -> Iterator[dict[str, Any]]:
        storage = Storage(self.settings)
        for file in storage.list_files(folder, (".jsonl",)):
            with storage.open(file.uri) as stream:
                for line in stream:
                    if line.strip():
                        yield orjson.loads(line)


def _folder(location: str, base: Path) -> str:
    """The folder of a workload's input or output (a glob's fixed part), absolute."""
    cut = min((location.index(c) for c in "*?[" if c in location), default=None)
    if cut is not None:
        location = location[: location.rfind("/", 0, cut) + 1]
    if is_s3(location) or Path(location).is_absolute():
        return location
    return str(base / location)


def _jsonl(records: Sequence[Mapping[str, Any]]) -> bytes:
    if not records:
        raise InvalidInput("records: expected at least one record, found none")
    return b"".join(orjson.dumps(dict(r)) + b"\n" for r in records)
