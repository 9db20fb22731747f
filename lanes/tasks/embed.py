"""embed: text -> one L2-normalised float32 vector (mean of the token states).

The model is an encoder with `input_ids` and `attention_mask` (and, if it has it,
`token_type_ids`, fed zeros). Its `last_hidden_state` (else its first output) is
mean-pooled over the attention mask; an output that is already [batch, dim] is
taken as pooled.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from lanes.binding import run
from lanes.errors import InvalidInput, ModelError
from lanes.runtime import Runtime, check_io, describe
from lanes.spec import ModelSpec, TaskName, Workload
from lanes.tasks.base import check_count, encode, load_tokenizer
from lanes.tasks.decoder_config import PAST_INPUT
from lanes.tasks.handler import NO_HANDLER, Handler
from lanes.tasks.session_slot import SessionSlot, SlotSession
from lanes.tasks.wordpiece import WordPiece
from lanes.validation import describe as describe_value

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EmbedItem:
    """One text, tokenized: ids with the tokenizer's special tokens, within max_length."""

    ids: npt.NDArray[np.int64]
    n_tokens: int  # for OpenAI `usage.prompt_tokens`


class EmbedTask(SlotSession):
    """An encoder workload. See the module docstring for the model it expects."""

    kind: TaskName = "embed"

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
        self.tokenizer = load_tokenizer(model, "embed")
        # Encode one item at a time, unpadded: `run` pads each batch to its own longest.
        self.tokenizer.no_padding()
        self.max_length = model.max_length
        # Longer text is refused unless the workload asks for it to be cut.
        self.truncate = workload.truncate
        if self.truncate:
            self.tokenizer.enable_truncation(max_length=model.max_length)
        else:
            self.tokenizer.no_truncation()
        self.vocab_size = self.tokenizer.get_vocab_size()
        self._wordpiece = WordPiece.of(self.tokenizer)  # the same ids, faster, where it applies
        self.slot = SessionSlot.of(runtime, model, workload, backfilled)
        where = str(model.path)
        check_io(self.session, where=where, task="embed", inputs=("input_ids", "attention_mask"))
        inputs = describe(self.session.get_inputs())
        check_fed(inputs, where)
        outputs = describe(self.session.get_outputs())
        self._ids_dtype = inputs["input_ids"].dtype or np.dtype(np.int64)
        self._mask_dtype = inputs["attention_mask"].dtype or np.dtype(np.int64)
        self._token_types = "token_type_ids" in inputs
        self._output = (
            "last_hidden_state" if "last_hidden_state" in outputs else next(iter(outputs))
        )
        self._pad_id = _pad_id(self.tokenizer)
        self.dimensions = _dimensions(outputs[self._output].shape) or self._measured_dimensions()

    def prepare(self, item: Any) -> EmbedItem:
        """A non-empty str (after the handler's `pre`) -> its token ids; a list of token
        ids (the model's own, special tokens included, as a client's tokenizer made them)
        is taken as it is. Raises `InvalidInput` (about `input`) otherwise, and for more
        than `max_length` tokens unless the workload truncates."""
        return self.check(self.handler.before(item))

    def check(self, text: Any) -> EmbedItem:
        """`prepare` without the handler's `pre`."""
        if isinstance(text, list):
            return self._ids(text)
        if not isinstance(text, str):
            found = describe_value(text)
            raise InvalidInput.field("input", f"expected a string, found {found}", "invalid_type")
        if not text.strip():
            found = "only whitespace" if text else "an empty one"
            detail = f"expected a non-empty string, found {found}"
            raise InvalidInput.field("input", detail, "invalid_value")
        found_ids = self._wordpiece.encode(text) if self._wordpiece else None
        ids = np.asarray(found_ids or encode(self.tokenizer, text), dtype=np.int64)
        if len(ids) == 0:
            detail = "the tokenizer found no tokens in the text"
            raise InvalidInput.field("input", detail, "invalid_value")
        return self._within_length(ids)

    def _ids(self, ids: list[Any]) -> EmbedItem:
        for i, token in enumerate(ids):
            if not isinstance(token, int) or isinstance(token, bool):
                detail = f"expected token ids (integers), found {describe_value(token)} at [{i}]"
                raise InvalidInput.field("input", detail, "invalid_type")
            if not 0 <= token < self.vocab_size:
                detail = (
                    f"token id {token} at [{i}] is outside the model's vocabulary "
                    f"(0 to {self.vocab_size - 1})"
                )
                raise InvalidInput.field("input", detail, "invalid_value")
        if not ids:
            detail = "expected at least one token id, found none"
            raise InvalidInput.field("input", detail, "empty_array")
        return self._within_length(np.asarray(ids, dtype=np.int64))

    def _within_length(self, ids: npt.NDArray[np.int64]) -> EmbedItem:
        if len(ids) > self.max_length:
            if not self.truncate:
                raise InvalidInput.field(
                    "input",
                    f"this model's maximum context length is {self.max_length} tokens, but "
                    f"the input has {len(ids)}; send a shorter one (or declare "
                    "`truncate: true` on the workload to cut it)",
                    "context_length_exceeded",
                )
            ids = ids[: self.max_length]  # token ids given as they are: text was cut already
        return EmbedItem(ids, len(ids))

    def run(self, batch: Sequence[EmbedItem]) -> list[Any]:
        """One vector per item (or the handler's `post` of it)."""
        outputs = [self.handler.after(v) for v in self.vectors(batch)]
        check_count(self.name, outputs, batch)
        return outputs

    def vectors(self, batch: Sequence[EmbedItem], options: ort.RunOptions | None = None) -> Vector:
        """[len(batch), dim]: the model run behind `run`, without the handler (`options`:
        the run's, see lanes.binding.run)."""
        if not batch:
            return np.zeros((0, 0), dtype=np.float32)
        lengths = np.fromiter((item.n_tokens for item in batch), np.int64, len(batch))
        width = int(lengths.max())
        mask = np.arange(width) < lengths[:, None]  # [B, T] True on real tokens
        ids = np.full((len(batch), width), self._pad_id, dtype=self._ids_dtype)
        # Row-major order of the True cells is exactly the items' tokens, concatenated.
        ids[mask] = np.concatenate([item.ids for item in batch])
        feeds: dict[str, np.ndarray[Any, Any]] = {
            "input_ids": ids,
            "attention_mask": mask.astype(self._mask_dtype),
        }
        if self._token_types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = run(self.session, [self._output], feeds, self.placement, options)
        return _pool(np.asarray(hidden, dtype=np.float32), mask, self.name)

    def warm_up(self) -> None:
        self.vectors([self._warm_up_item()])

    def _warm_up_item(self) -> EmbedItem:
        # Not every tokenizer can encode any text (a WordLevel one without an unknown
        # token): then one pad token warms the session up as well.
        try:
            ids = encode(self.tokenizer, "warm up")
        except InvalidInput:
            ids = []
        ids = ids or [self._pad_id]
        return EmbedItem(np.asarray(ids, dtype=np.int64), len(ids))

    def _measured_dimensions(self) -> int:
        return int(self.vectors([self._warm_up_item()]).shape[1])


