"""A causal decoder with a KV cache: the Hugging Face/Optimum ONNX signature.

Inputs: `input_ids` [B, T], `attention_mask` [B, P+T], `position_ids` [B, T] (if
the model has it), `past_key_values.N.key|value` [B, H, P, D]. Outputs: `logits`
[B, T, V], `present.N.key|value` [B, H, P+T, D]. `Decoder.step` runs one step of
that over a batch; `Decoder.generate` is the simple single-sequence loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from lanes.errors import InvalidInput
from lanes.runtime import Runtime, describe
from lanes.spec import ModelSpec
from lanes.tasks.base import encode, load_tokenizer
from lanes.tasks.decoder_config import DecoderConfig, read_config
from lanes.tasks.sampling import SamplingParams, generator, sample

Array = np.ndarray[Any, Any]
FinishReason = Literal["stop", "length"]

__all__ = ["Completion", "Decoder", "DecoderConfig", "Past", "StepOutput", "read_config"]


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
