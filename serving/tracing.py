"""Spans of the serving side: one per HTTP request, its queue wait, and each batch run
(a generate request's prefill run and decode window: `GenerateSpans`).

`TracedRequests` wraps the app only when tracing is on. A request's span continues
the caller's trace (its `traceparent`) and is written in the request's record, so
the executor can hang the request's queue wait below it and link its batch run to
it: a batch span links every request that rode in it, and its parent is the oldest
of them, so a trace viewer shows it in place. The model's run is the batch's child.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lanes.generation.seq import Event, Seq, StepPlan
from lanes.serving.access import record_of
from lanes.serving.batching import Pending
from lanes.tracing import Tracing, WallClock

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext


class TracedRequests:
    """ASGI middleware (inside `RequestIds`): a SERVER span per HTTP request."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        record = record_of(scope)
        name = f"{scope['method']} {record.route if record else scope['path']}"
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        if record is not None:
            attributes.update({"http.route": record.route, "lanes.request_id": record.id})
        with self.tracing.span(
            name, self.tracing.kinds.SERVER, self.tracing.extract(headers), attributes
        ) as span:
            if record is not None:
                record.trace = span.get_span_context()

            async def traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:  # OTel's HTTP convention for a SERVER span
                        self.tracing.failed(span, f"HTTP {message['status']}")
                await send(message)

            await self.app(scope, receive, traced)
            if record is not None and record.workload is not None:
                span.set_attribute("lanes.workload", record.workload)


def batch_spans(
    tracing: Tracing,
    workload: str,
    batch: Sequence[Pending],
    start: float,
    end: float,
    run_s: float | None,
    clock: Callable[[], float],
) -> None:
    """Spans of one batch run from `start` to `end` (the executor's clock): each
    request's queue wait (its arrival to `start`), the batch linked to every request,
    and the model's run (its last `run_s`) below it. A request of several items is one
    link and one queue span."""
    wall = WallClock(clock())
    firsts: dict[int, Pending] = {}
    for pending in batch:
        if pending.request is not None and pending.request.trace is not None:
            firsts.setdefault(id(pending.request), pending)
    traced = sorted(firsts.values(), key=lambda p: p.enqueued_at)
    contexts = [p.request.trace for p in traced if p.request is not None and p.request.trace]
    for pending, context in zip(traced, contexts, strict=True):
        tracing.finished("queue", wall.ns(pending.enqueued_at), wall.ns(start), context)
    run = tracing.finished(
        "batch",
        wall.ns(start),
        wall.ns(end),
        contexts[0] if contexts else None,
        [tracing.link(context) for context in contexts],
        {"lanes.workload": workload, "lanes.batch_size": len(batch)},
    )
    if run_s is not None:
        tracing.finished("model", wall.ns(max(start, end - run_s)), wall.ns(end), run)


def expired_span(
    tracing: Tracing,
    request: SpanContext,
    arrived: float,
    clock: Callable[[], float],
    why: str,
) -> None:
    """The queue wait of a request answered 504 before it ran, from its arrival to
    now (the executor's clock), an error that `why` describes."""
    now = clock()
    wall = WallClock(now)
    tracing.finished("queue", wall.ns(arrived), wall.ns(now), request, error=why)


@dataclass(eq=False)
class _Traced:
    """One traced sequence's times so far (on the engine's clock)."""

    request: SpanContext  # its HTTP request's span
    arrived: float
    prefill: SpanContext | None = None  # the (last) prefill run it rode in
    first_at: float | None = None  # its first token
    tokens: int = 0
    steps: int = 0  # decode steps it rode in (one that makes eos makes no token)


class GenerateSpans:
    """Spans of one generate engine's requests, built only when tracing is on: each
    sequence's queue wait (arrival to its prefill), each prefill run linked to every
    request it prefilled (its parent the oldest, as a batch's is), and each sequence's
    decode window, from its first token to its finish, with the tokens it made and the
    steps it rode in: a span per request, never one per token.

    `submitted` runs on the event loop, the rest on the engine's thread.
    """

    def __init__(self, tracing: Tracing, workload: str, clock: Callable[[], float]) -> None:
        self.tracing = tracing
        self.workload = workload
        self._wall = WallClock(clock())
        self._lock = threading.Lock()
        self._seqs: dict[int, _Traced] = {}

    def submitted(self, seq: Seq, request: SpanContext) -> None:
        with self._lock:
            self._seqs[seq.id] = _Traced(request, seq.arrived)

    def prefilled(self, seqs: Sequence[Seq], start: float, end: float) -> None:
        """One prefill run of `seqs`, from `start` to `end`."""
        with self._lock:
            traced = [t for s in seqs if (t := self._seqs.get(s.id)) is not None]
        if not traced:
            return
        ns, tracing = self._wall.ns, self.tracing
        for t in traced:
            if t.prefill is None:  # its first run ends its wait
                tracing.finished("queue", ns(t.arrived), ns(start), t.request)
        requests = list({c.span_id: c for c in (t.request for t in traced)}.values())
        run = tracing.finished(
            "prefill",
            ns(start),
            ns(end),
            min(traced, key=lambda t: t.arrived).request,
            [tracing.link(c) for c in requests],
            {
                "lanes.workload": self.workload,
                "lanes.batch_size": len(seqs),
                "lanes.prompt_tokens": sum(len(s.prompt_ids) for s in seqs),
            },
        )
        for t in traced:
            t.prefill = run

    def observed(self, plan: StepPlan, events: Sequence[Event], now: float) -> None:
        """A step's `events` (of `plan`), at `now`: the decode span of every traced
        sequence that finished (or the queue wait of one that never ran)."""
        if not self._seqs:  # nobody traced in flight (requests without a span)
            return
        decoded = {s.id for s in plan.decode}
        ended: list[tuple[_Traced, Event]] = []
        with self._lock:
            for event in events:
                t = self._seqs.get(event.seq_id)
                if t is None:
                    continue
                if event.tokens and t.first_at is None:
                    t.first_at = now
                t.tokens += event.made  # as usage counts them
                t.steps += event.seq_id in decoded
                if event.finish is not None:
                    ended.append((t, event))
                    del self._seqs[event.seq_id]
        ns = self._wall.ns
        for t, event in ended:
            finish = {"lanes.finish_reason": event.finish or ""}
            if t.first_at is not None:
                self.tracing.finished(
                    "decode",
                    ns(t.first_at),
                    ns(now),
                    t.request,
                    [self.tracing.link(t.prefill)] if t.prefill is not None else None,
                    {"lanes.tokens_out": t.tokens, "lanes.steps": t.steps, **finish},
                )
            elif t.prefill is None:  # left before any prefill (a deadline, an abort)
                # A deadline (504) or a failure is an error; a caller who went away is not.
                error = event.finish if event.finish in ("deadline", "error") else None
                self.tracing.finished(
                    "queue", ns(t.arrived), ns(now), t.request, None, finish, error
                )
