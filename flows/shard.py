"""One shard, end to end: read, prepare, run in batches, write, commit. No Prefect here.

The work of a shard overlaps with itself: while the model runs batch k, a second
thread prepares (tokenizes) batch k+1 and a third writes batch k-1. Records are
sorted by text length inside the shard first, so each batch pads to similar lengths.
A generate task runs a window of GENERATE_WINDOW batches at a time through its
continuous step loop (lanes/generation/batch.py) with `batch_size` rows in flight,
each finished row refilled from the window at once.

Commit protocol, the basis of exactly-once: the output and errors files are written
aside, published (an atomic rename, or an S3 object that appears only when whole),
and only then the marker. A shard with a marker whose key matches is done; a shard
without one is redone from scratch, overwriting its outputs under the same names,
so a run killed at any point and run again leaves each input id in the output once.

A shard that rejected more than its workload's `max_error_rate` of its records fails
(`TooManyErrors`, not retried: the data would not change) and publishes nothing.

Retrying errors (`lanes run --retry-errors`) reruns only the records a committed
shard's errors file names, by their numbers in the input, and publishes the old
output plus the newly answered lines, then the errors still left, then the marker.
Killed between the two files, the output already holds some records the errors file
still names: a retry reads the output's ids first and skips those, and the ids'
first occurrences are found in the whole input as in a full run, so no id is
written twice and none is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from lanes.errors import InvalidInput, JobFailed, PermanentStorageError, StorageError
from lanes.flows.records import read_shard, unit
from lanes.flows.requests import Rejection, Request, to_request
from lanes.flows.runners import DeviceTime, ShardModel
from lanes.flows.shape import RecordShape
from lanes.isolation import Failed, failed_alone
from lanes.listing import StoredFile
from lanes.spec import as_offline
from lanes.storage import Storage
from lanes.tasks.base import Task
from lanes.tasks.generate import GenerateTask
from lanes.tracing import Tracing, maybe_span

log = logging.getLogger(__name__)

# Batches of a generate task's records that one continuous loop runs: rows are
# refilled from the window as sequences finish, so only the window's last rows
# drain with nobody to take their place.
GENERATE_WINDOW = 8


@dataclass(frozen=True)
class ShardPlan:
    """Where one input shard's results go, and the key that says they are current."""

    input: StoredFile
    name: str  # output name below the output folder, e.g. "part-000.jsonl"
    output: str
    errors: str
    marker: str
    key: str  # input identity + model identity: a different key means redo
    workload: str  # whose results these are: another's marker is not ours to overwrite
    # The input as named wherever the project lies (flows.job.shard_source): a local
    # file inside the spec's folder by its relative path, any other by its URI.
    source: str = ""
    # Where the input must really lie when read (flows.job.Job.roots); None: anywhere.
    roots: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ShardStats:
    """What one shard did (or, with `skipped`, what an earlier run committed)."""

    input: str
    output: str
    errors_file: str
    records: int  # input lines and rows holding a record, good or bad
    outputs: int
    errors: int
    items: int  # task items run (an OpenAI line may hold many texts)
    batches: int
    seconds: float
    host: str
    provider: str
    committed_at: str
    skipped: bool = False
    retried: int = 0  # records a --retry-errors run reran (0: the shard ran whole)
    recovered: int = 0  # of those, answered now
    # Its batches' model time on the endpoint; None elsewhere (local, Dask, old servers).
    busy_seconds: float | None = None


class TooManyErrors(JobFailed):
    """A shard rejected more of its records than its workload's max_error_rate allows."""

    repeats = True  # the same records are rejected again


@dataclass
class _Batch:
    """Whole requests, prepared, and the records the preparing rejected."""

    requests: list[tuple[Request, list[Any]]]
    rejected: list[dict[str, Any]]


