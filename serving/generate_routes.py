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
stream, aborts its sequences: the engine frees their rows at the next step. The
answer's body and events are spelled by serving/generate_answer.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from lanes.errors import LanesError
from lanes.generation.kvcache import MAX_PADDING
from lanes.generation.logprobs import TokenLogprob
from lanes.generation.scheduler import Policy
from lanes.protocols.chat import ChatCompletionRequest
from lanes.protocols.completions import CompletionRequest, prepare_prompts
from lanes.protocols.generateparams import check_choices
from lanes.protocols.openai import parse
from lanes.serving.access import named, record_of
from lanes.serving.batching import never_fits
from lanes.serving.engine import Engine
from lanes.serving.generate_answer import CHAT, COMPLETIONS, Answer, Endpoint, cancel_all
from lanes.serving.guard import Piece, TextGuard, pieces
from lanes.serving.http import (
    JSONResponse,
    decode_json,
    openai_error,
    read_body,
    timeout_s,
)
from lanes.serving.state import ServingState
from lanes.serving.token_stream import TokenStream
from lanes.tasks.generate import GenerateTask

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
        cancel_all(streams)  # a later prompt (or choice) was refused: the earlier ones leave too
        return openai_error(e)
    # OpenAI's default, whatever the workload's `stream:` (that is the SDK's default).
    streaming = body.streamed
    guard = state.guards.get(body.model)
    flows = [pieces(s, guard, streaming) for s in streams]
    answer = Answer(endpoint, body, streams, engine.task.spelling, record, prepared)
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
        cancel_all(streams)
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
