"""Open Inference Protocol v2 (KServe/Triton): request and response bodies, tensors as
JSON or as binary tensor data (no HTTP).

A body is JSON, or (Triton's binary tensor data extension) a JSON header of
`Inference-Header-Content-Length` bytes followed by raw tensors: each input with
`parameters.binary_data_size` takes that many bytes, in the order of `inputs`. Raw
tensors are little-endian and row-major; BOOL is one byte, BYTES elements are each a
4-byte little-endian length and the bytes. An output goes back in binary when its
`parameters.binary_data` says so, else when the request's
`parameters.binary_data_output` does; then the answer is a JSON header followed by
the outputs' bytes in the order of its `outputs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput, ModelError, shown
from lanes.validation import describe, invalid_input, malformed_json

# The size of the JSON part of a body that binary tensor data follows (both ways).
HEADER_LENGTH = "Inference-Header-Content-Length"
# lanes serves one version of each workload: the one in workloads.yaml.
MODEL_VERSION = "1"

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": object,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BYTES"}

Array = np.ndarray[Any, Any]


def datatype_of(dtype: np.dtype[Any]) -> str | None:
    """The v2 datatype of a numpy dtype: text, bytes and objects are BYTES; None when
    the protocol has no such type (complex numbers, dates)."""
    if dtype.kind in "OUS":
        return "BYTES"
    return _NAMES.get(dtype)


class Part(BaseModel):
    """A v2 body's part. Its fields take JSON's own types only (a shape's dims are
    integers: true, "1" and 1.0 are not 1); fields the protocol does not define are
    ignored, as Triton ignores them."""

    model_config = ConfigDict(extra="ignore", strict=True)


class Tensor(Part):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None

    def binary_size(self) -> int | None:
        """`parameters.binary_data_size`: this input's bytes after the JSON header."""
        params = self.parameters or {}
        if "shared_memory_region" in params:
            raise InvalidInput.field(
                f"inputs.{self.name}.parameters.shared_memory_region",
                "shared memory is not supported; send the tensor in the body (as data or "
                "binary data)",
            )
        size = params.get("binary_data_size")
        if size is None:
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput.field(
                f"inputs.{self.name}.parameters.binary_data_size",
                f"expected a byte count >= 0, found {describe(size)}",
                "integer_below_min_value" if isinstance(size, int) else "invalid_type",
            )
        return size


class RequestedOutput(Part):
    name: str
    parameters: dict[str, Any] | None = None

    def binary(self, default: bool) -> bool:
        """Whether to answer this output as binary data (`parameters.binary_data`)."""
        params = self.parameters or {}
        for unsupported in ("classification", "shared_memory_region"):
            if params.get(unsupported):
                raise InvalidInput.field(
                    f"outputs.{self.name}.parameters.{unsupported}",
                    "not supported; ask for the output itself",
                )
        return _flag(params, "binary_data", f"outputs.{self.name}.", default)


class InferRequest(Part):
    id: str | None = None
    inputs: list[Tensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None

    @classmethod
    def parse(cls, body: bytes | memoryview) -> InferRequest:
        """A JSON request (or the JSON header of one); InvalidInput names the first wrong
        field."""
        if not body:
            raise InvalidInput.field("body", "expected a JSON object, found an empty body")
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            hint = ""
            if isinstance(body, bytes) and b'"binary_data_size"' in body:
                hint = f"; binary tensor data needs an {HEADER_LENGTH} header (the JSON's size)"
            raise InvalidInput.field("body", f"{malformed_json(body, e)}{hint}") from None
        try:
            return cls.model_validate(parsed)
        except ValidationError as err:
            raise _by_name(invalid_input(err), parsed) from None

    def timeout_s(self) -> float | None:
        """Triton's `parameters.timeout`, in microseconds, as seconds; None where it is
        not given, or is 0, which is no timeout in Triton (its default)."""
        value = (self.parameters or {}).get("timeout")
        if value is None or (value == 0 and not isinstance(value, bool)):
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidInput.field(
                "parameters.timeout",
                f"expected microseconds >= 0 (0: none), found {describe(value)}",
            )
        return float(value) / 1e6

    def check_outputs(self, available: Collection[str], workload: str) -> None:
        """InvalidInput unless every requested output is one of `available`."""
        missing = [o.name for o in self.outputs or [] if o.name not in available]
        if missing:
            listed = ", ".join(map(repr, available)) or "none"
            raise InvalidInput.field(
                f"outputs.{missing[0]}",
                f"workload {workload!r} has no output {', '.join(map(repr, missing))}; "
                f"its outputs: {listed}",
            )


def _by_name(error: InvalidInput, parsed: Any) -> InvalidInput:
    """`error` about `inputs[i]...` (or `outputs[i]...`) named as every other error about
    a tensor is, `inputs.<name>...`, when that tensor has a name: the one its sender
    gave it, where its place in the list is a detail of the body. A tensor whose name
    is missing or no string keeps its place."""
    found = _PLACE.match(error.param or "")
    if found is None or not isinstance(parsed, dict):
        return error
    kind, index, rest = found["kind"], int(found["index"]), found["rest"]
    tensors = parsed.get(kind)
    tensor = tensors[index] if isinstance(tensors, list) and index < len(tensors) else None
    name = tensor.get("name") if isinstance(tensor, dict) else None
    if not isinstance(name, str) or not name:
        return error
    return error.at(f"{kind}.{name}{rest}")


_PLACE = re.compile(r"(?P<kind>inputs|outputs)\[(?P<index>\d+)\](?P<rest>.*)", re.DOTALL)


@dataclass(slots=True)
class InferCall:
    """A request and its inputs as numpy arrays of their datatypes and shapes, by name."""

    request: InferRequest
    inputs: dict[str, Array]


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


def _binary_output(params: Mapping[str, Any]) -> bool:
    return _flag(params, "binary_data_output", "", False)


def _flag(params: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput.field(
            f"{where}parameters.{key}",
            f"expected true or false, found {describe(value)}",
            "invalid_type",
        )
    return value


# ---- tensors ---------------------------------------------------------------------------


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
    if isinstance(value, np.ndarray) and value.dtype in _NAMES:
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
