"""OpenAI's completions and chat completions (no HTTP): requests, prompts, whole
answers and stream chunks.

The online routes and the offline batch lines both prepare prompts with
`prepare_prompts` and answer with these bodies, so both lanes answer alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import orjson
from pydantic import Field

from lanes.errors import InvalidInput
from lanes.generation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from lanes.protocols.openai import (
    Inputs,
    OpenAIRequest,
    Shape,
    one_input,
    texts_or_ids,
    unsupported,
)
from lanes.tasks.sampling import choice_seed
from lanes.validation import describe

if TYPE_CHECKING:  # lanes.tasks.generate reads GenerationOptions from here
    from lanes.tasks.generate import GenerateRequest

T = TypeVar("T")

OpenAIFinish = Literal["stop", "length", "content_filter"]
# vLLM's sampling extensions lanes does not implement, each at the value that changes
# nothing: accepted there, refused elsewhere. Ignored (as unknown fields are), a vLLM
# client would get other tokens than it asked for, and not know.
VLLM_NO_OPS: dict[str, Any] = {
    "bad_words": [],
    "use_beam_search": False,
}


# What OpenAI and vLLM write for a token whose probability is 0 (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


class Spelling(Protocol):
    """How a token's logprobs name it (lanes.generation.text.Spelling)."""

    def text(self, token: int) -> str: ...

    def bytes(self, token: int) -> bytes: ...


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
    # vLLM's extensions (lanes/generation/advance.py applies them).
    stop_token_ids: list[int] | None = Field(
        None, max_length=64, description="vLLM's: token ids that end the text, left out of it."
    )
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM's: eos and stop_token_ids cannot end the text before."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's: a stop string that ends the text stays in it."
    )
    # Applied to the logits before sampling (lanes/generation/processors.py).
    logit_bias: dict[str, Any] | None = Field(
        None, description="Token id (a string) -> -100 to 100, added to its logit."
    )
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Taken off the logit of each token made."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="Taken off a token's logit per time it was made."
    )
    repetition_penalty: float | None = Field(
        None, gt=0.0, description="vLLM's: divides the prompt's and made tokens' logits."
    )
    min_p: float | None = Field(
        None, ge=0.0, le=1.0, description="vLLM's: drops tokens below min_p x the likeliest."
    )


