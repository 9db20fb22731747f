"""Reading input shards into numbered records: JSONL, CSV, JSON arrays, Parquet.

    JSONL       .jsonl .ndjson       one JSON object a line; streamed
    CSV         .csv                 a header line, then one record a line (RFC 4180
                                     quoting; a quoted field may hold newlines; one never
                                     closed rejects each line to the end); streamed;
                                     every value is a string (`Line.text`)
    JSON array  .json                one array of objects; read whole
    Parquet     .parquet .pq         one record a row; read by row groups; a MAP
                                     column keyed by text or integers is an object

A suffix counts in any case (DATA.CSV is CSV). The text formats may be gzipped
(`.jsonl.gz`, `.csv.gz`, ...); a UTF-8 byte-order mark
at their start is skipped (some editors write one). A record's number is
its line (JSONL; CSV: the line it starts on, the header being line 1), its row
(Parquet) or its element (JSON array), counted from 1.

A record that cannot be read (malformed JSON, a record over the size limit, a value
that is not an object, a CSV row with the wrong number of fields) comes back as a
`Line` with `error` set, never as an exception: one bad record must not cost the rest
of its shard. A file that cannot be read at all (a CSV header that is no header, a
JSON file that is no array) is one such Line, numbered 1. An empty (or blank) text file,
JSON included, holds no records.
"""

from __future__ import annotations

import csv
import gzip
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO, Any

import orjson

from lanes.errors import PermanentStorageError, StorageError
from lanes.inputs import check_opened
from lanes.listing import StoredFile
from lanes.s3errors import Missing
from lanes.storage import Storage
from lanes.uris import is_s3
from lanes.validation import describe, not_utf8

JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
CSV = (".csv", ".csv.gz")
JSON = (".json", ".json.gz")
PARQUET = (".parquet", ".pq")
SUFFIXES = JSONL + CSV + JSON + PARQUET
FORMATS = (
    "JSONL (.jsonl, .ndjson), CSV (.csv), JSON arrays (.json), each optionally gzipped "
    "(.gz), and Parquet (.parquet, .pq)"
)
_CHUNK = 1024 * 1024
_QUOTE = ord('"')


@dataclass(frozen=True)
class Line:
    """One input record: its 1-based number (see the module docstring), and the parsed
    object or why it could not be read."""

    number: int
    value: dict[str, Any] | None
    error: str | None = None
    text: bool = False  # every value is a string, as read (CSV): RecordShape.typed
    # A Parquet row: a column of integers with a missing value may be float64 (pandas
    # writes it so): RecordShape.typed.
    parquet: bool = False


def is_known(name: str) -> bool:
    """Whether a file of this name is in a format `read_shard` reads."""
    return name.lower().endswith(SUFFIXES)


def unit(name: str) -> str:
    """What a record's number counts in a file of this name: line, row or element."""
    if name.lower().endswith(PARQUET):
        return "row"
    return "element" if name.lower().endswith(JSON) else "line"


def read_shard(
    storage: Storage, shard: StoredFile, max_bytes: int, roots: Sequence[str] | None = None
) -> Iterator[Line]:
    """Every record of `shard`, in order. Records longer than `max_bytes` are errors. A
    local file opened outside `roots` (the job's, `ShardPlan.roots`) is refused."""
    name = shard.name.lower()  # a suffix in capitals (DATA.CSV) is the same format
    if name.endswith(PARQUET):
        yield from _parquet(storage, shard, roots)
        return
    with _opened(storage, shard, roots) as stream:
        source: IO[bytes] = stream
        if name.endswith(".gz"):
            source = gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[assignment]
        if name.endswith(CSV):
            records = _csv(source, max_bytes)
        elif name.endswith(JSON):
            records = _json_array(source, max_bytes)
        else:
            records = _jsonl(source, max_bytes)
        try:
            yield from records
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # a corrupt or truncated .gz
            raise PermanentStorageError(
                f"{shard.uri}: not a readable gzip file: {err}; replace it, or move it "
                "out of the input"
            ) from None
        except OSError as err:
            raise StorageError(f"{shard.uri}: cannot read: {err}") from None


