"""OpenAI's completions and chat completions answers (no HTTP): whole answers, stream
chunks, and the `logprobs` and echo they carry.

The online routes (serving/generate_routes.py) and the offline batch lines
(flows/requests.py) both answer with these bodies, so both lanes answer alike; the
requests they answer are in lanes/protocols/completions.py and chat.py (what both
share: generateparams.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lanes.generation.logprobs import TokenLogprob

OpenAIFinish = Literal["stop", "length", "content_filter"]

# What OpenAI and vLLM write for a token whose probability is 0 (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


class Spelling(Protocol):
    """How a token's logprobs name it (lanes.generation.text.Spelling)."""

    def text(self, token: int) -> str: ...

    def bytes(self, token: int) -> bytes: ...


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

    @property
    def end(self) -> int:
        """Where the completion's `text_offset` start. With the prompt's logprobs shown,
        past its tokens' own texts, which its offsets count: a character split over
        tokens is one U+FFFD per token there, more than the text holds, and offsets
        must not go back. Without them, past the text."""
        if self.logprobs is None or not self.logprobs["tokens"]:
            return len(self.text)
        return int(self.logprobs["text_offset"][-1]) + len(self.logprobs["tokens"][-1])

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
