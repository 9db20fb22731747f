"""A causal decoder with a KV cache: the Hugging Face/Optimum ONNX signature.

Inputs: `input_ids` [B, T], `attention_mask` [B, P+T], `position_ids` [B, T] (if
the model has it), `past_key_values.N.key|value` [B, H, P, D]. Outputs: `logits`
[B, T, V], `present.N.key|value` [B, H, P+T, D]. `Decoder.step` runs one step of
that over a batch on numpy arrays; `Decoder.step_bound` runs it with IO binding on a
`DevicePast` that stays on the session's device (lanes/tasks/device_past.py), only
the logits coming back to the host. `Decoder.generate` is the simple
single-sequence loop, on the bound path when the decoder `binds`.

A graph with the slot layout (`DecoderConfig.kv_layout`, lanes/demo/slots.py) takes
`seqlens_k` and `total_sequence_length` instead of `attention_mask` and keeps each
row's past at the front of a buffer as long as the context. `Decoder.step` gives it
the signature above all the same (each row's real columns moved to the front, run,
and moved back), so prefills and single sequences need nothing else; the batch's
decode runs `Decoder.step_slots` on buffers the step writes in place
(lanes/generation/slots.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from lanes.binding import Placement, bind_inputs
from lanes.errors import InvalidInput, ModelError
from lanes.runtime import Runtime, describe
from lanes.spec import ModelSpec
from lanes.tasks.base import encode, load_tokenizer
from lanes.tasks.decoder_config import DecoderConfig, read_config
from lanes.tasks.device_past import DevicePast, PastRows, RowRef
from lanes.tasks.sampling import SamplingParams, generator, sample

Array = np.ndarray[Any, Any]
FinishReason = Literal["stop", "length"]

__all__ = [
    "BoundStep",
    "Completion",
    "Decoder",
    "DecoderConfig",
    "DevicePast",
    "Past",
    "RowRef",
    "SlotRun",
    "StepOutput",
    "read_config",
]


@dataclass(frozen=True)
class Past:
    """The KV cache: per layer, keys and values shaped [batch, heads, length, head_dim]."""

    keys: tuple[Array, ...]
    values: tuple[Array, ...]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])


@dataclass(frozen=True)
class StepOutput:
    logits: Array  # [batch, new tokens, vocab]
    present: Past  # the cache including the new tokens


@dataclass(frozen=True)
class BoundStep:
    logits: Array  # [batch, new tokens, vocab], on the host
    present: DevicePast  # the cache including the new tokens, on the session's device


@dataclass(frozen=True)
class Completion:
    text: str  # decoded, without special tokens, cut before a stop string
    tokens: list[int]  # generated ids (no eos); len() is usage.completion_tokens
    finish_reason: FinishReason
    prompt_tokens: int = 0


class Decoder:
    """One decoder session and its tokenizer. `step`, `step_bound`, `generate` and the
    device past's helpers are thread-safe.

    `placement` is where the session runs, hence where a `DevicePast` lives; `binds`
    (the runtime's `io_binding` choice) makes `generate` run on the bound path.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        tokenizer: Tokenizer,
        config: DecoderConfig,
        binds: bool = False,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.config = config
        # The bound path feeds attention_mask and a device past; a slot-layout graph's
        # decode binds its own host buffers (step_slots).
        self.binds = binds and config.kv_layout == "concat"
        self.placement = Placement.of(session)
        if config.kv_layout == "slots" and self.placement.on_gpu:
            # Its buffers are host arrays: on a GPU every step would copy them whole
            # to the device and back, far slower than the concat layout's bound path.
            raise ModelError(
                "a decoder that keeps its cache in slots (it takes seqlens_k) runs on the "
                "CPU provider only for now; on a GPU serve its Optimum export "
                "(past_key_values + attention_mask), which decodes with IO binding"
            )
        self._rows: PastRows | None = None
        self._rows_lock = threading.Lock()
        inputs = describe(session.get_inputs())
        self._ids_dtype = inputs["input_ids"].dtype or np.dtype(np.int64)
        self.slots = config.kv_layout == "slots"
        mask = inputs.get("attention_mask")
        self._mask_dtype = (mask.dtype if mask else None) or np.dtype(np.int64)
        positions = inputs.get("position_ids")
        self._positions_dtype = (positions.dtype if positions else None) or np.dtype(np.int64)
        self._positions = positions is not None
        self._past_dtype = inputs["past_key_values.0.key"].dtype or np.dtype(np.float32)
        layers = range(config.num_layers)
        self._outputs = ["logits"] + [
            f"present.{i}.{kv}" for i in layers for kv in ("key", "value")
        ]

    @classmethod
    def load(cls, model: ModelSpec, runtime: Runtime) -> Decoder:
        """Load the model, its tokenizer and the config files beside them (see
        lanes/tasks/decoder_config.py).

        The context length comes from config.json (`max_position_embeddings`,
        `n_positions` or `max_position`), else the spec's `max_length` when it is
        declared, else a fixed length of the graph's `attention_mask`, else none."""
        session = runtime.session(model)
        tokenizer = load_tokenizer(model, "generate")
        tokenizer.no_padding()
        tokenizer.no_truncation()
        config = read_config(session, model.path, tokenizer, model.tokenizer)
        if config.max_position is None:
            declared = model.max_length if "max_length" in model.model_fields_set else None
            mask = describe(session.get_inputs())["attention_mask"].shape
            fixed = mask[1] if len(mask) == 2 and isinstance(mask[1], int) else None
            config = dataclasses.replace(config, max_position=declared or fixed)
        return cls(session, tokenizer, config, binds=runtime.binds(session))

    def empty_past(self, batch: int) -> Past:
        c = self.config
        empty = np.zeros((batch, c.num_heads, 0, c.head_dim), dtype=self._past_dtype)
        return Past((empty,) * c.num_layers, (empty,) * c.num_layers)

    def step(
        self, input_ids: Array, attention_mask: Array, position_ids: Array, past: Past
    ) -> StepOutput:
        """One forward pass over [B, T] new tokens on top of `past` (never recomputed).

        `attention_mask` covers past and new tokens: [B, past.length + T].
        """
        self._check_step(input_ids, attention_mask, past.length, past.batch)
        if self.slots:
            return self._slot_step(input_ids, attention_mask, past)
        feeds = self._feeds(input_ids, attention_mask, position_ids)
        for i in range(self.config.num_layers):
            feeds[f"past_key_values.{i}.key"] = past.keys[i]
            feeds[f"past_key_values.{i}.value"] = past.values[i]
        logits, *present = self.session.run(self._outputs, feeds)
        return StepOutput(logits, Past(tuple(present[0::2]), tuple(present[1::2])))

    def _slot_step(self, input_ids: Array, attention_mask: Array, past: Past) -> StepOutput:
        """`step` on a slot-layout graph. Each row's real columns (its mask's ones, after
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
                self._slot_step(input_ids[r : r + 1], attention_mask[r : r + 1], _rows(past, r))
                for r in range(batch)
            ]
            return StepOutput(
                np.concatenate([o.logits for o in parts]),
                _concatenated([o.present for o in parts]),
            )
        dense = bool((held == length).all() and (fed == new).all())
        if dense:
            ids, compact = input_ids, past
        else:
            ids = np.full((batch, wide), self.config.pad_token_id, dtype=np.int64)
            compact = _empty_like(past, batch, deep)
            for r in range(batch):
                ids[r, : fed[r]] = input_ids[r, new - fed[r] :]
                for ours, theirs in zip(_arrays(compact), _arrays(past), strict=True):
                    ours[r, :, : held[r]] = theirs[r, :, length - held[r] :]
        feeds: dict[str, Array] = {
            "input_ids": ids.astype(self._ids_dtype, copy=False),
            "seqlens_k": (held + fed - 1).astype(np.int32),
            "total_sequence_length": np.asarray(int((held + fed).max()), dtype=np.int32),
        }
        for i in range(self.config.num_layers):
            feeds[f"past_key_values.{i}.key"] = compact.keys[i]
            feeds[f"past_key_values.{i}.value"] = compact.values[i]
        logits, *arrays = self.session.run(self._outputs, feeds)
        present = Past(tuple(arrays[0::2]), tuple(arrays[1::2]))
        if dense:
            return StepOutput(logits, present)
        out_logits = np.zeros((batch, new, logits.shape[-1]), dtype=logits.dtype)
        out = _empty_like(past, batch, length + new)
        for r in range(batch):
            out_logits[r, new - fed[r] :] = logits[r, : fed[r]]
            n = held[r] + fed[r]
            for ours, theirs in zip(_arrays(out), _arrays(present), strict=True):
                ours[r, :, length + new - n :] = theirs[r, :, :n]
        return StepOutput(out_logits, out)

    def step_slots(self, input_ids: Array, lengths: Array, past: Past, rows: int) -> Array:
        """One decode step of a slot-layout graph in place (see `SlotRun`): the logits
        [rows, 1, vocab]."""
        return self.slot_run(past, rows)(input_ids, lengths)

    def slot_run(self, past: Past, rows: int) -> SlotRun:
        """The decode of a slot-layout graph bound to the first `rows` rows of `past`'s
        buffers, to run once per step while they stay (see `SlotRun`)."""
        return SlotRun(self, past, rows)

    def empty_device_past(self, batch: int) -> DevicePast:
        """A past of no positions on the session's device, for a prefill."""
        return self.to_device(self.empty_past(batch))

    def to_device(self, past: Past) -> DevicePast:
        """`past` copied to the session's device (on the CPU: wrapped, not copied)."""
        where = self.placement
        return DevicePast(
            tuple(_ortvalue(k, where) for k in past.keys),
            tuple(_ortvalue(v, where) for v in past.values),
        )

    @staticmethod
    def to_host(past: DevicePast) -> Past:
        """`past` copied to numpy arrays."""
        return Past(tuple(k.numpy() for k in past.keys), tuple(v.numpy() for v in past.values))

    def step_bound(
        self, input_ids: Array, attention_mask: Array, position_ids: Array, past: DevicePast
    ) -> BoundStep:
        """`step` with IO binding: `past` is bound in where it lies, the present is
        allocated on the session's device and returned there; only the logits are
        copied to the host. The same numbers as `step` on the same provider."""
        self._check_step(input_ids, attention_mask, past.length, past.batch)
        binding = self.session.io_binding()
        bind_inputs(binding, self._feeds(input_ids, attention_mask, position_ids))
        for i in range(self.config.num_layers):
            binding.bind_ortvalue_input(f"past_key_values.{i}.key", past.keys[i])
            binding.bind_ortvalue_input(f"past_key_values.{i}.value", past.values[i])
        where = self.placement
        for name in self._outputs:
            binding.bind_output(name, where.device_type, where.device_id)
        self.session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        return BoundStep(logits.numpy(), DevicePast.of(present[0::2] + present[1::2]))

    def assemble_past(
        self, sources: Sequence[DevicePast], rows: Sequence[RowRef | None], length: int
    ) -> DevicePast:
        """Rows of `sources` rearranged on the device: row i is `rows[i]`'s source row,
        right-aligned to `length` positions (zeros before, or its first positions
        dropped), or zeros for None. See `PastRows.assemble`."""
        return self._past_rows().assemble(sources, rows, length)

    def take_past(self, past: DevicePast, rows: Sequence[int], drop: int = 0) -> DevicePast:
        """`rows` of `past` in that order, without their first `drop` positions, on the
        device."""
        return self._past_rows().take(past, rows, drop)

    def _past_rows(self) -> PastRows:
        with self._rows_lock:
            if self._rows is None:
                providers = self.session.get_providers()
                c = self.config
                self._rows = PastRows(providers, self.placement, c.num_layers, self._past_dtype)
            return self._rows

    def _check_step(self, input_ids: Array, attention_mask: Array, length: int, rows: int) -> None:
        batch, new = input_ids.shape
        if attention_mask.shape != (batch, length + new) or rows != batch:
            raise ValueError(
                f"step: input_ids {input_ids.shape} and a past of length {length} "
                f"(batch {rows}) need attention_mask ({batch}, {length + new}), "
                f"found {attention_mask.shape}"
            )

    def _feeds(
        self, input_ids: Array, attention_mask: Array, position_ids: Array
    ) -> dict[str, Array]:
        feeds: dict[str, Array] = {
            "input_ids": input_ids.astype(self._ids_dtype, copy=False),
            "attention_mask": attention_mask.astype(self._mask_dtype, copy=False),
        }
        if self._positions:
            feeds["position_ids"] = position_ids.astype(self._positions_dtype, copy=False)
        return feeds

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt` (after bos, when lanes adds it and the tokenizer did
        not); `InvalidInput` (about `prompt`) when there are none, when the
        tokenizer cannot encode it, or when they fill the context."""
        ids = encode(self.tokenizer, prompt, "prompt")
        bos = self.config.bos_token_id
        if self.config.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        if not ids:
            detail = "expected text with at least one token, found none"
            raise InvalidInput.field("prompt", detail, "invalid_value")
        self.check_context(len(ids))
        return ids

    def check_context(self, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        """`InvalidInput` (about `prompt`, worded as OpenAI and vLLM word it) when the
        prompt leaves no room in the context, or no room for `max_new_tokens` more."""
        limit = self.config.max_position
        if limit is None:
            return
        wanted = 1 if max_new_tokens is None else max_new_tokens
        if prompt_tokens + wanted <= limit:
            return
        completion = "at least 1" if max_new_tokens is None else str(max_new_tokens)
        raise InvalidInput.field(
            "prompt",
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + wanted} tokens ({prompt_tokens} in the prompt, {completion} "
            "for the completion). Please reduce the length of the prompt or the completion.",
            "context_length_exceeded",
        )

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
    ) -> Completion:
        """Complete `prompt`: prefill once, then one token per step on the KV cache."""
        sampling = SamplingParams(temperature, top_k, top_p)
        return self.complete(self.encode(prompt), max_new_tokens, sampling, stop, seed)

    def complete(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        seed: int | None = None,
    ) -> Completion:
        """`generate` from token ids. Ends at eos or a stop string ("stop"), or at
        `max_new_tokens` or the model's context ("length")."""
        rng = generator(seed)
        n_prompt = len(prompt_ids)
        budget = max_new_tokens
        if self.config.max_position is not None:
            budget = min(budget, self.config.max_position - n_prompt)
        ids = np.asarray([prompt_ids], dtype=np.int64)
        steps = _BoundSteps(self) if self.binds else _HostSteps(self)
        logits = steps.run(ids, np.ones_like(ids), np.arange(n_prompt)[None, :])
        tokens: list[int] = []
        text = ""
        while len(tokens) < budget:
            token = sample(logits[0, -1], sampling, rng)
            if token in self.config.eos_token_ids:
                return Completion(text, tokens, "stop", n_prompt)
            tokens.append(token)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = _first_stop(text, stop)
            if cut is not None:
                return Completion(text[:cut], tokens, "stop", n_prompt)
            if len(tokens) == budget:
                break
            seen = n_prompt + len(tokens)
            logits = steps.run(
                np.asarray([[token]]), np.ones((1, seen), dtype=np.int64), np.asarray([[seen - 1]])
            )
        return Completion(text, tokens, "length", n_prompt)


class SlotRun:
    """A slot-layout graph's decode step, bound once. `past` holds C-contiguous host
    buffers [R >= rows, heads, max_position, head_dim], the same arrays in and out:
    each call gives row r of the first `rows`, which holds `lengths[r]` positions,
    `input_ids[r]` [rows, 1] after them, its new key and value written into the
    buffers at column `lengths[r]`, and returns the logits [rows, 1, vocab]. Binding
    the buffers costs a good part of a small model's step (bench/offline_generate.py
    shows it), so a batch keeps one `SlotRun` while its rows and buffers stay and
    rebinds only the three small inputs."""

    def __init__(self, decoder: Decoder, past: Past, rows: int) -> None:
        self.session = decoder.session
        self.rows = rows
        self._ids_dtype = decoder._ids_dtype
        binding = self.session.io_binding()
        binding.bind_output("logits")
        shape = [rows, *past.keys[0].shape[1:]]
        for i in range(decoder.config.num_layers):
            for kind, buffer in (("key", past.keys[i]), ("value", past.values[i])):
                if not buffer.flags.c_contiguous or buffer.dtype != decoder._past_dtype:
                    raise ValueError(
                        f"slot buffers must be C-contiguous {decoder._past_dtype} arrays"
                    )
                at = buffer.ctypes.data
                binding.bind_input(f"past_key_values.{i}.{kind}", "cpu", 0, buffer.dtype, shape, at)
                binding.bind_output(f"present.{i}.{kind}", "cpu", 0, buffer.dtype, shape, at)
        self._binding = binding

    def __call__(self, input_ids: Array, lengths: Array) -> Array:
        binding = self._binding
        binding.bind_cpu_input("input_ids", input_ids.astype(self._ids_dtype, copy=False))
        binding.bind_cpu_input("seqlens_k", lengths.astype(np.int32, copy=False))
        total = np.asarray(int(lengths.max()) + 1, dtype=np.int32)
        binding.bind_cpu_input("total_sequence_length", total)
        self.session.run_with_iobinding(binding)
        logits: Array = binding.get_outputs()[0].numpy()
        return logits


class _HostSteps:
    """One sequence's steps on numpy past: `run` returns the logits, keeps the past."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.past = decoder.empty_past(1)

    def run(self, ids: Array, mask: Array, positions: Array) -> Array:
        out = self.decoder.step(ids, mask, positions, self.past)
        self.past = out.present
        return out.logits


class _BoundSteps:
    """`_HostSteps` on the bound path: the past stays on the device."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.past = decoder.empty_device_past(1)

    def run(self, ids: Array, mask: Array, positions: Array) -> Array:
        out = self.decoder.step_bound(ids, mask, positions, self.past)
        self.past = out.present
        return out.logits


def _arrays(past: Past) -> tuple[Array, ...]:
    return (*past.keys, *past.values)


def _rows(past: Past, r: int) -> Past:
    return Past(tuple(k[r : r + 1] for k in past.keys), tuple(v[r : r + 1] for v in past.values))


def _concatenated(parts: Sequence[Past]) -> Past:
    keys = zip(*(p.keys for p in parts), strict=True)
    values = zip(*(p.values for p in parts), strict=True)
    return Past(tuple(np.concatenate(k) for k in keys), tuple(np.concatenate(v) for v in values))


def _empty_like(past: Past, batch: int, length: int) -> Past:
    """Zeros shaped like `past`'s arrays, with `batch` rows and `length` positions."""
    _, heads, _, dim = past.keys[0].shape

    def zeros(a: Array) -> Array:
        return np.zeros((batch, heads, length, dim), dtype=a.dtype)

    return Past(tuple(zeros(k) for k in past.keys), tuple(zeros(v) for v in past.values))


def _ortvalue(array: Array, where: Placement) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(
        np.ascontiguousarray(array), where.device_type, where.device_id
    )


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None
