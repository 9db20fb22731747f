"""OpenAI-compatible request and response shapes (no HTTP): embeddings, completions,
chat completions (and their stream chunks), batch-file lines.

Serving wraps these in routes; flows wraps them in batch records, so an offline
OpenAI batch line gets exactly the body the online endpoint would have answered.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lanes.errors import InvalidInput, LanesError
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
    a list of texts, one array of token ids, a list of arrays of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        detail = f"expected at least one {what}, found an empty array"
        raise InvalidInput.field(param, detail, "empty_array")
    if _is_id(value[0]):
        return [_token_ids(value, param)]
    inputs: Inputs = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, list):
            inputs.append(_token_ids(item, f"{param}[{i}]"))
        else:
            detail = f"expected a string or an array of token ids, found {describe(item)}"
            raise InvalidInput.field(f"{param}[{i}]", detail, "invalid_type")
    return inputs


def _token_ids(value: list[Any], param: str) -> list[int]:
    if not value:
        detail = "expected at least one token id, found an empty array"
        raise InvalidInput.field(param, detail, "empty_array")
    for i, item in enumerate(value):
        if not _is_id(item):
            detail = f"expected a token id (an integer), found {describe(item)}"
            raise InvalidInput.field(f"{param}[{i}]", detail, "invalid_type")
    return list(value)


def _one_input(value: str | list[Any]) -> bool:
    """Whether the request's inputs are one input (a text, an array of token ids)."""
    return isinstance(value, str) or (bool(value) and _is_id(value[0]))


class EmbeddingsRequest(OpenAIRequest):
    input: str | list[Any] = Field(description="Text(s), or array(s) of token ids.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Only the model's own.")

    @property
    def inputs(self) -> Inputs:
        return texts_or_ids(self.input, "input", "text")


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


# ---- completions and chat completions --------------------------------------------------

OpenAIFinish = Literal["stop", "length", "content_filter"]


class StreamOptions(Shape):
    include_usage: bool | None = None


class GenerateParams(OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share. Unset fields take the
    workload's `generation:`; `top_k` and `ignore_eos` are vLLM's extensions."""

    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM's: -1 and 0 cut nothing.")
    stop: str | list[str] | None = Field(None, description="Strings that end the text.")
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1, description="Makes sampling reproducible."
    )
    n: int | None = Field(None, ge=1, le=128, description="Choices per prompt: lanes makes one.")
    stream: bool | None = Field(None, description="Answer as Server-Sent Events.")
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0.")
    logit_bias: dict[str, Any] | None = Field(None, description="Only empty.")
    ignore_eos: bool | None = Field(None, description="Run to max_tokens (benchmarks).")

    @property
    def streamed(self) -> bool:
        """OpenAI's default: an answer is streamed only when the request says so."""
        return self.stream is True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True

    def check(self) -> None:
        if self.n not in (None, 1):
            raise unsupported(
                "n", f"lanes makes one choice per prompt; send {self.n} requests, found {self.n}"
            )
        if self.frequency_penalty:
            raise unsupported(
                "frequency_penalty",
                f"lanes applies no penalties; send 0 or leave it out, found {self.frequency_penalty}",
            )
        if self.presence_penalty:
            raise unsupported(
                "presence_penalty",
                f"lanes applies no penalties; send 0 or leave it out, found {self.presence_penalty}",
            )
        if self.logit_bias:
            for key, bias in self.logit_bias.items():
                number = isinstance(bias, int | float) and not isinstance(bias, bool)
                if not key.isdigit() or not number or not -100 <= bias <= 100:
                    detail = (
                        "expected token ids (as strings) mapped to numbers from -100 to 100, "
                        f"found {key!r}: {describe(bias)}"
                    )
                    raise InvalidInput.field("logit_bias", detail, "invalid_value")
            raise unsupported("logit_bias", "lanes applies no biases; send {} or leave it out")
        if self.stream_options is not None and not self.streamed:
            detail = "only allowed when stream is true"
            raise InvalidInput.field("stream_options", detail, "invalid_value")

    def generation_item(self, prompt: str | list[int]) -> dict[str, Any]:
        """The generate task's item: the prompt (text or token ids) and the parameters
        that are set."""
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }


