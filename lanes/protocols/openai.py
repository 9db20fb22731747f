"""OpenAI-compatible request and response shapes (no HTTP): what every request shares
(strict fields, `parse`, inputs as texts or token ids), embeddings, error bodies and
batch-file lines. Completions and chat completions are in lanes.protocols.completions,
lanes.protocols.chat and lanes.protocols.generateparams (requests) and
lanes.protocols.answers (answers).

Serving wraps these in routes; flows wraps them in batch records, so an offline
OpenAI batch line gets exactly the body the online endpoint would have answered.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lanes.errors import InvalidInput, LanesError, RequestTooLarge
from lanes.validation import describe, invalid_input

T = TypeVar("T")


class Shape(BaseModel):
    """A request shape. Fields OpenAI defines are typed as strictly as OpenAI checks
    them (no "5" for 5, no 1 for true); fields lanes does not know are ignored, as
    vLLM ignores them: clients send their own vendors' extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    def check(self) -> None:
        """Refuse what the types let through but lanes cannot serve (see `unsupported`)."""


class OpenAIRequest(Shape):
    model: str = Field(description="The workload name.")
    user: str | None = Field(None, description="The caller's end user, for their logs.")


def unsupported(param: str, detail: str) -> InvalidInput:
    """A parameter lanes does not implement, sent with a value that would change the
    answer (its no-op value is accepted)."""
    return InvalidInput.field(param, detail, "unsupported_value")


R = TypeVar("R", bound=Shape)


def parse(model: type[R], body: Any) -> R:
    """Validate a request body; a bad one raises InvalidInput naming the field."""
    if not isinstance(body, dict):
        found = describe(body)
        raise InvalidInput.field("body", f"expected a JSON object, found {found}", "invalid_type")
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        raise invalid_input(err) from None
    request.check()
    return request


Inputs = list[str | list[int]]


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def texts_or_ids(value: str | list[Any], param: str, what: str) -> Inputs:
    """OpenAI's four spellings of a request's inputs (each a `what`), as a list: a text,
    a list of texts, one array of token ids, a list of arrays of token ids. A list is
    of one kind, as its first item's (OpenAI and vLLM take no mix of texts and
    arrays): an item of the other kind is refused, named `param[i]`."""
    if isinstance(value, str):
        return [value]
    if not value:
        detail = f"expected at least one {what}, found an empty array"
        raise InvalidInput.field(param, detail, "empty_array")
    if _is_id(value[0]):
        return [_token_ids(value, param)]
    texts = isinstance(value[0], str)
    inputs: Inputs = []
    for i, item in enumerate(value):
        if isinstance(item, str) and texts:
            inputs.append(item)
        elif isinstance(item, list) and not texts:
            inputs.append(_token_ids(item, f"{param}[{i}]"))
        else:
            detail = _not_of_kind(item, i, param, texts)
            raise InvalidInput.field(f"{param}[{i}]", detail, "invalid_type")
    return inputs


def _not_of_kind(item: Any, i: int, param: str, texts: bool) -> str:
    """Why item `i` of the list of inputs `param` is refused: its kind (`texts`, else
    arrays of token ids) is set by its first item."""
    found = describe(item)
    if i == 0 or not isinstance(item, str | list):
        return f"expected a string or an array of token ids, found {found}"
    wanted = "a string" if texts else "an array of token ids"
    return (
        f"expected {wanted}, as {param}[0] is (a list is all strings or all arrays of "
        f"token ids, not a mix), found {found}"
    )


def _token_ids(value: list[Any], param: str) -> list[int]:
    if not value:
        detail = "expected at least one token id, found an empty array"
        raise InvalidInput.field(param, detail, "empty_array")
    for i, item in enumerate(value):
        if not _is_id(item):
            detail = f"expected a token id (an integer), found {describe(item)}"
            raise InvalidInput.field(f"{param}[{i}]", detail, "invalid_type")
    return list(value)


def one_input(value: str | list[Any]) -> bool:
    """Whether the request's inputs are one input (a text, an array of token ids)."""
    return isinstance(value, str) or (bool(value) and _is_id(value[0]))


def input_count(value: str | list[Any]) -> int:
    """How many inputs `value` holds, before any of them is checked."""
    return 1 if one_input(value) else len(value)


def check_inputs(count: int, limit: int, param: str) -> None:
    """RequestTooLarge when a request carries more than `limit` inputs (in `param`): the
    endpoint's requests and the offline batch lines alike."""
    if count > limit:
        raise RequestTooLarge.field(
            param,
            f"{count} inputs is over the limit of {limit} per request "
            f"(LANES_MAX_INPUTS_PER_REQUEST); split them into requests of at most {limit}",
        )


