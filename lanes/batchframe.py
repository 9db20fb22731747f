"""The internal batch route's body, both ways: prepared items out, raw outputs back.

One frame:

    MAGIC, uint32 little-endian header length, orjson header, array bytes

The header lists one entry per item: its named arrays (dtype, shape, where its bytes
lie), or, in an answer, the error that item failed with alone. Text tensors (infer's
BYTES) travel as JSON lists in the header.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from lanes.backfill import CONTENT_TYPE
from lanes.errors import InvalidInput, LanesError, ModelError, from_wire
from lanes.isolation import Failed
from lanes.spec import TaskName
from lanes.tasks.base import Task
from lanes.tasks.embed import EmbedItem, EmbedTask
from lanes.tasks.infer import InferItem, InferTask

MAGIC = b"LNB1"
_LENGTH = struct.Struct("<I")

Arrays = dict[str, np.ndarray[Any, Any]]


def _pack(entries: Sequence[Arrays | LanesError]) -> bytes:
    header: list[Any] = []
    chunks: list[bytes] = []
    at = 0
    for entry in entries:
        if isinstance(entry, LanesError):
            error = {"message": str(entry), "status": entry.status, "code": entry.code}
            header.append({"error": error})
            continue
        described: dict[str, Any] = {}
        for name, array in entry.items():
            if array.dtype == object:
                described[name] = {"text": [str(v) for v in array.ravel()], "shape": array.shape}
                continue
            data = np.ascontiguousarray(array).tobytes()
            described[name] = {
                "dtype": array.dtype.str,
                "shape": array.shape,
                "at": at,
                "size": len(data),
            }
            chunks.append(data)
            at += len(data)
        header.append({"arrays": described})
    head = orjson.dumps({"items": header})
    return b"".join([MAGIC, _LENGTH.pack(len(head)), head, *chunks])


def _unpack(body: bytes, what: str) -> list[Arrays | LanesError]:
    """The frame's entries; InvalidInput naming what is wrong with it."""
    view = memoryview(body)
    start = len(MAGIC) + _LENGTH.size
    if len(body) < start or bytes(view[: len(MAGIC)]) != MAGIC:
        raise InvalidInput(
            f"{what}: expected a lanes batch frame ({CONTENT_TYPE}), found other bytes"
        )
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    try:
        header = orjson.loads(view[start : start + length])
        entries = header["items"]
        blob = view[start + length :]
        return [_entry(e, blob) for e in entries]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise InvalidInput(f"{what}: the batch frame does not parse ({err})") from None


def _entry(entry: Mapping[str, Any], blob: memoryview) -> Arrays | LanesError:
    if "error" in entry:
        error = entry["error"]
        return from_wire(str(error["message"]), int(error["status"]), error.get("code"))
    arrays: Arrays = {}
    for name, spec in entry["arrays"].items():
        shape = tuple(int(d) for d in spec["shape"])
        if "text" in spec:
            arrays[name] = np.array(spec["text"], dtype=object).reshape(shape)
            continue
        at, size = int(spec["at"]), int(spec["size"])
        if at < 0 or at + size > len(blob):
            raise ValueError(f"array {name!r} lies past the end of the body")
        arrays[name] = np.frombuffer(blob[at : at + size], dtype=np.dtype(spec["dtype"])).reshape(
            shape
        )
    return arrays


# ---- items out, outputs back -----------------------------------------------------------


def encode_items(items: Sequence[Any]) -> bytes:
    """Prepared embed or infer items, as the route's request body."""
    entries: list[Arrays | LanesError] = []
    for item in items:
        if isinstance(item, EmbedItem):
            entries.append({"ids": item.ids})
        elif isinstance(item, InferItem):
            entries.append(dict(item.inputs))
        else:
            raise TypeError(f"cannot send a {type(item).__name__} to the endpoint's batch route")
    return _pack(entries)


def decode_items(task: Task, body: bytes) -> list[Any]:
    """The request body as `task`'s prepared items, each checked as `prepare` would;
    InvalidInput (400) for what does not fit."""
    entries = _unpack(body, "body")
    items: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, LanesError):
            raise InvalidInput(f"body: item {i} is an error, not an input")
        try:
            items.append(_item(task, entry))
        except InvalidInput as err:
            raise InvalidInput(f"body: item {i}: {err}") from None
    if not items:
        raise InvalidInput("body: expected at least one item, found none")
    return items


def _item(task: Task, arrays: Arrays) -> Any:
    if isinstance(task, EmbedTask):
        ids = arrays.get("ids")
        if ids is None or ids.ndim != 1 or ids.dtype != np.int64 or len(ids) == 0:
            raise InvalidInput("expected `ids`, a non-empty 1-d int64 array of token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= task.vocab_size:
            raise InvalidInput(f"token ids outside the vocabulary (0 to {task.vocab_size - 1})")
        if len(ids) > task.max_length:
            raise InvalidInput(f"{len(ids)} tokens, over the model's {task.max_length}")
        return EmbedItem(ids, len(ids))
    if isinstance(task, InferTask):
        return task.check(arrays)
    raise InvalidInput(f"workload {task.name!r} ({task.kind}) takes no offline batches")


def run_unhandled(task: Task, items: Sequence[Any]) -> list[Any]:
    """The model run behind `task.run`, without the workload's handler (the offline
    workload applies its own): embed, one vector per item; infer, named tensors."""
    if isinstance(task, EmbedTask):
        return list(task.vectors(items))
    if isinstance(task, InferTask):
        return list(task.tensors(items))
    raise ModelError(f"workload {task.name!r} ({task.kind}) takes no offline batches")


def encode_outputs(outcomes: Sequence[Any]) -> bytes:
    """Each item's raw output (a vector, or named tensors) or the error it failed
    with alone, as the route's answer."""
    entries: list[Arrays | LanesError] = []
    for outcome in outcomes:
        if isinstance(outcome, LanesError):
            entries.append(outcome)
        elif isinstance(outcome, Exception):
            entries.append(ModelError(f"the model failed on this item: {outcome}"))
        elif isinstance(outcome, np.ndarray):
            entries.append({"embedding": outcome})
        else:
            entries.append(dict(outcome))
    return _pack(entries)


def decode_outputs(body: bytes, count: int, kind: TaskName) -> list[Any]:
    """The route's answer: per item its raw output (embed: the vector; infer: named
    tensors) or a `Failed` holding its error. ModelError when it does not hold
    `count` entries."""
    try:
        entries = _unpack(body, "the endpoint's answer")
    except InvalidInput as err:
        raise ModelError(str(err)) from None
    if len(entries) != count:
        raise ModelError(f"the endpoint answered {len(entries)} outputs for {count} items")
    outputs: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, LanesError):
            outputs.append(Failed(i, entry))
        elif kind == "embed":
            outputs.append(entry["embedding"].copy())  # writable, as a local run's
        else:
            outputs.append({name: array.copy() for name, array in entry.items()})
    return outputs
