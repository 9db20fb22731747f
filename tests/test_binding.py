"""lanes.binding: when runs are IO-bound (pure), and embed/infer batches run bound on the
CPU provider (the code path a GPU runs) with exactly the outputs of `session.run`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, save_model

from lanes.binding import Placement, run, uses_io_binding
from lanes.runtime import CPU, Runtime
from lanes.settings import IoBinding, Settings
from lanes.spec import ModelSpec, Spec
from lanes.tasks import load_task
from lanes.tasks.embed import EmbedTask
from lanes.tasks.infer import InferTask
from tests.test_runtime import identity_model

CPU0, CUDA1 = Placement("cpu"), Placement("cuda", 1)

TEXTS = [
    "a short one",
    "a rather longer sentence, so that the batch is padded to its length",
    "x",
    "the quick brown fox jumps over the lazy dog " * 4,
]


@pytest.mark.parametrize(
    ("setting", "placement", "binds"),
    [
        ("auto", CUDA1, True),
        ("auto", CPU0, False),
        ("on", CPU0, True),
        ("on", CUDA1, True),
        ("off", CUDA1, False),
        ("off", CPU0, False),
    ],
)
def test_auto_binds_on_a_gpu_only(setting: IoBinding, placement: Placement, binds: bool) -> None:
    assert uses_io_binding(setting, placement) is binds


def strings_model(path: Path) -> Path:
    """x string [n] -> y = x, and n float32 [n] -> m = n (a string output and a number)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["n"], ["m"])],
        "strings",
        [
            helper.make_tensor_value_info("x", TensorProto.STRING, ["b"]),
            helper.make_tensor_value_info("n", TensorProto.FLOAT, ["b"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.STRING, ["b"]),
            helper.make_tensor_value_info("m", TensorProto.FLOAT, ["b"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


def sequence_model(path: Path) -> Path:
    """x float32 [n] -> s = [x] (a sequence: an output IO binding cannot bind)."""
    graph = helper.make_graph(
        [helper.make_node("SequenceConstruct", ["x"], ["s"])],
        "sequence",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [
            helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, ["n"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


def test_a_session_here_is_on_the_cpu_and_binds_as_the_setting_says(tmp_path: Path) -> None:
    model = ModelSpec(path=identity_model(tmp_path / "model.onnx"))
    for setting, binds in (("auto", False), ("on", True), ("off", False)):
        runtime = Runtime(Settings(device="cpu", io_binding=setting))
        session = runtime.session(model)
        assert session.get_providers() == [CPU]
        assert Placement.of(session) == CPU0
        assert runtime.binds(session) is binds
        assert runtime.binding(session) == (CPU0 if binds else None)


def test_models_binding_cannot_take_run_unbound(tmp_path: Path) -> None:
    """onnxruntime binds numeric tensors only: strings in or out, or a sequence out."""
    runtime = Runtime(Settings(device="cpu", io_binding="on"))
    strings = runtime.session(ModelSpec(path=strings_model(tmp_path / "s.onnx")))
    assert runtime.binds(strings) and runtime.binding(strings) is None
    texts = np.asarray(["é", "", "b"], dtype=object)
    numbers = np.asarray([1.5, -2.0, 0.25], dtype=np.float32)
    y, m = run(strings, ["y", "m"], {"x": texts, "n": numbers}, runtime.binding(strings))
    assert y.tolist() == ["é", "", "b"]
    assert m.dtype == np.float32 and m.tolist() == [1.5, -2.0, 0.25]
    sequence = runtime.session(ModelSpec(path=sequence_model(tmp_path / "q.onnx")))
    assert runtime.binding(sequence) is None
    x = np.asarray([1.0, 2.0], dtype=np.float32)
    (made,) = run(sequence, ["s"], {"x": x}, runtime.binding(sequence))
    assert [list(x) for x in made] == [[1.0, 2.0]]


def test_a_bound_run_feeds_and_returns_numbers(tmp_path: Path) -> None:
    runtime = Runtime(Settings(device="cpu", io_binding="on"))
    session = runtime.session(ModelSpec(path=identity_model(tmp_path / "model.onnx")))
    assert runtime.binding(session) == CPU0
    x = np.arange(5, dtype=np.float32)
    (y,) = run(session, ["y"], {"x": x[::2]}, CPU0)  # not contiguous: bound as a copy
    assert isinstance(y, np.ndarray) and y.tolist() == [0.0, 2.0, 4.0]


def demo_spec(demo_models: Path) -> Spec:
    return Spec.model_validate(
        {
            "models": {
                "minilm": {
                    "path": demo_models / "minilm" / "model.onnx",
                    "tokenizer": demo_models / "minilm" / "tokenizer.json",
                    "max_length": 256,
                },
                "classifier": {"path": demo_models / "classifier" / "model.onnx"},
            },
            "workloads": {
                "embed": {"mode": "interactive", "task": "embed", "model": "minilm"},
                "classify": {"mode": "interactive", "task": "infer", "model": "classifier"},
            },
        }
    )


def loaded(spec: Spec, name: str, setting: IoBinding) -> EmbedTask | InferTask:
    task = load_task(name, spec, Runtime(Settings(device="cpu", threads=1, io_binding=setting)))
    assert isinstance(task, EmbedTask | InferTask)
    assert task.placement == (CPU0 if setting == "on" else None)
    return task


def test_bound_embed_batches_equal_session_run(demo_models: Path) -> None:
    spec = demo_spec(demo_models)
    bound, plain = (loaded(spec, "embed", s) for s in ("on", "off"))
    assert isinstance(bound, EmbedTask) and isinstance(plain, EmbedTask)
    for batch in (TEXTS, TEXTS[:1], TEXTS[::-1]):
        want = plain.vectors([plain.prepare(t) for t in batch])
        got = bound.vectors([bound.prepare(t) for t in batch])
        assert got.shape == (len(batch), plain.dimensions)
        assert np.array_equal(got, want)


def test_bound_infer_batches_equal_session_run(demo_models: Path) -> None:
    """The demo MLP: rows stacked across items, outputs split back per item."""
    spec = demo_spec(demo_models)
    bound, plain = (loaded(spec, "classify", s) for s in ("on", "off"))
    assert isinstance(bound, InferTask) and isinstance(plain, InferTask)
    (name,) = bound.inputs
    width = bound.inputs[name].shape[1]
    assert isinstance(width, int)
    rows = np.random.default_rng(0).normal(size=(7, width)).astype(np.float32)
    items = [{name: rows[:3]}, {name: rows[3:4]}, {name: rows[4:]}]
    want = plain.tensors([plain.prepare(i) for i in items])
    got = bound.tensors([bound.prepare(i) for i in items])
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want, strict=True):
        for output in w:
            assert g[output].shape == w[output].shape
            assert np.array_equal(g[output], w[output])
