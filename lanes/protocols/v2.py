"""Open Inference Protocol v2 (KServe/Triton) tensor shapes, JSON encoding (no HTTP)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput

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


class Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    shape: list[int]
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    inputs: list[Tensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None

    @classmethod
    def parse(cls, body: Any) -> InferRequest:
        """Validate a request body; InvalidInput names the first wrong field."""
        try:
            return cls.model_validate(body)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            field = ".".join(str(p) for p in first["loc"]) or "body"
            raise InvalidInput(f"{field}: {first['msg'].lower()}") from None

    @property
    def output_names(self) -> set[str]:
        return {o.name for o in self.outputs or []}

    def timeout_s(self) -> float | None:
        """Triton's `parameters.timeout`, in microseconds, as seconds."""
        value = (self.parameters or {}).get("timeout")
        if value is None:
            return None
        if not isinstance(value, int | float) or value <= 0:
            raise InvalidInput(f"parameters.timeout: expected microseconds > 0, found {value!r}")
        return float(value) / 1e6


def to_array(tensor: Tensor) -> np.ndarray[Any, Any]:
    """A request tensor as a numpy array of its declared dtype and shape."""
    dtype = DTYPES.get(tensor.datatype)
    where = f"inputs.{tensor.name}"
    if dtype is None:
        known = ", ".join(DTYPES)
        raise InvalidInput(f"{where}.datatype: expected one of {known}, found {tensor.datatype!r}")
    if any(d < 0 for d in tensor.shape):
        raise InvalidInput(f"{where}.shape: expected non-negative dims, found {tensor.shape}")
    try:
        array = np.asarray(tensor.data, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        raise InvalidInput(f"{where}.data: expected {tensor.datatype} values") from None
    if dtype is not object and array.dtype.kind in "iu" and not _ints(tensor.data):
        raise InvalidInput(f"{where}.data: expected integers for {tensor.datatype}")
    expected = math.prod(tensor.shape)
    if array.size != expected:
        raise InvalidInput(
            f"{where}: shape {tensor.shape} needs {expected} values, found {array.size}"
        )
    return array.reshape(tensor.shape)


def _ints(data: list[Any]) -> bool:
    flat = np.asarray(data, dtype=object).reshape(-1)
    return all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in flat)


def output_tensor(name: str, array: np.ndarray[Any, Any]) -> dict[str, Any]:
    """A response tensor: flat data in row-major order, as the protocol's JSON form has it."""
    datatype = "BYTES" if array.dtype == object else _NAMES.get(array.dtype)
    if datatype is None:
        raise InvalidInput(f"output {name!r}: dtype {array.dtype} has no v2 datatype")
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape),
        "data": array.reshape(-1).tolist(),
    }
