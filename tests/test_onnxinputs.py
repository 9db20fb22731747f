"""lanes.onnxinputs: a model's required inputs from its file, weights unread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lanes.onnxinputs import required_inputs


def as_onnx_reads(path: Path) -> list[str]:
    graph = onnx.load(str(path), load_external_data=False).graph
    defaults = {t.name for t in graph.initializer}
    return [i.name for i in graph.input if i.name not in defaults]


def scaled_model(path: Path, external: bool) -> Path:
    """x [batch, 4] * weight [4] (+ bias, an input with a default), its weights in files
    of their own when `external`."""
    weight = numpy_helper.from_array(np.ones(4, dtype=np.float32), "weight")
    bias = numpy_helper.from_array(np.zeros(4, dtype=np.float32), "bias")
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "weight"], ["scaled"]),
            helper.make_node("Add", ["scaled", "bias"], ["y"]),
        ],
        "scaled",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [weight, bias],
    )
    model = helper.make_model(graph)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=external, size_threshold=0)
    return path


def test_the_demo_models_inputs_are_onnxs_own(demo_models: Path) -> None:
    models = sorted(demo_models.glob("*/*.onnx"))
    assert len(models) >= 3
    for path in models:
        assert required_inputs(path) == as_onnx_reads(path), path


def test_an_input_with_a_default_is_not_required_and_no_weight_is_read(tmp_path: Path) -> None:
    inline = scaled_model(tmp_path / "inline.onnx", external=False)
    assert required_inputs(inline) == as_onnx_reads(inline) == ["x"]
    apart = scaled_model(tmp_path / "apart" / "model.onnx", external=True)
    for weights in apart.parent.iterdir():
        if weights != apart:
            weights.unlink()  # nothing reads them
    assert required_inputs(apart) == ["x"]


@pytest.mark.parametrize(
    "content", [b"", b"models:\n  m: {path: m.onnx}\n", b"\x0a\xff\xff\xff\xff\x0f"]
)
def test_a_file_that_is_no_model_is_a_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        required_inputs(path)
