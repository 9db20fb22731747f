"""A v2 request's input tensors as numpy arrays of their datatypes and shapes
(`parse_infer`): from JSON `data`, or from binary tensor data after the JSON header,
each value checked against its datatype as Triton checks it.

Apart from the body shapes (lanes.protocols.v2) because reading tensors is most of a
request's checks, and from the answer's encoding (lanes.protocols.v2outputs), which
reads none of them.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import numpy as np

from lanes.errors import InvalidInput, shown
from lanes.protocols.v2 import (
    DTYPES,
    HEADER_LENGTH,
    Array,
    InferCall,
    InferRequest,
    Tensor,
)
from lanes.validation import describe


def parse_infer(body: bytes, header_length: str | None = None) -> InferCall:
    """A request body, JSON or with binary tensor data (`header_length`: the
    Inference-Header-Content-Length header); InvalidInput names the first wrong field."""
    if header_length is None:
        request, rest = InferRequest.parse(body), memoryview(b"")
    else:
        size = _header_size(header_length, len(body))
        view = memoryview(body)
        request, rest = InferRequest.parse(view[:size]), view[size:]
    blobs = _claim(request.inputs, rest, binary=header_length is not None)
    inputs = {t.name: to_array(t, blob) for t, blob in zip(request.inputs, blobs, strict=True)}
    if len(inputs) < len(request.inputs):
        _twice("inputs", [t.name for t in request.inputs])
    if request.outputs and len({o.name for o in request.outputs}) < len(request.outputs):
        _twice("outputs", [o.name for o in request.outputs])
    return InferCall(request, inputs)


def _claim(inputs: list[Tensor], data: memoryview, binary: bool) -> list[memoryview | None]:
    """Each input's binary data (None: its data is JSON); every byte must be claimed."""
    blobs: list[memoryview | None] = []
    offset = 0
    for tensor in inputs:
        size = None if tensor.parameters is None else tensor.binary_size()
        if size is None:
            if tensor.data is None:
                raise InvalidInput.field(
                    f"inputs.{tensor.name}",
                    "no data; send `data`, or binary data and its parameters.binary_data_size",
                )
            blobs.append(None)
            continue
        where = f"inputs.{tensor.name}"
        if tensor.data is not None:
            raise InvalidInput.field(where, "both data and parameters.binary_data_size; send one")
        if not binary:
            raise InvalidInput.field(
                f"{where}.parameters.binary_data_size",
                f"binary data needs an {HEADER_LENGTH} header giving the size of the JSON "
                "before it",
            )
        if offset + size > len(data):
            raise InvalidInput.field(
                f"{where}.parameters.binary_data_size",
                f"{size} bytes, but only {len(data) - offset} bytes of binary data are left "
                "in the body",
            )
        blobs.append(data[offset : offset + size])
        offset += size
    if offset != len(data):
        raise InvalidInput.field(
            "body",
            f"{len(data) - offset} bytes after the JSON header that no input's "
            "parameters.binary_data_size accounts for",
        )
    return blobs


def _twice(kind: str, names: list[str]) -> NoReturn:
    first, *others = sorted({n for n in names if names.count(n) > 1})
    also = f" (as {', '.join(map(repr, others))} {'is' if len(others) == 1 else 'are'})"
    raise InvalidInput.field(f"{kind}.{first}", "given more than once" + (also if others else ""))


def _header_size(raw: str, body_size: int) -> int:
    if not raw.isdigit() or int(raw) > body_size:
        raise InvalidInput.field(
            HEADER_LENGTH,
            f"expected the size of the body's JSON part (0 to {body_size} bytes), found {shown(raw)}",
        )
    return int(raw)


