"""OpenAI-compatible request and response shapes (no HTTP): embeddings.

Serving wraps these in routes; flows wraps them in batch records, so an offline
OpenAI batch line gets exactly the body the online endpoint would have answered.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput


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
