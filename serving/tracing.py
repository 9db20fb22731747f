"""Spans of the serving side: one per HTTP request, its queue wait, and each batch run.

`TracedRequests` wraps the app only when tracing is on. A request's span continues
the caller's trace (its `traceparent`) and is written in the request's record, so
the executor can hang the request's queue wait below it and link its batch run to
it: a batch span links every request that rode in it, and its parent is the oldest
of them, so a trace viewer shows it in place. The model's run is the batch's child.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lanes.serving.access import record_of
from lanes.serving.batching import Pending
from lanes.tracing import Tracing, WallClock


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
