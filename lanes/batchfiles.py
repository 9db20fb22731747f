"""A finished batch's output and error files, assembled from its shards in the store:
the committed shards' lines in input order, their rejected lines numbered as in the
input file, and, for a batch that expired or failed, an error line for every request of
a shard never committed (lanes.batches calls it once a batch's run has ended).

Every line of the error file carries OpenAI's BatchError object in `error` (`code`,
`message`, `param`, `line`); a rejected line also its `response`, the 400 the endpoint
would answer. (`lanes run`'s own errors files say the error in a string: they are
converted here, not there.)

The files' ids are the batch's own (`output_file_id`): their content is made
deterministically from the committed shards, so two servers that finalize one batch
at once write the same file under the same id, and neither record names an orphan.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from lanes import layout
from lanes.batchstore import BatchStore
from lanes.jobs import BATCH_PREFIX
from lanes.uris import join

REJECTED_CODE = "invalid_request"  # a rejected line's code when its answer names none


@dataclass(frozen=True)
class BatchError:
    """OpenAI's BatchError: in a batch's `errors` and in each line of its error file."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def output_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id}-error"


def assemble(
    store: BatchStore,
    record: dict[str, Any],
    markers: list[dict[str, Any] | None],
    unanswered: BatchError | None,
    per_shard: int,
) -> dict[str, int]:
    """Write the output file (committed shards' lines, in input order) and the error
    file (their rejected lines, numbered as in the input file, then, given the
    `unanswered` error, every request of a shard never committed); returns the
    counts. `markers`: each shard's commit marker, None for one never committed.
    Idempotent: a second call for the same batch writes the same files."""
    folder = record["_lanes"]["folder"]
    batch = record["id"]
    # Batches made before shards kept their blank lines: whole shards of `per_shard`.
    starts = record["_lanes"].get("starts") or [
        shard * per_shard + 1 for shard in range(len(markers))
    ]
    storage = store.storage
    counts = {"total": record["request_counts"]["total"], "completed": 0, "failed": 0}

    def outputs() -> Iterator[bytes]:
        for shard, marker in enumerate(markers):
            if marker is not None:
                with storage.open(join(folder, "out", f"part-{shard:05d}.jsonl")) as lines:
                    for line in lines:
                        if line.strip():
                            counts["completed"] += 1
                            yield line

    def errors() -> Iterator[bytes]:
        for shard, marker in enumerate(markers):
            first = starts[shard] - 1  # the input's number of the line before the shard
            if marker is not None:
                uri = join(folder, "out", layout.ERRORS, f"part-{shard:05d}.jsonl")
                if marker["errors"] and storage.read_bytes(uri) is not None:
                    with storage.open(uri) as lines:
                        for line in lines:
                            if line.strip():
                                counts["failed"] += 1
                                yield orjson.dumps(_rejected(batch, line, first)) + b"\n"
            elif unanswered is not None:
                uri = join(folder, "in", f"part-{shard:05d}.jsonl")
                with storage.open(uri) as lines:
                    for number, line in enumerate(lines, first + 1):
                        if line.strip():
                            counts["failed"] += 1
                            entry = _unanswered(batch, number, line, unanswered)
                            yield orjson.dumps(entry) + b"\n"

    made = store.put_file(output_file_id(batch), f"{batch}_output.jsonl", "batch_output", outputs())
    record["output_file_id"] = made.id if made else None
    failed = store.put_file(
        error_file_id(batch), f"{batch}_error.jsonl", "batch_output", errors(), keep_empty=False
    )
    record["error_file_id"] = failed.id if failed else None
    return counts


def _rejected(batch: str, raw: bytes, first: int) -> dict[str, Any]:
    """A line of a shard's errors file (`{"id", "line", "error": "<message>", ...}`, as
    `lanes run` writes it) as a line of the batch's error file."""
    entry = orjson.loads(raw)
    number = entry["line"] + first if isinstance(entry.get("line"), int) else None
    response = entry.get("response")
    answer = response["body"].get("error") if isinstance(response, dict) else None
    answered = answer if isinstance(answer, dict) else {}
    error = BatchError(
        answered.get("code") or REJECTED_CODE, str(entry["error"]), answered.get("param"), number
    )
    request_id = response.get("request_id") if isinstance(response, dict) else None
    return {
        "id": f"batch_req_{request_id}" if request_id else _line_id(batch, number or 0),
        "custom_id": entry.get("custom_id"),
        "line": number,
        "response": response,
        "error": error.as_json(),
    }


def _unanswered(batch: str, number: int, line: bytes, error: BatchError) -> dict[str, Any]:
    try:
        custom_id = orjson.loads(line).get("custom_id")
    except (orjson.JSONDecodeError, AttributeError):
        custom_id = None
    return {
        "id": _line_id(batch, number),
        "custom_id": custom_id,
        "line": number,
        "response": None,
        "error": BatchError(error.code, error.message, error.param, number).as_json(),
    }


def _line_id(batch: str, number: int) -> str:
    return f"batch_req_{batch.removeprefix(BATCH_PREFIX)[:12]}{number:08d}"
