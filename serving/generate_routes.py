"""OpenAI-compatible generate routes: POST /v1/completions and /v1/chat/completions.

With `stream: true` the answer is Server-Sent Events in OpenAI's chunk format,
ending with `data: [DONE]`; without it (OpenAI's default, whatever the workload's
`stream:`), one JSON body with `usage` and `finish_reason`. A list of prompts gets
`n` choices per prompt, in order (`index`: prompt i's choice j at i * n + j; a chat's
0 to n - 1), each its own sequence; `usage` counts each prompt once. A bad request (400) or a full queue (503)
is always an HTTP status: every prompt is checked and admitted before the answer
starts. A single prompt's answer starts once its first text may be sent, so a deadline
passed before its first token (504) is still a status too. A streamed list of prompts
(or n > 1) starts at once and streams each choice's pieces as they come, interleaved by
`index`; one choice that fails (its deadline, the model) ends with an error event
carrying its `index`, and the others go on. A client that disconnects, before or during its
stream, aborts its sequences: the engine frees their rows at the next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from lanes.errors import LanesError
from lanes.generation.kvcache import MAX_PADDING
from lanes.generation.logprobs import TokenLogprob
from lanes.generation.scheduler import Policy
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
from lanes.protocols.completions import CompletionRequest, prepare_prompts
from lanes.protocols.generateparams import GenerateParams, check_choices
from lanes.protocols.openai import (
    error_of,
    parse,
)
from lanes.serving.access import RequestRecord, named, record_of
from lanes.serving.batching import never_fits
from lanes.serving.engine import Engine
from lanes.serving.guard import Piece, TextGuard, pieces
from lanes.serving.http import (
    ClientGone,
    JSONResponse,
    decode_json,
    openai_error,
    read_body,
    timeout_s,
)
from lanes.serving.state import ServingState
from lanes.serving.token_stream import TokenStream
from lanes.tasks.generate import GenerateRequest, GenerateTask

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


async def _generate(request: Request, endpoint: Endpoint) -> Response:
    state: ServingState = request.app.state.lanes
    arrived = time.monotonic()
    streams: list[TokenStream] = []
    settings = state.settings
    record = record_of(request.scope)
    try:
        # A large body is parsed and tokenized off the event loop (serving/offload.py).
        raw = await read_body(request, settings.max_body_bytes, state.offload)
        body = await state.offload.run(len(raw), _decode, endpoint.request, raw)
        engine = state.engine(body.model)
        named(request.scope, body.model)
        body.check_limits(settings.max_inputs_per_request)  # as an offline batch line's
        config = engine.decoder.config
        prepared = await state.offload.run(
            len(raw),
            prepare_prompts,
            body,
            config.chat_template,
            config.chat_generation_prompt,
            engine.task.prepare,
        )
        too_many = never_fits(len(prepared), engine.max_queue)
        if too_many is not None:
            raise too_many
        queued = "what the workload queues (`batching.max_queue`)"
        check_choices(len(prepared), body.choices, engine.max_queue, queued)
        # Prompt i's choice j at i * n + j: OpenAI's order of the choices.
        prepared = [choice for item in prepared for choice in body.choices_of(item)]
        timeout = timeout_s(request)
        ignore_eos = body.ignore_eos is True
        trace = record.trace if record is not None else None
        for item in prepared:
            streams.append(engine.submit(item, timeout, ignore_eos=ignore_eos, trace=trace))
    except LanesError as e:
        _cancel(streams)  # a later prompt (or choice) was refused: the earlier ones leave too
        return openai_error(e)
    # OpenAI's default, whatever the workload's `stream:` (that is the SDK's default).
    streaming = body.streamed
    guard = state.guards.get(body.model)
    flows = [pieces(s, guard, streaming) for s in streams]
    answer = _Answer(endpoint, body, streams, engine.task.spelling, record, prepared)
    latency = state.metrics.request_latency.labels(body.model)
    watch = asyncio.ensure_future(_left(request.receive, streams))
    sse: _EventStream | None = None  # once made, it ends the watch when written
    try:
        if streaming:
            done = lambda: latency.observe(time.monotonic() - arrived)  # noqa: E731
            # One prompt's answer starts with its first text: a deadline before that is
            # still an HTTP status (a client gone: 499). A list's starts now: waiting for
            # every first text would hold back the texts of prompts that have one.
            first = await _first(flows[0]) if len(flows) == 1 else None
            sse = _EventStream(answer.events(first, flows, done), watch)
            return sse
        whole = await _each(flows, _collect)
    except LanesError as e:
        _cancel(streams)
        return openai_error(e)
    finally:
        if sse is None:
            watch.cancel()
    latency.observe(time.monotonic() - arrived)
    answer.account()
    return JSONResponse(answer.whole(whole))


def _decode(
    shape: type[CompletionRequest] | type[ChatCompletionRequest], raw: bytes
) -> CompletionRequest | ChatCompletionRequest:
    return parse(shape, decode_json(raw))


def _cancel(streams: Sequence[TokenStream]) -> None:
    for stream in streams:
        stream.cancel()


async def _first(flow: AsyncIterator[Piece]) -> Piece:
    return await anext(flow)


async def _each(
    flows: Sequence[AsyncIterator[Piece]], get: Callable[[AsyncIterator[Piece]], Awaitable[Piece]]
) -> list[Piece]:
    """`get` of every prompt's flow, at once; the first error, once all have ended."""
    if len(flows) == 1:  # the usual request: no task of its own
        return [await get(flows[0])]
    found = await asyncio.gather(*(get(f) for f in flows), return_exceptions=True)
    for result in found:
        if isinstance(result, BaseException):
            raise result
    return [r for r in found if isinstance(r, Piece)]


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


