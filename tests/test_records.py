"""The record readers (flows.records) on real files, and plain records in the user's own
shape (flows.shape: `fields:`, templates, a handler's `pre`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from lanes.errors import InvalidInput, PermanentStorageError
from lanes.flows.records import Line, count_records, is_known, output_name, read_shard, unit
from lanes.flows.requests import PlainRecord, Rejection, to_request
from lanes.flows.shape import RecordShape
from lanes.protocols.generateparams import GenerationOptions
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
from lanes.storage import Storage
from lanes.tasks.handler import Handler
from lanes.template import Template

RAISE_IT = "(LANES_MAX_BODY_BYTES: raise it, or split the record)"
MAX_INPUTS = Settings.model_fields["max_inputs_per_request"].default


def read(path: Path, max_bytes: int = 1 << 20) -> list[Line]:
    storage = Storage(Settings())
    (shard,) = storage.list_files(str(path), (path.name,))
    return list(read_shard(storage, shard, max_bytes))


CSV = (
    "\ufeffticket_id,subject,body\r\n"  # a spreadsheet's byte-order mark and CRLF
    '1,Printer,"on fire, again\nsee ""photo"""\r\n'  # a quoted comma, newline, quotes
    "\r\n"  # a blank line
    '2,5" screen,cracked\n'  # a quote inside an unquoted field is a quote
    "3,too,many,fields\n"
    "4," + "x" * 200 + ",long\n"
    "5,Login,fails\n"
    '6,"never closed,\n'
    "still inside\n"
)


def test_csv_records_are_numbered_by_their_first_line_and_bad_ones_are_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tickets.csv"
    path.write_text(CSV, encoding="utf-8", newline="")
    lines = read(path, max_bytes=120)
    assert lines == [
        Line(
            2,
            {"ticket_id": "1", "subject": "Printer", "body": 'on fire, again\nsee "photo"'},
            text=True,
        ),
        Line(5, {"ticket_id": "2", "subject": '5" screen', "body": "cracked"}, text=True),
        Line(6, None, "expected 3 fields (the header's), found 4"),
        Line(7, None, "record is 208 bytes, over the limit of 120 " + RAISE_IT),
        Line(8, {"ticket_id": "5", "subject": "Login", "body": "fails"}, text=True),
        Line(
            9,
            None,
            "a quoted field opened on line 9 or later is never closed: it takes in the rest "
            "of the file, lines 9 to 10 (2 lines), none read as a record; close the quote "
            '(a quote inside a quoted field is written "")',
        ),
        Line(
            10,
            None,
            "inside the quoted field opened on line 9 or later, never closed (see line 9); "
            'close the quote (a quote inside a quoted field is written "")',
        ),
    ]
    zipped = tmp_path / "tickets.csv.gz"
    zipped.write_bytes(gzip.compress(CSV.encode()))
    assert read(zipped, max_bytes=120) == lines


def test_an_unclosed_quote_over_the_size_limit_still_names_every_line(tmp_path: Path) -> None:
    """The lines an unclosed quote takes in are rejected one by one (blank ones hold no
    record), however many bytes they make."""
    path = tmp_path / "a.csv"
    path.write_text('id,text\na,ok\nb,"open\n' + "c,more\n\n" * 20, encoding="utf-8")
    lines = read(path, max_bytes=64)
    assert [line.number for line in lines] == [2, 3, *range(4, 44, 2)]
    assert lines[1].error is not None
    assert lines[1].error.startswith(
        "a quoted field opened on line 3 or later is never closed: it takes in the rest "
        "of the file, lines 3 to 43 (41 lines)"
    )


def test_a_jsonl_line_over_the_limit_says_which_setting_raises_it(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"id": 1, "text": "' + "x" * 200 + '"}\n{"id": 2, "text": "y"}\n')
    assert read(path, max_bytes=100) == [
        Line(1, None, "line is 222 bytes, over the limit of 100 " + RAISE_IT),
        Line(2, {"id": 2, "text": "y"}),
    ]


