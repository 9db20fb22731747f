"""A v2 answer: a task's results as named output arrays (`result_arrays`), their
metadata, and the response body that carries them (`encode_response`), each output as
JSON or as binary tensor data as the request asked.

Apart from the body shapes (lanes.protocols.v2) and from reading a request's tensors
(lanes.protocols.v2inputs): an answer reads only which outputs were asked for, and
how.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from lanes.errors import InvalidInput, ModelError
from lanes.protocols.v2 import (
    DATATYPE_NAMES,
    MODEL_VERSION,
    Array,
    InferRequest,
    RequestedOutput,
    datatype_of,
    flag,
)


def result_arrays(result: Any) -> dict[str, Array]:
    """One item's answer as named arrays. A mapping's values are the outputs (strings are
    BYTES); any other value (a handler's `post` may return any JSON value) is one output
    `result`, one BYTES element per row, each a JSON text."""
    if isinstance(result, dict | Mapping):
        return {str(name): _output_array(name, value) for name, value in result.items()}
    rows = result if isinstance(result, list) else [result]
    try:
        texts = [orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY).decode() for r in rows]
    except TypeError as e:
        raise ModelError(f"the handler's result is not JSON: {e}") from None
    array = np.empty(len(texts), dtype=object)
    array[:] = texts
    return {"result": array}


def _output_array(name: Any, value: Any) -> Array:
    if isinstance(value, np.ndarray) and value.dtype in DATATYPE_NAMES:
        return value  # the model's own output, as it came
    try:
        array = np.asarray(value)
        if array.dtype.kind == "S":  # numpy's bytes type drops trailing zero bytes
            array = np.asarray(value, dtype=object)
    except ValueError as e:  # ragged nested lists
        raise ModelError(f"output {name!r}: not a rectangular array ({e})") from None
    if datatype_of(array.dtype) is None:
        raise ModelError(f"output {name!r}: dtype {array.dtype} has no v2 datatype")
    return array


def output_metadata(name: str, array: Array) -> dict[str, Any]:
    """An output's metadata entry from an example of it: its rank is known, its dims are not."""
    return {"name": name, "datatype": datatype_of(array.dtype), "shape": [-1] * array.ndim}


# ---- responses -------------------------------------------------------------------------


@dataclass(slots=True)
class EncodedResponse:
    """An answer's body; `header_length` is the JSON part's size when binary data follows."""

    body: bytes
    header_length: int | None


def encode_response(
    request: InferRequest, model_name: str, outputs: Mapping[str, Array]
) -> EncodedResponse:
    """The answer to `request`: the outputs it asked for (all, if none), in its order, each
    as JSON or binary data as it asked."""
    default = False if request.parameters is None else _binary_output(request.parameters)
    asked = request.outputs
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for output in asked or outputs:
        name = output.name if isinstance(output, RequestedOutput) else output
        binary = output.binary(default) if isinstance(output, RequestedOutput) else default
        array = outputs[name]
        datatype = datatype_of(array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": array.shape}
        if binary:
            blob = _bytes_of(array) if datatype == "BYTES" else _raw(array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = _texts(name, array)
        else:  # orjson writes a flat native-order array, no Python list in between
            flat = array.reshape(-1)
            entry["data"] = (
                flat if flat.dtype.isnative else flat.astype(flat.dtype.newbyteorder("="))
            )
        entries.append(entry)
    answer: dict[str, Any] = {
        "model_name": model_name,
        "model_version": MODEL_VERSION,
        "outputs": entries,
    }
    if request.id is not None:
        answer["id"] = request.id
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return EncodedResponse(header, None)
    return EncodedResponse(b"".join([header, *blobs]), len(header))


def _raw(array: Array) -> bytes:
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()


def _element(value: Any) -> bytes | str:
    if isinstance(value, bytes | str):
        return value
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _bytes_of(array: Array) -> bytes:
    parts: list[bytes] = []
    for value in array.reshape(-1).tolist():
        element = _element(value)
        data = element.encode() if isinstance(element, str) else element
        parts += (len(data).to_bytes(4, "little"), data)
    return b"".join(parts)


def _texts(name: str, array: Array) -> list[str]:
    texts = []
    for value in array.reshape(-1).tolist():
        element = _element(value)
        if isinstance(element, bytes):
            try:
                element = element.decode()
            except UnicodeDecodeError:
                raise InvalidInput.field(
                    f"outputs.{name}",
                    "holds bytes that are not UTF-8 text, which JSON cannot carry; ask for it "
                    "as binary data (parameters.binary_data: true)",
                ) from None
        texts.append(element)
    return texts


def _binary_output(params: Mapping[str, Any]) -> bool:
    return flag(params, "binary_data_output", "", False)
