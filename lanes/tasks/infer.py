"""infer: named tensors in, named tensors out, for any ONNX model.

An item maps each model input name to an array-like (nested lists or numpy) whose
first dimension is rows. `run` stacks the rows of a whole batch, runs the model
once and splits every output back by each item's row count. A model whose first
dimension is fixed (or that has a scalar input) cannot stack rows: it runs once
per item.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import onnxruntime as ort

from lanes.binding import run
from lanes.errors import InvalidInput, ModelError
from lanes.payloads import infer_inputs, input_array
from lanes.runtime import Runtime, TensorInfo, describe
from lanes.spec import ModelSpec, TaskName, Workload
from lanes.tasks.base import check_count
from lanes.tasks.handler import NO_HANDLER, Handler
from lanes.tasks.session_slot import SessionSlot, SlotSession
from lanes.validation import describe as describe_value

log = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
Tensors = dict[str, Array]


@dataclass(frozen=True)
class InferItem:
    """One item's inputs, converted to the model's dtypes; `rows` is their shared first dim."""

    inputs: Tensors
    rows: int


class InferTask(SlotSession):
    """Any ONNX model behind the Open Inference Protocol."""

    kind: TaskName = "infer"

    def __init__(
        self,
        name: str,
        workload: Workload,
        model: ModelSpec,
        runtime: Runtime,
        handler: Handler = NO_HANDLER,
        backfilled: bool = False,
    ) -> None:
        """`backfilled`: the spec runs an offline workload's batches on this one's
        sessions (lanes.backfill.backfilled)."""
        self.name = name
        self.workload = workload
        self.handler = handler
        self.slot = SessionSlot.of(runtime, model, workload, backfilled)
        self.inputs = describe(self.session.get_inputs())
        self.outputs = describe(self.session.get_outputs())
        for info in self.inputs.values():
            if info.dtype is None:
                raise ModelError(
                    f"model {model.path}: input {info.name!r} has element type {info.type}, "
                    "which lanes cannot feed"
                )
        # Rows can be stacked across items only when every input's first dim is free.
        self.stacks_rows = all(
            info.shape and not isinstance(info.shape[0], int) for info in self.inputs.values()
        )
        # What the handler's `post` made of the warm-up's output (None: no post, or it
        # failed on zeros): servers describe a handler's outputs by it.
        self.post_example: Any = None

    def prepare(self, item: Any) -> InferItem:
        """Check names, dtypes, ranks and fixed dims (after the handler's `pre`); raise
        `InvalidInput` naming the input (its `param`: the input's name, or None when
        the problem is the inputs' together)."""
        return self.check(self.handler.before(item))

    def check(self, item: Any) -> InferItem:
        """`prepare` without the handler's `pre`."""
        item = infer_inputs(item, list(self.inputs), self.name)
        missing = [n for n in self.inputs if n not in item]
        unknown = [str(n) for n in item if n not in self.inputs]
        if missing or unknown:
            parts = [f"missing input {n!r}" for n in missing]
            parts += [f"unknown input {n!r}" for n in unknown]
            first = (missing or unknown)[0]
            message = f"{'; '.join(parts)}; the model takes {', '.join(self.inputs)}"
            raise InvalidInput(message, param=first)
        tensors = {n: _convert(info, item[n]) for n, info in self.inputs.items()}
        return InferItem(tensors, self._rows(tensors))

    def _rows(self, tensors: Tensors) -> int:
        if not self.stacks_rows:
            return 1
        counts = {n: int(a.shape[0]) for n, a in tensors.items()}
        if len(set(counts.values())) > 1:
            found = ", ".join(f"{n} has {c}" for n, c in counts.items())
            detail = f"expected the same number of rows in each, found {found}"
            raise InvalidInput.field("inputs", detail)
        name, rows = next(iter(counts.items()))
        if rows == 0:
            raise InvalidInput(f"input {name!r}: expected at least one row, found 0", param=name)
        return rows

    def run(self, batch: Sequence[InferItem]) -> list[Any]:
        """Per item: output name -> array with that item's rows (or the handler's `post`)."""
        outputs = [self.handler.after(o) for o in self.tensors(batch)]
        check_count(self.name, outputs, batch)
        return outputs

    def tensors(
        self, batch: Sequence[InferItem], options: ort.RunOptions | None = None
    ) -> list[Tensors]:
        """The model run behind `run`, without the handler (`options`: its runs', see
        lanes.binding.run)."""
        if len(batch) <= 1 or not self.stacks_rows:
            return [out for it in batch for out in self._stacked([it], options)]
        found: dict[int, Tensors] = {}
        for indices in stack_runs(batch):
            stack = self._stacked([batch[i] for i in indices], options)
            found.update(zip(indices, stack, strict=True))
        return [found[i] for i in range(len(batch))]

    def _stacked(self, batch: Sequence[InferItem], options: ort.RunOptions | None) -> list[Tensors]:
        """One model run over `batch`'s rows stacked (their dims after the rows agree),
        split back per item."""
        names = list(self.outputs)
        if len(batch) == 1:
            results = run(self.session, names, batch[0].inputs, self.placement, options)
            return [dict(zip(names, results, strict=True))]
        feeds = {n: np.concatenate([it.inputs[n] for it in batch]) for n in self.inputs}
        results = run(self.session, names, feeds, self.placement, options)
        total = sum(it.rows for it in batch)
        bounds = np.cumsum([it.rows for it in batch])[:-1]
        pieces: dict[str, list[Array]] = {}
        for name, value in zip(names, results, strict=True):
            if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != total:
                shape = getattr(value, "shape", type(value).__name__)
                raise ModelError(
                    f"workload {self.name!r}: output {name!r} has shape {shape} for {total} "
                    "input rows; cannot split it per item (its first dim must be rows)"
                )
            pieces[name] = np.split(value, bounds)
        return [{n: pieces[n][i] for n in names} for i in range(len(batch))]

    def warm_up(self) -> None:
        """Run the model once on zeros, and `post` (if any) on its output."""
        feeds = {n: _dummy(info) for n, info in self.inputs.items()}
        [outputs] = self.tensors([InferItem(feeds, 1)])
        if self.handler.post is not None:
            try:
                self.post_example = self.handler.post(outputs)
            except Exception as err:  # a post may well refuse zeros; real inputs will tell
                log.info("workload %s: post failed on the warm-up's zeros: %s", self.name, err)


def stack_runs(batch: Sequence[InferItem]) -> list[list[int]]:
    """The runs `InferTask.tensors` makes of a batch whose rows stack, each as its
    items' indices: the items whose inputs agree in every dim after the rows (a model
    with a free dim there, a sequence's length, takes requests of several lengths; as
    in Triton's batcher, each shape is a run of its own)."""
    runs: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for i, item in enumerate(batch):
        runs.setdefault(tuple(a.shape[1:] for a in item.inputs.values()), []).append(i)
    return list(runs.values())


# What a numpy dtype kind holds, as a request's JSON spelled it.
_FOUND = {
    "b": "true/false values",
    "i": "integers",
    "u": "integers",
    "f": "floats",
    "U": "strings",
    "S": "bytes",
    "O": "mixed or non-numeric values",
}


def _convert(info: TensorInfo, value: Any) -> Array:
    """`value` as the model's dtype, or `InvalidInput` when that would change its meaning."""
    name = info.name
    try:
        array = input_array(value)
    except ValueError as err:  # numpy refuses ragged nested lists
        detail = f"expected a rectangular array, found {err}"
        raise InvalidInput(f"input {name!r}: {detail}", param=name) from None
    target = info.dtype
    assert target is not None  # checked when the task loaded
    source = array.dtype.kind
    wanted = f"input {name!r}: expected {target.name} values ({info.type})"
    if target.kind == "O":  # tensor(string)
        if source == "O" or source == "S":
            array = _texts(name, array)  # onnxruntime would feed bytes as their repr
        elif source != "U":
            raise InvalidInput(
                f"{wanted}, found {_FOUND.get(source, array.dtype.name)}", param=name
            )
        array = array.astype(object)
    elif source == "b" and target.kind in "biuf":
        array = array.astype(target, copy=False)
    elif source in "iu" and target.kind in "iu":
        limits = np.iinfo(cast("np.dtype[np.integer[Any]]", target))
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            raise InvalidInput(
                f"{wanted}, found integers from {array.min()} to {array.max()}, "
                f"outside {target.name}'s range",
                param=name,
            )
        array = array.astype(target, copy=False)
    elif (source in "iu" and target.kind == "f") or (source == "f" and target.kind == "f"):
        array = array.astype(target, copy=False)
    else:
        raise InvalidInput(f"{wanted}, found {_FOUND.get(source, array.dtype.name)}", param=name)
    _check_shape(info, array.shape)
    return array


def _check_shape(info: TensorInfo, shape: tuple[int, ...]) -> None:
    expected = "[" + ", ".join("?" if d is None else str(d) for d in info.shape) + "]"
    if len(shape) != len(info.shape):
        raise InvalidInput(
            f"input {info.name!r}: expected rank {len(info.shape)} (shape {expected}), "
            f"found shape {list(shape)}",
            param=info.name,
        )
    for axis, (want, got) in enumerate(zip(info.shape, shape, strict=True)):
        if isinstance(want, int) and want != got:
            raise InvalidInput(
                f"input {info.name!r}: expected shape {expected}, found {list(shape)} "
                f"(dim {axis} must be {want})",
                param=info.name,
            )


def _texts(name: str, array: Array) -> Array:
    """Strings as they are and bytes decoded as UTF-8, or `InvalidInput`."""
    texts = np.empty(array.shape, dtype=object)
    for index, value in np.ndenumerate(array):
        if isinstance(value, bytes | np.bytes_):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                detail = f"element {index} is not UTF-8 text"
                raise InvalidInput(f"input {name!r}: {detail}", param=name) from None
        elif not isinstance(value, str):
            raise InvalidInput(
                f"input {name!r}: expected strings, found {describe_value(value)} at {index}",
                param=name,
            )
        texts[index] = value
    return texts


def _dummy(info: TensorInfo) -> Array:
    shape = tuple(d if isinstance(d, int) else 1 for d in info.shape)
    if info.dtype is not None and info.dtype.kind == "O":
        return np.full(shape, "", dtype=object)
    return np.zeros(shape, dtype=info.dtype)