# What `vectors` feeds; `token_type_ids` only where the model has it.
FED = ("input_ids", "attention_mask", "token_type_ids")


def check_fed(inputs: Collection[str], where: str) -> None:
    """`ModelError` when the model requires an input `vectors` does not feed: it would
    fail on every request, so it fails at load instead, naming the task that fits.
    (onnxruntime lists required inputs only: one with a default initializer is absent.)
    `lanes validate` runs it on the graph's inputs alone (lanes.specrules)."""
    unfed = [n for n in inputs if n not in FED and not PAST_INPUT.match(n)]
    past = [n for n in inputs if PAST_INPUT.match(n)]
    if len(past) > 2:  # a real decoder has dozens: the first, the last and the count
        unfed.append(f"{past[0]} ... {past[-1]} ({len(past)} inputs)")
    else:
        unfed += past
    if not unfed:
        return
    if past:
        fits = (
            "it takes past_key_values inputs, so it is a decoder: declare `task: generate` "
            "on the workload (or export an encoder for embed)"
        )
    else:
        fits = "declare `task: infer` on the workload to feed every input yourself"
    raise ModelError(
        f"model {where} cannot serve task 'embed': embed feeds {', '.join(FED)} only, "
        f"but the model also requires {', '.join(unfed)}; {fits}"
    )


def _dimensions(shape: Sequence[Any]) -> int | None:
    """The vector size, when the model's output shape states it."""
    last = shape[-1] if shape else None
    return last if isinstance(last, int) and last > 0 else None


def _pool(hidden: npt.NDArray[np.float32], mask: npt.NDArray[np.bool_], name: str) -> Vector:
    """Masked mean over tokens of [B, T, H] (or [B, H] as is), then L2-normalise rows."""
    if hidden.ndim == 3:
        weights = mask.astype(np.float32)
        # [B, 1, T] @ [B, T, H]: a batched BLAS call instead of a [B, T, H] temporary.
        summed = np.matmul(weights[:, None, :], hidden)[:, 0, :]
        pooled = summed / np.maximum(weights.sum(axis=1, keepdims=True), 1e-9)
    elif hidden.ndim == 2:
        pooled = hidden
    else:
        raise ModelError(
            f"workload {name!r}: the encoder's output has shape {hidden.shape}; "
            "expected [batch, tokens, dim] or [batch, dim]"
        )
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    # Same floor as torch.nn.functional.normalize, so vectors match sentence-transformers.
    result: Vector = (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return result


def _pad_id(tokenizer: Any) -> int:
    """The tokenizer's own pad id when it declares one; the mask makes any id harmless."""
    for token in ("[PAD]", "<pad>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0
