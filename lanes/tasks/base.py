"""The `Task` protocol every task implements, and the little the tasks share.

A task is what a workload does with its model. Callers (the HTTP server, the
Prefect flows) use it in two steps, so a bad input never reaches a batch:

    prepared = task.prepare(item)        # per request/record: validate, convert
    outputs = task.run([p1, p2, ...])    # per batch: one model run, one output each

Prepared values are opaque to callers: they come from `prepare` and go to `run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from lanes.errors import InvalidInput, ModelError
from lanes.spec import ModelSpec, TaskName, Workload
from lanes.tasks.handler import Handler


class Task(Protocol):
    """One workload's model, ready to run. Implementations are thread-safe."""

    name: str  # the workload's name
    workload: Workload
    kind: TaskName  # "embed" | "infer" | "generate"
    handler: Handler

    def prepare(self, item: Any) -> Any:
        """Validate and convert one input (after the handler's `pre`). Cheap.

        Raises `InvalidInput` naming the field, what was expected and what was found.
        """
        ...

    def check(self, item: Any) -> Any:
        """`prepare` without the handler's `pre`: for an item `pre` already made (an
        offline plain record's, from the whole record)."""
        ...

    def run(self, batch: Sequence[Any]) -> list[Any]:
        """Run prepared items as one batch; returns exactly one output per item, in order.

        Pads to the longest item in this batch only; applies the handler's `post`
        per item. Safe to call from a worker thread (onnxruntime releases the GIL).
        """
        ...

    def warm_up(self) -> None:
        """One small run, so the first real request does not pay for initialisation."""
        ...


def check_count(task: str, outputs: Sequence[object], batch: Sequence[object]) -> None:
    """Raise `ModelError` unless there is one output per input (names both counts)."""
    if len(outputs) != len(batch):
        raise ModelError(
            f"task {task!r} produced {len(outputs)} outputs for {len(batch)} inputs; "
            "the model's outputs do not follow its batch dimension"
        )


def load_tokenizer(model: ModelSpec, task: str) -> Tokenizer:
    """The model's tokenizer.json; `ModelError` when it is not declared or cannot load."""
    if model.tokenizer is None:
        raise ModelError(f"task {task!r} needs a tokenizer, but model {model.path} declares none")
    path: Path = model.tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception subclass
        raise ModelError(f"cannot load tokenizer {path}: {err}") from err


def encode(tokenizer: Tokenizer, text: str, param: str = "input") -> list[int]:
    """`tokenizer.encode(text).ids`; text the tokenizer cannot encode (a character a
    WordLevel vocabulary without an unknown token lacks) is an `InvalidInput`.

    Through `encode_batch`, which lets go of the GIL while it tokenizes (`encode` holds
    it throughout): a large body is prepared off the event loop (serving/offload.py)
    so that the loop keeps serving meanwhile, which a held GIL would undo."""
    try:
        ids: list[int] = tokenizer.encode_batch([text])[0].ids
    except Exception as err:  # tokenizers raises a bare Exception subclass
        detail = f"this model's tokenizer cannot encode the text ({err})"
        raise InvalidInput.field(param, detail, "invalid_value") from None
    return ids
