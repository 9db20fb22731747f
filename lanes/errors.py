"""Errors a lanes user can act on, and how each one travels over HTTP.

    LanesError                     every error lanes raises on purpose (HTTP 500)
    ├── SpecError                  workloads.yaml (or an override) is wrong; holds every Problem
    │   └── SettingsError          a LANES_* setting is wrong (a bad value, JSON that is not)
    ├── ModelError                 a model does not fit its task, or failed on an input alone
    ├── HandlerError               a workload's `handler: module:attr` cannot be imported, or its post failed
    ├── InvalidInput               a request or record does not fit the workload (HTTP 400)
    │   ├── RequestTooLarge        the request can never fit: body or item count (HTTP 413)
    │   └── UnsupportedEncoding    a Content-Encoding the server cannot decode (HTTP 415)
    ├── UnknownWorkload            no workload of that name (HTTP 404)
    ├── NotFound                   no job, or Batch API file or batch, of that id (HTTP 404)
    ├── WrongMode                  call() on an offline workload, submit() on an interactive one
    ├── Overloaded                 the queue is full; retry later (HTTP 503)
    │   └── Unavailable            a service is down (the endpoint, Prefect's API); retry later
    ├── NotConfigured              the server lacks what the route needs (HTTP 503, no retry)
    ├── DeadlineExceeded           the request's deadline passed before it ran (HTTP 504)
    ├── AuthError                  missing or wrong API key (HTTP 401)
    ├── StorageError               an input/output URI cannot be read or written
    │   └── PermanentStorageError  the same each time: a corrupt file, access denied
    └── JobFailed                  an offline job ended in a failed state
        └── OutputBusy             another run is writing the same output folder now

Every message says what failed, where, and what to do about it.

This module is the one table between errors and HTTP: each class states its `status`,
OpenAI's error `type` and its default `code`; each error carries the request field it
is about (`param`, OpenAI's spelling: `max_tokens`, `input[3]`, `messages[1].content`)
and a `code` as data. The server writes them as OpenAI's
`{"error": {"message", "type", "param", "code"}}` (v2: `{"error": message}`) and the
SDK reads them back into the same class with `from_wire`. An error whose class says it
`repeats` fails the same way for the same request: the server adds `x-should-retry:
false` (which the openai client obeys; it retries other 500s), and no SDK retries it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Self


class LanesError(Exception):
    """Base class of every error lanes raises on purpose.

    `param` names the request field at fault (None when it is no one field);
    `code` is machine-readable (OpenAI's where OpenAI has one, e.g.
    `integer_below_min_value`, `model_not_found`), else the class's `default_code`.
    """

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"  # OpenAI's error `type`
    default_code: ClassVar[str | None] = None
    repeats: ClassVar[bool] = False  # the same request fails the same way: never retry
    # The server's id of the request that failed (X-Request-Id), when it came from one.
    request_id: str | None = None

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code if code is not None else self.default_code


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where it is and what was expected."""

    source: str  # "workloads.yaml" or "env LANES_WORKLOADS__..."
    line: int | None  # 1-based
    column: int | None  # 1-based
    path: str  # dotted field path, e.g. workloads.search-query.batching.max_wait_ms
    message: str

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to about `limit` characters: a message names what it found, briefly."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({len(text)} characters)"


def with_article(word: str) -> str:
    """`word` after "a" or "an", for messages: "an object array", "a float32 array",
    "an embed workload" (a word spoken with a vowel first: "a uint8")."""
    return f"{'an' if word[:1].lower() in 'aeio' else 'a'} {word}"


