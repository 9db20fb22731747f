"""What a call's input becomes on the wire, and its answer back: a request's JSON body
(encoded once, and what JSON cannot hold named by its field), v2 tensors with the
model's datatypes, and embeddings. No I/O: `lanes.wire` builds requests with these.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lanes.errors import InvalidInput
from lanes.protocols.v2 import DTYPES
from lanes.validation import describe


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: dict[str, Any] | None  # None: no body (a GET)
    headers: dict[str, str]
    streamed: bool = False  # the answer comes as Server-Sent Events
    timeout_ms: float | None = None  # the call's deadline (X-Timeout-Ms), over its retries

    @functools.cached_property
    def content(self) -> bytes | None:
        """The body as JSON, encoded once for every attempt; what JSON cannot hold (a
        set, bytes, NaN) is InvalidInput naming its field, before anything is sent."""
        if self.body is None:
            return None
        try:
            return _json(self.body)
        except (TypeError, ValueError) as e:
            raise _unsendable(self.body, e) from None


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def _unsendable(body: Mapping[str, Any], error: Exception) -> InvalidInput:
    """The field of `body` (an infer tensor by its name) that JSON cannot hold."""
    inputs = body.get("inputs")
    tensors = inputs if isinstance(inputs, list) else []
    parts = [(k, v) for k, v in body.items() if v is not inputs or not tensors]
    parts += [(t["name"], t["data"]) for t in tensors]  # made by _tensor
    found = "body", error
    for name, part in parts:
        try:
            _json(part)
        except (TypeError, ValueError) as e:
            found = name, e
            break
    name, cause = found
    return InvalidInput.field(
        name, f"cannot be sent as JSON ({cause}); send strings, finite numbers, lists and mappings"
    )


def embed_input(value: Any) -> Any:
    """An embed call's input, numpy arrays made what JSON holds: a 1-D array of texts
    (dtype str, or object holding only str) a list of str, a 1-D or 2-D array of ints
    token ids; any other array is InvalidInput naming `input`. Other values pass as
    they are (`Request.content` names what JSON cannot hold)."""
    if not isinstance(value, np.ndarray):
        return value
    kind, flat = value.dtype.kind, value.ndim == 1
    if flat and (kind == "U" or (kind == "O" and all(isinstance(v, str) for v in value))):
        return [str(v) for v in value]
    if kind in "iu" and value.ndim in (1, 2):
        return value.tolist()
    raise InvalidInput.field(
        "input",
        f"a numpy array of {value.dtype} with shape {value.shape} cannot be sent as an embed "
        "input: send texts (a str, a list of str or a 1-D array of str) or token ids "
        "(a 1-D or 2-D array of ints)",
    )


def infer_inputs(input: Any, names: Sequence[str], workload: str) -> Mapping[str, Any]:
    """An infer call's input by the model's input `names`: a mapping as it is; any other
    value (a flat row, rows, a text) is the model's only input. Shared by the SDK and
    the task itself (`lanes predict`), so both take the same. InvalidInput naming the
    inputs when there are several to choose from."""
    if isinstance(input, Mapping):
        return input
    if len(names) == 1:
        return {names[0]: input}
    listed = ", ".join(map(repr, names))
    example = ", ".join(f"{n!r}: [...]" for n in names)
    raise InvalidInput.field(
        "input",
        f"workload {workload!r} takes {len(names)} inputs ({listed}): send a mapping of "
        f"input name -> array, like {{{example}}}; found {describe(input)}",
        "invalid_type",
    )


def input_array(value: Any) -> np.ndarray[Any, Any]:
    """`np.asarray(value)`, but where `value` (not already an array) mixes strings or
    bytes with other values, the values as they are, in an object array: numpy would
    make the 1 of `[1, "a"]` the string "1", and a string input would take it
    unnoticed. Shared by the SDK and the infer task, so neither converts it.
    ValueError for ragged lists, as numpy's."""
    array = np.asarray(value)
    if array.dtype.kind not in "US" or isinstance(value, np.ndarray):
        return array
    given = np.asarray(value, dtype=object)
    kind = str if array.dtype.kind == "U" else bytes
    if all(isinstance(v, kind) for v in given.reshape(-1)):
        return array
    return given


_V2_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BYTES"}


def guessed(value: Any) -> bool:
    """Whether a value's v2 datatype is a guess: Python numbers and lists, and numpy's
    default int64 and float64 that they become. Any other numpy dtype is the caller's."""
    if isinstance(value, np.ndarray | np.generic):
        return value.dtype in _DEFAULT_DTYPES
    return not isinstance(value, str | bytes)


_DEFAULT_DTYPES = (np.dtype(np.int64), np.dtype(np.float64))


def tensor(name: str, value: Any, model_type: str | None = None) -> dict[str, Any]:
    """One v2 request tensor. A guessed datatype (see `guessed`) becomes the model's
    when the values fit it unchanged in kind (ints into floats, float64 into FP32,
    int64 into int32 within range), else without the model's, float64 goes as FP32,
    the usual type; other values go as their own dtype, for the server to name a
    mismatch."""
    array = input_array(value)
    if array.dtype.kind in "OUS":
        datatype = "BYTES"
    elif model_type is not None and guessed(value) and _fits(array, model_type):
        array = array.astype(DTYPES[model_type])
        datatype = model_type
    elif array.dtype == np.float64 and model_type is None and guessed(value):
        datatype = "FP32"
    else:
        found = _V2_NAMES.get(array.dtype)
        if found is None:
            raise InvalidInput(f"input {name!r}: dtype {array.dtype} has no v2 datatype")
        datatype = found
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype,
        "data": array.reshape(-1).tolist(),
    }


def _fits(array: np.ndarray[Any, Any], datatype: str) -> bool:
    target = DTYPES.get(datatype)
    if target is None or target is object or array.dtype.kind not in "biuf":
        return False
    cast = array.astype(target)
    same_kind = np.can_cast(array.dtype, target, casting="same_kind")
    return bool(same_kind and (cast.dtype.kind == "f" or np.array_equal(cast, array)))


def output_array(output: Mapping[str, Any]) -> Any:
    if output["datatype"] == "BYTES" and output["name"] == "result":
        # A handler's JSON results, one per row.
        return [json.loads(v) for v in output["data"]]
    return np.asarray(output["data"], dtype=DTYPES[output["datatype"]]).reshape(output["shape"])


def vector(embedding: Any) -> np.ndarray[Any, Any]:
    if isinstance(embedding, str):  # OpenAI's base64: little-endian float32
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").astype(np.float32)
    return np.asarray(embedding, dtype=np.float32)
