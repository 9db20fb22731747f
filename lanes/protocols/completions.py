"""OpenAI's completions and chat completions (no HTTP): requests, prompts, whole
answers and stream chunks.

The online routes and the offline batch lines both prepare prompts with
`prepare_prompts` and answer with these bodies, so both lanes answer alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson
from pydantic import Field

from lanes.errors import InvalidInput
from lanes.protocols.openai import (
    Inputs,
    OpenAIRequest,
    Shape,
    one_input,
    texts_or_ids,
    unsupported,
)
from lanes.validation import describe

T = TypeVar("T")

OpenAIFinish = Literal["stop", "length", "content_filter"]
# vLLM's sampling extensions lanes does not implement, each at the value that changes
# nothing: accepted there, refused elsewhere. Ignored (as unknown fields are), a vLLM
# client would get other tokens than it asked for, and not know.
VLLM_NO_OPS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "stop_token_ids": [],
    "bad_words": [],
    "include_stop_str_in_output": False,
    "use_beam_search": False,
}


class ResponseFormat(Shape):
    type: Literal["text", "json_object", "json_schema"]


class StreamOptions(Shape):
    include_usage: bool | None = None


class GenerationOptions(Shape):
    """The generation parameters a request may set, and their ranges: one definition
    for the OpenAI routes and batch lines (`GenerateParams`) and for a generate
    workload's plain items (records, `lanes predict`, the SDK's call), so a value one
    lane refuses, every lane refuses alike. Unset fields take the workload's
    `generation:`; `top_k` is vLLM's extension."""

    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy.")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM's: -1 and 0 cut nothing.")
    stop: str | list[str] | None = Field(None, description="Strings that end the text.")
    seed: int | None = Field(
        None, ge=-(2**63), le=2**63 - 1, description="Makes sampling reproducible."
    )


class GenerateParams(GenerationOptions, OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share; `ignore_eos` is vLLM's."""

    n: int | None = Field(None, ge=1, le=128, description="Choices per prompt: lanes makes one.")
    stream: bool | None = Field(None, description="Answer as Server-Sent Events.")
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0.")
    logit_bias: dict[str, Any] | None = Field(None, description="Only empty.")
    # OpenAI's for chat, vLLM's for completions too: ignored, JSON asked for would come
    # back as free text.
    response_format: ResponseFormat | None = Field(None, description="Only text.")
    ignore_eos: bool | None = Field(None, description="Run to max_tokens (benchmarks).")
    # vLLM's sampling extensions that lanes does not implement (VLLM_NO_OPS).
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM's: only 1.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM's: only 0.")
    min_tokens: int | None = Field(None, ge=0, description="vLLM's: only 0.")
    stop_token_ids: list[int] | None = Field(None, description="vLLM's: only empty.")
    bad_words: list[str] | None = Field(None, description="vLLM's: only empty.")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: only false.")
    use_beam_search: bool | None = Field(None, description="vLLM's: only false.")

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
        if self.response_format is not None and self.response_format.type != "text":
            raise unsupported(
                "response_format",
                f'lanes answers plain text; send {{"type": "text"}}, found {self.response_format.type!r}',
            )
        for name, no_op in VLLM_NO_OPS.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                shown = orjson.dumps(value).decode()
                raise unsupported(
                    name,
                    f"lanes does not implement vLLM's {name}; send {orjson.dumps(no_op).decode()} "
                    f"or leave it out, found {shown[:80]}",
                )
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
            "top_k": self.top_k,
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
    # Typed so that they are refused (ChatCompletionRequest.check), not ignored: the
    # prompt would lose them, and the model answer a conversation the caller did not send.
    tool_calls: list[Any] | None = Field(None, description="Only none or empty.")
    function_call: dict[str, Any] | None = Field(None, description="Only none.")
    tool_call_id: str | None = Field(None, description="Only none: no tool messages.")

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(GenerateParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    logprobs: bool | None = Field(None, description="Only false.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only null.")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    audio: dict[str, Any] | None = Field(None, description="Only none.")
    web_search_options: dict[str, Any] | None = Field(None, description="Only none.")
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
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported(
                "modalities",
                f'lanes answers text only; send ["text"] or leave it out, found {describe(self.modalities)}',
            )
        if self.audio is not None:
            raise unsupported("audio", "lanes answers text only; leave it out")
        if self.web_search_options is not None:
            raise unsupported("web_search_options", "lanes does not search the web; leave it out")
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
            _check_no_tools(message, f"messages[{i}]")
            # As OpenAI: only an assistant's turn may come without content (its tool
            # calls, which lanes does not make, would be its content).
            if message.role != "assistant" and message.content in (None, []):
                code = "missing_required_parameter" if message.content is None else "empty_array"
                detail = (
                    f"a {message.role} message needs content, found {describe(message.content)}"
                )
                raise InvalidInput.field(f"messages[{i}].content", detail, code)
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


def _check_no_tools(message: ChatMessage, where: str) -> None:
    """Refuse a message about tool calls: lanes makes none, so it has no call such a
    message could be about, and its template has no place for one."""
    if message.tool_calls:
        raise unsupported(
            f"{where}.tool_calls",
            "lanes does not call tools, so a conversation cannot hold tool calls; "
            f"leave them out, found {len(message.tool_calls)}",
        )
    if message.function_call is not None:
        raise unsupported(f"{where}.function_call", "lanes does not call functions; leave it out")
    if message.role in ("tool", "function"):
        raise unsupported(
            f"{where}.role",
            f"lanes does not call tools, so no {message.role} message answers one; "
            "send its content in a user message",
        )
    if message.tool_call_id is not None:
        raise unsupported(f"{where}.tool_call_id", "lanes does not call tools; leave it out")


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
    one = one_input(request.prompt)
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
