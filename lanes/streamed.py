"""A generate answer as the SDK gives it back (`Usage`, `Completion`), and a streamed
one read back from its SSE lines (`sse_data`, `Gathered`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lanes.errors import LanesError


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Completion:
    """A whole generated text, why it ended ("stop", "length", "content_filter"), usage,
    and its tokens' `logprobs` where the call asked (`logprobs=` options, as OpenAI's):
    the choice's as the endpoint answers it, streamed chunks' joined (completions'
    shape for a prompt, chat's for messages); None where not asked."""

    text: str
    finish_reason: str
    usage: Usage
    logprobs: dict[str, Any] | None = None


DONE: dict[str, Any] = {}


def sse_data(line: str) -> dict[str, Any] | None:
    """One SSE line: an event's JSON, DONE for `data: [DONE]`, None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        event = json.loads(data)
    except ValueError:
        raise LanesError(f"the stream sent an event that is not JSON: {data[:200]!r}") from None
    return event if isinstance(event, dict) else None


class Gathered:
    """A streamed generate answer read back, line by line, into the Completion that
    `call` returns: its text, its finish_reason, and usage (asked for in the request)."""

    def __init__(self, chunk_text: Callable[[dict[str, Any]], str], endpoint: str) -> None:
        self._chunk_text = chunk_text  # an event's text; an error event raises (Core's)
        self._endpoint = endpoint
        self._parts: list[str] = []
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._logprobs: dict[str, Any] | None = None

    def feed(self, line: str) -> bool:
        """Read one line; True at `data: [DONE]`. An error event raises its typed error."""
        event = sse_data(line)
        if event is DONE:
            return True
        if event is None:
            return False
        self._parts.append(self._chunk_text(event))
        for choice in event.get("choices") or []:
            self._finish = choice.get("finish_reason") or self._finish
            part = choice.get("logprobs")
            if isinstance(part, dict):
                self._logprobs = _joined_logprobs(self._logprobs, part)
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = Usage(**{k: int(usage[k]) for k in Usage.__dataclass_fields__})
        return False

    def result(self) -> Completion:
        if self._finish is None or self._usage is None:
            raise LanesError(
                f"{self._endpoint}: the streamed answer had no finish_reason or usage; "
                "is this a lanes endpoint?"
            )
        return Completion("".join(self._parts), self._finish, self._usage, self._logprobs)


def _joined_logprobs(before: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """A chunk's logprobs after the earlier chunks': each list goes on (the chunks'
    text_offset count from the answer's start already)."""
    if before is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in part.items()}
    for key, value in part.items():
        if isinstance(value, list) and isinstance(before.get(key), list):
            before[key] += value
        else:
            before.setdefault(key, value)
    return before
