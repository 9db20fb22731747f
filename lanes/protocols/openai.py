"""OpenAI-compatible request and response shapes (no HTTP): embeddings, batch-file lines.

Serving wraps these in routes; flows wraps them in batch records, so an offline
OpenAI batch line gets exactly the body the online endpoint would have answered.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput

T = TypeVar("T")


class OpenAIRequest(BaseModel):
    # OpenAI clients send fields lanes does not use (user, dimensions): accept, ignore.
    model_config = ConfigDict(extra="ignore")


class EmbeddingsRequest(OpenAIRequest):
    model: str = Field(description="The workload name.")
    input: str | list[str] = Field(description="One text or a list of texts.")
    encoding_format: Literal["float", "base64"] = "float"

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def parse(model: type[OpenAIRequest], body: Any) -> Any:
    """Validate a request body; a bad one raises InvalidInput naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidInput(f"{field}: {first['msg']}") from None


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


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # OpenAI's base64 format is little-endian float32 bytes.
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    values: list[float] = np.asarray(vector, dtype=np.float32).tolist()
    return values


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


class BatchRequestLine(OpenAIRequest):
    """One line of a batch input file: {"custom_id", "method", "url", "body"}."""

    custom_id: str = Field(min_length=1, description="The caller's id, echoed on the output.")
    method: Literal["POST"] = Field(description="Always POST.")
    url: str = Field(description="The endpoint the body is for, e.g. /v1/embeddings.")
    body: dict[str, Any] = Field(description="The request body that endpoint takes.")


def is_batch_line(record: Mapping[str, Any]) -> bool:
    """Whether a parsed input line is a batch request line (else a plain record)."""
    return "custom_id" in record and ("body" in record or "url" in record)


def prepare_texts(request: EmbeddingsRequest, prepare: Callable[[str], T]) -> list[T]:
    """Every text of an embeddings request prepared, at least one; an `InvalidInput`
    names the text (`input` or `input[i]`) the way the online endpoint does."""
    texts = request.texts
    if not texts:
        raise InvalidInput("input: expected at least one text, found an empty list")
    items = []
    for i, text in enumerate(texts):
        try:
            items.append(prepare(text))
        except InvalidInput as e:
            where = "input" if isinstance(request.input, str) else f"input[{i}]"
            raise InvalidInput(f"{where}: {str(e).removeprefix('input: ')}") from None
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


def invalid_request_body(message: str) -> dict[str, Any]:
    """The 400 body the online endpoint answers an `InvalidInput` with."""
    return error_body(message, "invalid_request_error")