def to_array(tensor: Tensor, binary: memoryview | None = None) -> Array:
    """A request tensor (its JSON data, or its `binary` data) as a numpy array of its
    datatype and shape; BYTES elements are str from JSON, bytes from binary data."""
    dtype = DTYPES.get(tensor.datatype)
    where = f"inputs.{tensor.name}"
    if dtype is None:
        known = ", ".join(DTYPES)
        detail = f"expected one of {known}, found {shown(tensor.datatype)}"
        raise InvalidInput.field(f"{where}.datatype", detail)
    if any(d < 0 for d in tensor.shape):
        detail = f"expected non-negative dims, found {tensor.shape}"
        raise InvalidInput.field(f"{where}.shape", detail)
    count = math.prod(tensor.shape)
    if binary is not None:
        return _from_binary(tensor, binary, count).reshape(tensor.shape)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # checked below
            array = np.asarray(tensor.data, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        ragged = _ragged(tensor.data)
        if ragged is not None:
            raise InvalidInput.field(f"{where}.data", ragged) from None
        within = ""
        if np.dtype(dtype).kind in "iu":  # numpy refuses an integer past the type's range
            info = np.iinfo(dtype)
            within = f" (integers from {info.min} to {info.max})"
        detail = f"expected {tensor.datatype} values{within}"
        raise InvalidInput.field(f"{where}.data", detail) from None
    kind = array.dtype.kind
    # numpy reads "5.1" and true as numbers: JSON's types are checked here, as Triton
    # checks them, so a value of the wrong type is refused, not converted.
    stray = _stray(tensor.data, _JSON_TYPES[kind]) if kind in _JSON_TYPES else None
    if stray is not None:
        wanted = {"b": "true or false", "f": "numbers"}.get(kind, "integers")
        raise InvalidInput.field(
            f"{where}.data",
            f"expected {wanted} for {tensor.datatype}, found {describe(stray[1])} at [{stray[0]}]",
        )
    # JSON has no NaN or infinity: a float that is not finite was null, or a number
    # beyond the datatype's range.
    if kind == "f" and not np.isfinite(array).all():
        raise InvalidInput.field(
            f"{where}.data",
            f"expected {tensor.datatype} numbers, found null or a number beyond "
            f"{tensor.datatype}'s range",
        )
    if array.size != count:
        raise InvalidInput.field(
            where, f"shape {tensor.shape} needs {count} values, found {array.size}"
        )
    return array.reshape(tensor.shape)


# The JSON values a tensor of each numpy kind takes: a number is never a bool.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "b": (bool, np.bool_),
    "i": (int, np.integer),
    "u": (int, np.integer),
    "f": (int, float, np.integer, np.floating),
}


def _ragged(data: Any, at: tuple[int, ...] = ()) -> str | None:
    """What makes nested `data` ragged (rows of different lengths, or lists beside
    values), as a refusal's detail; None when it is not."""
    if not isinstance(data, list):
        return None
    sizes = [_size(v) for v in data]
    for i, size in enumerate(sizes):
        if size != sizes[0]:
            return (
                f"expected rows of one length, found {sizes[0]} at {_index(*at, 0)} "
                f"and {size} at {_index(*at, i)}"
            )
    for i, row in enumerate(data):
        found = _ragged(row, (*at, i))
        if found is not None:
            return found
    return None


def _size(value: Any) -> str:
    if not isinstance(value, list):
        return "a value"
    return f"{len(value)} value{'' if len(value) == 1 else 's'}"


def _index(*at: int) -> str:
    return "".join(f"[{i}]" for i in at)


def _stray(data: list[Any] | None, types: tuple[type, ...]) -> tuple[int, Any] | None:
    """The first element of `data` (flat or nested; its index in the flat order) that
    is none of `types`, or a bool where `types` are numbers; None when there is none."""
    flat: Any = data or []
    found = set(map(type, flat))  # at C speed: tritonclient sends data flat
    if list in found:
        flat = np.asarray(flat, dtype=object).reshape(-1)
        found = set(map(type, flat))
    if found <= {t for t in types if t in (bool, int, float)}:
        return None  # JSON's own types, each right (type() tells a bool from an int)
    numbers = bool not in types
    for i, v in enumerate(flat):
        if not isinstance(v, types) or (numbers and isinstance(v, bool | np.bool_)):
            return i, v
    return None


def _from_binary(tensor: Tensor, raw: memoryview, count: int) -> Array:
    where = f"inputs.{tensor.name}"
    if tensor.datatype == "BYTES":
        elements = _split_bytes(raw, where)
        if len(elements) != count:
            raise InvalidInput.field(
                where,
                f"shape {tensor.shape} needs {count} BYTES elements, found {len(elements)} "
                "in its binary data",
            )
        array = np.empty(count, dtype=object)
        array[:] = elements
        return array
    dtype = np.dtype(DTYPES[tensor.datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput.field(
            where,
            f"shape {tensor.shape} of {tensor.datatype} is {count * dtype.itemsize} bytes, "
            f"found parameters.binary_data_size {len(raw)}",
        )
    if tensor.datatype == "BOOL" and count and np.frombuffer(raw, np.uint8).max() > 1:
        raise InvalidInput.field(where, "BOOL binary data must be bytes 0 or 1")
    return np.frombuffer(raw, dtype=dtype)


def _split_bytes(raw: memoryview, where: str) -> list[bytes]:
    """BYTES binary data: each element a 4-byte little-endian length, then the bytes."""
    elements: list[bytes] = []
    offset, end = 0, len(raw)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput.field(
                where, f"BYTES binary data ends inside element {len(elements)}'s 4-byte length"
            )
        length = int.from_bytes(raw[offset : offset + 4], "little")
        offset += 4
        if offset + length > end:
            raise InvalidInput.field(
                where,
                f"BYTES element {len(elements)} claims {length} bytes, but only "
                f"{end - offset} are left in its binary data",
            )
        elements.append(bytes(raw[offset : offset + length]))
        offset += length
    return elements
