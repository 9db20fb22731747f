"""OpenAI-compatible request and response shapes (no HTTP): embeddings, completions,
chat completions (and their stream chunks), batch-file lines.

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


# ---- completions and chat completions --------------------------------------------------

OpenAIFinish = Literal["stop", "length", "content_filter"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class GenerateParams(OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share. Unset fields take the
    workload's `generation:`; `top_k` and `ignore_eos` are vLLM's extensions."""

    model: str = Field(description="The workload name.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float | None = Field(None, description="0 is greedy.")
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = Field(None, description="Strings that end the text.")
    seed: int | None = Field(None, description="Makes sampling reproducible.")
    n: Literal[1] = Field(1, description="Choices per request: lanes makes one.")
    stream: bool = Field(False, description="Answer as Server-Sent Events.")
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Run to max_tokens (benchmarks).")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generation_item(self, prompt: str) -> dict[str, Any]:
        """The generate task's item: the prompt and the parameters that are set."""
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }


class CompletionRequest(GenerateParams):
    prompt: str | list[str] = Field(description="One prompt (a list of one is accepted).")

    @property
    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidInput(
                f"prompt: expected one prompt, found a list of {len(self.prompt)}; "
                "send one request per prompt"
            )
        return self.prompt[0]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(description="system, user, assistant, ...")
    content: str | list[ContentPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerateParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="Newer name of max_tokens.")

    def generation_item(self, prompt: str) -> dict[str, Any]:
        item = super().generation_item(prompt)
        if self.max_completion_tokens is not None:
            item["max_tokens"] = self.max_completion_tokens
        return item


def render_chat(
    messages: Sequence[ChatMessage], template: str | None, generation_prompt: str | None
) -> str:
    """The prompt of a chat: `template.format(role=, content=)` per message, then the
    generation prompt (both from the model's config.json). `InvalidInput` without one."""
    if template is None:
        raise InvalidInput(
            "messages: this workload's model has no chat template (config.json "
            "`chat_template`); use /v1/completions with a prompt"
        )
    turns = "".join(template.format(role=m.role, content=m.text) for m in messages)
    return turns + (generation_prompt or "")


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: OpenAIFinish,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a /v1/completions answer."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    id: str, created: int, model: str, text: str, finish_reason: OpenAIFinish | None = None
) -> dict[str, Any]:
    """One Server-Sent Event of a streamed /v1/completions answer."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_response(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: OpenAIFinish,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a /v1/chat/completions answer."""
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    id: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: OpenAIFinish | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One Server-Sent Event of a streamed chat answer; the first carries the role,
    the last an empty delta and the finish_reason."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    id: str, created: int, model: str, kind: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """The last event of a stream asked for `stream_options.include_usage`: no choices."""
    return {
        "id": id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


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
