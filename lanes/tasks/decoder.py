"""A causal decoder with a KV cache: the Hugging Face/Optimum ONNX signature.

Inputs: `input_ids` [B, T], `attention_mask` [B, P+T], `position_ids` [B, T] (if
the model has it), `past_key_values.N.key|value` [B, H, P, D]. Outputs: `logits`
[B, T, V], `present.N.key|value` [B, H, P+T, D]. `Decoder.step` runs one step of
that over a batch; `Decoder.generate` is the simple single-sequence loop.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from lanes.errors import InvalidInput, ModelError
from lanes.runtime import Runtime, TensorInfo, check_io, describe
from lanes.spec import ModelSpec
from lanes.tasks.base import encode, load_tokenizer
from lanes.tasks.sampling import SamplingParams, generator, sample

Array = np.ndarray[Any, Any]
FinishReason = Literal["stop", "length"]

_PAST = re.compile(r"^past_key_values\.(\d+)\.key$")


@dataclass(frozen=True)
class DecoderConfig:
    """What the loop needs to know about the model, from its metadata and config.json."""

    num_layers: int
    num_heads: int  # key/value heads (fewer than query heads under GQA)
    head_dim: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None = None  # prepended to prompts that do not start with it
    vocab_size: int | None = None
    max_position: int | None = None  # the context: longest prompt + completion it can see
    chat_template: str | None = None
    chat_generation_prompt: str | None = None


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
class Completion:
    text: str  # decoded, without special tokens, cut before a stop string
    tokens: list[int]  # generated ids (no eos); len() is usage.completion_tokens
    finish_reason: FinishReason
    prompt_tokens: int = 0


class Decoder:
    """One decoder session and its tokenizer. `step` is thread-safe; so is `generate`."""

    def __init__(
        self, session: ort.InferenceSession, tokenizer: Tokenizer, config: DecoderConfig
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.config = config
        inputs = describe(session.get_inputs())
        self._ids_dtype = inputs["input_ids"].dtype or np.dtype(np.int64)
        self._mask_dtype = inputs["attention_mask"].dtype or np.dtype(np.int64)
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
        """Load the model, its tokenizer and config.json (next to the model, if there).

        The context length comes from config.json (`max_position_embeddings`,
        `n_positions` or `max_position`), else the spec's `max_length` when it is
        declared, else a fixed length of the graph's `attention_mask`, else none."""
        session = runtime.session(model)
        tokenizer = load_tokenizer(model, "generate")
        tokenizer.no_padding()
        tokenizer.no_truncation()
        config = read_config(session, model.path, tokenizer)
        if config.max_position is None:
            declared = model.max_length if "max_length" in model.model_fields_set else None
            mask = describe(session.get_inputs())["attention_mask"].shape
            fixed = mask[1] if len(mask) == 2 and isinstance(mask[1], int) else None
            config = dataclasses.replace(config, max_position=declared or fixed)
        return cls(session, tokenizer, config)

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
        batch, new = input_ids.shape
        if attention_mask.shape != (batch, past.length + new) or past.batch != batch:
            raise ValueError(
                f"step: input_ids {input_ids.shape} and a past of length {past.length} "
                f"(batch {past.batch}) need attention_mask ({batch}, {past.length + new}), "
                f"found {attention_mask.shape}"
            )
        feeds: dict[str, Array] = {
            "input_ids": input_ids.astype(self._ids_dtype, copy=False),
            "attention_mask": attention_mask.astype(self._mask_dtype, copy=False),
        }
        if self._positions:
            feeds["position_ids"] = position_ids.astype(self._positions_dtype, copy=False)
        for i in range(self.config.num_layers):
            feeds[f"past_key_values.{i}.key"] = past.keys[i]
            feeds[f"past_key_values.{i}.value"] = past.values[i]
        logits, *present = self.session.run(self._outputs, feeds)
        return StepOutput(logits, Past(tuple(present[0::2]), tuple(present[1::2])))

    def encode(self, prompt: str) -> list[int]:
        """Token ids of `prompt` (after bos, when the model has one and the tokenizer
        does not add it); `InvalidInput` (about `prompt`) when there are none, when the
        tokenizer cannot encode it, or when they fill the context."""
        ids = encode(self.tokenizer, prompt, "prompt")
        bos = self.config.bos_token_id
        if bos is not None and ids[:1] != [bos]:
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
        out = self.step(ids, np.ones_like(ids), np.arange(n_prompt)[None, :], self.empty_past(1))
        tokens: list[int] = []
        text = ""
        while len(tokens) < budget:
            token = sample(out.logits[0, -1], sampling, rng)
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
            out = self.step(
                np.asarray([[token]]),
                np.ones((1, seen), dtype=np.int64),
                np.asarray([[seen - 1]]),
                out.present,
            )
        return Completion(text, tokens, "length", n_prompt)


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None


