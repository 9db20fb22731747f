"""The inputs an ONNX model requires, read from its file without its weights.

`lanes validate` checks a model's inputs against its task (lanes.specrules). Parsing the
file with `onnx.load` would read every weight a single-file model embeds: a model of
a few GB parsed whole, to learn a handful of names. So this walks the protobuf wire
format on a memory map instead, stepping over every field it does not need by its
length: ModelProto.graph (7), then the graph's inputs (11, ValueInfoProto: name 1)
and initializers (5, TensorProto: name 8). An input with an initializer has a
default, so onnxruntime does not require it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

_GRAPH, _INPUT, _INITIALIZER = 7, 11, 5  # ModelProto.graph, GraphProto.input/initializer
_VALUE_NAME, _TENSOR_NAME = 1, 8  # ValueInfoProto.name, TensorProto.name
_FIXED = {1: 8, 5: 4}  # wire types of fixed width: 64-bit, 32-bit
_VARINT, _BYTES = 0, 2
Span = tuple[int, int]


def required_inputs(path: Path) -> list[str]:
    """The names of the graph inputs `path`'s model requires, in the graph's order.
    ValueError when the file is not an ONNX model (OSError when it cannot be read)."""
    with path.open("rb") as file:
        if file.seek(0, 2) == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            graphs = [span for field, span in _fields(data, (0, len(data))) if field == _GRAPH]
            if not graphs:
                raise ValueError("it holds no graph")
            inputs: list[str] = []
            defaults: set[str] = set()
            for field, span in _fields(data, graphs[-1]):  # protobuf: the last one wins
                if field == _INPUT:
                    inputs.append(_name(data, span, _VALUE_NAME))
                elif field == _INITIALIZER:
                    defaults.add(_name(data, span, _TENSOR_NAME))
            return [name for name in inputs if name not in defaults]


def _fields(data: mmap.mmap, span: Span) -> Iterator[tuple[int, Span]]:
    """(field number, span of its bytes) of each length-delimited field in `span`; the
    other fields are stepped over."""
    at, end = span
    while at < end:
        key, at = varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == _BYTES:
            length, at = varint(data, at)
            if at + length > end:
                raise ValueError("a field runs past its message")
            yield field, (at, at + length)
            at += length
        elif wire == _VARINT:
            _, at = varint(data, at)
        elif wire in _FIXED:
            at += _FIXED[wire]
        else:
            raise ValueError(f"wire type {wire} is not ONNX's")
    if at != end:
        raise ValueError("a field runs past its message")


def varint(data: mmap.mmap, at: int) -> tuple[int, int]:
    """The protobuf varint at `at`, and where the next field starts; ValueError past
    the end."""
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("a number runs past the file")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _name(data: mmap.mmap, span: Span, number: int) -> str:
    names = [data[a:b] for field, (a, b) in _fields(data, span) if field == number]
    return names[-1].decode("utf-8") if names else ""
