"""A finished batch's output and error files, assembled from its shards in the store:
the committed shards' lines in input order, their rejected lines numbered as in the
input file, and, for a batch that expired or failed, an error line for every request of
a shard never committed (lanes.batches calls it once a batch's run has ended).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from lanes import layout
from lanes.batchstore import BatchStore
from lanes.jobs import BATCH_PREFIX
from lanes.storage import join


def assemble(
    store: BatchStore,
    record: dict[str, Any],
    markers: list[dict[str, Any] | None],
    unanswered: dict[str, Any] | None,
    per_shard: int,
) -> dict[str, int]:
    """Write the output file (committed shards' lines, in input order) and the error
    file (their rejected lines, numbered as in the input file, then, given the
    `unanswered` error, every request of a shard never committed); returns the
    counts. `markers`: each shard's commit marker, None for one never committed."""
    folder = record["_lanes"]["folder"]
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
                                entry = orjson.loads(line)
                                if isinstance(entry.get("line"), int):
                                    entry["line"] += first
                                yield orjson.dumps(entry) + b"\n"
            elif unanswered is not None:
                uri = join(folder, "in", f"part-{shard:05d}.jsonl")
                with storage.open(uri) as lines:
                    for number, line in enumerate(lines, first + 1):
                        if line.strip():
                            counts["failed"] += 1
                            entry = _unanswered(record["id"], number, line, unanswered)
                            yield orjson.dumps(entry) + b"\n"

    batch = record["id"]
    made = store.put_file(f"{batch}_output.jsonl", "batch_output", outputs())
    record["output_file_id"] = made.id
    failed = store.put_file(f"{batch}_error.jsonl", "batch_output", errors())
    if failed.bytes:
        record["error_file_id"] = failed.id
    else:
        store.delete_file(failed.id)
    return counts


def _unanswered(batch: str, number: int, line: bytes, error: dict[str, Any]) -> dict[str, Any]:
    try:
        custom_id = orjson.loads(line).get("custom_id")
    except (orjson.JSONDecodeError, AttributeError):
        custom_id = None
    return {
        "id": f"batch_req_{batch.removeprefix(BATCH_PREFIX)[:12]}{number:08d}",
        "custom_id": custom_id,
        "line": number,
        "response": None,
        "error": error,
    }