def read_config(session: ort.InferenceSession, path: Path, tokenizer: Tokenizer) -> DecoderConfig:
    """Layers, heads and head_dim from the past_key_values inputs (config.json fills in
    symbolic dims; a disagreement is a `ModelError`); eos and the rest from config.json."""
    where = str(path)
    inputs = describe(session.get_inputs())
    layers = sorted(int(m.group(1)) for n in inputs if (m := _PAST.match(n)))
    if not layers or layers != list(range(len(layers))):
        raise ModelError(
            f"model {where} cannot serve task 'generate': expected inputs "
            f"past_key_values.0.key, past_key_values.0.value, ...; found {', '.join(inputs)}"
        )
    past_in = [f"past_key_values.{i}.{p}" for i in layers for p in ("key", "value")]
    present = [f"present.{i}.{p}" for i in layers for p in ("key", "value")]
    check_io(
        session,
        where=where,
        task="generate",
        inputs=["input_ids", "attention_mask", *past_in],
        outputs=["logits", *present],
    )
    file = path.parent / "config.json"
    raw: dict[str, Any] = {}
    if file.is_file():
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot read {file}: {err}") from err
    first = inputs["past_key_values.0.key"]
    heads = _dim(first, 1, raw, ("num_heads", "num_key_value_heads", "num_attention_heads"), where)
    head_dim = _dim(first, 3, raw, ("head_dim",), where)
    configured = _int(raw, ("num_layers", "num_hidden_layers"))
    if configured is not None and configured != len(layers):
        raise ModelError(
            f"{file} says num_layers={configured} but model {where} has {len(layers)} "
            "past_key_values layers; rebuild one of them"
        )
    return DecoderConfig(
        num_layers=len(layers),
        num_heads=heads,
        head_dim=head_dim,
        eos_token_ids=_eos(raw, tokenizer),
        bos_token_id=_int(raw, ("bos_token_id",)),
        vocab_size=_int(raw, ("vocab_size",)),
        max_position=_int(raw, ("max_position_embeddings", "n_positions", "max_position")),
        chat_template=_str(raw, "chat_template"),
        chat_generation_prompt=_str(raw, "chat_generation_prompt"),
    )


def _int(raw: dict[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        if isinstance(raw.get(key), int):
            return int(raw[key])
    return None


def _str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    return value if isinstance(value, str) else None


def _dim(info: TensorInfo, axis: int, raw: dict[str, Any], keys: Sequence[str], where: str) -> int:
    from_model = info.shape[axis] if len(info.shape) == 4 else None
    from_config = _int(raw, keys)
    if isinstance(from_model, int):
        if from_config is not None and from_config != from_model:
            raise ModelError(
                f"config.json next to {where} says {keys[0]}={from_config} but input "
                f"{info.name} has {from_model}; rebuild one of them"
            )
        return from_model
    if from_config is None:
        raise ModelError(
            f"model {where}: dim {axis} of {info} is symbolic; put {keys[0]} in a "
            "config.json next to the model"
        )
    return from_config


def _eos(raw: dict[str, Any], tokenizer: Tokenizer) -> frozenset[int]:
    eos = raw.get("eos_token_id")
    if isinstance(eos, int):
        return frozenset({eos})
    if isinstance(eos, list):
        return frozenset(int(e) for e in eos)
    # No config: the usual end-of-text tokens, when the tokenizer has them.
    found = (tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>"))
    return frozenset(i for i in found if i is not None)
