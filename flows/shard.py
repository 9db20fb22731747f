"""One shard, end to end: read, prepare, run in batches, write, commit. No Prefect here.

The work of a shard overlaps with itself: while the model runs batch k, a second
thread prepares (tokenizes) batch k+1 and a third writes batch k-1. Records are
sorted by text length inside the shard first, so each batch pads to similar lengths.

Commit protocol, the basis of exactly-once: the output and errors files are written
aside, published (an atomic rename, or an S3 object that appears only when whole),
and only then the marker. A shard with a marker whose key matches is done; a shard
without one is redone from scratch, overwriting its outputs under the same names,
so a run killed at any point and run again leaves each input id in the output once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from lanes.errors import InvalidInput
from lanes.flows.records import read_shard
from lanes.flows.requests import Rejection, Request, to_request
from lanes.storage import Storage, StoredFile
from lanes.tasks.base import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardPlan:
    """Where one input shard's results go, and the key that says they are current."""

    input: StoredFile
    name: str  # output name below the output folder, e.g. "part-000.jsonl"
    output: str
    errors: str
    marker: str
    key: str  # input identity + model identity: a different key means redo


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


@dataclass
class Model:
    """A loaded task. `lock`: one batch on the device at a time, however many shards
    run at once in this process, so the rest of their work overlaps the model's."""

    task: Task
    provider: str
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Failed:
    message: str


@dataclass
class _Batch:
    """Whole requests, prepared, and the records the preparing rejected."""

    requests: list[tuple[Request, list[Any]]]
    rejected: list[dict[str, Any]]


def committed(storage: Storage, plan: ShardPlan) -> ShardStats | None:
    """The stats an earlier run committed for this shard, if its key is still current."""
    raw = storage.read_bytes(plan.marker)
    if raw is None:
        return None
    try:
        marker = orjson.loads(raw)
        if marker.get("key") != plan.key:
            return None
        stats = {k: marker[k] for k in ShardStats.__dataclass_fields__ if k != "skipped"}
        return ShardStats(**stats, skipped=True)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        log.warning("ignoring unreadable marker %s: the shard will be redone", plan.marker)
        return None


def run_shard(
    plan: ShardPlan,
    model: Model,
    storage: Storage,
    batch_size: int,
    max_record_bytes: int,
    progress: Callable[[int], None] = lambda n: None,
) -> ShardStats:
    """Process one shard and commit it. Raises on what a retry might fix (storage, a
    model that fails on every item); bad records go to the errors file instead."""
    started = time.monotonic()
    with storage.staged(plan.output) as out_path, storage.staged(plan.errors) as err_path:
        with out_path.open("wb") as out, err_path.open("wb") as err:
            writer = _Writer(out, err, progress)
            requests = _read(plan, model.task, storage, max_record_bytes, writer)
            progress(writer.errors)  # records rejected while reading
            batches = _pipeline(requests, model, batch_size, writer)
        # Publish outputs first and the marker last: the marker is the commit.
        storage.publish(out_path, plan.output)
        storage.publish(err_path, plan.errors)
    stats = ShardStats(
        input=plan.input.uri,
        output=plan.output,
        errors_file=plan.errors,
        records=writer.outputs + writer.errors,
        outputs=writer.outputs,
        errors=writer.errors,
        items=writer.items,
        batches=batches,
        seconds=round(time.monotonic() - started, 6),
        host=socket.gethostname(),
        provider=model.provider,
        committed_at=datetime.now(UTC).isoformat(),
    )
    marker = {"key": plan.key, **asdict(stats)}
    del marker["skipped"]
    storage.write_bytes(plan.marker, orjson.dumps(marker, option=orjson.OPT_INDENT_2))
    return stats


def _read(
    plan: ShardPlan, task: Task, storage: Storage, max_bytes: int, writer: _Writer
) -> list[Request]:
    """The shard's requests, sorted by length; unreadable records go to the writer."""
    requests: list[Request] = []
    first_seen: dict[Any, int] = {}
    for line in read_shard(storage, plan.input, max_bytes):
        request = to_request(line, task.kind, plan.input.uri)
        if isinstance(request, Rejection):
            writer.error(request.line)
            continue
        if request.id in first_seen:
            # An id twice in one shard would be twice in the output: keep the first.
            message = f"duplicate id {request.id!r}: first on line {first_seen[request.id]}"
            writer.error(request.reject(message))
            continue
        first_seen[request.id] = request.number
        requests.append(request)
    requests.sort(key=lambda r: r.sort_key())  # stable: equal lengths keep file order
    return requests


def _pipeline(requests: list[Request], model: Model, batch_size: int, writer: _Writer) -> int:
    """Prepare batch k+1 and write batch k-1 while batch k runs. Returns batches run."""
    batches = _prepared(requests, model.task, batch_size)
    runs = 0
    with ThreadPoolExecutor(2, thread_name_prefix="lanes-shard") as pool:
        upcoming = pool.submit(next, batches, None)
        writing: Future[None] | None = None
        while (batch := upcoming.result()) is not None:
            upcoming = pool.submit(next, batches, None)
            items = [item for _, prepared in batch.requests for item in prepared]
            outputs: list[Any] = []
            for start in range(0, len(items), batch_size):
                outputs += _run(model, items[start : start + batch_size])
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


def _run(model: Model, items: Sequence[Any]) -> list[Any]:
    """One model run; if it fails, find the items it fails on by halving the batch.

    An item that fails alone becomes that record's error. When every item fails
    alone, the model (not the data) is at fault: the first error is raised, for
    the shard's retries."""
    if not items:
        return []
    try:
        with model.lock:
            return list(model.task.run(items))
    except Exception as err:
        if len(items) == 1:
            raise
        log.warning("a batch of %d failed (%s): retrying it in halves", len(items), err)
        results = _bisect(model, items)
        if all(isinstance(r, _Failed) for r in results):
            raise
        return results


def _bisect(model: Model, items: Sequence[Any]) -> list[Any]:
    try:
        with model.lock:
            return list(model.task.run(items))
    except Exception as err:
        if len(items) == 1:
            return [_Failed(f"the model failed on this record: {type(err).__name__}: {err}")]
        middle = len(items) // 2
        return _bisect(model, items[:middle]) + _bisect(model, items[middle:])


class _Writer:
    """Serialises output and error lines; used by one thread at a time."""

    def __init__(self, out: IO[bytes], err: IO[bytes], progress: Callable[[int], None]) -> None:
        self.out, self.err, self.progress = out, err, progress
        self.outputs = self.errors = self.items = 0

    def error(self, line: dict[str, Any]) -> None:
        self.err.write(orjson.dumps(line) + b"\n")
        self.errors += 1

    def batch(self, batch: _Batch, outputs: list[Any]) -> None:
        for line in batch.rejected:
            self.error(line)
        at = 0
        for request, prepared in batch.requests:
            mine = outputs[at : at + len(prepared)]
            at += len(prepared)
            failed = next((o for o in mine if isinstance(o, _Failed)), None)
            if failed is not None:
                self.error(request.reject(failed.message))
                continue
            try:
                data = orjson.dumps(
                    request.answer(prepared, mine), option=orjson.OPT_SERIALIZE_NUMPY
                )
            except TypeError as err:  # a handler's post returned something not JSON
                self.error(request.reject(f"the output cannot be written as JSON: {err}"))
                continue
            self.out.write(data + b"\n")
            self.outputs += 1
            self.items += len(prepared)
        self.progress(len(batch.requests) + len(batch.rejected))