async def _left(receive: Receive, streams: Sequence[TokenStream]) -> None:
    """A request's watch, a task from the wait for its first text to its answer's end:
    when the client disconnects, its sequences are aborted and their streams end at
    once (ClientGone). One task per request, nothing per token."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.leave()


class _EventStream(Response):
    """An SSE answer, written from its request's own task as its pieces come.
    Starlette's StreamingResponse would start two more tasks per answer to watch for
    a disconnect (uvicorn speaks ASGI 2.3), which `watch` does already; every task
    between a first token and its write is a turn of a busy event loop."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[bytes, None], watch: asyncio.Task[None]) -> None:
        self.status_code = 200
        self.background = None
        self.chunks = body
        self.watch = watch
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.watch.cancel()
            await self.chunks.aclose()  # cut short (a failed write): its sequences leave


class _Answer:
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
            _cancel(self.streams)


async def _collect(flow: AsyncIterator[Piece]) -> Piece:
    """A prompt's whole text and its finish."""
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for piece in flow:
        text.append(piece.text)
        logprobs += piece.logprobs
        if piece.finish is not None:
            return Piece("".join(text), piece.finish, tuple(logprobs))
    raise AssertionError("a token stream ended without a finish")  # pieces() never does


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]


def start_engine(
    state: ServingState,
    task: GenerateTask,
    policy: Policy = "continuous",
    max_padding: float = MAX_PADDING,
    prefill_beside: bool | None = None,
) -> Engine:
    """Start the engine of a loaded generate workload (and load its guard) in `state`.
    Call on the event loop; its readiness is the caller's to mark. `policy`,
    `max_padding` and `prefill_beside` are the benchmark's knobs (see serving/engine.py)."""
    name = task.name
    guard = task.workload.guard
    if guard is not None:
        blocked = state.metrics.guard_blocked.labels(name, guard.mode)
        state.guards[name] = TextGuard.load(guard, state.spec.root, blocked.inc, state.tracing)
    keep = state.settings.preempted_cache_bytes
    engine = Engine(
        task,
        state.metrics,
        policy,
        max_padding,
        state.clock,
        tracing=state.tracing,
        keep_bytes=keep,
        prefill_beside=prefill_beside,
        prefix_bytes=state.settings.prefix_cache_bytes,
    )
    engine.start()
    state.engines[name] = engine
    return engine
