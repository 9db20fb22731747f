"""A decoder graph that keeps its cache in slots, run with the Optimum signature.

Such a graph (`DecoderConfig.kv_layout == "slots"`) attends with onnxruntime's
`GroupQueryAttention` and keeps each row's past at the front of a buffer as long as
the context: given the same buffer as past and present, it writes each step's column
in place, at the row's own length. It learns the rows' lengths one of two ways:
`seqlens_k` and `total_sequence_length` inputs (lanes/demo/slots.py), or an
`attention_mask` right-padded to the longest row, from which the graph derives them
(onnxruntime-genai's model builder). Either is fed here from the same lengths.

`SlotGraph.step` gives it the Optimum signature all the same (each row's real
columns moved to the front, run, and moved back), so prefills, prompts in parts
and single sequences need nothing else. A batch's decode runs a `SlotRun` on
buffers the step writes in place (lanes/generation/slots.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort

from lanes.runtime import describe
from lanes.tasks.decoder_config import DecoderConfig
from lanes.tasks.past import Past, StepOutput

Array = np.ndarray[Any, Any]


class SlotGraph:
    """A slot-layout session's two ways to run: `step` (any prefill or step, on
    numpy pasts) and `run` (the batch's decode, in place)."""

    def __init__(
        self,
        session: ort.InferenceSession,
        config: DecoderConfig,
        ids_dtype: np.dtype[Any],
        past_dtype: np.dtype[Any],
        outputs: list[str],
    ) -> None:
        self.session = session
        self.config = config
        self.ids_dtype = ids_dtype
        self.past_dtype = past_dtype
        self._outputs = outputs
        inputs = describe(session.get_inputs())
        logits = describe(session.get_outputs())["logits"]
        vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else config.vocab_size
        # Where its type and [batch, sequence, vocab] are known, a decode's logits go
        # straight into an array of ours.
        self.logits: tuple[np.dtype[Any], int] | None = None
        if logits.dtype is not None and vocab and len(logits.shape) == 3:
            self.logits = (logits.dtype, vocab)
        mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
        # Fed instead of seqlens_k and total_sequence_length, when the graph takes them.
        self.mask_dtype = None if mask is None else mask.dtype or np.dtype(np.int64)
        self.positions_dtype = None if positions is None else positions.dtype or np.dtype(np.int64)

    def lengths(self, held: Array, fed: Array) -> dict[str, Array]:
        """The feeds that tell the graph row r holds `held[r]` positions and gets
        `fed[r]` tokens after them (pads after those, up to the longest `fed`)."""
        total = held + fed
        if self.mask_dtype is None:
            return {
                "seqlens_k": (total - 1).astype(np.int32),
                "total_sequence_length": np.asarray(int(total.max()), dtype=np.int32),
            }
        columns = np.arange(int(total.max()))[None, :]
        feeds = {"attention_mask": (columns < total[:, None]).astype(self.mask_dtype)}
        if self.positions_dtype is not None:  # a pad takes its row's last position
            at = held[:, None] + np.arange(int(fed.max()))[None, :]
            feeds["position_ids"] = np.minimum(at, total[:, None] - 1).astype(self.positions_dtype)
        return feeds

    def step(self, input_ids: Array, attention_mask: Array, past: Past) -> StepOutput:
        """`Decoder.step` on this graph. Each row's real columns (its mask's ones, after
        its zeros, in the past and in the new tokens alike) move to the front, run with
        that row's own length, and come back right-aligned. Prompts on pasts run row
        by row: GroupQueryAttention takes one count of new tokens per batch."""
        batch, new = input_ids.shape
        length = past.length
        real = attention_mask != 0
        held, fed = real[:, :length].sum(axis=1), real[:, length:].sum(axis=1)
        column = np.arange(length + new)[None, :]
        suffixes = ((column >= (length - held)[:, None]) & (column < length)) | (
            column >= (length + new - fed)[:, None]
        )
        if not np.array_equal(real, suffixes) or not fed.all():
            raise ValueError(
                "step: a slot-layout decoder takes, in each row of attention_mask, zeros "
                "then ones over the past and zeros then at least one one over the new tokens"
            )
        wide, deep = int(fed.max()), int(held.max())
        if batch > 1 and wide > 1 and deep > 0:
            parts = [
                self.step(input_ids[r : r + 1], attention_mask[r : r + 1], past.row(r))
                for r in range(batch)
            ]
            return StepOutput(
                np.concatenate([o.logits for o in parts]),
                Past.concatenate([o.present for o in parts]),
            )
        dense = bool((held == length).all() and (fed == new).all())
        if dense:
            ids, compact = input_ids, past
        else:
            ids = np.full((batch, wide), self.config.pad_token_id, dtype=np.int64)
            compact = past.zeros(batch, deep)
            for r in range(batch):
                ids[r, : fed[r]] = input_ids[r, new - fed[r] :]
                for ours, theirs in zip(compact.arrays, past.arrays, strict=True):
                    ours[r, :, : held[r]] = theirs[r, :, length - held[r] :]
        feeds = self.lengths(held, fed)
        feeds["input_ids"] = ids.astype(self.ids_dtype, copy=False)
        for i in range(self.config.num_layers):
            feeds[f"past_key_values.{i}.key"] = compact.keys[i]
            feeds[f"past_key_values.{i}.value"] = compact.values[i]
        logits, *arrays = self.session.run(self._outputs, feeds)
        present = Past(tuple(arrays[0::2]), tuple(arrays[1::2]))
        if dense:
            return StepOutput(logits, present)
        out_logits = np.zeros((batch, new, logits.shape[-1]), dtype=logits.dtype)
        out = past.zeros(batch, length + new)
        for r in range(batch):
            out_logits[r, new - fed[r] :] = logits[r, : fed[r]]
            n = held[r] + fed[r]
            for ours, theirs in zip(out.arrays, present.arrays, strict=True):
                ours[r, :, length + new - n :] = theirs[r, :, :n]
        return StepOutput(out_logits, out)

    def run(self, past: Past, rows: int, logits: Array | None = None) -> SlotRun:
        """The decode bound to the first `rows` rows of `past`'s buffers (see `SlotRun`)."""
        return SlotRun(self, past, rows, logits)

    def logits_for(self, rows: int) -> Array | None:
        """An array for the logits of runs of up to `rows` rows, [rows, 1, vocab], that
        a batch's runs share (`SlotRun`); None where the graph does not say its
        vocabulary."""
        if self.logits is None:
            return None
        dtype, vocab = self.logits
        return np.empty((rows, 1, vocab), dtype=dtype)


class SlotRun:
    """A slot-layout graph's decode step, bound once. `past` holds C-contiguous host
    buffers [R >= rows, heads, max_position, head_dim], the same arrays in and out:
    each call gives row r of the first `rows`, which holds `lengths[r]` positions,
    `input_ids[r]` [rows, 1] after them, its new key and value written into the
    buffers at column `lengths[r]`, and returns the logits [rows, 1, vocab]. Binding
    the buffers costs a good part of a small model's step (bench/offline_generate.py
    shows it), so a batch keeps one `SlotRun` while its rows and buffers stay; each
    step writes the small inputs (ids, lengths) into arrays bound with them. The
    logits come back in an array bound once too (the first `rows` rows of `logits`,
    `SlotGraph.logits_for`, which runs of other row counts may share, or one of its
    own): a step's logits are valid until the next step of a run bound to the same
    array (a caller that keeps them longer copies them)."""

    def __init__(
        self, graph: SlotGraph, past: Past, rows: int, logits: Array | None = None
    ) -> None:
        self.session = graph.session
        self.rows = rows
        self._graph = graph
        binding = self.session.io_binding()
        # The small inputs too are bound once where their shapes stay (the ids, and the
        # lengths as seqlens_k and total_sequence_length; an attention_mask grows with
        # the longest row): each step writes them in place.
        self._ids = np.zeros((rows, 1), dtype=graph.ids_dtype)
        _bind(binding, "input_ids", self._ids)
        self._lengths: tuple[Array, Array] | None = None
        if graph.mask_dtype is None:
            self._lengths = (np.zeros(rows, dtype=np.int32), np.zeros((), dtype=np.int32))
            _bind(binding, "seqlens_k", self._lengths[0])
            _bind(binding, "total_sequence_length", self._lengths[1])
        self._logits: Array | None = None
        if graph.logits is None:
            binding.bind_output("logits")
        else:
            if logits is None:
                logits = graph.logits_for(rows)
            assert logits is not None
            dtype, vocab = graph.logits
            if logits.dtype != dtype or logits.shape[1:] != (1, vocab) or len(logits) < rows:
                raise ValueError(f"slot logits must be {dtype} [>= {rows}, 1, {vocab}]")
            if not logits.flags.c_contiguous:
                raise ValueError("slot logits must be a C-contiguous array")
            self._logits = logits[:rows]
            _bind_output(binding, "logits", self._logits)
        shape = [rows, *past.keys[0].shape[1:]]
        for i in range(graph.config.num_layers):
            for kind, buffer in (("key", past.keys[i]), ("value", past.values[i])):
                if not buffer.flags.c_contiguous or buffer.dtype != graph.past_dtype:
                    raise ValueError(f"slot buffers must be C-contiguous {graph.past_dtype} arrays")
                at = buffer.ctypes.data
                binding.bind_input(f"past_key_values.{i}.{kind}", "cpu", 0, buffer.dtype, shape, at)
                binding.bind_output(f"present.{i}.{kind}", "cpu", 0, buffer.dtype, shape, at)
        self._binding = binding

    def __call__(self, input_ids: Array, lengths: list[int]) -> Array:
        """`lengths`: a list, whose max is a builtin's (numpy's, of a few numbers, costs
        more Python than the rest of this call)."""
        binding, graph = self._binding, self._graph
        self._ids[...] = input_ids
        if self._lengths is not None:  # each row's new position is its count so far
            seqlens, total = self._lengths
            seqlens[...] = lengths
            total[...] = max(lengths) + 1
        else:
            held = np.asarray(lengths)
            for name, array in graph.lengths(held, np.ones_like(held)).items():
                binding.bind_cpu_input(name, array)
        self.session.run_with_iobinding(binding)
        if self._logits is None:
            # get_outputs() wraps every output, the cache's buffers too, in objects of
            # its own: only where the logits' shape is not known, to bind them once.
            found: Array = binding.get_outputs()[0].numpy()
            return found
        return self._logits


def _bind(binding: ort.IOBinding, name: str, array: Array) -> None:
    binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def _bind_output(binding: ort.IOBinding, name: str, array: Array) -> None:
    binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
