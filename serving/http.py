"""HTTP edge helpers: fast JSON, bounded body reading, and errors in each protocol's shape.

Statuses, OpenAI types and codes come from the errors themselves (lanes/errors.py):
this module only writes them.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope

from lanes.errors import InvalidInput, LanesError, Overloaded, RequestTooLarge, shown
from lanes.protocols import TIMEOUT_HEADER
from lanes.protocols.openai import error_of
from lanes.serving.encoding import HEADER as CONTENT_ENCODING
from lanes.serving.encoding import coding_of, decode
from lanes.serving.offload import Offload
from lanes.validation import malformed_json


class ClientGone(LanesError):
    """The client disconnected before its answer started: nobody reads this status
    (nginx's 499), and nothing failed on the server's side."""

    status = 499
    error_type = "invalid_request_error"
    default_code = "client_closed_request"


class JSONResponse(Response):
    """orjson: several times faster than json for the float vectors embeddings return."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class BodyStalled(LanesError):
    """The client sent part of its body, then nothing for `LANES_BODY_TIMEOUT_S`."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


def _headers(error: LanesError) -> dict[str, str] | None:
    if isinstance(error, BodyStalled):  # the rest of its body may still come: not here
        return {"Connection": "close"}
    if isinstance(error, Overloaded):
        return {"Retry-After": str(max(1, math.ceil(error.retry_after)))}
    if error.repeats:  # the openai client retries a 500 unless told not to
        return {"x-should-retry": "false"}
    return None


def openai_error(error: LanesError) -> JSONResponse:
    """OpenAI's {"error": {message, type, param, code}} shape, at the error's status."""
    return JSONResponse(error_of(error), error.status, headers=_headers(error))


def v2_error(error: LanesError) -> JSONResponse:
    """Open Inference Protocol's {"error": "..."} shape, with the error's `param` and
    `code` beside it when it has them (tritonclient reads `error` only; the SDK reads
    them back into the error's class)."""
    return JSONResponse(v2_body(error), error.status, headers=_headers(error))


def v2_body(error: LanesError) -> dict[str, str]:
    """The body `v2_error` answers `error` with."""
    body: dict[str, str] = {"error": str(error)}
    body |= {k: v for k, v in (("param", error.param), ("code", error.code)) if v is not None}
    return body


def is_v2(path: str) -> bool:
    """Whether a path is the Open Inference Protocol's (its errors are {"error": "..."})."""
    return path == "/v2" or path.startswith("/v2/")


def error_response(path: str, error: LanesError) -> JSONResponse:
    """`error` in the shape of the protocol `path` belongs to."""
    return v2_error(error) if is_v2(path) else openai_error(error)


async def read_json(request: Request, limit: int, offload: Offload) -> Any:
    """The request's JSON body (see `read_body`); InvalidInput if it is not JSON."""
    return decode_json(await read_body(request, limit, offload))


def decode_json(body: bytes) -> Any:
    """A body's JSON; InvalidInput if it is empty or not JSON."""
    if not body:
        raise InvalidInput.field("body", "expected a JSON object, found an empty body")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput.field("body", malformed_json(body, e)) from None


async def read_body(request: Request, limit: int, offload: Offload) -> bytes:
    """The request's body, decoded when its Content-Encoding is gzip or deflate
    (serving/encoding.py: a large one on `offload`'s thread); RequestTooLarge past
    `limit` bytes, sent or decoded; UnsupportedEncoding (415) for another coding;
    ClientGone if the client left before sending all of it.

    The body is read in chunks and abandoned past `limit`, so an oversized upload
    costs at most `limit` bytes of memory.
    """
    coding = coding_of(request.headers.get(CONTENT_ENCODING))  # before reading any of it
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        detail = f"{declared} bytes is over the limit of {limit} bytes"
        raise RequestTooLarge.field("body", detail)
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge.field("body", f"over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after {size} bytes of the body") from None
    body = b"".join(chunks)
    return body if coding is None else await decode(body, coding, limit, offload)


async def disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected. Only once the body is read: it takes
    every message `receive` gives."""
    while (await receive())["type"] != "http.disconnect":
        pass


def departure(request: Request) -> Callable[[], Awaitable[None]]:
    """`disconnected` of this request, for `BatchWorker.submit(gone=...)`."""
    return partial(disconnected, request.receive)


def timeout_s(request: Request) -> float | None:
    """The per-request deadline from the X-Timeout-Ms header, in seconds."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        detail = f"expected milliseconds, found {shown(raw)}"
        raise InvalidInput.field(TIMEOUT_HEADER, detail, "invalid_type") from None
    if not value > 0 or not math.isfinite(value):
        detail = f"expected a positive number, found {shown(raw)}"
        raise InvalidInput.field(TIMEOUT_HEADER, detail, "invalid_value")
    return value / 1000


class Receipt:
    """A request's `receive` that notes whether the body has arrived whole, and
    raises BodyStalled when the next part of it takes longer than `idle_s`."""

    __slots__ = ("_receive", "asked", "idle_s", "stalled", "whole")

    def __init__(self, receive: Receive, idle_s: float) -> None:
        self._receive = receive
        self.idle_s = idle_s
        self.asked = False  # whether anything read the body yet
        self.whole = False
        self.stalled = False

    async def __call__(self) -> Message:
        self.asked = True
        if self.whole:  # after the body, only a disconnect comes: no bound on its wait
            return await self._receive()
        try:
            async with asyncio.timeout(self.idle_s):
                message = await self._receive()
        except TimeoutError:
            self.stalled = True
            raise BodyStalled(
                f"the client sent no more of its body for {self.idle_s:g} s "
                "(LANES_BODY_TIMEOUT_S); send the whole body at once"
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.whole = True
        return message


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def closes_after(scope: Scope, response_headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the connection closes once this answer is sent: HTTP/1.0, or
    `Connection: close` from either side."""
    if scope.get("http_version") == "1.0":
        return True
    for where in (scope["headers"], response_headers):
        for key, value in where:
            if key.lower() == b"connection" and b"close" in value.lower():
                return True
    return False


async def discard_unread(scope: Scope, receipt: Receipt, limit: int) -> None:
    """Read and drop what is left of a body the answer did not need (a 413, a 401,
    a 503 sent before the body was read), up to `limit` bytes.

    Call it before the answer when the connection closes after it: a socket closed
    with unread bytes in its buffer is reset, and the client sees the reset, not the
    answer. A kept-alive connection needs none of this (uvicorn skips the rest of
    the body itself), nor a client that waits for `100 Continue` before sending the
    body and has not been asked for it: it sends nothing. A declared body over
    `limit` is not read: its client may see a reset.
    """
    if receipt.whole or receipt.stalled:  # a stalled client may send no more of it
        return
    length = _header(scope, b"content-length")
    chunked = _header(scope, b"transfer-encoding") is not None
    if not chunked and (length is None or not length.isdigit() or int(length) == 0):
        return  # no body
    if length is not None and length.isdigit() and int(length) > limit:
        return
    expect = _header(scope, b"expect")
    if not receipt.asked and expect is not None and expect.lower() == b"100-continue":
        return
    dropped = 0
    while not receipt.whole and dropped <= limit:
        try:
            message = await receipt()
        except BodyStalled:
            return
        dropped += len(message.get("body", b""))