# vLLM's embeddings extensions lanes does not implement, each at the value that changes
# nothing: accepted there, refused elsewhere. Ignored (as unknown fields are), a vLLM
# client would get vectors of other tokens, or not of unit length, and not know.
EMBED_NO_OPS: dict[str, bool | None] = {
    "truncate_prompt_tokens": None,
    "add_special_tokens": True,
    "normalize": True,
}


class EmbeddingsRequest(OpenAIRequest):
    input: str | list[Any] = Field(description="Text(s), or array(s) of token ids.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Only the model's own.")
    # vLLM's extensions that lanes does not implement (EMBED_NO_OPS).
    truncate_prompt_tokens: int | None = Field(None, description="vLLM's: only none.")
    add_special_tokens: bool | None = Field(None, description="vLLM's: only true.")
    normalize: bool | None = Field(None, description="vLLM's: only true.")

    @field_validator("encoding_format", mode="before")
    @classmethod
    def _null_is_float(cls, value: Any) -> Any:
        """null is the default, as OpenAI takes it (and `dimensions` and `user` here)."""
        return "float" if value is None else value

    def check(self) -> None:
        for name, no_op in EMBED_NO_OPS.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                raise unsupported(
                    name,
                    f"lanes does not implement vLLM's {name}; send {orjson.dumps(no_op).decode()} "
                    f"or leave it out, found {orjson.dumps(value).decode()}",
                )

    @property
    def inputs(self) -> Inputs:
        return texts_or_ids(self.input, "input", "text")

    def check_limits(self, max_inputs: int) -> None:
        """The endpoint's per-request limit, which an offline batch line meets too: at
        most `max_inputs` texts (`LANES_MAX_INPUTS_PER_REQUEST`), else RequestTooLarge."""
        check_inputs(input_count(self.input), max_inputs, "input")


def check_dimensions(request: EmbeddingsRequest, dimensions: int) -> None:
    """`dimensions` is accepted when it is the model's own: lanes does not shorten vectors."""
    if request.dimensions is not None and request.dimensions != dimensions:
        raise unsupported(
            "dimensions",
            f"this model's vectors have {dimensions} dimensions and lanes does not shorten "
            f"them; send {dimensions} or leave it out, found {request.dimensions}",
        )


def embeddings_response(
    model: str, vectors: Sequence[np.ndarray], tokens: int, encoding_format: str = "float"
) -> dict[str, Any]:
    """The body of a /v1/embeddings answer, in the input's order."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def encode_vector(vector: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """base64 text, or the float32 array itself for orjson (OPT_SERIALIZE_NUMPY) to write.

    orjson writes each float32 in its shortest form that reads back exactly:
    a 384-float answer is 4.7 KB instead of 8 KB of double digits, and faster.
    """
    if encoding_format == "base64":
        # OpenAI's base64 format is little-endian float32 bytes.
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.ascontiguousarray(vector, dtype=np.float32)


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- batch files: OpenAI's Batch API and vLLM's run-batch ---------------------------

# The URL of a batch line says which endpoint it would have called online.
BATCH_URLS: dict[str, str] = {
    "/v1/embeddings": "embed",
    "/v1/completions": "generate",
    "/v1/chat/completions": "generate",
}


class BatchRequestLine(Shape):
    """One line of a batch input file: {"custom_id", "method", "url", "body"}."""

    custom_id: str = Field(min_length=1, description="The caller's id, echoed on the output.")
    method: Literal["POST"] = Field(description="Always POST.")
    url: str = Field(description="The endpoint the body is for, e.g. /v1/embeddings.")
    body: dict[str, Any] = Field(description="The request body that endpoint takes.")


def is_batch_line(record: Mapping[str, Any]) -> bool:
    """Whether a parsed input line is a batch request line (else a plain record)."""
    return "custom_id" in record and ("body" in record or "url" in record)


def prepare_texts(request: EmbeddingsRequest, prepare: Callable[[str | list[int]], T]) -> list[T]:
    """Every input of an embeddings request prepared, at least one; an `InvalidInput`
    names the input (`input` or `input[i]`) the way the online endpoint does."""
    one = one_input(request.input)
    items = []
    for i, text in enumerate(request.inputs):
        try:
            items.append(prepare(text))
        except InvalidInput as e:
            raise e.at("input" if one else f"input[{i}]") from None
    return items


def batch_output(
    custom_id: str, request_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """One line of a batch output (or error) file, as OpenAI and vLLM write it."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def error_of(error: LanesError) -> dict[str, Any]:
    """The body the online endpoint answers `error` with (its status: `error.status`)."""
    return error_body(str(error), error.error_type, error.param, error.code)