def count_records(storage: Storage, shard: StoredFile, roots: Sequence[str] | None = None) -> int:
    """How many records `shard` holds, cheaply: a plain JSONL file's non-blank lines
    (a bad one counts: it is an errors-file line), a Parquet file's rows from its
    footer; other formats are read."""
    name = shard.name.lower()
    if name.endswith(PARQUET):
        import pyarrow as pa
        import pyarrow.parquet as pq

        with _parquet_source(storage, shard, roots) as source:
            try:
                return int(pq.ParquetFile(source).metadata.num_rows)
            except (pa.ArrowException, OSError) as err:
                raise _not_parquet(shard, err) from None
    if name.endswith(CSV) or name.endswith(JSON) or name.endswith(".gz"):
        return sum(1 for _ in read_shard(storage, shard, 2**62, roots))
    count = 0
    content = False  # whether the line read so far holds more than whitespace
    with _opened(storage, shard, roots) as stream:
        # A line longer than a chunk comes in pieces: it counts once, at its end.
        for at, piece in enumerate(iter(lambda: stream.readline(_CHUNK), b"")):
            if at == 0:
                piece = piece.removeprefix(_BOM)  # as _jsonl reads it: no record's
            content = content or bool(piece.strip())
            if piece.endswith(b"\n"):
                count += content
                content = False
    return count + content


_BOM = b"\xef\xbb\xbf"


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
            yield Line(number, None, f"line is {size} bytes, {_over(max_bytes)}")
            continue
        if number == 1:
            raw = raw.removeprefix(_BOM)  # as CSV's reader: some editors write one
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
        return Line(number, None, _json_error(raw, err))
    if not isinstance(value, dict):
        return Line(number, None, f"expected a JSON object, found {describe(value)}")
    return Line(number, value)


def _json_error(raw: bytes, err: orjson.JSONDecodeError) -> str:
    """Why `raw` did not parse; where a byte is not UTF-8 (`not_utf8`), which and where,
    as a CSV record's error says."""
    bad = not_utf8(raw)
    if bad is not None:
        return f"not UTF-8 text: {bad}; write the file encoded as UTF-8"
    return f"malformed JSON: {err}"


def _json_array(stream: IO[bytes], max_bytes: int) -> Iterator[Line]:
    # JSON has no record boundaries to stream by: the array is parsed whole (keep such
    # files to what fits in memory; JSONL streams).
    data = stream.read().removeprefix(_BOM)  # as JSONL's and CSV's readers
    if not data.strip():
        return  # an empty file holds no records, as an empty JSONL file
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        yield Line(1, None, _json_error(data, err))
        return
    if not isinstance(value, list):
        found = describe(value)
        yield Line(1, None, f"expected a JSON array of objects, found {found}")
        return
    for number, element in enumerate(value, 1):
        if not isinstance(element, dict):
            found = describe(element)
            yield Line(number, None, f"expected a JSON object, found {found}")
            continue
        size = len(orjson.dumps(element))
        if size > max_bytes:
            yield Line(number, None, f"element is {size} bytes, {_over(max_bytes)}")
            continue
        yield Line(number, element)


def _csv(stream: IO[bytes], max_bytes: int) -> Iterator[Line]:
    # The csv module's own limit on one field (128 KiB) is process-wide; records are
    # bounded here already, so it only needs to be no lower than ours.
    csv.field_size_limit(max(csv.field_size_limit(), max_bytes))
    header: list[str] | None = None
    for record in _csv_records(stream, max_bytes):
        if record.error is None and not record.data.strip():
            continue  # a blank line
        row, error = _csv_row(record, first=header is None)
        if header is None:
            header, error = _header(row, error)
            if error is not None:
                yield Line(record.start, None, f"CSV header: {error}")
                return
            continue
        if error is not None or row is None:
            yield Line(record.start, None, error)
        elif len(row) != len(header):
            expected = f"{len(header)} fields (the header's)"
            yield Line(record.start, None, f"expected {expected}, found {len(row)}")
        else:
            yield Line(record.start, dict(zip(header, row, strict=True)), text=True)


