"""A decoder's KV cache held as OrtValues on the session's device, and row surgery there.

`DevicePast` is `Past` whose tensors stay where the decoder's session runs (GPU
memory on the CUDA provider): `Decoder.step_bound` binds it in and returns the
present the same way, so no step copies the cache through the host.

A continuous batch also rearranges the cache between steps: rows join (into holes
or appended), leave (compaction), are run apart (a failed run isolated by halves)
and are put back together. onnxruntime has no tensor operations of its own outside
a graph, so `PastRows` is a tiny graph run on the decoder's own providers with IO
binding: each output row is one source row, right-aligned to a new length (zeros
in front, or leading columns dropped), or a row of zeros. One run rearranges every
layer's keys and values at once. `RowRef` names a source row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from lanes.binding import Placement
from lanes.errors import ModelError

Array = np.ndarray[Any, Any]

_OPSET = 18  # Pad with `pads` as an input, negative pads crop


@dataclass(frozen=True)
class DevicePast:
    """The KV cache on a device: per layer [batch, heads, length, head_dim] OrtValues."""

    keys: tuple[ort.OrtValue, ...]
    values: tuple[ort.OrtValue, ...]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape()[2])

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape()[0])

    @property
    def tensors(self) -> tuple[ort.OrtValue, ...]:
        """Keys then values, the order `PastRows` takes and returns them in."""
        return (*self.keys, *self.values)

    @classmethod
    def of(cls, tensors: Sequence[ort.OrtValue]) -> DevicePast:
        """From keys then values (`tensors`' order)."""
        half = len(tensors) // 2
        return cls(tuple(tensors[:half]), tuple(tensors[half:]))


@dataclass(frozen=True)
class RowRef:
    """Row `row` of source `source` (an index into the sources of one rearrangement)."""

    source: int
    row: int


class PastRows:
    """Row rearrangements of `DevicePast`s on the decoder's device, in one run each.

    Thread-safe (each run makes its own binding). Built once per decoder: the graph
    is typed by the cache's element type and sized by its layer count.
    """

    def __init__(
        self, providers: Sequence[str], placement: Placement, layers: int, dtype: np.dtype[Any]
    ) -> None:
        self.placement = placement
        self._tensors = 2 * layers
        self._dtype = np.dtype(dtype)
        options = ort.SessionOptions()
        options.log_severity_level = 4
        self._session = ort.InferenceSession(
            _graph(self._tensors, dtype), options, providers=list(providers)
        )
        if Placement.of(self._session) != placement:
            got = ", ".join(self._session.get_providers())
            raise ModelError(
                f"the cache's row graph runs on {got}, not on {placement} as the decoder does"
            )

    def assemble(
        self, sources: Sequence[DevicePast], rows: Sequence[RowRef | None], length: int
    ) -> DevicePast:
        """A new past of `len(rows)` rows and `length` positions: row i is `rows[i]`'s
        source row with its last `length` positions right-aligned (zeros before a
        shorter row; a longer one loses its first positions), or zeros for None.
        `sources` are left as they are. One run for up to two sources; more fold in
        one run each."""
        if not sources:
            raise ValueError("assemble: no sources (an all-zeros past needs one for its shape)")
        for ref in rows:
            if ref is not None and not (
                0 <= ref.source < len(sources) and 0 <= ref.row < sources[ref.source].batch
            ):
                raise ValueError(f"assemble: {ref} is not a row of the {len(sources)} sources")
        a, a_list = sources[0], self._refs(rows, 0)
        for s in range(1, len(sources)):
            b_list = self._refs(rows, s)
            if s == len(sources) - 1:
                return self._final(rows, length, a, a_list, sources[s], b_list)
            # Stack a's rows then b's, aligned, as the next fold's `a`.
            stacked = list(range(len(a_list) + len(b_list)))
            a_rows, b_rows = [r for _, r in a_list], [r for _, r in b_list]
            a = self._run(a, a_rows, sources[s], b_rows, stacked, length)
            a_list = [(i, k) for k, (i, _) in enumerate(a_list + b_list)]
        return self._final(rows, length, a, a_list, self._empty(a), [])

    @staticmethod
    def _refs(rows: Sequence[RowRef | None], source: int) -> list[tuple[int, int]]:
        """(output row, source row) of every output row that comes from `source`."""
        return [
            (i, ref.row) for i, ref in enumerate(rows) if ref is not None and ref.source == source
        ]

    def _final(
        self,
        rows: Sequence[RowRef | None],
        length: int,
        a: DevicePast,
        a_list: list[tuple[int, int]],
        b: DevicePast,
        b_list: list[tuple[int, int]],
    ) -> DevicePast:
        at = {i: k for k, (i, _) in enumerate(a_list + b_list)}
        zeros = len(at)
        order = [at.get(i, zeros) for i in range(len(rows))]
        return self._run(a, [r for _, r in a_list], b, [r for _, r in b_list], order, length)

    def take(self, past: DevicePast, rows: Sequence[int], drop: int = 0) -> DevicePast:
        """`rows` of `past`, in that order, without their first `drop` positions."""
        refs = [RowRef(0, r) for r in rows]
        return self.assemble([past], refs, past.length - drop)

    def _run(
        self,
        a: DevicePast,
        a_rows: Sequence[int],
        b: DevicePast,
        b_rows: Sequence[int],
        order: Sequence[int],
        length: int,
    ) -> DevicePast:
        """order[i] indexes the stack of a's `a_rows`, then b's `b_rows`, then a row of
        zeros; every row aligned to `length`."""
        binding = self._session.io_binding()
        for k, (x, y) in enumerate(zip(a.tensors, b.tensors, strict=True)):
            binding.bind_ortvalue_input(f"a.{k}", x)
            binding.bind_ortvalue_input(f"b.{k}", y)
        binding.bind_cpu_input("a_rows", np.asarray(a_rows, dtype=np.int64))
        binding.bind_cpu_input("b_rows", np.asarray(b_rows, dtype=np.int64))
        # Pads: [begin rows, heads, length, dim, end rows, heads, length, dim]; b's one
        # end row is the row of zeros, last in the stack.
        binding.bind_cpu_input("a_pads", _pads(length - a.length, 0))
        binding.bind_cpu_input("b_pads", _pads(length - b.length, 1))
        binding.bind_cpu_input("order", np.asarray(order, dtype=np.int64))
        for k in range(self._tensors):
            binding.bind_output(f"out.{k}", self.placement.device_type, self.placement.device_id)
        self._session.run_with_iobinding(binding)
        return DevicePast.of(binding.get_outputs())

    def _empty(self, like: DevicePast) -> DevicePast:
        """A source with no rows and no positions, shaped like `like`, on the device."""

        def none(value: ort.OrtValue) -> ort.OrtValue:
            _, heads, _, dim = value.shape()
            empty = np.zeros((0, heads, 0, dim), self._dtype)
            device = self.placement
            return ort.OrtValue.ortvalue_from_numpy(empty, device.device_type, device.device_id)

        return DevicePast(tuple(none(k) for k in like.keys), tuple(none(v) for v in like.values))


def _pads(columns: int, zero_rows: int) -> Array:
    return np.asarray([0, 0, columns, 0, zero_rows, 0, 0, 0], dtype=np.int64)


def _graph(tensors: int, dtype: np.dtype[Any]) -> bytes:
    """out.k = Gather(Concat(Pad(Gather(a.k, a_rows), a_pads), Pad(Gather(b.k, b_rows),
    b_pads)), order) for k < `tensors`, serialised. onnx is imported here only: a
    decoder that never rearranges its cache on a device never needs it."""
    from onnx import TensorProto, helper

    element = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
    if np.dtype(dtype) not in element:
        raise ValueError(f"the cache's element type {dtype} has no device row graph")
    kind = element[np.dtype(dtype)]
    shared = [
        helper.make_tensor_value_info(n, TensorProto.INT64, [None])
        for n in ("a_rows", "b_rows", "order")
    ] + [helper.make_tensor_value_info(n, TensorProto.INT64, [8]) for n in ("a_pads", "b_pads")]
    nodes: list[Any] = []
    inputs: list[Any] = []
    outputs: list[Any] = []
    for k in range(tensors):
        for side in ("a", "b"):
            inputs.append(helper.make_tensor_value_info(f"{side}.{k}", kind, [None] * 4))
            nodes.append(
                helper.make_node("Gather", [f"{side}.{k}", f"{side}_rows"], [f"{side}g.{k}"])
            )
            nodes.append(
                helper.make_node("Pad", [f"{side}g.{k}", f"{side}_pads"], [f"{side}p.{k}"])
            )
        nodes.append(helper.make_node("Concat", [f"ap.{k}", f"bp.{k}"], [f"s.{k}"], axis=0))
        nodes.append(helper.make_node("Gather", [f"s.{k}", "order"], [f"out.{k}"], axis=0))
        outputs.append(helper.make_tensor_value_info(f"out.{k}", kind, [None] * 4))
    graph = helper.make_graph(nodes, "past_rows", inputs + shared, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = 9
    return bytes(model.SerializeToString())