class CompletionRequest(GenerateParams):
    prompt: str | list[Any] = Field(description="Prompt(s): text(s) or array(s) of token ids.")
    echo: bool | None = Field(None, description="Only false.")
    suffix: str | None = Field(None, description="Only empty.")
    best_of: int | None = Field(None, ge=1, le=20, description="Only 1.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Only null.")

    @property
    def prompts(self) -> Inputs:
        return texts_or_ids(self.prompt, "prompt", "prompt")

    def check(self) -> None:
        super().check()
        if self.echo:
            raise unsupported("echo", "lanes does not echo the prompt; send false or leave it out")
        if self.suffix:
            raise unsupported("suffix", "lanes does not insert text; leave it out")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"lanes makes one choice per prompt, found {self.best_of}")
        if self.logprobs is not None:
            raise unsupported("logprobs", "lanes returns no log probabilities; leave it out")


class ContentPart(Shape):
    type: str = Field(description="Only text.")
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(Shape):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


class ResponseFormat(Shape):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(GenerateParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    logprobs: bool | None = Field(None, description="Only false.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only null.")
    response_format: ResponseFormat | None = Field(None, description="Only text.")
    tools: list[Any] | None = Field(None, description="Only none.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only none or auto.")
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(None, description="Only none.")
    function_call: str | dict[str, Any] | None = Field(None, description="Only none or auto.")

    def check(self) -> None:
        super().check()
        if self.logprobs:
            raise unsupported("logprobs", "lanes returns no log probabilities; send false")
        if self.top_logprobs is not None:
            raise unsupported("top_logprobs", "lanes returns no log probabilities; leave it out")
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported(
                "response_format",
                f'lanes answers plain text; send {{"type": "text"}}, found {self.response_format.type!r}',
            )
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise unsupported(name, "lanes does not call tools; leave it out")
        for name, choice in (
            ("tool_choice", self.tool_choice),
            ("function_call", self.function_call),
        ):
            if choice not in (None, "none", "auto"):
                raise unsupported(
                    name, f'with no tools, only "none" or "auto", found {describe(choice)}'
                )
        for i, message in enumerate(self.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                where = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise unsupported(
                        f"{where}.type", f"lanes serves text only, found {part.type!r}"
                    )
                if part.text is None:
                    raise InvalidInput.field(
                        f"{where}.text", "missing required parameter", "missing_required_parameter"
                    )

    def generation_item(self, prompt: str | list[int]) -> dict[str, Any]:
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
        raise InvalidInput.field(
            "messages",
            "this workload's model has no chat template (config.json `chat_template`); "
            "use /v1/completions with a prompt",
        )
    turns = "".join(template.format(role=m.role, content=m.text) for m in messages)
    return turns + (generation_prompt or "")


def prepare_prompts(
    request: CompletionRequest | ChatCompletionRequest,
    template: str | None,
    generation_prompt: str | None,
    prepare: Callable[[dict[str, Any]], T],
) -> list[T]:
    """Every prompt of a generate request prepared (a chat has one); an `InvalidInput`
    about the prompt names it as the request does (`prompt`, `prompt[2]`, `messages`).
    The online endpoint and the offline lane both call this."""
    if isinstance(request, ChatCompletionRequest):
        chat = render_chat(request.messages, template, generation_prompt)
        try:
            return [prepare(request.generation_item(chat))]
        except InvalidInput as e:
            raise (e.at("messages") if e.param == "prompt" else e) from None
    one = _one_input(request.prompt)
    items = []
    for i, prompt in enumerate(request.prompts):
        try:
            items.append(prepare(request.generation_item(prompt)))
        except InvalidInput as e:
            raise (e.at(f"prompt[{i}]") if e.param == "prompt" and not one else e) from None
    return items


@dataclass(frozen=True)
class Choice:
    """One generated text of an answer and why it ended."""

    text: str
    finish_reason: OpenAIFinish


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
    choices: Sequence[Choice],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a /v1/completions answer: one choice per prompt, in order."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(choices)
        ],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: OpenAIFinish | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One Server-Sent Event of a streamed /v1/completions answer (`index`: its prompt)."""
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
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
    one = _one_input(request.input)
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
