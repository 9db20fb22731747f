"""OpenAI's completions requests (no HTTP): their fields and checks, and the prompts
a completions or chat request makes (`prepare_prompts`).

The online routes and the offline batch lines both prepare prompts here and answer
with lanes/protocols/answers.py's bodies, so both lanes answer alike. What both
requests share is in lanes/protocols/generateparams.py, a chat's own messages in
lanes/protocols/chat.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from pydantic import Field

from lanes.errors import InvalidInput
from lanes.generation.logprobs import TokenLogprob
from lanes.protocols.answers import (
    Echoed,
    Prompt,
    Spelling,
    completion_logprobs,
    prompt_logprobs,
)
from lanes.protocols.chat import ChatCompletionRequest, render_chat
from lanes.protocols.generateparams import GenerateParams
from lanes.protocols.openai import (
    Inputs,
    input_count,
    one_input,
    texts_or_ids,
    unsupported,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Prepare(Protocol[T_co]):
    """A generate task's `prepare` (lanes.tasks.generate.GenerateTask.prepare)."""

    def __call__(self, item: dict[str, Any], *, prompt_only: bool = False) -> T_co: ...


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