def committed(storage: Storage, plan: ShardPlan) -> ShardStats | None:
    """The stats an earlier run committed for this shard, if its key is still current
    and its output and errors files are still there (one deleted since is written
    again: skipping the shard would leave its records unanswered unsaid). Raises
    PermanentStorageError when the marker is another workload's or another input's
    (`_check_owner`): redoing the shard would overwrite their results."""
    raw = storage.read_bytes(plan.marker)
    if raw is None:
        return None
    try:
        marker = orjson.loads(raw)
        _check_owner(plan, marker)
        if marker.get("key") != plan.key:
            return None
        gone = next((uri for uri in (plan.output, plan.errors) if not storage.exists(uri)), None)
        if gone is not None:
            log.warning("%s: committed, but %s is gone: the shard will be redone", plan.name, gone)
            return None
        # Fields with a default may be absent: markers written before they existed.
        stats = {
            name: marker[name]
            for name, field in ShardStats.__dataclass_fields__.items()
            if name != "skipped" and (name in marker or field.default is dataclasses.MISSING)
        }
        return ShardStats(**stats, skipped=True)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        log.warning("ignoring unreadable marker %s: the shard will be redone", plan.marker)
        return None


def _check_owner(plan: ShardPlan, marker: dict[str, Any]) -> None:
    """A marker for the same input file (and workload) whose key differs is this
    shard's own, gone stale (the file or the model changed): redone. One of another
    input file or workload means two jobs share this output: refuse before writing.
    The same input file is the same `source` (its path inside the project, wherever
    the project was when the marker was written); a marker older than `source` names
    its input by URI, and one older than the `workload` field names its input only."""
    input, workload = marker.get("input"), marker.get("workload")
    if not isinstance(input, str):
        return  # unreadable: committed() says so and the shard is redone
    if workload in (None, plan.workload) and _same_input(plan, input, marker.get("source")):
        return
    owner = f"workload {workload}'s shard of {input}" if workload else f"a shard of {input}"
    folder = plan.output.removesuffix(plan.name)
    raise PermanentStorageError(
        f"{plan.output} holds the results of {owner} (commit marker {plan.marker}), not "
        f"of {plan.input.uri} for workload {plan.workload}: two jobs write this output "
        f"and would overwrite each other; give this one a different output, or delete "
        f"{folder} to replace the old results"
    )


def _same_input(plan: ShardPlan, input: str, source: object) -> bool:
    if input == plan.input.uri:
        return True
    if not plan.source or plan.source == plan.input.uri:
        return False  # an input outside the project is known by its URI alone
    if isinstance(source, str):
        return source == plan.source
    # A marker from before `source`, of a project since moved: its input's path ends
    # with the same path inside the project (and its output moved along with it).
    return input.endswith("/" + plan.source)


def run_shard(
    plan: ShardPlan,
    model: ShardModel,
    storage: Storage,
    batch_size: int,
    max_record_bytes: int,
    max_inputs: int,
    progress: Callable[[int], None] = lambda n: None,
    retry: ShardStats | None = None,
    tracing: Tracing | None = None,
) -> ShardStats:
    """Process one shard and commit it; with `retry` (what an earlier run committed),
    rerun only its errored records. Raises `TooManyErrors` past the workload's
    max_error_rate, and on what a retry might fix (storage, a model that fails on every
    item); bad records go to the errors file instead."""
    started = time.monotonic()
    task = model.task
    workload = as_offline(task.workload)
    shape = RecordShape.of(task.name, workload, task.handler)
    redo = _errored_lines(storage, plan.errors) if retry is not None else None
    with storage.staged(plan.output) as out_path, storage.staged(plan.errors) as err_path:
        with out_path.open("wb") as out, err_path.open("wb") as err:
            kept = _copy_outputs(storage, plan.output, out) if redo is not None else None
            if retry is not None and kept is None:
                redo = None
                log.warning("%s: no output or errors file to retry: running it whole", plan.name)
            writer = _Writer(out, err, progress, task)
            answered = kept.ids if kept is not None else set()
            reader = _Reader(shape, max_inputs, redo, answered)
            requests = reader.read(plan, storage, max_record_bytes, writer)
            progress(writer.errors)  # records rejected while reading
            device = DeviceTime()
            batches = _pipeline(requests, model, batch_size, writer, tracing, device)
        earlier = kept.lines if kept is not None else 0
        outputs = earlier + writer.outputs
        records = outputs + writer.errors
        _check_error_rate(plan, workload.max_error_rate, records, writer)
        # Publish outputs first and the marker last: the marker is the commit.
        storage.publish(out_path, plan.output)
        storage.publish(err_path, plan.errors)
    stats = ShardStats(
        input=plan.input.uri,
        output=plan.output,
        errors_file=plan.errors,
        records=records,
        outputs=outputs,
        errors=writer.errors,
        items=writer.items,
        batches=batches,
        seconds=round(time.monotonic() - started, 6),
        host=socket.gethostname(),
        provider=model.provider,
        committed_at=datetime.now(UTC).isoformat(),
        retried=len(redo) if redo is not None else 0,
        recovered=writer.outputs + reader.answered if redo is not None else 0,
        busy_seconds=device.total,
    )
    marker: dict[str, Any] = {"key": plan.key, "workload": plan.workload, "source": plan.source}
    marker.update(asdict(stats))
    del marker["skipped"]
    storage.write_bytes(plan.marker, orjson.dumps(marker, option=orjson.OPT_INDENT_2))
    _log_shard(plan, stats)
    return stats