def test_a_jsonl_files_byte_order_mark_is_skipped_as_csvs_is(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n')
    assert read(path) == [Line(1, {"id": 1, "text": "a"}), Line(2, {"id": 2, "text": "b"})]


def test_a_json_arrays_byte_order_mark_is_skipped_as_jsonls_is(tmp_path: Path) -> None:
    # PowerShell 5's `Out-File -Encoding utf8` writes one before the array.
    path = tmp_path / "a.json"
    path.write_bytes(b'\xef\xbb\xbf[{"id": 1, "text": "a"}]')
    assert read(path) == [Line(1, {"id": 1, "text": "a"})]
    blank = tmp_path / "blank.json"
    blank.write_bytes(b"\xef\xbb\xbf\n")
    assert read(blank) == []


def test_a_suffix_in_capitals_is_read_as_its_lowercase_format(tmp_path: Path) -> None:
    # Windows tools and exports write DATA.CSV, Export.Parquet: the same formats.
    import pyarrow as pa
    import pyarrow.parquet as pq

    record = {"id": 1, "text": "a"}
    (tmp_path / "a.JSONL").write_bytes(json.dumps(record).encode() + b"\n")
    (tmp_path / "a.Json.GZ").write_bytes(gzip.compress(json.dumps([record]).encode()))
    (tmp_path / "a.CSV").write_text("id,text\n1,a\n")
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "a.Parquet")
    storage = Storage(Settings())
    for name in ("a.JSONL", "a.Json.GZ", "a.CSV", "a.Parquet"):
        assert is_known(name) and output_name(name) == "a.jsonl"
        (shard,) = storage.list_files(str(tmp_path / name), (name,))
        (line,) = read(tmp_path / name)
        assert line.error is None, name
        assert line.value == ({"id": "1", "text": "a"} if name == "a.CSV" else record)
        assert count_records(storage, shard) == 1
    assert unit("a.PQ") == "row" and unit("a.JSON") == "element"


def test_csv_fields_longer_than_the_csv_modules_default_limit_are_read(tmp_path: Path) -> None:
    path = tmp_path / "long.csv"
    path.write_text("id,text\n" + f'a,"{"w " * 100_000}"\n')
    (line,) = read(path)
    assert line.value is not None and len(line.value["text"]) == 200_000


@pytest.mark.parametrize(
    ("header", "error"),
    [
        ("id,text,id", "CSV header: expected distinct column names, found 'id' twice"),
        ("id,,text", "CSV header: expected a name for every column, found an empty one"),
    ],
)
def test_a_csv_header_that_is_no_header_is_one_error(
    tmp_path: Path, header: str, error: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(f"{header}\n1,a,b\n2,c,d\n")
    ((number, value, message),) = [(x.number, x.value, x.error) for x in read(path)]
    assert (number, value) == (1, None) and message is not None and message.startswith(error)


def test_json_arrays_are_read_element_by_element(tmp_path: Path) -> None:
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"id": 1, "text": "a"}, 7, {"id": 3, "text": "y" * 300}]))
    assert read(path, max_bytes=100) == [
        Line(1, {"id": 1, "text": "a"}),
        Line(2, None, "expected a JSON object, found 7"),
        Line(3, None, "element is 318 bytes, over the limit of 100 " + RAISE_IT),
    ]
    one = tmp_path / "one.json"
    one.write_text('{"id": 1, "text": "a"}')
    assert read(one) == [Line(1, None, "expected a JSON array of objects, found an object")]
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(gzip.compress(b'[{"id": 1'))
    ((number, value, message),) = [(x.number, x.value, x.error) for x in read(broken)]
    assert (number, value) == (1, None) and message is not None and "malformed JSON" in message


