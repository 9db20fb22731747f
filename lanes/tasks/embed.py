"""embed: text -> one L2-normalised float32 vector (mean of the token states).

The model is an encoder with `input_ids` and `attention_mask` (and, if it has it,
`token_type_ids`, fed zeros). Its `last_hidden_state` (else its first output) is
mean-pooled over the attention mask; an output that is already [batch, dim] is
taken as pooled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from lanes.errors import InvalidInput, ModelError
from lanes.runtime import Runtime, check_io, describe
from lanes.spec import ModelSpec, TaskName, Workload
from lanes.tasks.base import check_count, load_tokenizer
from lanes.tasks.handler import NO_HANDLER, Handler
from lanes.tasks.wordpiece import WordPiece

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class EmbedItem:
    """One text, tokenized: ids with the tokenizer's special tokens, truncated."""

    ids: npt.NDArray[np.int64]
    n_tokens: int  # for OpenAI `usage.prompt_tokens`


class EmbedTask:
    """An encoder workload. See the module docstring for the model it expects."""

    kind: TaskName = "embed"

    def __init__(
        self,
        name: str,
        workload: Workload,
        model: ModelSpec,
        runtime: Runtime,
        handler: Handler = NO_HANDLER,
    ) -> None:
        self.name = name
        self.workload = workload
        self.handler = handler
        self.tokenizer = load_tokenizer(model, "embed")
        # Encode one item at a time, unpadded: `run` pads each batch to its own longest.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=model.max_length)
        self._wordpiece = WordPiece.of(self.tokenizer)  # the same ids, faster, where it applies
        self.session = runtime.session(model)
        where = str(model.path)
        check_io(self.session, where=where, task="embed", inputs=("input_ids", "attention_mask"))
        inputs = describe(self.session.get_inputs())
        outputs = describe(self.session.get_outputs())
        self._ids_dtype = inputs["input_ids"].dtype or np.dtype(np.int64)
        self._mask_dtype = inputs["attention_mask"].dtype or np.dtype(np.int64)
        self._token_types = "token_type_ids" in inputs
        self._output = (
            "last_hidden_state" if "last_hidden_state" in outputs else next(iter(outputs))
        )
        self._pad_id = _pad_id(self.tokenizer)

    def prepare(self, item: Any) -> EmbedItem:
        """A non-empty str (after the handler's `pre`) -> its token ids. Raises
        `InvalidInput` otherwise."""
        return self.check(self.handler.before(item))

    def check(self, text: Any) -> EmbedItem:
        """`prepare` without the handler's `pre`."""
        if not isinstance(text, str):
            raise InvalidInput(f"input: expected a string, found {type(text).__name__}")
        if not text.strip():
            raise InvalidInput("input: expected a non-empty string, found an empty one")
        found = self._wordpiece.encode(text) if self._wordpiece else None
        ids = np.asarray(found or self.tokenizer.encode(text).ids, dtype=np.int64)
        if len(ids) == 0:
            raise InvalidInput("input: the tokenizer found no tokens in the text")
        return EmbedItem(ids, len(ids))

    def run(self, batch: Sequence[EmbedItem]) -> list[Any]:
        """One vector per item (or the handler's `post` of it)."""
        outputs = [self.handler.after(v) for v in self.vectors(batch)]
        check_count(self.name, outputs, batch)
        return outputs

    def vectors(self, batch: Sequence[EmbedItem]) -> Vector:
        """[len(batch), dim]: the model run behind `run`, without the handler."""
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
        (hidden,) = self.session.run([self._output], feeds)
        return _pool(np.asarray(hidden, dtype=np.float32), mask, self.name)

    def warm_up(self) -> None:
        ids = np.asarray(self.tokenizer.encode("warm up").ids, dtype=np.int64)
        self.vectors([EmbedItem(ids, len(ids))])


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