class GenerateParams(GenerationOptions, OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share; `ignore_eos` is vLLM's."""

    n: int | None = Field(
        None, ge=1, le=128, description="Choices per prompt, each sampled on its own."
    )
    stream: bool | None = Field(None, description="Answer as Server-Sent Events.")
    stream_options: StreamOptions | None = None
    # OpenAI's for chat, vLLM's for completions too: ignored, JSON asked for would come
    # back as free text.
    response_format: ResponseFormat | None = Field(None, description="Only text.")
    ignore_eos: bool | None = Field(None, description="Run to max_tokens (benchmarks).")
    # vLLM's sampling extensions that lanes does not implement (VLLM_NO_OPS).
    bad_words: list[str] | None = Field(None, description="vLLM's: only empty.")
    use_beam_search: bool | None = Field(None, description="vLLM's: only false.")
    # Refused, not ignored: a vLLM client would get no scores and not know.
    prompt_logprobs: int | None = Field(None, description="vLLM's: none; echo with logprobs.")

    @property
    def streamed(self) -> bool:
        """OpenAI's default: an answer is streamed only when the request says so."""
        return self.stream is True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives wanted beside each token's logprob; None: no logprobs."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives wanted beside each prompt token's logprob (the engine scores
        the prompt in its prefill); None: the prompt is not scored."""
        return None

    def logprobs_body(
        self, records: Sequence[TokenLogprob], spelling: Spelling, offset: int = 0
    ) -> dict[str, Any] | None:
        """A choice's (or a chunk's) `logprobs` for its tokens' `records`; `offset`: the
        characters of the tokens before them (completions' `text_offset`)."""
        return None

    def echo_of(self, prompt: Prompt, spelling: Spelling) -> Echoed | None:
        """What a choice starts with before its completion (completions' echo): None
        where the request did not ask."""
        return None

    def settle(self, item: T) -> T:
        """A prepared prompt (a GenerateRequest) with what this request asks of the
        engine beyond its generation parameters: the logprobs of its tokens and of its
        prompt's, and no token at all (an echo with max_tokens 0). The online route and
        the offline batch line both call this."""
        asked: dict[str, Any] = {}
        if self.top_logprobs_wanted is not None:
            asked["top_logprobs"] = self.top_logprobs_wanted
        if self.prompt_logprobs_wanted is not None:
            asked["prompt_logprobs"] = self.prompt_logprobs_wanted
            if self.max_tokens == 0:  # prepared with 1 (generation_item): the prefill only
                asked["max_new_tokens"] = 0
        if not asked or not dataclasses.is_dataclass(item) or isinstance(item, type):
            return item
        return dataclasses.replace(item, **asked)

    @property
    def choices(self) -> int:
        """Choices per prompt (`n`; 1 when unset)."""
        return self.n or 1

    def choices_of(self, item: GenerateRequest) -> list[GenerateRequest]:
        """A prepared prompt's `n` sequences, each settled (`settle`), choice j's seed
        derived from the prompt's and j (`choice_seed`): with a seed, a rerun draws
        the same choices; at temperature 0 they are equal. Each runs its own prefill
        (sharing one across them is an optimisation not built)."""
        settled = self.settle(item)
        if self.choices == 1:
            return [settled]
        return [
            dataclasses.replace(settled, seed=choice_seed(settled.seed, j))
            for j in range(self.choices)
        ]

    def check(self) -> None:
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
        if self.prompt_logprobs is not None:
            raise unsupported(
                "prompt_logprobs",
                "lanes scores a prompt as OpenAI does: send echo: true with logprobs on "
                "/v1/completions, and leave prompt_logprobs out",
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
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
        }


class CompletionRequest(GenerateParams):
    prompt: str | list[Any] = Field(description="Prompt(s): text(s) or array(s) of token ids.")
    # 0 only with echo: the prompt scored, nothing generated (check()).
    max_tokens: int | None = Field(
        None, ge=0, description="Most tokens to generate; 0 only with echo."
    )
    echo: bool | None = Field(
        None, description="Start the text with the prompt (and logprobs with its tokens')."
    )
    suffix: str | None = Field(None, description="Only empty.")
    best_of: int | None = Field(None, ge=1, le=20, description="Only 1 or n.")
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Alternatives per token, beside the sampled one."
    )

    @property
    def prompts(self) -> Inputs:
        return texts_or_ids(self.prompt, "prompt", "prompt")

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            detail = "0 only with echo: true (it scores the prompt), else expected at least 1"
            raise InvalidInput.field("max_tokens", detail, "integer_below_min_value")
        if self.suffix:
            raise unsupported("suffix", "lanes does not insert text; leave it out")
        if self.best_of not in (None, 1, self.choices):
            raise unsupported(
                "best_of",
                f"lanes returns every choice it makes, none ranked out: send 1 or n "
                f"({self.choices}), found {self.best_of}",
            )

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        if not self.echo:
            return None
        # An echo of nothing generated is its prefill alone: the engine finishes such
        # a sequence there where it scores its prompt (a few alternatives' cost).
        return self.logprobs if self.logprobs is not None or self.max_tokens != 0 else 0

    def logprobs_body(
        self, records: Sequence[TokenLogprob], spelling: Spelling, offset: int = 0
    ) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(records, spelling, self.logprobs, offset)

    def echo_of(self, prompt: Prompt, spelling: Spelling) -> Echoed | None:
        if not self.echo:
            return None
        if self.logprobs is None:
            return Echoed(prompt.text)
        return Echoed(prompt.text, prompt_logprobs(prompt, spelling, self.logprobs))

    def generation_item(self, prompt: str | list[int]) -> dict[str, Any]:
        item = super().generation_item(prompt)
        if self.max_tokens == 0:  # checked as 1; settle() asks the engine for none
            item["max_tokens"] = 1
        return item


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
class Prompt:
    """A prompt as an echo shows it: its text (token ids given: their decoding), its
    token ids, and its tokens after the first scored (None: the engine scored none)."""

    text: str
    ids: Sequence[int]
    scores: Sequence[TokenLogprob] | None = None


