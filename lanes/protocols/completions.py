"""OpenAI's completions and chat completions requests (no HTTP): their fields and
checks, and the prompts they make (`prepare_prompts`).

The online routes and the offline batch lines both prepare prompts here and answer
with lanes/protocols/answers.py's bodies, so both lanes answer alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import orjson
from pydantic import Field

from lanes.errors import InvalidInput, shown
from lanes.generation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from lanes.protocols.answers import (
    Choice,
    Echoed,
    OpenAIFinish,
    Prompt,
    Spelling,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from lanes.protocols.openai import (
    Inputs,
    OpenAIRequest,
    Shape,
    check_inputs,
    input_count,
    one_input,
    texts_or_ids,
    unsupported,
)
from lanes.validation import describe

if TYPE_CHECKING:  # lanes.tasks.generate reads GenerationOptions from here
    from lanes.tasks.generate import GenerateRequest

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Prepare(Protocol[T_co]):
    """A generate task's `prepare` (lanes.tasks.generate.GenerateTask.prepare)."""

    def __call__(self, item: dict[str, Any], *, prompt_only: bool = False) -> T_co: ...


# vLLM's sampling extensions lanes does not implement, each at the value that changes
# nothing: accepted there, refused elsewhere. Ignored (as unknown fields are), a vLLM
# client would get other tokens than it asked for, and not know.
VLLM_NO_OPS: dict[str, Any] = {
    "bad_words": [],
    "use_beam_search": False,
    # Structured output: JSON or a choice asked for would come back as free text.
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "allowed_token_ids": None,
}


class ResponseFormat(Shape):
    type: Literal["text", "json_object", "json_schema"]


