"""A server's failed answers, and a failed connection, as lanes' typed errors (the SDK
clients', through lanes.wire's `Core`): the server's own message, field (`param`) and
`code` kept, and what to check where no lanes server answered. No I/O here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import httpx

from lanes.errors import AuthError, DeadlineExceeded, LanesError, Unavailable, from_wire
from lanes.protocols import REQUEST_ID_HEADER


def answer_error(
    endpoint: str, status: int, body: bytes, headers: Mapping[str, str], sent_key: bool
) -> LanesError:
    """The typed error for a failed response, with the server's own message, field
    (`param`) and `code`. `sent_key`: whether the request carried an API key."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "error" in parsed:
        found = parsed_error(endpoint, status, parsed, _retry_after(headers))
    else:
        found = _foreign(endpoint, status, body, _retry_after(headers))
    if isinstance(found, AuthError):
        found = _refused(endpoint, sent_key, found)
    found.request_id = found.request_id or headers.get(REQUEST_ID_HEADER)
    return found


def _refused(endpoint: str, sent_key: bool, refused: AuthError) -> AuthError:
    """A 401 with what to set: the server's message is for any HTTP client (send
    Authorization: Bearer), a caller of this one sets a variable or an argument."""
    sent = "the API key sent" if sent_key else "a request without a key"
    return AuthError(
        f"{endpoint} refused {sent} ({refused}): set LANES_API_KEY to the server's "
        "key, or pass Client(api_key=...)",
        param=refused.param,
        code=refused.code,
    )


def _foreign(endpoint: str, status: int, body: bytes, retry_after: float) -> LanesError:
    """An error answer no lanes server wrote (every one of its errors is JSON with
    an `error`): another service on that port, a proxy's page. Said in one line with
    what to check, not as the page's HTML; typed by its status where the status means
    the same from anyone (401, 413, 503: retried), but a 404 is a path the endpoint
    lacks, not an unknown workload."""
    text = re.sub(r"<[^>]*>", " ", body.decode(errors="replace"))
    snippet = " ".join(text.split())
    snippet = (snippet if len(snippet) <= 200 else snippet[:197] + "...") or "no body"
    message = (
        f"{endpoint} answered HTTP {status} with no lanes error ({snippet}); check "
        "that LANES_ENDPOINT (or Client(endpoint=...)) is a lanes server or a proxy "
        "in front of one"
    )
    if status == 404:
        return LanesError(message)
    return from_wire(message, status, retry_after=retry_after)


def parsed_error(
    endpoint: str, status: int | None, parsed: Any, retry_after: float = 1.0
) -> LanesError:
    """The error a lanes error body, or a stream's error event (`status` None), says."""
    # OpenAI's {"error": {"message", "type", "param", "code"}} or v2's {"error": "..."}.
    error = parsed.get("error") if isinstance(parsed, dict) else parsed
    fields = error if isinstance(error, dict) else {"message": error}
    if isinstance(parsed, dict) and not isinstance(error, dict):  # v2: param, code beside
        fields = {**fields, "param": parsed.get("param"), "code": parsed.get("code")}
    rid = fields.get("request_id") or (
        parsed.get("request_id") if isinstance(parsed, dict) else None
    )
    found = _typed(endpoint, status, fields, retry_after)
    found.request_id = _str_or_none(rid)
    return found


def _typed(
    endpoint: str, status: int | None, fields: Mapping[str, Any], retry_after: float
) -> LanesError:
    text = fields.get("message")
    message = str(text) if text is not None else f"HTTP {status} from {endpoint}"
    found = from_wire(
        message,
        status,
        code=_str_or_none(fields.get("code")),
        param=_str_or_none(fields.get("param")),
        error_type=_str_or_none(fields.get("type")),
        retry_after=retry_after,
    )
    if type(found) is LanesError:
        where = f"HTTP {status}" if status is not None else "an error in the stream"
        return LanesError(
            f"{endpoint} failed with {where}: {message}",
            param=found.param,
            code=found.code,
        )
    return found


def final_failure(endpoint: str, error: Exception, tries: int) -> LanesError:
    """What the caller sees once retries are over (`tries` attempts): always a
    LanesError; the endpoint unreachable (refused, or no connection within the connect
    timeout) is an `Unavailable`."""
    if isinstance(error, LanesError):
        return error
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
        # Nothing reached the server, so nothing ran: the caller may retry it as it
        # retries an Overloaded (the client's own retries are spent by now).
        return Unavailable(
            f"cannot reach the lanes endpoint at {endpoint} ({error or type(error).__name__}; "
            f"{tries} attempt{'s' if tries > 1 else ''}): start `lanes serve` there, or "
            "point LANES_ENDPOINT (or Client(endpoint=...)) at a running one"
        )
    if isinstance(error, httpx.TimeoutException):
        return DeadlineExceeded(
            f"no answer from {endpoint} within the client's timeout "
            f"({type(error).__name__}); raise Client(timeout=...) or send less"
        )
    return LanesError(f"the connection to {endpoint} failed: {error!r}")


def cut_short(endpoint: str) -> LanesError:
    return LanesError(f"the stream from {endpoint} ended before its [DONE] event; retry it")


def json_body(response: httpx.Response, endpoint: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise LanesError(
            f"{endpoint} answered HTTP {response.status_code} with a body that is not JSON: "
            f"{response.text[:200]!r}"
        ) from None


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return max(0.0, float(headers.get("retry-after", "1")))
    except ValueError:
        return 1.0  # an HTTP date: lanes never sends one