def _log_shard(plan: ShardPlan, stats: ShardStats) -> None:
    """The shard's one line: records, errors, items/s (its fields too, in JSON logs)."""
    rate = stats.items / stats.seconds if stats.seconds > 0 else 0.0
    fields = {
        "shard": plan.name,
        "input": stats.input,
        "records": stats.records,
        "errors": stats.errors,
        "items": stats.items,
        "batches": stats.batches,
        "seconds": stats.seconds,
        "items_per_s": round(rate, 3),
    }
    log.info(
        "shard %s: %d records, %d errors, %d items in %d batches, %.1f items/s",
        plan.name,
        stats.records,
        stats.errors,
        stats.items,
        stats.batches,
        rate,
        extra={"lanes": fields},
    )


def _check_error_rate(plan: ShardPlan, limit: float, records: int, writer: _Writer) -> None:
    if writer.errors <= limit * records:
        return
    what = unit(plan.input.name)
    examples = "; ".join(f"{what} {e['line']}: {e['error']}" for e in writer.first_errors)
    raise TooManyErrors(
        f"{writer.errors} of {records} records rejected, more than "
        f"max_error_rate {limit:g} allows, so the shard is not committed; for example "
        f"{examples}"
    )


@dataclass(frozen=True)
class _Outputs:
    lines: int
    ids: set[Any]


