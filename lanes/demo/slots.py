"""tinycode's weights as a decoder with a slot KV cache (`model-slots.onnx`).

The Optimum signature (`model.onnx`) concatenates each step's keys and values onto
the past, so a batch's rows share one past length: rows of other lengths are padded,
and every step copies the whole past. This graph keeps the cache in place instead,
as vLLM and onnxruntime-genai do: each attention is onnxruntime's
`GroupQueryAttention`, whose past and present may be one buffer [rows, heads,
capacity, head_dim] that a step writes one column of, and whose `seqlens_k` gives
each row its own length. One run then decodes rows of any lengths, attending over
each row's own positions only (lanes/tasks/decoder.py reads the layout from the
graph's inputs; lanes/generation/slots.py keeps the buffer).

Inputs: `input_ids` [batch, seq] int64, `seqlens_k` [batch] int32 (each row's past
plus new tokens, minus one), `total_sequence_length` int32 scalar (the longest
row's past plus new), `past_key_values.{i}.key|value` [batch, heads, capacity,
head_dim] float32, each row's past at its first columns. Outputs: `logits` [batch,
seq, vocab] and `present.{i}.key|value`, the past with the new tokens written
after each row's own (the same buffer when bound to it). Rotary positions are the
cache columns: a row's tokens are at positions 0, 1, ... with no padding before.

With `lengths_from="mask"` the graph takes `attention_mask` [batch, total] int64
instead of the two length inputs and derives them from it (each row's ones, minus
one; its width), as onnxruntime-genai's model builder writes its decoders: the mask
is then right-padded, each row's ones first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:
    from lanes.demo.tinycode import TinyCode

# onnxruntime 1.20, the oldest this project takes, reads IR version 10.
IR_VERSION = 10
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def export_slots(
    model: TinyCode, path: Path, lengths_from: Literal["inputs", "mask"] = "inputs"
) -> None:
    """Write `model`'s weights as the slot-cache graph described above."""
    cfg = model.cfg
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    lengths = [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
    ]
    if lengths_from == "mask":
        lengths = [
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
        ]
        axis, one = const("mask.axis", np.asarray([1])), const("mask.one", np.asarray(1))
        nodes += [
            helper.make_node("ReduceSum", ["attention_mask", axis], ["mask.sum"], keepdims=1),
            helper.make_node("Sub", ["mask.sum", one], ["mask.last"]),
            helper.make_node("Cast", ["mask.last"], ["seqlens_k"], to=TensorProto.INT32),
            helper.make_node("Shape", ["attention_mask"], ["mask.shape"]),
            helper.make_node("Gather", ["mask.shape", one], ["mask.width"], axis=0),
            helper.make_node(
                "Cast", ["mask.width"], ["total_sequence_length"], to=TensorProto.INT32
            ),
        ]

    def linear(x: str, prefix: str, out: str) -> str:
        w = const(f"{prefix}.weight_t", weights[f"{prefix}.weight"].T)
        b = const(f"{prefix}.bias", weights[f"{prefix}.bias"])
        nodes.append(helper.make_node("MatMul", [x, w], [f"{out}.mm"]))
        nodes.append(helper.make_node("Add", [f"{out}.mm", b], [out]))
        return out

    def norm(x: str, prefix: str, out: str) -> str:
        scale, bias = weights[f"{prefix}.weight"], weights[f"{prefix}.bias"]
        nodes.append(
            helper.make_node(
                "LayerNormalization",
                [x, const(f"{prefix}.weight", scale), const(f"{prefix}.bias", bias)],
                [out],
                axis=-1,
                epsilon=1e-5,
            )
        )
        return out

    positions = np.arange(cfg.max_position, dtype=np.float32)[:, None]
    angles = positions * model.inv_freq.numpy()[None, :]  # [max_position, head_dim / 2]
    cos = const("cos_cache", np.cos(angles).astype(np.float32))
    sin = const("sin_cache", np.sin(angles).astype(np.float32))
    table = const("tok.weight", weights["tok.weight"])
    nodes.append(helper.make_node("Gather", [table, "input_ids"], ["x.0"]))
    x = "x.0"
    d = cfg.d_model
    split = const("qkv.split", np.asarray([d, d, d], dtype=np.int64))
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        h = norm(x, f"{p}.ln1", f"{p}.h1")
        qkv = linear(h, f"{p}.attn.qkv", f"{p}.qkv")
        q, k, v = f"{p}.q", f"{p}.k", f"{p}.v"
        nodes.append(helper.make_node("Split", [qkv, split], [q, k, v], axis=-1))
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    q,
                    k,
                    v,
                    f"past_key_values.{i}.key",
                    f"past_key_values.{i}.value",
                    "seqlens_k",
                    "total_sequence_length",
                    cos,
                    sin,
                ],
                [f"{p}.attn", f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                num_heads=cfg.num_heads,
                kv_num_heads=cfg.num_heads,
                do_rotary=1,
                rotary_interleaved=0,
            )
        )
        a = linear(f"{p}.attn", f"{p}.attn.proj", f"{p}.a")
        nodes.append(helper.make_node("Add", [x, a], [f"{p}.x1"]))
        h2 = norm(f"{p}.x1", f"{p}.ln2", f"{p}.h2")
        up = linear(h2, f"{p}.mlp.0", f"{p}.up")
        nodes.append(helper.make_node("Gelu", [up], [f"{p}.gelu"], domain="com.microsoft"))
        down = linear(f"{p}.gelu", f"{p}.mlp.2", f"{p}.down")
        nodes.append(helper.make_node("Add", [f"{p}.x1", down], [f"x.{i + 1}"]))
        x = f"x.{i + 1}"
    final = norm(x, "ln_f", "final")
    head = const("head.weight_t", weights["tok.weight"].T)
    nodes.append(helper.make_node("MatMul", [final, head], ["logits"]))

    kv: list[str | int] = ["batch", cfg.num_heads, "capacity", cfg.head_dim]
    kv_out: list[str | int] = ["batch", cfg.num_heads, "present_capacity", cfg.head_dim]
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        *lengths,
    ]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "sequence", cfg.vocab_size])]
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, kv))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", f32, kv_out))
    graph = helper.make_graph(nodes, "tinycode_slots", inputs, outputs, inits)
    onnx_model = helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION)
    onnx.checker.check_model(onnx_model)
    onnx.save(onnx_model, str(path))
