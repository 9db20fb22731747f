"""One generate request's events on the event loop, as the engine hands them over
(serving/engine.py), and an offline sequence's whole output read from them."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from lanes.errors import LanesError, ModelError
from lanes.generation.logprobs import TokenLogprob
from lanes.generation.seq import Event
from lanes.tasks.decoder import Completion


class Aborts(Protocol):
    """What a stream tells when its client goes away: the engine."""

    def abort(self, seq_id: int) -> None: ...


@dataclass(eq=False)
class TokenStream:
    """One request's events, in order, on the event loop; the last has `finish` set.

    `cancel()` aborts the sequence: its row is freed at the engine's next step.
    `leave()` (the client went away) also ends the stream at once.
    """

    id: int
    prompt_tokens: int
    _engine: Aborts = field(repr=False)
    top_logprobs: int | None = None  # as its sequence asked: its events carry logprobs
    completion_tokens: int = 0
    # Its prompt's tokens after the first, scored, once its first event brought them
    # (where it asked: Seq.prompt_logprobs).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finished: bool = False
    gone: bool = False  # its client left (`leave`)
    _events: deque[Event] = field(default_factory=deque, repr=False)
    _signal: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def _push(self, event: Event) -> None:
        self.completion_tokens += event.made
        if event.prompt_logprobs is not None:  # a first event's, once
            self.prompt_logprobs = event.prompt_logprobs
        self.finished = self.finished or event.finish is not None
        self._events.append(event)
        self._signal.set()

    async def next(self) -> list[Event]:
        """Every event that arrived since the last call (at least one); waits for one."""
        while not self._events:
            self._signal.clear()
            await self._signal.wait()
        events = list(self._events)
        self._events.clear()
        return events

    async def __aiter__(self) -> AsyncIterator[Event]:
        """One event at a time, up to the finish; leaving early loses none."""
        while True:
            while not self._events:
                self._signal.clear()
                await self._signal.wait()
            event = self._events.popleft()
            yield event
            if event.finish is not None:
                return

    def cancel(self) -> None:
        if not self.finished:
            self._engine.abort(self.id)

    def leave(self) -> None:
        """The client went away: the sequence is aborted, and its reader sees the
        stream end now (`gone`), without waiting for the engine's next step."""
        if not self.finished:
            self.cancel()
            self.gone = True
            self._push(Event(self.id, finish="abort"))


async def completion(stream: TokenStream) -> Completion | LanesError | None:
    """An offline sequence's whole output from its events; its error when the model
    failed on it alone; None when it was aborted (the server is stopping)."""
    tokens: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in stream:
        tokens += event.tokens
        text.append(event.text)
        logprobs += event.logprobs
        if event.finish in ("stop", "length"):
            scored = logprobs if stream.top_logprobs is not None else None
            prompt = stream.prompt_logprobs
            return Completion(
                "".join(text),
                tokens,
                event.finish,
                stream.prompt_tokens,
                scored,
                None if prompt is None else list(prompt),
                event.stop_token,
            )
        if event.finish == "error":
            return ModelError(event.error or "the model failed on this sequence")
        if event.finish is not None:
            return None
    return None