class SpecError(LanesError):
    """The spec is invalid. `problems` lists every problem found, in file order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class SettingsError(SpecError):
    """A LANES_* environment variable does not fit its setting; `problems` names each."""


class ModelError(LanesError):
    """A model does not fit its task, onnxruntime cannot load it, or it failed on an
    input run on its own (the input passed every check the model declares, so the
    model is at fault, and it fails the same way every time: a 500 never to retry)."""

    default_code = "model_error"
    repeats = True


class HandlerError(LanesError):
    """A workload's handler cannot be imported, lacks what it must have, or its `post`
    failed on an output."""


class InvalidInput(LanesError):
    """A request or record does not fit the workload: the message names the field.

    Made with `InvalidInput.field(param, detail)`, its message is `"param: detail"`
    and `at(other)` moves the same problem to another place (a text's index in a
    list, the field's name in another protocol) without touching the message's text.
    """

    status = 400
    error_type = "invalid_request_error"

    def __init__(
        self, message: str = "", *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.detail = message

    @classmethod
    def field(cls, param: str, detail: str, code: str | None = None) -> Self:
        """The error about request field `param`: `detail` says what was expected and found."""
        error = cls(f"{param}: {detail}", param=param, code=code)
        error.detail = detail
        return error

    def at(self, param: str) -> Self:
        """The same problem, about `param` instead."""
        return type(self).field(param, self.detail, self.code)


class RequestTooLarge(InvalidInput):
    """The request can never be served as sent (a body over the size limit, more items
    than the queue holds): smaller requests can. Never worth a retry as it is."""

    status = 413
    default_code = "request_too_large"


class UnsupportedEncoding(InvalidInput):
    """The body is compressed with a coding the server does not decode: the message
    names the ones it does."""

    status = 415
    default_code = "unsupported_content_encoding"


class UnknownWorkload(LanesError):
    """No workload has that name."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class NotFound(LanesError):
    """No job (a flow run on the Prefect API), nor file or batch of the Batch API, has
    that id."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class WrongMode(LanesError):
    """The workload runs in the other mode (or task): the message names what to use."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "wrong_mode"


class Overloaded(LanesError):
    """The workload cannot take the request now (its queue is full; code
    `model_unavailable`: its model failed to load again after idling). Retry after
    `retry_after` seconds."""

    status = 503
    default_code = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class Unavailable(Overloaded):
    """A service the call needs does not answer now: the lanes endpoint itself (the SDK
    could not connect), or the Prefect API behind the Batch API and jobs. Nothing was
    done; retry after `retry_after` seconds (its operator should see to it if it stays
    down)."""

    default_code = "service_unavailable"


class NotConfigured(LanesError):
    """The server lacks what the route needs (the Batch API: a Prefect API): its
    operator must set it up; the same request fails the same way until then."""

    status = 503
    default_code = "not_configured"
    repeats = True


class DeadlineExceeded(LanesError):
    """The request's deadline passed before it could run."""

    status = 504
    default_code = "timeout"


class AuthError(LanesError):
    """The API key is missing or wrong."""

    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"
    repeats = True  # the same key is refused again: an offline shard fails without retries


class StorageError(LanesError):
    """An input or output location cannot be read or written."""


class PermanentStorageError(StorageError):
    """A read or write that fails the same way every time: a corrupt .gz or Parquet
    file, access denied (S3's 401 or 403, a local file's or folder's mode), an input
    deleted after the job listed it. An offline shard that meets one fails at once,
    without its retries; other StorageErrors (a connection reset, a 5xx,
    throttling past boto3's own retries) keep theirs."""

    repeats = True


class JobFailed(LanesError):
    """An offline job ended in a failed state."""


class OutputBusy(JobFailed):
    """Another run is writing the same output folder now (lanes.runlock)."""


# What an answer can say. A code names its class; a status its most general one.
_BY_CODE: tuple[type[LanesError], ...] = (
    RequestTooLarge,
    UnsupportedEncoding,
    WrongMode,
    UnknownWorkload,
    AuthError,
    Overloaded,
    Unavailable,
    NotConfigured,
    DeadlineExceeded,
    ModelError,
)
_BY_STATUS: tuple[type[LanesError], ...] = (
    InvalidInput,
    RequestTooLarge,
    UnsupportedEncoding,
    UnknownWorkload,
    AuthError,
    Overloaded,
    DeadlineExceeded,
)


def from_wire(
    message: str,
    status: int | None,
    code: str | None = None,
    param: str | None = None,
    error_type: str | None = None,
    retry_after: float = 1.0,
) -> LanesError:
    """The error a server's answer describes: by its `code` when a class owns it, else
    by its HTTP status (None for an error sent inside a stream), else by OpenAI's
    `type`. Any other 4xx is an `InvalidInput`; anything else a plain `LanesError`."""
    cls: type[LanesError] = LanesError
    owner = next((c for c in _BY_CODE if code is not None and c.default_code == code), None)
    if owner is not None:
        cls = owner
    elif status is not None:
        cls = next((c for c in _BY_STATUS if c.status == status), cls)
        # A proxy's: 429 (a rate limit) waits as a full queue does, and 502 (no
        # upstream, a replica restarting) as a service that is down; both retried.
        cls = {429: Overloaded, 502: Unavailable}.get(status, cls)
        if cls is LanesError and 400 <= status < 500:
            cls = InvalidInput
    elif error_type in (InvalidInput.error_type, AuthError.error_type):
        cls = InvalidInput if error_type == InvalidInput.error_type else AuthError
    if issubclass(cls, Overloaded):
        return cls(message, retry_after, code)
    return cls(message, param=param, code=code)
