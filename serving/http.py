"""HTTP edge helpers: fast JSON, bounded body reading, and errors in each protocol's shape.

Statuses, OpenAI types and codes come from the errors themselves (lanes/errors.py):
this module only writes them.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from lanes.errors import InvalidInput, LanesError, Overloaded, RequestTooLarge
from lanes.protocols import TIMEOUT_HEADER
from lanes.protocols.openai import error_of


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


def _headers(error: LanesError) -> dict[str, str] | None:
    if isinstance(error, Overloaded):
        return {"Retry-After": str(max(1, math.ceil(error.retry_after)))}
    if error.repeats:  # the openai client retries a 500 unless told not to
        return {"x-should-retry": "false"}
    return None


def openai_error(error: LanesError) -> JSONResponse:
    """OpenAI's {"error": {message, type, param, code}} shape, at the error's status."""
    return JSONResponse(error_of(error), error.status, headers=_headers(error))


def v2_error(error: LanesError) -> JSONResponse:
    """Open Inference Protocol's {"error": "..."} shape."""
    return JSONResponse({"error": str(error)}, error.status, headers=_headers(error))


def is_v2(path: str) -> bool:
    """Whether a path is the Open Inference Protocol's (its errors are {"error": "..."})."""
    return path == "/v2" or path.startswith("/v2/")


def error_response(path: str, error: LanesError) -> JSONResponse:
    """`error` in the shape of the protocol `path` belongs to."""
    return v2_error(error) if is_v2(path) else openai_error(error)


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body; InvalidInput if it is not JSON, RequestTooLarge over
    `limit`, ClientGone if the client left before sending all of it."""
    body = await read_body(request, limit)
    if not body:
        raise InvalidInput.field("body", "expected a JSON object, found an empty body")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput.field("body", f"expected JSON, found malformed JSON ({e})") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; RequestTooLarge past `limit` bytes, ClientGone if the client
    left before sending all of it.

    The body is read in chunks and abandoned past `limit`, so an oversized upload
    costs at most `limit` bytes of memory.
    """
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
    return b"".join(chunks)


def timeout_s(request: Request) -> float | None:
    """The per-request deadline from the X-Timeout-Ms header, in seconds."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        detail = f"expected milliseconds, found {raw!r}"
        raise InvalidInput.field(TIMEOUT_HEADER, detail, "invalid_type") from None
    if not value > 0 or not math.isfinite(value):
        detail = f"expected a positive number, found {raw!r}"
        raise InvalidInput.field(TIMEOUT_HEADER, detail, "invalid_value")
    return value / 1000