@dataclass(frozen=True)
class _Record:
    """One CSV record's bytes (empty when it is over the limit), the line it starts on."""

    start: int
    data: bytes
    error: str | None


def _csv_records(stream: IO[bytes], max_bytes: int) -> Iterator[_Record]:
    """The stream cut into CSV records: at a newline outside quotes, so a quoted field
    may hold newlines; a record over `max_bytes` is skipped to its end. A quoted field
    never closed runs to the end of the file: see `_unclosed`."""
    number = 0  # physical lines started so far
    while raw := stream.readline(max_bytes + 1):
        number += 1
        start, size, parts = number, 0, []
        filled: list[int] = []  # the record's lines that are not blank
        quoted, at_start = False, True
        while True:
            size += len(raw)
            if size <= max_bytes:
                parts.append(raw)
            if raw.strip() and (not filled or filled[-1] != number):
                filled.append(number)
            quoted, at_start = _scan(raw, quoted, at_start)
            ended = raw.endswith(b"\n")
            if ended and not quoted:
                break
            raw = stream.readline(max_bytes + 1)
            if not raw:
                break
            if ended:
                number += 1
        if quoted:  # the file ended inside the field, however long that made the record
            yield from _unclosed(start, number, filled)
        elif size > max_bytes:
            yield _Record(start, b"", f"record is {size} bytes, {_over(max_bytes)}")
        else:
            yield _Record(start, b"".join(parts), None)


def _unclosed(start: int, last: int, filled: list[int]) -> Iterator[_Record]:
    """A quoted field opened in the record on line `start` and never closed took in
    every line to the end of the file (`last`). Where its records begin cannot be
    known, so each of those lines that is not blank is one rejected record: the
    counts show them all (none vanish into one record), the error names the lines
    and their number, and `lanes run --retry-errors` reruns exactly them once the
    quote is fixed. Failing the whole shard instead would cost the records before the
    quote their answers; this way `max_error_rate` decides, as for any bad record."""
    span = f"lines {start} to {last} ({last - start + 1} lines)" if last > start else "1 line"
    fix = 'close the quote (a quote inside a quoted field is written "")'
    message = (
        f"a quoted field opened on line {start} or later is never closed: it takes in "
        f"the rest of the file, {span}, none read as a record; {fix}"
    )
    yield _Record(start, b"", message)
    for number in filled:
        if number != start:
            message = (
                f"inside the quoted field opened on line {start} or later, never closed "
                f"(see line {start}); {fix}"
            )
            yield _Record(number, b"", message)


def _scan(chunk: bytes, quoted: bool, at_start: bool) -> tuple[bool, bool]:
    """CSV quoting after `chunk`: (inside a quoted field, at the start of a field).

    A quote opens a quoted field only at the start of a field, as the csv module
    reads it; `""` inside one is a quote."""
    at, end = 0, len(chunk)
    while at < end:
        if quoted:
            found = chunk.find(b'"', at)
            if found < 0:
                return True, False
            if found + 1 < end and chunk[found + 1] == _QUOTE:
                at = found + 2
                continue
            quoted, at = False, found + 1
        elif at_start and chunk[at] == _QUOTE:
            quoted, at_start, at = True, False, at + 1
        else:
            comma = chunk.find(b",", at)
            if comma < 0:
                return False, False
            at, at_start = comma + 1, True
    return quoted, at_start


def _csv_row(record: _Record, first: bool) -> tuple[list[str] | None, str | None]:
    if record.error is not None:
        return None, record.error
    try:
        # A header may open with the byte-order mark spreadsheet programs write.
        text = record.data.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text: {err}"
    try:
        return next(csv.reader([text]), []), None
    except csv.Error as err:
        return None, f"malformed CSV: {err}"


def _header(row: list[str] | None, error: str | None) -> tuple[list[str] | None, str | None]:
    if error is not None or row is None:
        return None, error
    names = [name.strip() for name in row]
    if any(not name for name in names):
        return None, f"expected a name for every column, found an empty one in {names}"
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return None, f"expected distinct column names, found {', '.join(map(repr, twice))} twice"
    return names, None


