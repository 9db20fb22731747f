"""A causal decoder with a KV cache: the Hugging Face/Optimum ONNX signature.

Inputs: `input_ids` [B, T], `attention_mask` [B, P+T], `position_ids` [B, T] (if
the model has it), `past_key_values.N.key|value` [B, H, P, D]. Outputs: `logits`
[B, T, V], `present.N.key|value` [B, H, P+T, D]. `Decoder.step` runs one step of
that over a batch on numpy arrays; `Decoder.step_bound` runs it with IO binding on a
`DevicePast` that stays on the session's device (lanes/tasks/device_past.py), only
the logits coming back to the host. `Decoder.generate` is the simple
single-sequence loop, on the bound path when the decoder `binds`.

A graph with the slot layout (`DecoderConfig.kv_layout`) gets the same signature
from `SlotGraph` (lanes/tasks/slot_graph.py); its batch's decode runs a `SlotRun`
(`Decoder.slot_run`) on buffers the step writes in place.
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
from lanes.generation.logprobs import TokenLogprob
from lanes.generation.usage import completion_tokens
from lanes.runtime import Runtime, describe
from lanes.spec import ModelSpec
from lanes.tasks.base import encode, load_tokenizer
from lanes.tasks.decoder_config import DecoderConfig, read_config
from lanes.tasks.device_past import DevicePast, PastRows, RowRef
from lanes.tasks.past import Past, StepOutput
from lanes.tasks.sampling import SamplingParams, generator, sample
from lanes.tasks.slot_graph import SlotGraph, SlotRun

Array = np.ndarray[Any, Any]
FinishReason = Literal["stop", "length"]

__all__ = [
    "BoundStep",
    "Completion",
    "Decoder",
    "DecoderConfig",
    "DevicePast",
    "RowRef",
    "read_config",
]


@dataclass(frozen=True)
class BoundStep:
    logits: Array  # [batch, new tokens, vocab], on the host
    present: DevicePast  # the cache including the new tokens, on the session's device


@dataclass(frozen=True)
class Completion:
    text: str  # decoded, without special tokens, cut before a stop string
    tokens: list[int]  # generated ids shown (no eos, no stop token)
    finish_reason: FinishReason
    prompt_tokens: int = 0
    # One per token made where the request asked (GenerateRequest.top_logprobs), else
    # None: `tokens`' and then `stop_token`'s, as many as completion_tokens counts.
    logprobs: list[TokenLogprob] | None = None
    # Its prompt's tokens after the first, scored, where the request asked
    # (GenerateRequest.prompt_logprobs), else None.
    prompt_logprobs: list[TokenLogprob] | None = None
    stop_token: int | None = None  # the eos or stop token that ended it (Seq's)

    @property
    def completion_tokens(self) -> int:
        """usage.completion_tokens: its tokens and the stop token that ended it."""
        return completion_tokens(len(self.tokens), self.stop_token)


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
                "a decoder that keeps its cache in slots (it attends with GroupQueryAttention) runs on the "
                "CPU provider only for now; on a GPU serve its Optimum export "
                "(past_key_values + attention_mask), which decodes with IO binding"
            )
        self._rows: PastRows | None = None
        self._rows_lock = threading.Lock()
        inputs = describe(session.get_inputs())
        self._ids_dtype = inputs["input_ids"].dtype or np.dtype(np.int64)
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
        # Named once: a step's feeds are built every step.
        self._keys = [f"past_key_values.{i}.key" for i in layers]
        self._values = [f"past_key_values.{i}.value" for i in layers]
        self._slots = (
            SlotGraph(session, config, self._ids_dtype, self._past_dtype, self._outputs)
            if config.kv_layout == "slots"
            else None
        )

    @property
    def slots(self) -> bool:
        """Whether the graph keeps its cache in slots (see lanes/tasks/slot_graph.py)."""
        return self._slots is not None

    @property
    def position_bytes(self) -> int:
        """Bytes one cached position takes: every layer's key and value."""
        c = self.config
        return c.num_layers * 2 * c.num_heads * c.head_dim * self._past_dtype.itemsize

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
        if self._slots is not None:
            return self._slots.step(input_ids, attention_mask, past)
        feeds = self._feeds(input_ids, attention_mask, position_ids)
        feeds.update(zip(self._keys, past.keys, strict=True))
        feeds.update(zip(self._values, past.values, strict=True))
        logits, *present = self.session.run(self._outputs, feeds)
        return StepOutput(logits, Past(tuple(present[0::2]), tuple(present[1::2])))

    def step_slots(self, input_ids: Array, lengths: list[int], past: Past, rows: int) -> Array:
        """One decode step of a slot-layout graph in place (see `SlotRun`): the logits
        [rows, 1, vocab]."""
        return self.slot_run(past, rows)(input_ids, lengths)

    def slot_run(self, past: Past, rows: int, logits: Array | None = None) -> SlotRun:
        """The decode of a slot-layout graph bound to the first `rows` rows of `past`'s
        buffers, to run once per step while they stay, its logits into the first rows
        of `logits` where given (`slot_logits`; see `SlotRun`)."""
        if self._slots is None:
            raise ValueError("slot_run: this decoder keeps its cache concatenated, not in slots")
        return self._slots.run(past, rows, logits)

    def slot_logits(self, rows: int) -> Array | None:
        """An array that slot runs of up to `rows` rows may share for their logits
        (`SlotGraph.logits_for`)."""
        if self._slots is None:
            raise ValueError("slot_logits: this decoder keeps its cache concatenated, not in slots")
        return self._slots.logits_for(rows)

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
            binding.bind_ortvalue_input(self._keys[i], past.keys[i])
            binding.bind_ortvalue_input(self._values[i], past.values[i])
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

    def encode(self, prompt: str, max_new_tokens: int | None = None) -> list[int]:
        """Token ids of `prompt` (after bos, when lanes adds it and the tokenizer did
        not); `InvalidInput` (about `prompt`) when there are none, when the
        tokenizer cannot encode it, or when they leave no room in the context for
        `max_new_tokens` more (None: for one)."""
        ids = encode(self.tokenizer, prompt, "prompt")
        bos = self.config.bos_token_id
        if self.config.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        if not ids:
            detail = "expected text with at least one token, found none"
            raise InvalidInput.field("prompt", detail, "invalid_value")
        self.check_context(len(ids), max_new_tokens)
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
                return Completion(text, tokens, "stop", n_prompt, stop_token=token)
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


def _ortvalue(array: Array, where: Placement) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(
        np.ascontiguousarray(array), where.device_type, where.device_id
    )


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None
