"""Reading input shards into numbered records: JSONL (optionally gzipped) and Parquet.

A record that cannot be read (malformed JSON, a line over the size limit, a line that
is not an object) comes back as a `Line` with `error` set, never as an exception:
one bad line must not cost the rest of its shard.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import orjson

from lanes.errors import StorageError
from lanes.storage import Storage, StoredFile, is_s3

JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET = (".parquet", ".pq")
SUFFIXES = JSONL + PARQUET
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Line:
    """One input record: its 1-based line (or Parquet row) number, and the parsed
    object or why it could not be read."""

    number: int
    value: dict[str, Any] | None
    error: str | None = None


def read_shard(storage: Storage, shard: StoredFile, max_bytes: int) -> Iterator[Line]:
    """Every record of `shard`, in order. Lines longer than `max_bytes` are errors."""
    if shard.name.endswith(PARQUET):
        yield from _parquet(storage, shard)
        return
    with storage.open(shard.uri) as stream:
        source: IO[bytes] = stream
        if shard.name.endswith(".gz"):
            source = gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[assignment]
        try:
            yield from _jsonl(source, max_bytes)
        except (OSError, EOFError) as err:  # a truncated or corrupt .gz
            raise StorageError(f"{shard.uri}: cannot read: {err}") from None


def _jsonl(stream: IO[bytes], max_bytes: int) -> Iterator[Line]:
    number = 0
    while True:
        # readline with a limit: a huge line costs at most max_bytes of memory.
        raw = stream.readline(max_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            size = len(raw) + _skip_line(stream)
            yield Line(number, None, f"line is {size} bytes, over the limit of {max_bytes}")
            continue
        if not raw.strip():
            continue  # a blank line counts (editors number it) but holds no record
        yield _parse(number, raw)


def _skip_line(stream: IO[bytes]) -> int:
    """Read past the rest of an over-long line; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = stream.readline(_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def _parse(number: int, raw: bytes) -> Line:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        return Line(number, None, f"malformed JSON: {err}")
    if not isinstance(value, dict):
        return Line(number, None, f"expected a JSON object, found {type(value).__name__}")
    return Line(number, value)


def _parquet(storage: Storage, shard: StoredFile) -> Iterator[Line]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source: Any = shard.uri
    if is_s3(shard.uri):
        # Parquet's footer is at the end: the reader needs random access, so the object
        # is held in memory (a shard is meant to fit there anyway).
        data = storage.read_bytes(shard.uri)
        if data is None:
            raise StorageError(f"{shard.uri}: no such object")
        source = pa.BufferReader(data)
    try:
        table = pq.ParquetFile(source)
        number = 0
        for batch in table.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                number += 1
                yield Line(number, row)
    except (pa.ArrowException, OSError) as err:
        raise StorageError(f"{shard.uri}: not a readable Parquet file: {err}") from None


def output_name(input_name: str) -> str:
    """The output shard's name for an input shard's listed name: the same folders and
    stem, `.jsonl`, always relative and below the output folder.

    Empty parts are dropped (an S3 key may hold `//`: `a//b.jsonl` is `a/b.jsonl`). A
    part that is `.`, `..` or starts with `_` or `.` (bookkeeping, hidden; listings skip
    them) is refused with a StorageError, as is a name with nothing left.
    """
    parts = [part for part in input_name.split("/") if part]
    refused = [part for part in parts if part.startswith(("_", "."))]
    if refused or not parts:
        why = f"its part {refused[0]!r} is not a data file's" if refused else "it is empty"
        raise StorageError(f"input {input_name!r} cannot name an output: {why}; rename it")
    name = "/".join(parts)
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".jsonl"
    return name + ".jsonl"
