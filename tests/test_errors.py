"""The one table between errors and HTTP: every error the server writes comes back,
through `from_wire`, as the class it left as, with its field and code."""

from __future__ import annotations

import pytest

from lanes.errors import (
    AuthError,
    DeadlineExceeded,
    InvalidInput,
    LanesError,
    ModelError,
    Overloaded,
    RequestTooLarge,
    Unavailable,
    UnknownWorkload,
    WrongMode,
    from_wire,
)
from lanes.protocols.openai import error_of

SENT: list[LanesError] = [
    InvalidInput.field("max_tokens", "expected a value >= 1, found 0", "integer_below_min_value"),
    RequestTooLarge("this request has 5 inputs; the workload queues at most 4"),
    WrongMode("workload 'w' is offline", param="model"),
    UnknownWorkload("no workload named 'ghost'", param="model"),
    AuthError("missing or wrong API key"),
    Overloaded("queue full", 3.0),
    Unavailable("cannot reach the Prefect API", 3.0),
    DeadlineExceeded("deadline passed"),
    ModelError("the model failed on this batch"),
]


@pytest.mark.parametrize("error", SENT, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("in_stream", [False, True])
def test_what_the_server_writes_comes_back_as_the_same_error(
    error: LanesError, in_stream: bool
) -> None:
    body = error_of(error)["error"]
    status = None if in_stream else error.status  # an error event inside a stream has none
    back = from_wire(body["message"], status, body["code"], body["param"], body["type"], 3.0)
    assert type(back) is type(error)
    assert (str(back), back.param, back.code) == (str(error), error.param, error.code)
    if isinstance(error, Overloaded):
        assert isinstance(back, Overloaded) and back.retry_after == 3.0


def test_an_error_moves_to_another_field_keeping_its_words_and_code() -> None:
    error = InvalidInput.field("input", "expected a non-empty string", "invalid_value")
    moved = error.at("input[3]")
    assert str(moved) == "input[3]: expected a non-empty string"
    assert (moved.param, moved.code) == ("input[3]", "invalid_value")
    assert type(RequestTooLarge.field("body", "over the limit").at("payload")) is RequestTooLarge


def test_answers_without_a_known_code_go_by_status() -> None:
    assert type(from_wire("m", 422)) is InvalidInput
    assert type(from_wire("m", 404)) is UnknownWorkload  # v2 says no code
    assert type(from_wire("m", 500)) is LanesError
    assert type(from_wire("m", None, error_type="invalid_request_error")) is InvalidInput


def test_only_a_full_queue_asks_for_a_retry_and_a_model_error_asks_for_none() -> None:
    from lanes.serving.http import openai_error, v2_error

    for write in (openai_error, v2_error):
        busy = write(Overloaded("queue full", 2.0))
        assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        failed = write(ModelError("the model failed on this input, run on its own"))
        assert failed.status_code == 500 and "retry-after" not in failed.headers
        assert failed.headers["x-should-retry"] == "false"  # the openai client retries 500s
        assert "x-should-retry" not in write(LanesError("internal error")).headers
