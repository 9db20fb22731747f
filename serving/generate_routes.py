"""OpenAI-compatible generate routes: POST /v1/completions and /v1/chat/completions.

With `stream: true` the answer is Server-Sent Events in OpenAI's chunk format,
ending with `data: [DONE]`; without it, one JSON body with `usage` and
`finish_reason`. Either way the response starts only once the first text may be
sent, so a full queue (503), a deadline passed while queued (504) or a bad
request (400) is still an HTTP status. A client that disconnects, before or
during its stream, aborts its sequence: the engine frees its row at the next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from lanes.errors import LanesError
from lanes.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateParams,
    OpenAIFinish,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    parse,
    render_chat,
    usage_chunk,
)
from lanes.serving.engine import Engine, TokenStream
from lanes.serving.guard import Piece, TextGuard, pieces
from lanes.serving.http import JSONResponse, openai_error, read_json, status_of, timeout_s
from lanes.serving.kvcache import MAX_PADDING
from lanes.serving.scheduler import Policy
from lanes.serving.state import ServingState
from lanes.tasks.decoder import DecoderConfig
from lanes.tasks.generate import GenerateTask

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The client went away before its answer started: nobody reads this status (nginx's).
CLIENT_GONE = 499


@dataclass(frozen=True)
class Shape:
    """How one endpoint reads its prompt and spells its answers."""

    request: type[GenerateParams]
    id_prefix: str
    chunk_object: str
    prompt: Callable[[Any, DecoderConfig], str]
    whole: Callable[[str, int, str, str, OpenAIFinish, int, int], dict[str, Any]]
    chunk: Callable[[str, int, str, str | None, OpenAIFinish | None, bool], dict[str, Any]]


COMPLETIONS = Shape(
    request=CompletionRequest,
    id_prefix="cmpl",
    chunk_object="text_completion",
    prompt=lambda body, config: body.text,
    whole=completion_response,
    chunk=lambda id, created, model, text, finish, first: completion_chunk(
        id, created, model, text or "", finish
    ),
)
CHAT = Shape(
    request=ChatCompletionRequest,
    id_prefix="chatcmpl",
    chunk_object="chat.completion.chunk",
    prompt=lambda body, config: render_chat(
        body.messages, config.chat_template, config.chat_generation_prompt
    ),
    whole=chat_response,
    chunk=chat_chunk,
)


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


async def _generate(request: Request, shape: Shape) -> Response:
    state: ServingState = request.app.state.lanes
    arrived = time.monotonic()
    try:
        body: GenerateParams = parse(
            shape.request, await read_json(request, state.settings.max_body_bytes)
        )
        engine = state.engine(body.model)
        prompt = shape.prompt(body, engine.decoder.config)
        prepared = engine.task.prepare(body.generation_item(prompt))
        stream = engine.submit(prepared, timeout_s(request), ignore_eos=body.ignore_eos)
    except LanesError as e:
        return openai_error(e)
    # A request that does not say is answered as its workload declares (`stream:`).
    streaming = body.stream if "stream" in body.model_fields_set else engine.task.workload.stream
    flow = pieces(stream, state.guards.get(body.model), streaming)
    answer = _Answer(shape, body, stream)
    latency = state.metrics.request_latency.labels(body.model)
    try:
        if streaming:
            first = await _unless_disconnected(request.receive, anext(flow))
            if first is None:
                stream.cancel()
                return Response(status_code=CLIENT_GONE)
            return StreamingResponse(
                answer.events(first, flow, lambda: latency.observe(time.monotonic() - arrived)),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        whole = await _unless_disconnected(request.receive, _collect(flow))
    except LanesError as e:
        stream.cancel()
        return openai_error(e)
    stream.cancel()  # a no-op once finished; frees the row of a client that left
    if whole is None:
        return Response(status_code=CLIENT_GONE)
    latency.observe(time.monotonic() - arrived)
    return JSONResponse(answer.whole(whole))


class _Answer:
    """One response's id, timestamps and shape."""

    def __init__(self, shape: Shape, body: GenerateParams, stream: TokenStream) -> None:
        self.shape = shape
        self.body = body
        self.stream = stream
        self.id = f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def whole(self, piece: Piece) -> dict[str, Any]:
        assert piece.finish is not None
        return self.shape.whole(
            self.id,
            self.created,
            self.body.model,
            piece.text,
            piece.finish,
            self.stream.prompt_tokens,
            self.stream.completion_tokens,
        )

    def _event(self, text: str | None, finish: OpenAIFinish | None, first: bool) -> bytes:
        chunk = self.shape.chunk(self.id, self.created, self.body.model, text, finish, first)
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    async def events(
        self, first: Piece, flow: AsyncIterator[Piece], done: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        """The SSE body: text chunks, a chunk with the finish_reason, usage if asked,
        [DONE]. Leaving early (a disconnect cancels this) aborts the sequence."""
        try:
            piece, opening = first, True
            while True:
                if piece.text or opening:
                    yield self._event(piece.text, None, opening)
                    opening = False
                if piece.finish is not None:
                    yield self._event(None, piece.finish, False)
                    break
                piece = await anext(flow)
            if self.body.include_usage:
                usage = usage_chunk(
                    self.id,
                    self.created,
                    self.body.model,
                    self.shape.chunk_object,
                    self.stream.prompt_tokens,
                    self.stream.completion_tokens,
                )
                yield b"data: " + orjson.dumps(usage) + b"\n\n"
            yield DONE
            done()
        except LanesError as e:
            # Mid-stream, the status is sent: the error travels as an event (the
            # openai client raises it as an APIError).
            body = error_body(str(e), "server_error", code=str(status_of(e)))
            yield b"data: " + orjson.dumps(body) + b"\n\n"
        finally:
            self.stream.cancel()


async def _collect(flow: AsyncIterator[Piece]) -> Piece:
    text: list[str] = []
    async for piece in flow:
        text.append(piece.text)
        if piece.finish is not None:
            return Piece("".join(text), piece.finish)
    raise AssertionError("a token stream ended without a finish")  # pieces() never does


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None as soon as the client disconnects (work is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]


def start_engine(
    state: ServingState,
    task: GenerateTask,
    policy: Policy = "continuous",
    max_padding: float = MAX_PADDING,
) -> Engine:
    """Start the engine of a loaded generate workload (and load its guard) in `state`.
    Call on the event loop; `state.ready` is the caller's to set. `policy` and
    `max_padding` are the benchmark's knobs (see serving/engine.py)."""
    name = task.name
    guard = task.workload.guard
    if guard is not None:
        blocked = state.metrics.guard_blocked.labels(name, guard.mode)
        state.guards[name] = TextGuard.load(guard, on_block=blocked.inc)
    engine = Engine(task, state.metrics, policy, max_padding, state.clock)
    engine.start()
    state.engines[name] = engine
    return engine
