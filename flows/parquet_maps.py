"""Parquet MAP columns read as JSON objects (flows.records reads Parquet with these).

pyarrow gives a MAP as a list of (key, value) pairs. A map keyed by text or integers,
a column or nested in structs, lists or other maps' values, is turned into the object a
JSONL record would hold (a generate record's `logit_bias`, at the top or in a struct of
options): integer keys as their digits (JSON's keys are text: token id 199 is "199"), a
key given twice its last value (as a JSON object's is read). A map of other keys stays
a list of pairs, as no JSON object can hold its keys. Imported only to read Parquet:
pyarrow is heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

Convert = Callable[[Any], Any]


def object_converters(schema: pa.Schema) -> dict[str, Convert]:
    """For each column of `schema` that holds such a map, what turns its values as
    pyarrow gives them into JSON's: made once per file, so that the types are walked
    once, not at every row."""
    return {f.name: _converter(f.type) for f in schema if _holds_object_map(f.type)}


def _object_keys(kind: pa.DataType) -> bool:
    """Whether a map keyed by `kind` can be a JSON object (its keys written as text)."""
    return bool(
        pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
    )


def _is_list(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(kind)
        or pa.types.is_large_list(kind)
        or pa.types.is_fixed_size_list(kind)
        or pa.types.is_list_view(kind)
        or pa.types.is_large_list_view(kind)
    )


def _holds_object_map(kind: pa.DataType) -> bool:
    if pa.types.is_map(kind):
        return _object_keys(kind.key_type) or _holds_object_map(kind.item_type)
    if _is_list(kind):
        return _holds_object_map(kind.value_type)
    if pa.types.is_struct(kind):
        return any(_holds_object_map(field.type) for field in kind)
    return False


def _converter(kind: pa.DataType) -> Convert:
    """What converts a value of type `kind`; a part holding no such map passes as it is."""
    if not _holds_object_map(kind):
        return _as_is
    if pa.types.is_map(kind):
        item = _converter(kind.item_type)
        if _object_keys(kind.key_type):
            return _unless_null(lambda pairs: {str(key): item(value) for key, value in pairs})
        return _unless_null(lambda pairs: [(key, item(value)) for key, value in pairs])
    if _is_list(kind):
        element = _converter(kind.value_type)
        return _unless_null(lambda values: [element(value) for value in values])
    fields = [(field.name, _converter(field.type)) for field in kind]  # a struct
    return _unless_null(lambda value: {name: each(value.get(name)) for name, each in fields})


def _as_is(value: Any) -> Any:
    return value


def _unless_null(convert: Convert) -> Convert:
    """`convert`, with a null (None) passed on as it is."""
    return lambda value: None if value is None else convert(value)
