"""Offline jobs from the SDK, followed by id (lanes.submit submits them).

A job is a Prefect flow run of the workload's deployment ("lanes-offline/<name>",
made by `lanes deploy`) with its own `input` and `output`, so the records of one
`submit` never mix with the workload's scheduled inputs or another job's outputs.
Everything a Job needs is in its flow run (the parameters hold its output location),
so `Job(id)` works from any process that reaches the same Prefect API and storage.

    <workload input folder>/_submitted/<key>/records.jsonl   the staged records
    <workload output folder>/jobs/<key>/                     its outputs (lanes.layout)

Prefect is imported only when a job is touched, here and in lanes.prefectapi (the
API the runs live on); lanes.jobstates reads a run's state as the job's status.

`results()` and `errors()` read the files each commit marker names, and whoever may
write in a shared output folder can write a marker: a file it names must lie inside
the job's output (by spelling, and for local files by real path, links resolved), or
the read is refused unread, as the flow refuses its own (lanes.outputs); so is a
manifest made a link out of the output. A service reading jobs with its own
credentials (the Batch API) hands back nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from lanes import layout
from lanes.errors import InvalidInput, JobFailed, LanesError, NotFound, StorageError
from lanes.inputs import absolute, check_spelling, inside_output
from lanes.jobstates import EXPIRED, EXPIRED_TAG, FAILED_STATES, FINISHED, status_of
from lanes.outputs import OutputStorage
from lanes.prefectapi import PrefectApi
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
from lanes.storage import Storage
from lanes.uris import is_s3, join

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import FlowRun

T = TypeVar("T")

POLL_S = 0.5
CHUNK_LINES = 1000  # lines an AsyncJob reads per trip to a thread
SUBMIT_TAG = "lanes-submit"
BATCH_TAG = "lanes-batch"  # runs of the Batch API's batches (lanes.batches)
BATCH_PREFIX = "batch_"  # a batch's id: this and its flow run's id in hex


@dataclass(frozen=True)
class JobSummary:
    """One job or batch as `lanes job` lists it."""

    id: str  # a batch's is its Batch API id
    kind: str  # "job" (client.submit) or "batch" (the endpoint's /v1/batches)
    status: str  # as Job.status() says
    name: str
    scheduled: datetime | None


def list_jobs(limit: int = 50, prefect_api_url: str | None = None) -> list[JobSummary]:
    """The newest submitted jobs and Batch API batches, newest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    found: list[JobSummary] = []
    with PrefectApi(prefect_api_url).client() as client:
        for tag, kind in ((SUBMIT_TAG, "job"), (BATCH_TAG, "batch")):
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])),
                sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                limit=limit,
            )
            for run in runs:
                id = BATCH_PREFIX + run.id.hex if kind == "batch" else str(run.id)
                when = run.expected_start_time
                found.append(JobSummary(id, kind, status_of(run), run.name, when))
    oldest = datetime.min.replace(tzinfo=UTC)
    found.sort(key=lambda j: j.scheduled or oldest, reverse=True)
    return found[:limit]


