"""One generate response in OpenAI's shapes: its whole JSON body, or its SSE events
as its pieces come (text chunks, each choice's finish, usage if asked, [DONE]).

`Endpoint` says how /v1/completions and /v1/chat/completions each spell theirs. A
choice of a list that fails alone gets an error event with its `index`. Apart from
serving/generate_routes.py, which reads, admits and submits the request and writes
this answer, because spelling an answer needs nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from lanes.errors import LanesError
from lanes.protocols.answers import (
    Choice,
    Echoed,
    OpenAIFinish,
    Prompt,
    Spelling,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    usage_body,
    usage_chunk,
)
from lanes.protocols.chat import ChatCompletionRequest
from lanes.protocols.completions import CompletionRequest
from lanes.protocols.generateparams import GenerateParams
from lanes.protocols.openai import error_of
from lanes.serving.access import RequestRecord
from lanes.serving.guard import Piece
from lanes.serving.http import ClientGone
from lanes.serving.token_stream import TokenStream
from lanes.tasks.generate import GenerateRequest

DONE = b"data: [DONE]\n\n"

Body = dict[str, Any]
Logprobs = Body | None  # a chunk's `logprobs` (GenerateParams.logprobs_body)


@dataclass(frozen=True)
class Endpoint:
    """How one endpoint reads its request and spells its answers."""

    request: type[CompletionRequest] | type[ChatCompletionRequest]
    id_prefix: str
    chunk_object: str
    whole: Callable[[str, int, str, Sequence[Choice], int, int], dict[str, Any]]
    chunk: Callable[[str, int, str, str | None, OpenAIFinish | None, bool, int, Logprobs], Body]


COMPLETIONS = Endpoint(
    request=CompletionRequest,
    id_prefix="cmpl",
    chunk_object="text_completion",
    whole=completion_response,
    chunk=lambda id, created, model, text, finish, first, index, logprobs: completion_chunk(
        id, created, model, text or "", finish, index, logprobs
    ),
)
CHAT = Endpoint(
    request=ChatCompletionRequest,
    id_prefix="chatcmpl",
    chunk_object="chat.completion.chunk",
    whole=chat_response,
    chunk=lambda id, created, model, text, finish, first, index, logprobs: chat_chunk(
        id, created, model, text, finish, first, logprobs, index
    ),
)


def cancel_all(streams: Sequence[TokenStream]) -> None:
    """Abort every stream's sequence (those finished already are left alone)."""
    for stream in streams:
        stream.cancel()


@dataclass(frozen=True)
class _Failed:
    """A prompt (or choice) of a list that failed alone (its deadline, the model): its
    last item."""

    error: LanesError


