"""Which items a failed batched run fails on: halve the batch until it is found.

A batched model run fails whole when one item makes it fail (a token id past the
model's table, a position past its embeddings, a handler's `post` raising on one
output). `isolate(run, items)` runs the batch; when that raises, it runs each half on
its own, recursively, down to single items. The items that fail alone are the
culprits; every other item keeps the result of a run that succeeded without them.
With one bad item among n it costs about 2·log2(n) runs more, and only when a run
fails. A run that fails must leave no trace (a model run's outputs are new arrays),
so what the halves give is what the batch would have given without the culprits.

Both lanes use it: the serving workers per dynamic batch (`per_item`), the generate
step loop (lanes/generation, online and offline) per prefill and per decode run over
rows of the KV cache, the offline shard per batch of records. `failed_alone` words
the error that an item failing alone gets: the same input fails the same way every
time, so it is never worth a retry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from lanes.errors import LanesError, ModelError

T = TypeVar("T")
R = TypeVar("R")
O = TypeVar("O")  # noqa: E741 (one output of a per-item run)


@dataclass(frozen=True)
class Ran(Generic[R]):
    """A run that succeeded: over `items[start:stop]`, giving `result`."""

    start: int
    stop: int
    result: R


@dataclass(frozen=True)
class Failed:
    """The item at `index`, which the run fails on alone, and the error it raised."""

    index: int
    error: Exception


@dataclass(frozen=True)
class Isolated(Generic[R]):
    """What came of running some items: the runs that succeeded, in item order, and
    the items that failed alone (between them they cover every item once); `error`,
    what the run over every item raised (None: it succeeded)."""

    ran: tuple[Ran[R], ...]
    failed: tuple[Failed, ...]
    error: Exception | None = None

    @property
    def whole(self) -> bool:
        """The first run, over every item, succeeded."""
        return self.error is None

    @property
    def all_failed(self) -> bool:
        """Every item failed alone: the model (or handler) fails on anything, not on
        one input. False when there were no items."""
        return bool(self.failed) and not self.ran


def isolate(
    run: Callable[[Sequence[T]], R], items: Sequence[T], failed: Exception | None = None
) -> Isolated[R]:
    """`run(items)`; when it raises, `run` on each half, recursively, until every item
    is either in a run that succeeded or has failed alone. `failed`: the caller ran
    `items` whole already and it raised that, so the halves come first. Never raises
    what `run` raises (`Exception`s; anything else, such as KeyboardInterrupt, goes
    through), and logs nothing: the caller knows what the items are."""
    ran: list[Ran[R]] = []
    lone: list[Failed] = []
    first: list[Exception] = []

    def attempt(start: int, stop: int, error: Exception | None) -> None:
        if error is None:
            try:
                ran.append(Ran(start, stop, run(items[start:stop])))
                return
            except Exception as raised:
                error = raised
        if not first:
            first.append(error)
        if stop - start == 1:
            lone.append(Failed(start, error))
            return
        middle = (start + stop) // 2
        attempt(start, middle, None)
        attempt(middle, stop, None)

    if items:
        attempt(0, len(items), failed)
    return Isolated(tuple(ran), tuple(lone), first[0] if first else None)


def per_item(isolated: Isolated[Sequence[O]], count: int) -> list[O | Failed]:
    """Each of `count` items' output, in order, from runs that return one output per
    item; a `Failed` where the item failed alone. `ModelError` when a run returned
    another number of outputs than it had items (naming both)."""
    parts: dict[int, Ran[Sequence[O]] | Failed] = {p.start: p for p in isolated.ran}
    parts.update((f.index, f) for f in isolated.failed)
    found: list[O | Failed] = []
    while len(found) < count:
        part = parts.get(len(found))
        if part is None:
            raise ValueError(f"per_item: no run covers item {len(found)} of {count}")
        if isinstance(part, Failed):
            found.append(part)
            continue
        if len(part.result) != part.stop - part.start:
            raise ModelError(
                f"a run of {part.stop - part.start} items returned {len(part.result)} outputs"
            )
        found.extend(part.result)
    return found


def failed_alone(error: Exception, what: str = "this input", every: bool = False) -> LanesError:
    """The error an item that fails alone answers with: a `LanesError` the run raised
    on purpose stays as it is; anything else is a `ModelError` (500) naming what the
    model raised. `every`: the other items of its batch failed alone too, so the model
    fails on any input. Either way the same input fails the same way again: no retry
    helps, and the message says so."""
    if isinstance(error, LanesError):
        return error
    raised = f"{type(error).__name__}: {error}"
    if every:
        return ModelError(
            f"the model failed on {what} and on every other input of its batch, each run "
            f"on its own ({raised}): the model, not the input, is at fault; fix or "
            "replace it"
        )
    return ModelError(
        f"the model failed on {what}, run on its own ({raised}); the same input fails "
        "the same way every time, so resending it as it is will not help: change it, or "
        "fix the model"
    )
