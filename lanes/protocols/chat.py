"""OpenAI's chat completions requests (no HTTP): messages and their checks, and the
prompt a chat makes with its model's template (`render_chat`).

Apart from completions (lanes/protocols/completions.py), which take a prompt as it
is: a chat's messages, its refusals of tools, audio and templates of its own, and its
rendering are its alone. What both share is lanes/protocols/generateparams.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from lanes.errors import InvalidInput, shown
from lanes.generation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from lanes.protocols.answers import Spelling, chat_logprobs
from lanes.protocols.generateparams import GenerateParams
from lanes.protocols.openai import Shape, unsupported
from lanes.validation import describe


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
    logprobs: bool | None = Field(None, description="Each generated token's logprob.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per token; needs logprobs."
    )
    # vLLM's (the last message before the answer): refused, not ignored, so a vLLM
    # client does not get an answer without the text it asked for.
    echo: bool | None = Field(None, description="vLLM's: only false.")
    # vLLM's, for an assistant's prefill: the prompt ends with the generation prompt (the
    # assistant's opening) unless add_generation_prompt is false. Continuing the last
    # message is not built: refused, not ignored, else the answer is a new turn unsaid.
    add_generation_prompt: bool | None = Field(
        None, description="vLLM's: false leaves the assistant's opening out."
    )
    continue_final_message: bool | None = Field(None, description="vLLM's: only false.")
    # vLLM's own template for the request: the prompt would be the model's instead.
    chat_template: Any = Field(None, description="vLLM's: only none.")
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
        if self.top_logprobs is not None and not self.logprobs:
            detail = f"needs logprobs: true, found logprobs: {describe(self.logprobs)}"
            raise InvalidInput.field("top_logprobs", detail, "invalid_value")
        if self.echo:
            raise unsupported(
                "echo", "a chat answer does not echo its messages; send false or leave it out"
            )
        if self.chat_template is not None:
            raise unsupported(
                "chat_template",
                "lanes renders a chat with its model's template (config.json "
                "`chat_template`); leave it out",
            )
        if self.continue_final_message:
            raise unsupported(
                "continue_final_message",
                "lanes does not continue the last message: its answer would be a new turn; "
                "send false or leave it out",
            )
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
                        f"{where}.type", f"lanes serves text only, found {shown(part.type)}"
                    )
                if part.text is None:
                    raise InvalidInput.field(
                        f"{where}.text", "missing required parameter", "missing_required_parameter"
                    )

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprobs_body(
        self, records: Sequence[TokenLogprob], spelling: Spelling, offset: int = 0
    ) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(records, spelling, self.top_logprobs or 0)

    def generation_item(self, prompt: str | list[int]) -> dict[str, Any]:
        item = super().generation_item(prompt)
        if self.max_completion_tokens is not None:
            item["max_tokens"] = self.max_completion_tokens
        return item

    def named(self, error: InvalidInput) -> InvalidInput:
        """`error` about the generate item (`generation_item`) named as this request
        sent it: its prompt is the messages, its budget max_completion_tokens if set."""
        if error.param == "prompt":
            return error.at("messages")
        if error.param == "max_tokens" and self.max_completion_tokens is not None:
            return error.at("max_completion_tokens")
        return error


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