async def _merged(
    flows: Sequence[AsyncIterator[Piece]],
) -> AsyncIterator[tuple[int, Piece | _Failed]]:
    """Each prompt's pieces as they come, tagged with its index, until each has its
    finish or its failure. A client gone (ClientGone) ends them all: it is raised."""
    waiting = {asyncio.ensure_future(anext(flow)): i for i, flow in enumerate(flows)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = waiting.pop(future)
                try:
                    piece = future.result()
                except ClientGone:
                    raise
                except LanesError as e:
                    yield i, _Failed(e)
                    continue
                yield i, piece
                if piece.finish is None:
                    waiting[asyncio.ensure_future(anext(flows[i]))] = i
    finally:
        for future in waiting:
            future.cancel()


class Answer:
    """One response's id, timestamps and shape."""

    def __init__(
        self,
        endpoint: Endpoint,
        body: GenerateParams,
        streams: Sequence[TokenStream],
        spelling: Spelling,
        record: RequestRecord | None = None,
        prepared: Sequence[GenerateRequest] = (),
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.streams = streams
        self.spelling = spelling
        self.record = record
        self.prepared = prepared  # per choice, what an echo shows of its prompt
        # Per choice, the characters of the tokens whose logprobs went out (a streamed
        # completion's text_offset goes on from there).
        self._offsets: dict[int, int] = {}
        # From the request id, as vLLM does: grep either and find both.
        rid = record.id if record is not None else uuid.uuid4().hex
        self.id = f"{endpoint.id_prefix}-{rid}"
        self.created = int(time.time())

    def account(self) -> None:
        """Write the tokens in and out in the request's record, for its access line."""
        if self.record is not None:
            self.record.tokens_in, self.record.tokens_out = self.usage

    @property
    def usage(self) -> tuple[int, int]:
        """Prompt tokens, each prompt's once (its first choice's: as OpenAI and vLLM
        count them), and completion tokens over every choice."""
        prompt = sum(s.prompt_tokens for s in self.streams[:: self.body.choices])
        return prompt, sum(s.completion_tokens for s in self.streams)

    def whole(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        body, spelling = self.body, self.spelling
        choices = [
            body.choice(p.text, p.finish, p.logprobs, self._prompt(index), spelling)
            for index, p in enumerate(pieces)
            if p.finish is not None
        ]
        return self.endpoint.whole(self.id, self.created, self.body.model, choices, *self.usage)

    def _prompt(self, index: int) -> Prompt | None:
        """What an echo of choice `index` shows of its prompt (its scores came with its
        first event); None where no echo was asked."""
        if not self.prepared:
            return None
        item = self.prepared[index]
        return Prompt(item.prompt, item.prompt_ids, self.streams[index].prompt_logprobs)

    def _echo(self, index: int) -> Echoed | None:
        """What choice `index` starts with (None: no echo asked)."""
        prompt = self._prompt(index)
        return None if prompt is None else self.body.echo_of(prompt, self.spelling)

    def _event(
        self,
        text: str | None,
        finish: OpenAIFinish | None,
        first: bool,
        index: int,
        logprobs: Logprobs = None,
    ) -> bytes:
        chunk = self.endpoint.chunk(
            self.id, self.created, self.body.model, text, finish, first, index, logprobs
        )
        if self.body.continuous_usage:
            # vLLM's continuous_usage_stats: each chunk carries its choice's usage, the
            # tokens its sequence has made so far (held-back text's included).
            stream = self.streams[index]
            chunk["usage"] = usage_body(stream.prompt_tokens, stream.completion_tokens)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _chunk_logprobs(self, index: int, piece: Piece) -> Logprobs:
        """The piece's tokens' logprobs, their offsets after the choice's earlier ones."""
        if not piece.logprobs:
            return None
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(
            len(self.spelling.text(r.token)) for r in piece.logprobs
        )
        return self.body.logprobs_body(piece.logprobs, self.spelling, offset)

    def _sse(self, index: int, piece: Piece, opened: set[int]) -> bytes:
        """A piece's events: its text (a choice's first, even empty: a chat's role
        rides on it; or empty, with the logprobs of tokens whose text is held back),
        then its finish_reason; one write for both. A choice a guard blocked before
        any text is its finish alone, as the README's guard table says."""
        sse = b""
        if index not in opened:
            echoed = self._echo(index)
            if echoed is None and piece.finish == "content_filter":
                # Nothing to show: no empty text chunk; the role rides on the finish.
                opened.add(index)
                return self._event(None, piece.finish, True, index)
            text, logprobs = piece.text, None
            if echoed is not None:
                self._offsets[index] = echoed.end  # the completion's follow it
                text, logprobs = echoed.before(text, self._chunk_logprobs(index, piece))
            else:
                logprobs = self._chunk_logprobs(index, piece)
            sse = self._event(text, None, True, index, logprobs)
            opened.add(index)
        elif piece.text or piece.logprobs:
            logprobs = self._chunk_logprobs(index, piece)
            sse = self._event(piece.text, None, False, index, logprobs)
        if piece.finish is not None:
            sse += self._event(None, piece.finish, False, index)
        return sse

    def _error(self, error: LanesError, index: int | None = None) -> bytes:
        """An error event, in the same shape as an HTTP error (the openai client raises
        it as an APIError); with `index`, the one choice of a list it ended."""
        body = error_of(error)
        if index is not None:
            body["error"]["index"] = index
        if self.record is not None:
            body["error"]["request_id"] = self.record.id
            # A request's first failure names it in its access line.
            self.record.error = self.record.error or body["error"]["code"] or body["error"]["type"]
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def events(
        self,
        first: Piece | None,
        flows: Sequence[AsyncIterator[Piece]],
        done: Callable[[], None],
    ) -> AsyncGenerator[bytes, None]:
        """The SSE body: text chunks, a chunk with each finish_reason, usage if asked,
        [DONE]. `first`: a single prompt's first piece, read already (None for a list).
        A choice of a list that fails alone gets an error event with its index, and the
        others go on; a single prompt's failure ends the body. Leaving early (closed, or
        its client gone) aborts every sequence."""
        opened: set[int] = set()
        try:
            if first is not None:  # the usual request: its flow read here, no layer between
                yield self._sse(0, first, opened)
                if first.finish is None:
                    async for piece in flows[0]:
                        if sse := self._sse(0, piece, opened):
                            yield sse
            else:
                async for index, item in _merged(flows):
                    if isinstance(item, _Failed):
                        yield self._error(item.error, index)
                    elif sse := self._sse(index, item, opened):
                        yield sse
            if self.body.include_usage:
                usage = usage_chunk(
                    self.id,
                    self.created,
                    self.body.model,
                    self.endpoint.chunk_object,
                    *self.usage,
                )
                yield b"data: " + orjson.dumps(usage) + b"\n\n"
            yield DONE
            done()
        except ClientGone:
            pass  # nobody reads the rest
        except LanesError as e:
            # Mid-stream, the status is sent: the error travels as an event.
            yield self._error(e)
        finally:
            self.account()
            cancel_all(self.streams)
