"""One embed or infer batch's run and its callers' answers, wherever it runs: the
model's thread, the event loop, or an offline thread at idle priority
(serving/worker.py, serving/beside.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import onnxruntime as ort

from lanes.errors import LanesError, ModelError
from lanes.isolation import Failed, Isolated, Ran, failed_alone, isolate, per_item
from lanes.serving.batching import Pending

log = logging.getLogger("lanes.serving")

# What a run hands its finish: each item's output (or `Failed`), and the run's seconds.
Result = tuple[list[Any], float]


# A batch's run over prepared items: one output per item, in order.
Run = Callable[[Sequence[Any]], list[Any]]


class StoppableRun(Protocol):
    """A run that `stop.terminate` may end early; without `stop` (the halves of a
    failed run, `stoppable_run`) it runs to its end. A Protocol, as a Callable cannot
    say both arities: a run that required `stop` made each half a TypeError."""

    def __call__(
        self, items: Sequence[Any], stop: ort.RunOptions | None = None, /
    ) -> list[Any]: ...


class Stopped(Exception):
    """An offline run ended early by its `RunOptions.terminate`."""


def timed_run(run: Run, items: list[Any], clock: Callable[[], float], name: str) -> Result:
    """`run(items)` and its own duration, without any thread hand-off.

    A run that fails is run again in halves (lanes/isolation.py): an item that fails
    alone gets a `Failed` holding its own error, the others their outputs (so a run is
    whole when no output is a `Failed`)."""
    start = clock()
    isolated = isolate(run, items)
    return _logged(isolated, clock() - start, len(items), name)


def stoppable_run(
    run: StoppableRun,
    items: list[Any],
    clock: Callable[[], float],
    name: str,
    stop: ort.RunOptions,
) -> Result:
    """`timed_run` whose whole run is `run(items, stop)`: raises `Stopped` if
    `stop.terminate` ended it; the halves after a failure run to their end."""
    start = clock()
    try:
        isolated = Isolated((Ran(0, len(items), run(items, stop)),), ())
    except Exception as error:
        if stop.terminate:
            raise Stopped from None
        isolated = isolate(run, items, error)
    return _logged(isolated, clock() - start, len(items), name)


def _logged(isolated: Isolated[list[Any]], took: float, items: int, name: str) -> Result:
    """The run's outputs (`_with_errors`) and `took`; a run that was not whole is logged."""
    if not isolated.whole:
        log.error(
            "workload %s: a batch of %d failed; %d of its items fail on their own",
            name,
            items,
            len(isolated.failed),
            exc_info=isolated.error,
        )
    return _with_errors(isolated, items), took


def answer(
    batch: list[Pending],
    start: float,
    result: Result | None,
    error: BaseException | None,
    name: str,
) -> tuple[list[Any], BaseException | None]:
    """Each live caller's output or error; returns the outputs and the batch's error
    (a model failure made a ModelError), as given to the callers."""
    outputs: list[Any] = []
    if error is not None and not isinstance(error, LanesError):
        # A model failure must answer its callers, not kill the loop.
        log.error(
            "workload %s: a batch of %d failed (requests %s)",
            name,
            len(batch),
            _ids(batch),
            exc_info=error,
        )
        error = ModelError(f"the model failed on this batch: {error}")
    elif result is not None:
        outputs = result[0]
        if len(outputs) != len(batch):
            error = ModelError(f"the task returned {len(outputs)} outputs for {len(batch)} inputs")
    for i, pending in enumerate(batch):
        if pending.request is not None:  # before its answer: the access line reads it
            pending.request.queue_wait_s = start - pending.enqueued_at
            pending.request.batch_size = len(batch)
        if pending.future.done():
            continue  # the caller went away meanwhile
        if error is not None:
            pending.future.set_exception(error)
        elif isinstance(outputs[i], Failed):  # the model fails on this item alone
            pending.future.set_exception(outputs[i].error)
        else:
            pending.future.set_result(outputs[i])
    return outputs, error


def _ids(batch: Sequence[Pending]) -> str:
    """The request ids of a batch, for a line about the whole batch."""
    return ", ".join(sorted({p.request.id for p in batch if p.request is not None})) or "none"


def _with_errors(isolated: Isolated[Any], items: int) -> list[Any]:
    """Each item's output; where it failed alone, a `Failed` holding the error its
    caller gets (every item failing alone is the model's fault, and says so)."""
    every = isolated.all_failed and items > 1
    return [
        Failed(o.index, failed_alone(o.error, every=every)) if isinstance(o, Failed) else o
        for o in per_item(isolated, items)
    ]