class Job:
    """One submitted offline job, by its id (the flow run's): `status()`, `wait()`,
    `results()`, `errors()`, `manifest()`, `cancel()`. Reads Prefect for its state
    and storage for its files; each call asks afresh."""

    def __init__(
        self, id: str, settings: Settings | None = None, *, prefect_api_url: str | None = None
    ) -> None:
        try:
            # A batch of the OpenAI door is a run too: its id holds the run's.
            self._uuid = uuid.UUID(id.removeprefix(BATCH_PREFIX))
        except ValueError:
            raise InvalidInput(
                f"job id: expected a UUID (from submit) or a batch id, found {id!r}"
            ) from None
        self.id = id if id.startswith(BATCH_PREFIX) else str(self._uuid)
        self.settings = settings or Settings()
        self._prefect = PrefectApi(prefect_api_url)
        self._output: str | None = None

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> str:
        """The flow run's state: SCHEDULED, PENDING, RUNNING, COMPLETED (every record
        answered), COMPLETED_WITH_ERRORS (it finished, and some records were rejected:
        see `errors()`), FAILED, CANCELLED, EXPIRED (a batch whose completion window
        passed before all its records ran: those committed are in `results()`),
        CRASHED, ..."""
        return status_of(self._run())

    def message(self) -> str | None:
        """The message of the flow run's state: how it ended (the counts of answered
        and rejected records, or why it failed), when it has one. For an EXPIRED batch:
        when its window passed and how many lines were answered by then."""
        return self._message(self._run())

    def _message(self, run: FlowRun) -> str | None:
        if status_of(run) == EXPIRED:
            return self._expiry(run)
        return run.state.message if run.state else None

    def _expiry(self, run: FlowRun) -> str:
        """An expired batch's story: its window's end (the run's `finish_by`) and the
        lines its committed shards answered (their commit markers, as /v1/batches
        counts them)."""
        markers = join(str(run.parameters["output"]), layout.MARKERS)
        storage = Storage(self.settings)
        try:
            found = storage.list_files(markers, (".json",))
        except StorageError:
            found = []  # no shard committed
        answered = 0
        for marker in found:
            data = storage.read_bytes(marker.uri)
            answered += int(orjson.loads(data)["outputs"]) if data is not None else 0
        ended_batch = self._ended_batch() if not found else None
        if ended_batch is not None:  # its shards are gone, counted in its record
            answered = int(ended_batch["request_counts"]["completed"])
        ended = run.parameters.get("finish_by") or "its end"
        return (
            f"the batch expired: its completion window passed at {ended}, with {answered} "
            "lines answered (the rest are in its error file, as batch_expired)"
        )

    def scheduled_time(self) -> datetime | None:
        """When the run is (or was) due to start."""
        run = self._run()
        return run.next_scheduled_start_time or run.expected_start_time

    @property
    def output(self) -> str:
        """Where the job's outputs go: its flow run's `output` parameter, or for a run of
        a deployment as declared (its cron, `prefect deployment run`), the workload's
        own output in the spec (LANES_SPEC)."""
        if self._output is None:
            run = self._run()
            given = run.parameters.get("output")
            self._output = str(given) if given else self._declared_output(run)
        return self._output

    def _declared_output(self, run: FlowRun) -> str:
        from lanes.specfile import load_spec

        name = run.parameters.get("workload")
        spec = load_spec(self.settings.spec, self.settings, check_files=False)
        workload = spec.workloads.get(str(name))
        if not isinstance(workload, OfflineWorkload):
            raise InvalidInput(
                f"job {self.id} ({run.name}) ran workload {name!r} as declared, with no "
                f"output of its own, and {self.settings.spec} has no offline workload of "
                "that name: point LANES_SPEC at the spec it was deployed from"
            )
        return absolute(workload.output, spec.root or Path.cwd())

    def wait(self, timeout: float = 3600.0) -> Job:
        """Block until the job ends. Returns itself once COMPLETED or
        COMPLETED_WITH_ERRORS; raises JobFailed if it ended otherwise, TimeoutError if
        it is still going after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.settled()
            if state in FINISHED:
                return self
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {state} after {timeout:g} s")
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def settled(self) -> str:
        """The state, once; raises JobFailed if the job ended without completing."""
        run = self._run()
        state = status_of(run)
        if state in FAILED_STATES:
            message = self._message(run) or "no message"
            raise JobFailed(f"job {self.id} ({run.name}) ended {state}: {message}")
        return state

    def results(self) -> Iterator[dict[str, Any]]:
        """`{"id", "result"}` per output line committed so far, shard by shard: the
        record's id (an OpenAI batch line's custom_id) and what it produced (embed:
        the vector; infer: the named outputs; generate: the answer body)."""
        for line in self._lines(self._committed("output", "outputs")):
            yield _result(line)

    def errors(self) -> Iterator[dict[str, Any]]:
        """Every rejected record: `{"id", "line", "error", ...}`; none if none."""
        yield from self._lines(self._committed("errors_file", None))

    def manifest(self) -> dict[str, Any]:
        """The run's manifest: counts, items/s, cost estimate, per-shard stats."""
        storage = self._storage()  # a manifest made a link out of the output is refused
        try:  # its own: runs of a workload as declared share one output, and _manifest.json
            own = storage.list_files(  # is the newest run's
                join(self.output, layout.MANIFESTS), (f"-{str(self._uuid)[:8]}.json",)
            )
        except StorageError:
            own = []
        data = storage.read_bytes(own[-1].uri if own else join(self.output, layout.LATEST))
        if data is None:
            raise LanesError(f"job {self.id} has no manifest yet (it is {self.status()})")
        manifest: dict[str, Any] = orjson.loads(data)
        return manifest

    def cancel(self) -> str:
        """Cancel the job unless it has ended; committed shards stay committed. A job
        not started yet is CANCELLED at once (lanes.jobstates), a running one
        CANCELLING until its worker stops it. Returns the state after."""
        from prefect.client.schemas.objects import State, StateType

        with self._prefect.client() as client:
            self._read(client)
            client.set_flow_run_state(self._uuid, State(type=StateType.CANCELLING))
            return status_of(self._read(client))

    def expire(self) -> str:
        """Cancel the job as expired (a batch's completion window passed): as `cancel`,
        and its state reads EXPIRED once cancelled. Returns the state after."""
        with self._prefect.client() as client:
            run = self._read(client)
            if EXPIRED_TAG not in run.tags:
                client.update_flow_run(self._uuid, tags=[*run.tags, EXPIRED_TAG])
        return self.cancel()

    def _run(self) -> FlowRun:
        with self._prefect.client() as client:
            return self._read(client)

    def _read(self, client: SyncPrefectClient) -> FlowRun:
        from prefect.exceptions import ObjectNotFound

        try:
            return client.read_flow_run(self._uuid)
        except ObjectNotFound:
            raise NotFound(
                f"no job {self.id} on the Prefect API at {self._prefect.shown()}; "
                "is PREFECT_API_URL the server it was submitted to?"
            ) from None

    def _storage(self) -> OutputStorage:
        """Storage whose local reads below the output must really lie in it (the folder's
        real path now: a link at the output itself is the operator's data disk)."""
        real = absolute(self.output, Path.cwd()).rstrip("/") or "/"
        return OutputStorage(self.settings, real, self.output)

    def _committed(self, key: str, missing: str | None) -> list[str]:
        """The `key` file ("output" or "errors_file") of each committed shard, by its
        commit marker: a workload's output also holds its submitted jobs' (jobs/), which
        a listing of the folder would mix in. A marker naming a file outside the output
        is refused (`_named`)."""
        storage = self._storage()
        try:
            markers = storage.list_files(join(self.output, layout.MARKERS), (".json",))
        except StorageError:
            markers = []
        if not markers and (ended := self._ended_batch()) is not None:
            files = " and ".join(filter(None, (ended["output_file_id"], ended["error_file_id"])))
            raise LanesError(
                f"batch {self.id} has ended ({ended['status']}) and its run's shards are "
                f"deleted: its lines are in its files ({files or 'none'}; GET "
                "/v1/files/{file_id}/content)"
            )
        if not markers and missing is not None:
            raise LanesError(
                f"job {self.id} has no {missing} at {self.output} yet (it is {self.status()})"
            )
        found = []
        for marker in markers:
            data = storage.read_bytes(marker.uri)
            if data is not None:
                named = str(orjson.loads(data)[key])
                found.append(self._named(marker.uri, key, named, storage.real_output))
        return found

    def _ended_batch(self) -> dict[str, Any] | None:
        """A Batch API batch's record once it has ended, when this job is one: its
        run's output folder is deleted then (lanes.batches), its lines in its files."""
        if not self.id.startswith(BATCH_PREFIX):
            return None
        from lanes.batch_claim import FINAL
        from lanes.batchstore import BatchStore

        try:
            record = BatchStore(self.settings).batch(self.id)
        except (NotFound, StorageError):
            return None  # another store's, or not readable here: as before
        return record if record["status"] in FINAL else None

    def _named(self, marker: str, key: str, named: str, real_output: str) -> str:
        """`named`, the `key` file of commit marker `marker`, unless it lies outside the
        job's output: by spelling (another bucket or prefix, `.` or `..` parts in an S3
        key, another scheme), and for a local file by its real path now (`..` and links
        resolved) against the output's, `real_output`. Where the opened file really
        leads is judged again as it is read (`OutputStorage.open`)."""
        try:
            check_spelling(named, key)
        except InvalidInput:
            inside = False
        else:
            local = not (is_s3(named) or is_s3(self.output))
            inside = inside_output(named, real_output if local else self.output, Path.cwd())
        if inside:
            return named
        raise LanesError(
            f"job {self.id}: commit marker {marker} names its {key} {named}, outside the "
            f"job's output {self.output}, so nothing was read from it; a marker names its "
            "shard's own files, so this one was written by someone else (whoever may write "
            "in the output folder can): remove it and run the job again"
        )

    def _lines(self, files: list[str]) -> Iterator[dict[str, Any]]:
        storage = self._storage()
        for file in files:
            with storage.open(file) as stream:
                for line in stream:
                    if line.strip():
                        yield orjson.loads(line)


