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

Here: the body shapes (`InferRequest` and its parts), the datatypes and the
protocol's constants, which both directions read. A request's tensors are read into
numpy arrays in lanes.protocols.v2inputs; outputs are written into an answer in
lanes.protocols.v2outputs.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput
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
# Each v2 datatype but BYTES by its numpy dtype (BYTES is text, bytes or objects).
DATATYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BYTES"}

Array = np.ndarray[Any, Any]


def datatype_of(dtype: np.dtype[Any]) -> str | None:
    """The v2 datatype of a numpy dtype: text, bytes and objects are BYTES; None when
    the protocol has no such type (complex numbers, dates)."""
    if dtype.kind in "OUS":
        return "BYTES"
    return DATATYPE_NAMES.get(dtype)


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
        return flag(params, "binary_data", f"outputs.{self.name}.", default)


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


def flag(params: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """`params[key]` (`default` where it is absent), which must be true or false;
    InvalidInput names `{where}parameters.{key}` otherwise."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput.field(
            f"{where}parameters.{key}",
            f"expected true or false, found {describe(value)}",
            "invalid_type",
        )
    return value
