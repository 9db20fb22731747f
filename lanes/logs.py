"""Log lines, as text or JSON, each carrying the id of the request it is about.

The serving edge sets `request_id` for the duration of each request; every line
logged meanwhile on that request's task (or a task it spawned) carries the id, in
text as `request_id=...` at the end, in JSON as a field. Structured fields ride in
a record's `lanes` extra (`log.info(..., extra={"lanes": {...}})`): JSON lines merge
them in, text lines show the message alone, which already says them.

Nothing here reads a request body or header: what is logged is what the caller of
`log.*` passes, and lanes passes neither bodies nor keys.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

# The id of the request being handled on this task; None outside a request.
request_id: ContextVar[str | None] = ContextVar("lanes_request_id", default=None)

ACCESS_LOGGER = "lanes.access"


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request).

    A record that already has one (`extra={"request_id": ...}`, as a line about a
    whole batch can) keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return line if rid is None else f"{line} request_id={rid}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, the record's
    `lanes` fields, and exc (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line["request_id"] = rid
        fields = getattr(record, "lanes", None)
        if isinstance(fields, dict):
            line.update({k: v for k, v in fields.items() if k not in line})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def handler(format: LogFormat, stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) writing `format`, request ids included."""
    out = logging.StreamHandler(sys.stderr if stream is None else stream)
    out.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    out.addFilter(RequestIdFilter())
    return out


def configure(
    format: LogFormat, level: LogLevel, access_level: LogLevel, stream: Any = None
) -> logging.Handler:
    """Send every logger's lines (uvicorn's too) to one handler on the root logger.

    `access_level` is the threshold of the access lines (logger `lanes.access`, one
    per request, at INFO): WARNING turns them off while other lines stay at `level`.
    Returns the handler, so a caller can remove it again.
    """
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h.formatter, TextFormatter | JsonFormatter)]:
        root.removeHandler(old)  # configured twice in one process: one line per record
    out = handler(format, stream)
    root.addHandler(out)
    root.setLevel(level)
    logging.getLogger(ACCESS_LOGGER).setLevel(access_level)
    return out