class AsyncJob:
    """A Job for async code: the same methods, awaited (`results()`/`errors()` with
    `async for`). Prefect and storage calls run in a thread; `wait` sleeps on the
    event loop, so cancelling it stops it."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.id = job.id

    def __repr__(self) -> str:
        return f"AsyncJob({self.id!r})"

    async def status(self) -> str:
        return await asyncio.to_thread(self.job.status)

    async def scheduled_time(self) -> datetime | None:
        return await asyncio.to_thread(self.job.scheduled_time)

    async def message(self) -> str | None:
        return await asyncio.to_thread(self.job.message)

    async def wait(self, timeout: float = 3600.0) -> AsyncJob:
        """See `Job.wait`."""
        deadline = time.monotonic() + timeout
        while True:
            state = await asyncio.to_thread(self.job.settled)
            if state in FINISHED:
                return self
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {state} after {timeout:g} s")
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))

    def results(self) -> AsyncIterator[dict[str, Any]]:
        return _in_chunks(self.job.results())

    def errors(self) -> AsyncIterator[dict[str, Any]]:
        return _in_chunks(self.job.errors())

    async def manifest(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.job.manifest)

    async def cancel(self) -> str:
        return await asyncio.to_thread(self.job.cancel)


def _result(line: dict[str, Any]) -> dict[str, Any]:
    """An output line as `{"id", "result"}` (see flows.requests for the line shapes)."""
    if "custom_id" in line and isinstance(line.get("response"), Mapping):
        return {"id": line["custom_id"], "result": line["response"].get("body")}
    rest = {k: v for k, v in line.items() if k != "id"}
    if rest.keys() == {"embedding"} or rest.keys() == {"result"}:
        (value,) = rest.values()
        return {"id": line.get("id"), "result": value}
    return {"id": line.get("id"), "result": rest}


async def _in_chunks(lines: Iterator[T]) -> AsyncIterator[T]:
    """A blocking iterator's items, read CHUNK_LINES at a time in a thread."""
    try:
        while chunk := await asyncio.to_thread(lambda: list(itertools.islice(lines, CHUNK_LINES))):
            for item in chunk:
                yield item
    finally:
        close = getattr(lines, "close", None)
        if close is not None:
            close()
