"""A workload's guard: text is scored before a client sees it, streaming or not.

A guard is `module:fn` with `fn(text) -> float` (a risk score in [0, 1]; a bool
counts as 1 or 0): text scoring at or above `threshold` fails. Modes:

- a response that is not streamed is always scored whole before it is returned;
- `buffer` holds a stream until the whole text is scored: safe, no TTFT gain;
- `chunked` scores the text so far every `every_tokens` tokens and sends only what
  passed: a failing score ends the stream with finish_reason `content_filter`
  before the failing chunk is sent. The text before it was already seen.

`pieces()` turns a request's token stream into what may be sent, guard applied.
Scoring runs on a worker thread: a guard may be a model of its own. With tracing on,
each scoring is a `guard` span below the current one (the request's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes.errors import DeadlineExceeded, LanesError, ModelError, Overloaded
from lanes.generation.logprobs import TokenLogprob
from lanes.generation.seq import Event
from lanes.protocols.answers import (
    OpenAIFinish,
)
from lanes.serving.http import ClientGone
from lanes.serving.token_stream import TokenStream
from lanes.spec import Guard
from lanes.tasks.handler import load_scorer
from lanes.tracing import Tracing

log = logging.getLogger("lanes.serving")

# The engine's reasons, as OpenAI spells them: a deadline cuts the text like max_tokens.
_FINISH: dict[str, OpenAIFinish] = {"stop": "stop", "length": "length", "deadline": "length"}


@dataclass(frozen=True)
class Piece:
    """Text that may be sent now; the last piece has `finish` set. `logprobs`: those of
    the tokens made since the last piece (where the request asked), whether or not
    their text is in this one: text held back (a stop string's start, part of a
    character) comes later, or never when a stop string cuts it."""

    text: str
    finish: OpenAIFinish | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class TextGuard:
    """A loaded guard of one workload."""

    def __init__(
        self,
        spec: Guard,
        score: Callable[[str], Any],
        on_block: Callable[[], None] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.spec = spec
        self.score = score
        self.on_block = on_block
        self.tracing = tracing

    @classmethod
    def load(
        cls,
        spec: Guard,
        root: Path | None = None,
        on_block: Callable[[], None] | None = None,
        tracing: Tracing | None = None,
    ) -> TextGuard:
        """Import the scorer, with the spec's folder `root` on the import path;
        `HandlerError` when it cannot be imported or called."""
        return cls(spec, load_scorer(spec.handler, root), on_block, tracing)

    async def passes(self, text: str) -> bool:
        """Whether `text` scores below the threshold. A scorer that raises fails closed."""
        if self.tracing is None:
            return await self._passes(text)
        attributes = {
            "lanes.guard.handler": self.spec.handler,
            "lanes.guard.mode": self.spec.mode,
            "lanes.guard.chars": len(text),
        }
        with self.tracing.span("guard", attributes=attributes) as span:
            passed = await self._passes(text)
            span.set_attribute("lanes.guard.passed", passed)
            return passed

    async def _passes(self, text: str) -> bool:
        try:
            score = await asyncio.to_thread(self.score, text)
            passed = float(score) < self.spec.threshold
        except Exception:
            log.exception("guard %s raised: the text is withheld", self.spec.handler)
            passed = False
        if not passed and self.on_block is not None:
            self.on_block()
        return passed


def pieces(stream: TokenStream, guard: TextGuard | None, streaming: bool) -> AsyncIterator[Piece]:
    """What may be sent of `stream`, in order; every event that arrived together is
    one piece. Raises `ModelError` when the model failed on the sequence."""
    # The flow itself, not a generator around it: a streamed token passes through
    # every layer between the engine and the socket.
    if guard is None:
        return _plain(stream)
    if guard.spec.mode == "buffer" or not streaming:
        return _buffered(stream, guard)
    return _chunked(stream, guard, guard.spec.every_tokens)


def _finish(stream: TokenStream, event: Event) -> OpenAIFinish | None:
    if event.finish is None:
        return None
    if event.finish == "deadline" and stream.completion_tokens == 0:
        raise DeadlineExceeded("deadline passed before the request reached the model")
    if event.finish == "error":  # the same input fails the same way: no retry helps
        raise ModelError(event.error or "the model failed while generating this text")
    if event.finish == "abort":
        if stream.gone:
            raise ClientGone("the client disconnected before its answer ended")
        raise Overloaded("the server stopped this sequence (shutting down); retry", 1.0)
    return _FINISH[event.finish]


def _logprobs(stream: TokenStream, events: list[Event]) -> tuple[TokenLogprob, ...]:
    if stream.top_logprobs is None:  # the usual request: nothing to gather
        return ()
    return tuple(record for event in events for record in event.logprobs)


async def _plain(stream: TokenStream) -> AsyncIterator[Piece]:
    while True:
        events = await stream.next()
        text = "".join(e.text for e in events)
        try:
            finish = _finish(stream, events[-1])
        except LanesError:
            # Tokens made before a failure are sent before it, however fast the
            # failure followed them: a stream's first piece is text whenever the
            # model made any, so the answer opens with 200 and ends with the error.
            if len(events) > 1:
                yield Piece(text, None, _logprobs(stream, events))
            raise
        yield Piece(text, finish, _logprobs(stream, events))
        if finish is not None:
            return


async def _buffered(stream: TokenStream, guard: TextGuard) -> AsyncIterator[Piece]:
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        events = await stream.next()
        text += (e.text for e in events)
        logprobs += _logprobs(stream, events)
        finish = _finish(stream, events[-1])
        if finish is None:
            continue
        whole = "".join(text)
        if await guard.passes(whole):
            yield Piece(whole, finish, tuple(logprobs))
        else:
            yield Piece("", "content_filter")
        return


async def _chunked(stream: TokenStream, guard: TextGuard, every: int) -> AsyncIterator[Piece]:
    """Chunks of `every` tokens, however the events arrive: many steps' tokens read at
    once (a slow reader, a fast model) are still scored chunk by chunk, so the chunks
    before a failing one are sent whatever the timing."""
    passed: list[str] = []
    held: list[str] = []
    logprobs: list[TokenLogprob] = []
    tokens = 0
    while True:
        for event in await stream.next():
            held.append(event.text)
            logprobs += event.logprobs
            tokens += len(event.tokens)
            finish = _finish(stream, event)
            if tokens < every and finish is None:
                continue
            chunk = "".join(held)
            if not await guard.passes("".join(passed) + chunk):
                stream.cancel()
                yield Piece("", "content_filter")
                return
            passed.append(chunk)
            yield Piece(chunk, finish, tuple(logprobs))
            held, logprobs, tokens = [], [], 0
            if finish is not None:
                return
