"""read_config: what a decoder's graph and the files beside it say, on tiny graphs built
here (every past dim symbolic unless a test fixes it). The exports of real exporters
are in tests/test_optimum_decoders.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, save_model
from tokenizers import Tokenizer, models, pre_tokenizers

from lanes.errors import ModelError
from lanes.tasks.decoder import DecoderConfig, read_config

F, I64 = TensorProto.FLOAT, TensorProto.INT64
WORDS = ["<pad>", "<s>", "</s>", "a", "b"]


def decoder(
    folder: Path,
    layers: int = 1,
    heads: int | str = "heads",
    head_dim: int | str = "head_dim",
    extra: Sequence[str] = (),
    **files: dict[str, Any],
) -> DecoderConfig:
    """read_config of a graph with the decoder signature (outputs are its inputs passed
    through: nothing runs) and the given JSON files (config=..., generation_config=...,
    tokenizer_config=...) beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    past = ["batch", heads, "past", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", I64, ["batch", "total"]),
        *(helper.make_tensor_value_info(name, I64, ["batch"]) for name in extra),
    ]
    outputs = [helper.make_tensor_value_info("logits", F, ["batch", "seq", len(WORDS)])]
    nodes = [helper.make_node("Gather", ["L", "input_ids"], ["logits"])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", F, past))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", F, past))
            nodes.append(
                helper.make_node(
                    "Identity", [f"past_key_values.{i}.{kind}"], [f"present.{i}.{kind}"]
                )
            )
    logits = numpy_helper.from_array(np.zeros((len(WORDS), len(WORDS)), np.float32), "L")
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, initializer=[logits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    return read_config(session, folder / "model.onnx", tokenizer, folder / "tokenizer.json")


def test_symbolic_dims_come_from_config_json_kv_heads_first(tmp_path: Path) -> None:
    llama = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}
    config = decoder(tmp_path / "gqa", config={**llama, "num_hidden_layers": 1})
    assert (config.num_layers, config.num_heads, config.head_dim) == (1, 2, 8)
    gpt2 = {"n_head": 4, "n_embd": 32, "n_layer": 2, "n_positions": 64}
    config = decoder(tmp_path / "gpt2", layers=2, config=gpt2)
    assert (config.num_layers, config.num_heads, config.head_dim) == (2, 4, 8)
    assert config.max_position == 64
    stated = {**llama, "head_dim": 16, "max_position_embeddings": 32}  # Gemma-like
    config = decoder(tmp_path / "stated", config=stated)
    assert (config.head_dim, config.max_position) == (16, 32)


def test_a_symbolic_dim_without_a_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"dim 1 of .* is symbolic; put num_key_value_heads"):
        decoder(tmp_path)
    with pytest.raises(ModelError, match=r"dim 3 of .* is symbolic; put head_dim"):
        decoder(tmp_path / "heads", config={"num_key_value_heads": 2})


def test_config_json_that_is_no_object_is_an_error_in_json_s_words(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"config\.json: expected a JSON object, found an array$"):
        decoder(tmp_path, config=[1, 2])  # type: ignore[arg-type]


def test_config_json_that_contradicts_the_graph_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        ModelError, match=r"num_key_value_heads=2 but input past_key_values\.0\.key"
    ):
        decoder(tmp_path / "heads", heads=4, head_dim=8, config={"num_key_value_heads": 2})
    with pytest.raises(ModelError, match="n_layer=3 but the model has 1 past_key_values layers"):
        decoder(tmp_path / "layers", heads=4, head_dim=8, config={"n_layer": 3})
    # Query heads (a multi-query model's 4 against its 1 key/value head) and a derived
    # head size are no contradiction: they only stand in for symbolic dims.
    multi_query = {"num_attention_heads": 4, "hidden_size": 64}
    config = decoder(tmp_path / "mq", heads=1, head_dim=8, config=multi_query)
    assert (config.num_heads, config.head_dim) == (1, 8)


def test_an_input_the_loop_cannot_feed_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"also takes use_cache_branch tensor\(int64\)"):
        decoder(tmp_path, heads=1, head_dim=2, extra=["use_cache_branch"])


def test_eos_and_pad_come_from_generation_config_first(tmp_path: Path) -> None:
    dims = {"heads": 1, "head_dim": 2}
    config = decoder(
        tmp_path / "both",
        **dims,
        config={"eos_token_id": 2, "pad_token_id": 3, "vocab_size": 5},
        generation_config={"eos_token_id": [2, 4], "pad_token_id": 0},
    )
    assert (config.eos_token_ids, config.pad_token_id) == (frozenset({2, 4}), 0)
    config = decoder(tmp_path / "config", **dims, config={"eos_token_id": [2, 4]})
    assert config.eos_token_ids == frozenset({2, 4})
    assert config.pad_token_id == 2  # no pad: an eos id, as generate pads
    # -1 (old Llama configs) and ids past the vocabulary cannot be looked up: an eos
    # id then, else 0.
    for pad, eos in ((-1, 2), (9, 7)):
        files = {"pad_token_id": pad, "eos_token_id": eos, "vocab_size": 5}
        config = decoder(tmp_path / f"pad{pad}", **dims, config=files)
        assert config.pad_token_id == (eos if eos < 5 else 0)
    config = decoder(tmp_path / "none", **dims)
    assert config.eos_token_ids == frozenset({2})  # the tokenizer's </s>


def test_tokenizer_config_decides_whether_lanes_adds_bos(tmp_path: Path) -> None:
    dims: dict[str, Any] = {"heads": 1, "head_dim": 2, "config": {"bos_token_id": 1}}
    assert decoder(tmp_path / "lanes", **dims).add_bos_token  # lanes' own format
    hf = decoder(tmp_path / "hf", **dims, tokenizer_config={"bos_token": "<s>"})
    assert not hf.add_bos_token and hf.bos_token_id == 1  # the tokenizer decides
    flag = {"add_bos_token": True}
    assert decoder(tmp_path / "flag", **dims, tokenizer_config=flag).add_bos_token
    bos = decoder(tmp_path / "gen", heads=1, head_dim=2, generation_config={"bos_token_id": 0})
    assert bos.bos_token_id == 0