def test_a_record_that_is_not_utf8_names_the_byte_not_surrogates(tmp_path: Path) -> None:
    # Latin-1 ("é" is 0xe9), as a tool that does not write UTF-8 leaves a line; the
    # good lines around it are read as ever.
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "caf\xe9"}\n{"id": 3}\n')
    first, bad, last = read(path)
    assert (first.value, last.value) == ({"id": 1, "prompt": "a"}, {"id": 3})
    assert bad.number == 2 and bad.value is None and bad.error is not None
    assert "byte 0xe9 in position 24" in bad.error and "surrogates" not in bad.error, bad.error
    array = tmp_path / "records.json"
    array.write_bytes('[{"id": 1, "text": "café"}]'.encode("latin-1"))
    ((number, value, message),) = [(x.number, x.value, x.error) for x in read(array)]
    assert (number, value) == (1, None) and message is not None
    assert "byte 0xe9 in position 23" in message and "surrogates" not in message, message


WHOLE_GZ = gzip.compress(b'{"id": 1, "text": "a"}\n' * 50, mtime=0)
CORRUPT_GZ = {
    "truncated": WHOLE_GZ[: len(WHOLE_GZ) // 2],  # EOFError
    "not gzip": b'{"id": 1, "text": "a"}\n',  # gzip.BadGzipFile
    "bad deflate": WHOLE_GZ[:10] + b"\xff" * 20,  # zlib.error
    "bad checksum": WHOLE_GZ[:-8] + bytes(8),  # gzip.BadGzipFile
}


@pytest.mark.parametrize("kind", CORRUPT_GZ)
def test_a_corrupt_gzip_file_is_a_permanent_storage_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(CORRUPT_GZ[kind])
    with pytest.raises(PermanentStorageError, match=r"a.jsonl.gz: not a readable gzip file: "):
        read(path)


def test_a_corrupt_parquet_file_is_a_permanent_storage_error(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    path.write_bytes(b"PAR1 and then not Parquet at all")
    storage = Storage(Settings())
    (shard,) = storage.list_files(str(path), (".parquet",))
    with pytest.raises(PermanentStorageError, match=r"a.parquet: not a readable Parquet file: "):
        read(path)
    with pytest.raises(PermanentStorageError, match=r"a.parquet: not a readable Parquet file: "):
        count_records(storage, shard)


def test_a_parquet_map_column_is_read_as_a_json_records_object(tmp_path: Path) -> None:
    """pyarrow gives a MAP's value as (key, value) pairs; a record holds it as JSON would:
    an object, integer keys as their digits, a key given twice its last value. A map of
    keys no JSON object holds (here: bytes) stays pairs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    table = pa.table(
        {
            "id": [1, 2, 3],
            "by_text": pa.array(
                [[("199", 5.0)], None, [("1", -1.0), ("1", 2.0)]],
                pa.map_(pa.string(), pa.float64()),
            ),
            "by_id": pa.array([[(199, 5)], [], None], pa.map_(pa.int64(), pa.int64())),
            "by_bytes": pa.array([[(b"k", 1)], None, None], pa.map_(pa.binary(), pa.int64())),
        }
    )
    pq.write_table(table, path)
    assert [line.value for line in read(path)] == [
        {"id": 1, "by_text": {"199": 5.0}, "by_id": {"199": 5}, "by_bytes": [(b"k", 1)]},
        {"id": 2, "by_text": None, "by_id": {}, "by_bytes": None},
        {"id": 3, "by_text": {"1": 2.0}, "by_id": None, "by_bytes": None},
    ]


def test_a_parquet_map_inside_a_struct_or_list_is_read_as_an_object_too(tmp_path: Path) -> None:
    """A MAP nested in a struct, a list, a map's values or a list of structs is the
    object a JSON record's would be, as a top-level one is; a nested map of bytes keys
    stays pairs, its values read the same way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bias = pa.map_(pa.int64(), pa.float64())
    path = tmp_path / "a.parquet"
    options = pa.struct([("logit_bias", bias), ("seed", pa.int64())])
    table = pa.table(
        {
            "id": [1, 2],
            "options": pa.array(
                [{"logit_bias": [(199, 5.0)], "seed": 1}, {"logit_bias": None, "seed": None}],
                options,
            ),
            "biases": pa.array([[[(1, 1.0)], None], None], pa.list_(bias)),
            "turns": pa.array(
                [[{"tags": [("a", "b")]}], [{"tags": None}]],
                pa.large_list(pa.struct([("tags", pa.map_(pa.string(), pa.string()))])),
            ),
            "by_name": pa.array([[("x", [(2, 0.5)])], []], pa.map_(pa.string(), bias)),
            "by_bytes": pa.array([[(b"k", [(3, 1.0)])], None], pa.map_(pa.binary(), bias)),
        }
    )
    pq.write_table(table, path)
    assert [line.value for line in read(path)] == [
        {
            "id": 1,
            "options": {"logit_bias": {"199": 5.0}, "seed": 1},
            "biases": [{"1": 1.0}, None],
            "turns": [{"tags": {"a": "b"}}],
            "by_name": {"x": {"2": 0.5}},
            "by_bytes": [(b"k", {"3": 1.0})],
        },
        {
            "id": 2,
            "options": {"logit_bias": None, "seed": None},
            "biases": None,
            "turns": [{"tags": None}],
            "by_name": {},
            "by_bytes": None,
        },
    ]


EMPTY = {
    "empty.json": b"",
    "blank.json": b" \n\t\r\n",
    "empty.json.gz": gzip.compress(b"", mtime=0),
    "blank.json.gz": gzip.compress(b"\n\n", mtime=0),
    "empty.jsonl": b"",
    "bom.jsonl": b"\xef\xbb\xbf",  # an editor's byte-order mark, and nothing more
    "bom-blank.jsonl": b"\xef\xbb\xbf \n",
    "empty.csv": b"",
}


@pytest.mark.parametrize("name", EMPTY)
def test_an_empty_text_file_holds_no_records(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(EMPTY[name])
    storage = Storage(Settings())
    (shard,) = storage.list_files(str(path), (name,))
    assert read(path) == []
    assert count_records(storage, shard) == 0


# ---- records in the user's own shape -------------------------------------------------------


def shape(task: str = "embed", handler: Handler | None = None, **fields: Any) -> RecordShape:
    workload = OfflineWorkload.model_validate(
        {"mode": "offline", "task": task, "model": "m", "input": "in/", "output": "out/"}
        | ({"fields": fields} if fields else {})
        | ({"handler": "tests.test_records:unused"} if handler else {})
    )
    return RecordShape.of("w", workload, handler if handler is not None else None)


def request(record: dict[str, Any], rshape: RecordShape) -> PlainRecord | Rejection:
    made = to_request(Line(4, record), rshape, "in/a.jsonl", MAX_INPUTS)
    assert isinstance(made, PlainRecord | Rejection)
    return made


TICKET = {"ticket_id": 17, "subject": "Printer", "body": "on fire", "customer": "acme", "n": 2}


def test_fields_name_the_id_a_template_of_the_text_and_the_fields_to_keep() -> None:
    rshape = shape(id="ticket_id", text="{subject}: {body} ({n}, {{x}})", keep=["customer"])
    made = request(TICKET, rshape)
    assert isinstance(made, PlainRecord)
    assert (made.id, made.item, made.kept) == (
        17,
        "Printer: on fire (2, {x})",
        {"customer": "acme"},
    )
    plain = request(TICKET, shape(id="ticket_id", text="body"))
    assert isinstance(plain, PlainRecord) and plain.item == "on fire"


@pytest.mark.parametrize(
    ("fields", "record", "error"),
    [
        ({}, {"text": "a"}, 'missing field "id": a plain record is {"id": ..., "text": "..."}; '
         "if your records name it otherwise, set the workload's `fields.id`"),
        ({"id": "ticket_id"}, {"id": 1, "text": "a"}, 'missing field "ticket_id" (the id, by `fields.id`)'),
        ({}, {"method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}},
         'missing field "custom_id": an OpenAI batch line is {"custom_id": ..., "method": "POST", '
         '"url": ..., "body": {...}}'),
        ({"id": "ticket_id", "text": "{subject} {body}"}, {"ticket_id": 1, "subject": "s"},
         "missing field \"body\" (in `fields.text`: '{subject} {body}')"),
        ({"text": "body"}, {"id": 1, "text": "a"}, 'missing field "body" (the text, by `fields.text`)'),
        ({"keep": ["customer"]}, {"id": 1, "text": "a"}, 'missing field "customer" (in `fields.keep`)'),
        ({}, {"id": [1], "text": "a"}, 'field "id" (the id): expected a string or an integer, found an array'),
        ({}, {"id": "", "text": "a"}, 'field "id" (the id): expected a non-empty id, found an empty string'),
        ({"keep": ["blob"]}, {"id": 1, "text": "a", "blob": b"\x00"},  # Parquet's binary
         'field "blob" (in `fields.keep`): a bytes cannot be written in a JSON output line; '
         "cast it in the input, or keep it out"),
    ],
)  # fmt: skip
def test_a_record_missing_what_the_fields_name_is_rejected_saying_which(
    fields: dict[str, Any], record: dict[str, Any], error: str
) -> None:
    made = request(record, shape(**fields))
    assert isinstance(made, Rejection) and made.line["error"] == error
    assert made.line["line"] == 4


def test_generate_and_infer_items_leave_out_the_id_and_the_kept_fields() -> None:
    generate = request(TICKET, shape("generate", id="ticket_id", prompt="{body}", keep=["n"]))
    assert isinstance(generate, PlainRecord) and generate.item == {"prompt": "on fire"}
    # With a prompt made by `fields.prompt`, the fields named as generation options are
    # the request's too (a kept one is copied as well); the template's data is not.
    options = {"max_tokens": 3, "temperature": 0.5, "stop": ["\n"], "seed": 1}
    asked = request(
        {**TICKET, **options}, shape("generate", id="ticket_id", prompt="{body}", keep=["seed"])
    )
    assert isinstance(asked, PlainRecord) and asked.kept == {"seed": 1}
    assert asked.item == {"prompt": "on fire", **options}
    # Without it, as with it: a kept prompt or option is copied and still asked for.
    kept = request(
        {"id": 1, "prompt": "a", "max_tokens": 3, "n": 2},
        shape("generate", keep=["prompt", "max_tokens", "n"]),
    )
    assert isinstance(kept, PlainRecord) and kept.kept == {"prompt": "a", "max_tokens": 3, "n": 2}
    assert kept.item == {"prompt": "a", "max_tokens": 3}
    infer = request(TICKET, shape("infer", id="ticket_id", keep=["customer"]))
    assert isinstance(infer, PlainRecord)
    assert infer.item == {"subject": "Printer", "body": "on fire", "n": 2}


def test_a_generate_record_without_a_prompt_is_rejected_saying_how_to_name_it() -> None:
    made = request({"id": 1, "question": "why?"}, shape("generate"))
    assert isinstance(made, Rejection)
    assert made.line["error"] == (
        'missing field "prompt": a generate record is {"id": ..., "prompt": "...", '
        "<generation options>}; if your records name it otherwise, set the workload's "
        "`fields.prompt`"
    )


def csv_request(record: dict[str, str], rshape: RecordShape) -> PlainRecord | Rejection:
    made = to_request(Line(5, record, text=True), rshape, "in/a.csv", MAX_INPUTS)
    assert isinstance(made, PlainRecord | Rejection)
    return made


def test_a_csv_generate_records_options_are_read_as_a_jsonl_records_numbers() -> None:
    cells = {"id": "7", "prompt": "a b", "max_tokens": "12", "temperature": " 0.5 "}
    cells |= {"top_k": "", "top_p": "1", "seed": "-3", "stop": "\n\n"}
    made = csv_request(cells, shape("generate"))
    assert isinstance(made, PlainRecord) and made.id == "7"
    assert made.item == {
        "prompt": "a b",
        "max_tokens": 12,
        "temperature": 0.5,
        "top_k": None,  # an empty cell: the workload's default
        "top_p": 1,
        "seed": -3,
        "stop": "\n\n",
    }
    # Read as text only from CSV: a JSON record's string stays a string (the task refuses it).
    jsonl = request({"id": 7, "prompt": "a", "max_tokens": "12"}, shape("generate"))
    assert isinstance(jsonl, PlainRecord) and jsonl.item == {"prompt": "a", "max_tokens": "12"}
    # Columns that make no item stay text: an embed record's, a template's data.
    embedded = csv_request({"id": "1", "text": "a", "seed": "x"}, shape())
    assert isinstance(embedded, PlainRecord) and embedded.item == "a"
    # A prompt made by `fields.prompt` leaves the record's options its own: read alike.
    by_field = shape("generate", prompt="{body} ({seed})")
    templated = csv_request({"id": "1", "body": "a", "seed": "7", "top_k": ""}, by_field)
    assert isinstance(templated, PlainRecord)
    assert templated.item == {"prompt": "a (7)", "seed": 7, "top_k": None}
    refused = csv_request({"id": "1", "body": "a", "seed": "x"}, by_field)
    assert isinstance(refused, Rejection)
    assert refused.line["error"] == "seed: expected an integer, found 'x'"


def test_a_csv_generate_records_list_object_and_boolean_options_are_read_as_json() -> None:
    # A spreadsheet's optional columns: a cell left empty is not given, as a number's;
    # one filled is the JSON a JSONL record would hold there.
    cells = {"id": "a", "prompt": "x", "stop_token_ids": "[199, 7]", "logit_bias": '{"199": 5}'}
    made = csv_request({**cells, "include_stop_str_in_output": "true"}, shape("generate"))
    assert isinstance(made, PlainRecord)
    assert made.item == {
        "prompt": "x",
        "stop_token_ids": [199, 7],
        "logit_bias": {"199": 5},
        "include_stop_str_in_output": True,
    }
    empty = {"stop_token_ids": "", "logit_bias": " ", "include_stop_str_in_output": ""}
    made = csv_request({"id": "b", "prompt": "x", **empty}, shape("generate"))
    assert isinstance(made, PlainRecord)
    assert made.item == {"prompt": "x"} | dict.fromkeys(empty)
    # A cell that is no JSON stays text, for the request's own check to name.
    made = csv_request({"id": "c", "prompt": "x", "stop_token_ids": "199;7"}, shape("generate"))
    assert isinstance(made, PlainRecord) and made.item["stop_token_ids"] == "199;7"


@pytest.mark.parametrize(
    ("field", "cell", "error"),
    [
        ("max_tokens", "abc", "max_tokens: expected an integer, found 'abc'"),
        ("max_tokens", "12.5", "max_tokens: expected an integer, found '12.5'"),
        ("seed", "true", "seed: expected an integer, found 'true'"),
        ("top_k", "1_000", "top_k: expected an integer, found '1_000'"),
        ("temperature", "warm", "temperature: expected a number, found 'warm'"),
        ("top_p", "NaN", "top_p: expected a number, found 'NaN'"),
    ],
)
def test_a_csv_cell_that_is_no_number_rejects_its_record_naming_field_and_line(
    field: str, cell: str, error: str
) -> None:
    made = csv_request({"id": "r1", "prompt": "a", field: cell}, shape("generate"))
    assert isinstance(made, Rejection)
    assert made.line == {"id": "r1", "line": 5, "error": error}


def test_a_parquet_integer_option_in_a_float_column_is_read_as_its_integer(
    tmp_path: Path,
) -> None:
    """pandas writes a column of integers with a missing value as float64: its whole
    floats are the integers the user wrote, NaN (or null) not given. A JSON record's
    2.0 stays what it is, refused as the endpoint refuses it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    nan = float("nan")
    table = {
        "id": [1, 2, 3, 4],
        "prompt": ["a", "b", "c", "d"],
        "max_tokens": pa.array([2.0, None, nan, 2.5]),
        "seed": pa.array([7.0, 8.0, None, 9.0]),
        "temperature": pa.array([0.5, 1.0, 1.0, 1.0]),
    }
    pq.write_table(pa.table(table), path)
    items = []
    for line in read(path):
        made = to_request(line, shape("generate"), str(path), MAX_INPUTS)
        assert isinstance(made, PlainRecord)
        items.append({k: v for k, v in made.item.items() if k != "prompt"})
    assert items[:3] == [
        {"max_tokens": 2, "seed": 7, "temperature": 0.5},
        {"max_tokens": None, "seed": 8, "temperature": 1.0},
        {"max_tokens": None, "seed": None, "temperature": 1.0},
    ]
    for item in items[:3]:
        GenerationOptions.model_validate(item)  # the task's own check: they pass
    with pytest.raises(ValidationError, match="max_tokens"):
        GenerationOptions.model_validate(items[3])  # 2.5 is no integer
    jsonl = request({"id": 1, "prompt": "a", "max_tokens": 2.0}, shape("generate"))
    assert isinstance(jsonl, PlainRecord)
    with pytest.raises(ValidationError, match="max_tokens"):
        GenerationOptions.model_validate({"max_tokens": jsonl.item["max_tokens"]})


class Hooks:
    """A handler whose `pre` sees whole records: it keeps what it was given."""

    def __init__(self, returns: Any) -> None:
        self.seen: list[Any] = []
        self.returns = returns

    def pre(self, record: Any) -> Any:
        self.seen.append(record)
        return self.returns(record)


def test_pre_gets_the_whole_record_and_returns_a_record_or_the_item() -> None:
    text = Hooks(lambda r: f"{r['subject']} / {r['body']}")
    rshape = shape(handler=Handler("h:text", text.pre, None), id="ticket_id", keep=["customer"])
    made = request(TICKET, rshape)
    assert isinstance(made, PlainRecord) and made.item is None  # made when prepared
    assert rshape.item_of(made.record) == "Printer / on fire"
    assert text.seen == [TICKET]
    # A record back is read by the fields like any record.
    record = Hooks(lambda r: {**r, "body": r["body"].upper()})
    rshape = shape(handler=Handler("h:rec", record.pre, None), id="ticket_id", text="{body}!")
    assert rshape.item_of(TICKET) == "ON FIRE!"
    failing = Hooks(lambda r: r["missing"])
    rshape = shape(handler=Handler("h:bad", failing.pre, None), id="ticket_id")
    with pytest.raises(InvalidInput, match=r"handler h:bad rejected the input: 'missing'"):
        rshape.item_of(TICKET)


def test_templates_parse_at_load_time_and_render_values() -> None:
    template = Template.parse("{a} and {b}{{}} {a}")
    assert template.fields == ("a", "b")
    assert template.render({"a": "x", "b": [1, None]}) == "x and [1,null]{} x"
    assert Template.parse("{Ticket ID}").render({"Ticket ID": None}) == ""
    for bad, error in [
        ("{a", "opens no field"),
        ("a}", "a single '}'"),
        ("{}", "names no field"),
        ("{a{b}", "opens no field"),
    ]:
        with pytest.raises(ValueError, match=error):
            Template.parse(bad)