@contextmanager
def _opened(
    storage: Storage, shard: StoredFile, roots: Sequence[str] | None
) -> Iterator[IO[bytes]]:
    """`shard`'s bytes. One no longer there is a PermanentStorageError (`_gone`), and so
    is a local one opened outside `roots` (lanes.inputs.check_opened)."""
    with ExitStack() as stack:
        try:
            stream = stack.enter_context(storage.open(shard.uri))
        except Missing:
            raise _gone(shard) from None
        if roots is not None and not is_s3(shard.uri):
            check_opened(shard.uri, stream, roots)
        yield stream


@contextmanager
def _parquet_source(
    storage: Storage, shard: StoredFile, roots: Sequence[str] | None
) -> Iterator[Any]:
    """What pyarrow reads `shard` from: the local file, opened (so that one missing or
    denied says so), or the S3 object, held in memory: Parquet's footer is at the end,
    the reader needs random access (a shard is meant to fit in memory anyway)."""
    import pyarrow as pa

    if not is_s3(shard.uri):
        with _opened(storage, shard, roots) as stream:
            yield stream
        return
    data = storage.read_bytes(shard.uri)
    if data is None:
        raise _gone(shard)
    yield pa.BufferReader(data)


def _gone(shard: StoredFile) -> PermanentStorageError:
    # The job's shard plans are fixed when it lists its input, and a task's retry reads
    # the same name again: it cannot find the file under a new one. Failing the shard
    # at once commits nothing for it, so nothing is lost (if the file comes back, the
    # next run runs it) and nothing is doubled (the next run skips the committed
    # shards); skipping it instead would end the run Completed with its records
    # unanswered and unsaid.
    return PermanentStorageError(
        f"{shard.uri}: no longer there: deleted or moved after the run listed its input; "
        "run the workload again to list it anew (the shards committed now are skipped)"
    )


def _parquet(storage: Storage, shard: StoredFile, roots: Sequence[str] | None) -> Iterator[Line]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lanes.flows.parquet_maps import object_converters

    with _parquet_source(storage, shard, roots) as source:
        try:
            table = pq.ParquetFile(source)
            maps = object_converters(table.schema_arrow)
            number = 0
            for batch in table.iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    number += 1
                    for name, convert in maps.items():
                        row[name] = convert(row[name])
                    yield Line(number, row, parquet=True)
        except (pa.ArrowException, OSError) as err:
            raise _not_parquet(shard, err) from None


def _not_parquet(shard: StoredFile, err: Exception) -> PermanentStorageError:
    # pyarrow says OSError of corrupt pages too: the file is read (S3: held in memory)
    # as it is, and would fail the same way again.
    return PermanentStorageError(
        f"{shard.uri}: not a readable Parquet file: {err}; replace it, or move it out of the input"
    )


def output_name(input_name: str) -> str:
    """The output shard's name for an input shard's listed name: the same folders and
    stem, `.jsonl`, always relative and below the output folder.

    Empty parts are dropped (an S3 key may hold `//`: `a//b.jsonl` is `a/b.jsonl`). A
    part that is `.`, `..` or starts with `_` or `.` (bookkeeping, hidden; listings skip
    them) is refused with a StorageError, as is a name with nothing left. A name of one
    part may be a file the input names itself, read whatever its name: it loses its
    leading `_` and `.` instead (`_x.jsonl` writes `x.jsonl`), so that its output is no
    bookkeeping, which the listings of the output skip.
    """
    parts = [part for part in input_name.split("/") if part]
    if len(parts) == 1 and parts[0].lstrip("_."):
        parts = [parts[0].lstrip("_.")]
    refused = [part for part in parts if part.startswith(("_", "."))]
    if refused or not parts:
        why = f"its part {refused[0]!r} is not a data file's" if refused else "it is empty"
        raise StorageError(f"input {input_name!r} cannot name an output: {why}; rename it")
    name = "/".join(parts)
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)] + ".jsonl"
    return name + ".jsonl"


def _over(max_bytes: int) -> str:
    """What a record too long to read is over, and which setting raises it."""
    return f"over the limit of {max_bytes} (LANES_MAX_BODY_BYTES: raise it, or split the record)"
