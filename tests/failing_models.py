"""Tiny real models that fail at run time on one kind of input, as onnxruntime fails
on a Gather index out of range: a model whose tables are shorter than what its
tokenizer or its config lets through. Every other input runs, with known outputs.

- `positional_decoder`: flows_fixtures' bigram decoder (greedy "a" -> "b c d") plus a
  position table of POSITIONS rows (all zeros, so it changes no logit): a run that
  feeds a position past it fails. Its config.json names no context length, so lanes
  cannot refuse such a prompt before it runs.
- `short_embed_model`: flows_fixtures' embed model whose table lacks its last word
  (BAD_WORD): a text holding it fails.
- `lookup_model` (infer): `y = T[i]` over a table of LOOKUP_ROWS rows; an index past
  them fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.flows_fixtures import DECODER_WORDS, WORDS, decoder_model, embed_model

POSITIONS = 8
BAD_WORD = WORDS[-1]
LOOKUP_ROWS = 4


def positional_decoder(folder: Path) -> tuple[Path, Path]:
    """The bigram decoder, whose logits also add P[position_ids] (P: zeros, POSITIONS
    rows): a prompt of more than POSITIONS tokens fails in its prefill, one of
    POSITIONS - 1 at its second decode step."""
    model_path, tokenizer = decoder_model(folder)
    model = onnx.load(str(model_path))
    graph = model.graph
    (gather,) = [n for n in graph.node if n.output[0] == "logits"]
    gather.output[0] = "bigram"
    table = np.zeros((POSITIONS, len(DECODER_WORDS)), dtype=np.float32)
    graph.initializer.append(numpy_helper.from_array(table, "P"))
    graph.node.extend(
        [
            helper.make_node("Gather", ["P", "position_ids"], ["by_position"]),
            helper.make_node("Add", ["bigram", "by_position"], ["logits"]),
        ]
    )
    onnx.save(model, str(model_path))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    del config["max_position"]  # what the model can see is nowhere said
    config_path.write_text(json.dumps(config))
    return model_path, tokenizer


def short_embed_model(folder: Path) -> tuple[Path, Path]:
    """The embed model with its table one row short: BAD_WORD's id is past it."""
    model_path, tokenizer = embed_model(folder)
    model = onnx.load(str(model_path))
    (table,) = [t for t in model.graph.initializer if t.name == "table"]
    table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table)[:-1], "table"))
    onnx.save(model, str(model_path))
    return model_path, tokenizer


def lookup_model(folder: Path) -> Path:
    """i int64 [batch, 1] -> y float32 [batch, 1, 3] = T[i], T of LOOKUP_ROWS rows
    (row k is k, k + 0.5, k + 0.25)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = np.arange(LOOKUP_ROWS, dtype=np.float32)[:, None]
    table = rows + np.array([0.0, 0.5, 0.25], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["T", "i"], ["y"])],
        "lookup",
        [helper.make_tensor_value_info("i", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 3])],
        initializer=[numpy_helper.from_array(table, "T")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"