def _errored_lines(storage: Storage, uri: str) -> set[int] | None:
    """The numbers of the records an errors file names; None without a readable one.
    One this job may not read (denied, a link out of its output: lanes.outputs) is a
    PermanentStorageError: run whole instead, the shard would hide why."""
    try:
        with storage.open(uri) as stream:
            return {int(orjson.loads(line)["line"]) for line in stream if line.strip()}
    except PermanentStorageError:
        raise
    except (StorageError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _copy_outputs(storage: Storage, uri: str, out: IO[bytes]) -> _Outputs | None:
    """Copy a committed output file into `out`, and the ids it answers; None (and `out`
    left empty) without a readable one. One this job may not read is a
    PermanentStorageError (as `_errored_lines`), nothing copied."""
    ids: set[Any] = set()
    lines = 0
    try:
        with storage.open(uri) as stream:
            for raw in stream:
                if raw.strip():
                    line = orjson.loads(raw)
                    ids.add(line["custom_id"] if "custom_id" in line else line.get("id"))
                    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                    lines += 1
    except PermanentStorageError:
        raise
    except (StorageError, orjson.JSONDecodeError, AttributeError, TypeError):
        out.seek(0)
        out.truncate()
        return None
    return _Outputs(lines, ids)


class _Reader:
    """The shard's requests, sorted by length; unreadable records go to the writer.

    With `only`, just the records of those numbers become requests, but every
    record's id counts for "first seen" as in a full run, and one whose id is in
    `answered` (the output has it) is skipped."""

    def __init__(
        self, shape: RecordShape, max_inputs: int, only: set[int] | None, answered: set[Any]
    ) -> None:
        self.shape, self.max_inputs = shape, max_inputs
        self.only, self.answered_ids = only, answered
        self.answered = 0  # records of `only` found answered already

    def read(
        self, plan: ShardPlan, storage: Storage, max_bytes: int, writer: _Writer
    ) -> list[Request]:
        requests: list[Request] = []
        first_seen: dict[Any, int] = {}
        for line in read_shard(storage, plan.input, max_bytes, plan.roots):
            request = to_request(line, self.shape, plan.input.uri, self.max_inputs)
            wanted = self.only is None or line.number in self.only
            if isinstance(request, Rejection):
                if wanted:
                    writer.error(request.line)
                continue
            if request.id in first_seen:
                if wanted:
                    # An id twice in one shard would be twice in the output: keep the first.
                    first = first_seen[request.id]
                    writer.error(
                        request.reject(f"duplicate id {request.id!r}: first on line {first}")
                    )
                continue
            first_seen[request.id] = request.number
            if not wanted:
                continue
            if request.id in self.answered_ids:
                self.answered += 1  # answered by a retry cut short before its errors file
                continue
            requests.append(request)
        requests.sort(key=lambda r: r.sort_key())  # stable: equal lengths keep file order
        return requests


def _pipeline(
    requests: list[Request],
    model: ShardModel,
    batch_size: int,
    writer: _Writer,
    tracing: Tracing | None = None,
    device: DeviceTime | None = None,
) -> int:
    """Prepare batch k+1 and write batch k-1 while batch k runs. Returns batches run.
    With `tracing`, each model run is a span ("batch") below the current one; the
    model time the runner reports goes into `device`."""
    # A generate task's step loop refills rows as sequences finish: hand it several
    # batches at once, so rows stay full across batch edges.
    continuous = isinstance(model.task, GenerateTask)
    window = batch_size * GENERATE_WINDOW if continuous else batch_size
    batches = _prepared(requests, model.task, window)
    runs = 0
    with ThreadPoolExecutor(2, thread_name_prefix="lanes-shard") as pool:
        upcoming = pool.submit(next, batches, None)
        writing: Future[None] | None = None
        while (batch := upcoming.result()) is not None:
            upcoming = pool.submit(next, batches, None)
            items = [item for _, prepared in batch.requests for item in prepared]
            outputs: list[Any] = []
            if continuous:
                with maybe_span(tracing, "batch", {"lanes.batch_size": len(items)}):
                    outputs = model.run(items, device)
                runs += 1
            else:
                for start in range(0, len(items), batch_size):
                    part = items[start : start + batch_size]
                    with maybe_span(tracing, "batch", {"lanes.batch_size": len(part)}):
                        outputs += model.run(part, device)
                    runs += 1
            if writing is not None:
                writing.result()
            writing = pool.submit(writer.batch, batch, outputs)
        if writing is not None:
            writing.result()
    return runs


def _prepared(requests: list[Request], task: Task, batch_size: int) -> Iterator[_Batch]:
    """Batches of whole requests holding at least `batch_size` items (the last fewer)."""
    batch = _Batch([], [])
    size = 0
    for request in requests:
        try:
            prepared = request.prepare(task)
        except InvalidInput as err:
            batch.rejected.append(request.reject(err))
            continue
        batch.requests.append((request, prepared))
        size += len(prepared)
        if size >= batch_size:
            yield batch
            batch, size = _Batch([], []), 0
    if batch.requests or batch.rejected:
        yield batch


class _Writer:
    """Serialises output and error lines; used by one thread at a time."""

    FIRST_ERRORS = 3  # kept to name in a failure's message

    def __init__(
        self, out: IO[bytes], err: IO[bytes], progress: Callable[[int], None], task: Task
    ) -> None:
        self.out, self.err, self.progress = out, err, progress
        self.task = task  # its outputs' (an OpenAI line's logprobs name its tokens)
        self.outputs = self.errors = self.items = 0
        self.first_errors: list[dict[str, Any]] = []

    def error(self, line: dict[str, Any]) -> None:
        self.err.write(orjson.dumps(line) + b"\n")
        self.errors += 1
        if len(self.first_errors) < self.FIRST_ERRORS:
            self.first_errors.append(line)

    def batch(self, batch: _Batch, outputs: list[Any]) -> None:
        for line in batch.rejected:
            self.error(line)
        at = 0
        for request, prepared in batch.requests:
            mine = outputs[at : at + len(prepared)]
            at += len(prepared)
            failed = next((o for o in mine if isinstance(o, Failed)), None)
            if failed is not None:
                self.error(request.reject(failed_alone(failed.error, "this record")))
                continue
            try:
                data = orjson.dumps(
                    request.answer(prepared, mine, self.task), option=orjson.OPT_SERIALIZE_NUMPY
                )
            except TypeError as err:  # a handler's post returned something not JSON
                self.error(request.reject(f"the output cannot be written as JSON: {err}"))
                continue
            except InvalidInput as err:  # e.g. a kept field the output has too
                self.error(request.reject(str(err)))
                continue
            self.out.write(data + b"\n")
            self.outputs += 1
            self.items += len(prepared)
        self.progress(len(batch.requests) + len(batch.rejected))