@dataclass(frozen=True)
class Echoed:
    """What an echo puts before a choice's completion: the prompt's text, and where
    the request asked for logprobs, its tokens' (completions' shape)."""

    text: str
    logprobs: dict[str, Any] | None = None

    def before(
        self, text: str, logprobs: dict[str, Any] | None
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion's `text` and `logprobs` (its offsets counted from the end of
        the echo already) with the echo in front."""
        if self.logprobs is None:
            return self.text + text, logprobs
        if logprobs is None:
            return self.text + text, self.logprobs
        return self.text + text, {k: [*v, *logprobs[k]] for k, v in self.logprobs.items()}


def prompt_logprobs(prompt: Prompt, spelling: Spelling, top: int) -> dict[str, Any]:
    """Completions' `logprobs` of an echoed prompt: its first token has none (nothing
    comes before it: null, as OpenAI writes it), the others theirs and the `top`
    likeliest there, as generated tokens do; offsets from 0."""
    if prompt.scores is None or len(prompt.scores) != len(prompt.ids) - 1:
        found = None if prompt.scores is None else len(prompt.scores)
        raise ValueError(
            f"echo: expected scores of the prompt's {len(prompt.ids) - 1} tokens after "
            f"its first, found {found}"
        )
    first = spelling.text(prompt.ids[0])
    rest = completion_logprobs(prompt.scores, spelling, top, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


@dataclass(frozen=True)
class Choice:
    """One generated text of an answer and why it ended."""

    text: str
    finish_reason: OpenAIFinish
    logprobs: dict[str, Any] | None = None  # its request's `logprobs_body`, if it asked


def completion_logprobs(
    records: Sequence[TokenLogprob], spelling: Spelling, top: int, offset: int = 0
) -> dict[str, Any]:
    """Completions' `logprobs` (vLLM's shape): per token its text, its logprob, the
    `top` likeliest with the token itself where it is not among them, and where its
    text starts, counted from `offset` by the tokens' own texts."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    for record in records:
        text = spelling.text(record.token)
        logprob = max(record.logprob, LOGPROB_FLOOR)
        alternatives = record.top[:top]
        likeliest = {spelling.text(a.token): max(a.logprob, LOGPROB_FLOOR) for a in alternatives}
        if all(a.token != record.token for a in alternatives):
            likeliest.setdefault(text, logprob)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(likeliest)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(records: Sequence[TokenLogprob], spelling: Spelling, top: int) -> dict[str, Any]:
    """Chat's `logprobs` (OpenAI's shape): per token its text, logprob and bytes, and
    exactly `top` alternatives (fewer only where the vocabulary is smaller)."""
    content = []
    for record in records:
        entry = _chat_token(record.token, record.logprob, spelling)
        entry["top_logprobs"] = [
            _chat_token(a.token, a.logprob, spelling) for a in record.top[:top]
        ]
        content.append(entry)
    return {"content": content, "refusal": None}


def _chat_token(token: int, logprob: float, spelling: Spelling) -> dict[str, Any]:
    return {
        "token": spelling.text(token),
        "logprob": max(logprob, LOGPROB_FLOOR),
        "bytes": list(spelling.bytes(token)),
    }


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
    """The body of a /v1/completions answer: each prompt's `n` choices, in order
    (prompt i's choice j at i * n + j, as OpenAI orders them)."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
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
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One Server-Sent Event of a streamed /v1/completions answer (`index`: its choice;
    `logprobs`: its tokens', where the request asked)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
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
    choices: Sequence[Choice],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a /v1/chat/completions answer: its `n` choices, in order."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    id: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: OpenAIFinish | None = None,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One Server-Sent Event of a streamed chat answer (`index`: its choice); a
    choice's first carries the role, its last an empty delta and the finish_reason."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if text is not None:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
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
