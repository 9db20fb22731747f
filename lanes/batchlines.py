"""Checking a Batch API input file's lines, OpenAI's `validating` step (lanes.batches
splits the file into shards as it reads it and calls these): each line a POST of the
batch's endpoint with a unique `custom_id`, one model for the whole file, a workload of
the endpoint's task. The first MAX_ERRORS problems are listed, each with its line, then
one saying how many more there were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from lanes.batchfiles import BatchError
from lanes.errors import shown, with_article
from lanes.protocols.openai import BATCH_URLS
from lanes.spec import Spec, a_task
from lanes.validation import not_utf8

MAX_ERRORS = 100  # validation errors listed per file (then one saying how many more)

# A line's number, its problem, and the field at fault.
Error = Callable[[int, str, str | None], None]


class LineErrors:
    """The problems found in a file: the first MAX_ERRORS listed, the rest counted."""

    def __init__(self) -> None:
        self._listed: list[dict[str, Any]] = []
        self._unlisted = 0

    def __bool__(self) -> bool:
        return bool(self._listed)

    def add(self, number: int, message: str, param: str | None = None) -> None:
        if len(self._listed) < MAX_ERRORS:
            self._listed.append(BatchError("invalid_request", message, param, number).as_json())
        else:
            self._unlisted += 1

    def listed(self) -> list[dict[str, Any]]:
        """The batch's `errors`; past MAX_ERRORS, one more says how many were left out,
        so that a fixed file is not refused again for lines never shown."""
        if not self._unlisted:
            return list(self._listed)
        more = (
            f"{self._unlisted} more errors on later lines are not listed (only the first "
            f"{MAX_ERRORS} are); check the whole file before creating the batch again"
        )
        return [*self._listed, BatchError("invalid_request", more).as_json()]


def check_line(
    number: int,
    raw: bytes,
    endpoint: str,
    seen: set[str],
    model: str | None,
    error: Error,
) -> str | None:
    """The line's model when it is a good request line; else its errors are added."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        # orjson's error for a byte that is not UTF-8 names neither the byte nor
        # where it is; `lanes run`'s for the same line says both (flows.records).
        bad = not_utf8(raw)
        if bad is not None:
            detail = f"not UTF-8 text: {bad}; write the file encoded as UTF-8"
        else:
            detail = f"not JSON ({err})"
        error(number, f"line {number}: {detail}", None)
        return None
    if not isinstance(line, dict):
        error(number, f"line {number}: expected a JSON object", None)
        return None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        error(number, f"line {number}: custom_id: expected a non-empty string", "custom_id")
    elif custom_id in seen:
        error(number, f"line {number}: custom_id {shown(custom_id)} is used twice", "custom_id")
    else:
        seen.add(custom_id)
    if line.get("method") != "POST":
        error(number, f'line {number}: method: expected "POST"', "method")
    if line.get("url") != endpoint:
        found = line.get("url")
        error(
            number,
            f"line {number}: url: expected the batch's {endpoint}, found {shown(found)}",
            "url",
        )
    body = line.get("body")
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str):
        error(number, f"line {number}: body.model: expected a workload's name", "body.model")
        return None
    if model is not None and name != model:
        error(
            number,
            f"line {number}: body.model: expected {model!r} as on the lines before "
            f"(one model per batch), found {shown(name)}",
            "body.model",
        )
        return None
    return name


def check_model(spec: Spec, model: str, endpoint: str, error: Error) -> None:
    """An error on line 1 unless `model` is a workload of the task `endpoint` takes."""
    workload = spec.workloads.get(model)
    if workload is None:
        known = ", ".join(spec.workloads) or "none"
        error(
            1,
            f"line 1: body.model: no workload named {shown(model)}; known: {known}",
            "body.model",
        )
    elif workload.task != BATCH_URLS[endpoint]:
        error(
            1,
            f"line 1: body.model: workload {model!r} is {a_task(workload.task)} workload; "
            f"{endpoint} takes {with_article(BATCH_URLS[endpoint])} one",
            "body.model",
        )
