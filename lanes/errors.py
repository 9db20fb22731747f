"""Errors a lanes user can act on.

    LanesError                     every error lanes raises on purpose
    ├── SpecError                  workloads.yaml (or an override) is wrong; holds every Problem
    │   └── SettingsError          a LANES_* setting is wrong (a bad value, JSON that is not)
    ├── ModelError                 a model file does not fit its task or cannot be loaded
    ├── HandlerError               a workload's `handler: module:attr` cannot be imported
    ├── InvalidInput               a request or record does not fit the workload (HTTP 400)
    ├── UnknownWorkload            no workload of that name (HTTP 404)
    ├── WrongMode                  call() on an offline workload, submit() on an interactive one
    ├── Overloaded                 the queue is full; retry later (HTTP 503)
    ├── DeadlineExceeded           the request's deadline passed before it ran (HTTP 504)
    ├── AuthError                  missing or wrong API key (HTTP 401)
    ├── StorageError               an input/output URI cannot be read or written
    └── JobFailed                  an offline job ended in a failed state

Every message says what failed, where, and what to do about it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any


class LanesError(Exception):
    """Base class of every error lanes raises on purpose."""


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


class SpecError(LanesError):
    """The spec is invalid. `problems` lists every problem found, in file order."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class SettingsError(SpecError):
    """A LANES_* environment variable does not fit its setting; `problems` names each."""


class ModelError(LanesError):
    """A model does not fit its task, or onnxruntime cannot load it."""


class HandlerError(LanesError):
    """A workload's handler cannot be imported or lacks what it must have."""


class InvalidInput(LanesError):
    """A request or record does not fit the workload: the message names the field."""


class UnknownWorkload(LanesError):
    """No workload has that name."""


class WrongMode(LanesError):
    """The workload runs in the other mode: the message names the method to use."""


class Overloaded(LanesError):
    """The workload's queue is full. Retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(LanesError):
    """The request's deadline passed before it could run."""


class AuthError(LanesError):
    """The API key is missing or wrong."""


class StorageError(LanesError):
    """An input or output location cannot be read or written."""


class JobFailed(LanesError):
    """An offline job ended in a failed state."""
