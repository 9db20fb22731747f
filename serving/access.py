"""Request ids and access lines: the outermost layer of the serving app.

Every HTTP request gets an id: the caller's `X-Request-Id` when it sends a usable
one (up to 128 characters of letters, digits and `-_.:/+=`), else a new one. The id
is answered in the `X-Request-Id` header, added to every error body (OpenAI's
`error.request_id`, v2's top-level `request_id`), set in `lanes.logs.request_id` so
every line logged about the request carries it, and readable by the routes as the
request's `RequestRecord` (OpenAI `id` fields are made from it).

When the answer is over, one access line goes to the `lanes.access` logger at INFO:
method, route, status, latency, and what the request's executor wrote in its record
(workload, queue wait, batch size, tokens in and out). Neither bodies nor headers
are ever logged; an error's `code` (or `type`) is, never its message, which may
quote the input.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lanes.logs import ACCESS_LOGGER, request_id

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger(ACCESS_LOGGER)

HEADER = b"x-request-id"
_SCOPE_KEY = "lanes.request"
_USABLE_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")


@dataclass(eq=False)
class RequestRecord:
    """What one request's access line says; its executor fills in the middle part."""

    id: str
    method: str
    route: str
    workload: str | None = None
    status: int | None = None
    queue_wait_s: float | None = None  # arrival at the executor to the start of its run
    batch_size: int | None = None  # items in the model run it rode in (a request may hold many)
    tokens_in: int | None = None  # generate: prompt tokens
    tokens_out: int | None = None  # generate: completion tokens
    error: str | None = None  # the error body's code (or type)
    trace: SpanContext | None = None  # the request's span, when tracing is on

    def fields(self, latency_s: float) -> dict[str, Any]:
        found: dict[str, Any] = {
            "method": self.method,
            "route": self.route,
            "status": self.status,
            "latency_ms": round(latency_s * 1000, 3),
        }
        if self.workload is not None:
            found["workload"] = self.workload
        if self.queue_wait_s is not None:
            found["queue_wait_ms"] = round(self.queue_wait_s * 1000, 3)
        if self.batch_size is not None:
            found["batch_size"] = self.batch_size
        if self.tokens_in is not None:
            found["tokens_in"] = self.tokens_in
        if self.tokens_out is not None:
            found["tokens_out"] = self.tokens_out
        if self.error is not None:
            found["error"] = self.error
        return found


def record_of(scope: Scope) -> RequestRecord | None:
    """The record of the request `scope` belongs to (None outside `RequestIds`)."""
    found = scope.get(_SCOPE_KEY)
    return found if isinstance(found, RequestRecord) else None


def named(scope: Scope, workload: str) -> None:
    """Name the request's workload in its access line: call it once the server knows
    it hosts `workload`, so a caller's unknown name (any string) is never logged."""
    record = record_of(scope)
    if record is not None:
        record.workload = workload


def new_id() -> str:
    return uuid.uuid4().hex


def incoming_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The caller's X-Request-Id, if it sent one lanes can log and echo as it is."""
    for name, value in headers:
        if name == HEADER:
            return value.decode("ascii") if _USABLE_ID.fullmatch(value) else None
    return None


def with_request_id(body: bytes, rid: str) -> tuple[bytes, str | None]:
    """An error body with the request id added, and the error's code (or type).

    OpenAI's {"error": {...}} gets `error.request_id`; v2's {"error": "..."} a
    top-level `request_id`. A body of another shape passes unchanged."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, None
    if not isinstance(parsed, dict) or "error" not in parsed:
        return body, None
    error = parsed["error"]
    code: str | None = None
    if isinstance(error, dict):
        error["request_id"] = rid
        found = error.get("code") or error.get("type")
        code = str(found) if found is not None else None
    else:  # v2: its code, when the error has one, beside the message
        parsed["request_id"] = rid
        found = parsed.get("code")
        code = str(found) if found is not None else None
    return orjson.dumps(parsed), code


class RequestIds:
    """ASGI middleware: an id per request, in the answer and the logs, and the access line.

    Success costs one header and one contextvar; an error's body is parsed once more
    to add the id (its response start waits for its body, so the length is right).
    `clock` times the latency the access line reports.
    """

    def __init__(
        self,
        app: ASGIApp,
        route_label: Callable[[str], str],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.app = app
        self.route_label = route_label
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = self.clock()
        rid = incoming_id(scope["headers"]) or new_id()
        record = RequestRecord(rid, scope["method"], self.route_label(scope["path"]))
        scope[_SCOPE_KEY] = record
        header = (HEADER, rid.encode("ascii"))
        held: Message | None = None  # an error's response start, until its body

        async def stamped(message: Message) -> None:
            nonlocal held
            kind = message["type"]
            if kind == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
                if record.status >= 400:
                    held = message
                    return
            elif kind == "http.response.body" and held is not None:
                start, held = held, None
                if not message.get("more_body"):
                    body, record.error = with_request_id(message.get("body", b""), rid)
                    message = {**message, "body": body}
                    start = {**start, "headers": _with_length(start["headers"], len(body))}
                await send(start)
            await send(message)

        token = request_id.set(rid)
        try:
            await self.app(scope, receive, stamped)
        finally:
            request_id.reset(token)
            if log.isEnabledFor(logging.INFO):
                _log_access(record, self.clock() - started)


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


def _log_access(record: RequestRecord, latency_s: float) -> None:
    fields = record.fields(latency_s)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("method", "route"))
    log.info(
        "%s %s %s",
        record.method,
        record.route,
        text,
        extra={"lanes": fields, "request_id": record.id},
    )