class StreamOptions(Shape):
    include_usage: bool | None = Field(None, description="A last chunk with the usage.")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, each chunk its choice's usage so far."
    )


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
    guided_json: Any = Field(None, description="vLLM's: only none.")
    guided_regex: Any = Field(None, description="vLLM's: only none.")
    guided_choice: Any = Field(None, description="vLLM's: only none.")
    guided_grammar: Any = Field(None, description="vLLM's: only none.")
    structured_outputs: Any = Field(None, description="vLLM's: only none.")
    allowed_token_ids: Any = Field(None, description="vLLM's: only none.")
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
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`, which it reads only with include_usage."""
        options = self.stream_options
        return self.include_usage and options is not None and options.continuous_usage_stats is True

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives wanted beside each token's logprob; None: no logprobs."""
        return None

    @property
    def prompt_only(self) -> bool:
        """The prefill alone is asked for: the prompt scored, no token made (a
        completions echo with max_tokens 0), so the prompt may fill the context."""
        return False

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

    def choice(
        self,
        text: str,
        finish: OpenAIFinish,
        records: Sequence[TokenLogprob],
        prompt: Prompt | None,
        spelling: Spelling,
    ) -> Choice:
        """A whole answer's choice as both lanes write it: its text and `logprobs`
        (`records`: its tokens'), its prompt's echo in front where the request asked
        (`prompt`: what an echo shows of it; None: nothing to show)."""
        echoed = None if prompt is None else self.echo_of(prompt, spelling)
        if echoed is None:
            return Choice(text, finish, self.logprobs_body(records, spelling))
        logprobs = self.logprobs_body(records, spelling, echoed.end)
        text, logprobs = echoed.before(text, logprobs)
        return Choice(text, finish, logprobs)

    def settle(self, item: T) -> T:
        """A prepared prompt (a GenerateRequest) with what this request asks of the
        engine beyond its generation parameters: the logprobs of its tokens and of its
        prompt's (an echo with max_tokens 0 was prepared to make no token:
        `prompt_only`). The online route and the offline batch line both call this."""
        asked: dict[str, Any] = {}
        if self.top_logprobs_wanted is not None:
            asked["top_logprobs"] = self.top_logprobs_wanted
        if self.prompt_logprobs_wanted is not None:
            asked["prompt_logprobs"] = self.prompt_logprobs_wanted
        if not asked or not dataclasses.is_dataclass(item) or isinstance(item, type):
            return item
        return dataclasses.replace(item, **asked)

    @property
    def choices(self) -> int:
        """Choices per prompt (`n`; 1 when unset)."""
        return self.n or 1

    @property
    def prompt_count(self) -> int:
        """How many prompts the request carries, before any is checked (a chat: one)."""
        return 1

    def check_limits(self, max_inputs: int) -> None:
        """The endpoint's per-request limits, which an offline batch line meets too: at
        most `max_inputs` prompts (`LANES_MAX_INPUTS_PER_REQUEST`; RequestTooLarge
        naming `prompt`), and at most as many sequences, prompts times `n` (InvalidInput
        naming `n`). Checked before any prompt is tokenized."""
        count = self.prompt_count
        check_inputs(count, max_inputs, "prompt")
        where = "the inputs a request may carry (LANES_MAX_INPUTS_PER_REQUEST)"
        check_choices(count, self.choices, max_inputs, where)

    def choices_of(self, item: GenerateRequest) -> list[GenerateRequest]:
        """A prepared prompt's `n` sequences, each settled (`settle`), choice j's seed
        derived from the prompt's and j (`choice_seed`): with a seed, a rerun draws
        the same choices; at temperature 0 they are equal. Each runs its own prefill
        (sharing one across them is an optimisation not built)."""
        # Here, not at the top: lanes.tasks loads onnxruntime, and the SDK reads this
        # module's request shapes (lanes.wire) where no model runs.
        from lanes.tasks.sampling import choice_seed

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
                'lanes answers plain text; send {"type": "text"}, '
                f"found {shown(self.response_format.type)}",
            )
        for name, no_op in VLLM_NO_OPS.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                sent = orjson.dumps(value).decode()
                raise unsupported(
                    name,
                    f"lanes does not implement vLLM's {name}; send {orjson.dumps(no_op).decode()} "
                    f"or leave it out, found {sent[:80]}",
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

    def check_batch_line(self) -> None:
        """What a batch line may not ask beyond what a request may not: a stream. Its
        answer is one line of an output file, whole; OpenAI's Batch API refuses `stream:
        true` in a line too, so the line is refused rather than answered otherwise than
        it asked."""
        if self.streamed:
            raise unsupported(
                "stream",
                "a batch line is answered whole, in the output file, never streamed; "
                "send false or leave it out",
            )

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

    @property
    def prompt_count(self) -> int:
        return input_count(self.prompt)

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
    def prompt_only(self) -> bool:
        return self.echo is True and self.max_tokens == 0

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
        if self.prompt_only:  # no budget: prepared with prompt_only, it makes no token
            item["max_tokens"] = None
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


def check_choices(prompts: int, n: int, limit: int, where: str) -> None:
    """A 400 naming `n` when the `prompts` times `n` sequences are over `limit` (`where`
    says which), though the prompts alone are not: fewer choices per request fit."""
    if n == 1 or prompts * n <= limit:
        return
    detail = (
        f"{prompts} prompt(s) times n = {n} is {prompts * n} sequences, over {limit}, "
        f"{where}; expected n at most {limit // prompts}, or more requests"
    )
    raise InvalidInput.field("n", detail, "invalid_value")


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
    prepare: Prepare[T],
) -> list[T]:
    """Every prompt of a generate request prepared (a chat has one); an `InvalidInput`
    about the prompt names it as the request does (`prompt`, `prompt[2]`, `messages`).
    The online endpoint and the offline lane both call this."""
    alone = request.prompt_only
    if isinstance(request, ChatCompletionRequest):
        opening = None if request.add_generation_prompt is False else generation_prompt
        chat = render_chat(request.messages, template, opening)
        try:
            return [prepare(request.generation_item(chat))]
        except InvalidInput as e:
            raise request.named(e) from None
    one = one_input(request.prompt)
    items = []
    for i, prompt in enumerate(request.prompts):
        try:
            items.append(prepare(request.generation_item(prompt), prompt_only=alone))
        except InvalidInput as e:
            raise (e.at(f"prompt[{i}]") if e.param == "prompt" and not one else e) from None
    return items
