"""What OpenAI's completions and chat completions requests share (no HTTP): the
generation parameters and their ranges (`GenerationOptions`, which a generate
workload's plain items take too), and `GenerateParams`, their common fields and checks
and what both ask of the engine (choices, logprobs, an echo's prompt scores).

Apart from each request's own fields (lanes/protocols/completions.py,
lanes/protocols/chat.py): lanes.tasks.generate reads `GenerationOptions` from here
without either request's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import orjson
from pydantic import Field

from lanes.errors import InvalidInput, shown
from lanes.generation.logprobs import TokenLogprob
from lanes.protocols.answers import (
    Choice,
    Echoed,
    OpenAIFinish,
    Prompt,
    Spelling,
)
from lanes.protocols.openai import (
    OpenAIRequest,
    Shape,
    check_inputs,
    unsupported,
)

if TYPE_CHECKING:  # lanes.tasks.generate reads GenerationOptions from here
    from lanes.tasks.generate import GenerateRequest

T = TypeVar("T")


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
