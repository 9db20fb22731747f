"""lanes.runtime: the provider decision (pure), real CPU sessions, and model checks."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, save_model

from lanes.errors import ModelError
from lanes.runtime import (
    CPU,
    CUDA,
    TENSORRT,
    ProviderChoice,
    Runtime,
    check_io,
    choose_providers,
    cpu_quota,
    detect_gpu,
    usable_cores,
)
from lanes.settings import Settings
from lanes.spec import ModelSpec, SessionOptions

ALL = (TENSORRT, CUDA, CPU)  # what onnxruntime-gpu lists, GPU or not


def identity_model(path: Path) -> Path:
    """x float32 [n] -> y = x."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    return ModelSpec(path=identity_model(tmp_path_factory.mktemp("m") / "model.onnx"))


def test_auto_without_gpu_is_cpu_and_says_why() -> None:
    choice = choose_providers("auto", ALL, gpu_present=False)
    assert choice.providers == (CPU,)
    assert "no GPU" in choice.reason
    assert choice.gpu_provider is None


def test_auto_with_gpu_puts_cuda_first_then_cpu() -> None:
    choice = choose_providers("auto", ALL, gpu_present=True)
    assert choice.providers == (CUDA, CPU)
    assert choice.gpu_provider == CUDA
    assert not choice.strict  # auto accepts the CPU, loudly


def test_auto_with_gpu_but_cpu_build_says_which_package() -> None:
    choice = choose_providers("auto", (CPU,), gpu_present=True)
    assert choice.providers == (CPU,)
    assert "onnxruntime-gpu" in choice.reason


def test_cpu_is_cpu_even_with_a_gpu() -> None:
    assert choose_providers("cpu", ALL, gpu_present=True).providers == (CPU,)


def test_cuda_without_gpu_raises() -> None:
    with pytest.raises(ModelError, match="device is cuda but no GPU"):
        choose_providers("cuda", ALL, gpu_present=False)


def test_cuda_on_a_cpu_build_raises() -> None:
    with pytest.raises(ModelError, match="offers no CUDAExecutionProvider"):
        choose_providers("cuda", (CPU,), gpu_present=True)


def test_tensorrt_chains_cuda_then_cpu_and_is_strict() -> None:
    choice = choose_providers("tensorrt", ALL, gpu_present=True)
    assert choice.providers == (TENSORRT, CUDA, CPU)
    assert choice.gpu_provider == TENSORRT
    assert choice.strict


def test_real_session_runs_on_the_cpu(model: ModelSpec) -> None:
    session = Runtime(Settings(device="cpu")).session(model)
    assert session.get_providers() == [CPU]
    (y,) = session.run(None, {"x": np.array([1.5, -2.0], dtype=np.float32)})
    assert y.tolist() == [1.5, -2.0]


def test_runtime_logs_its_choice_once(caplog: pytest.LogCaptureFixture, model: ModelSpec) -> None:
    with caplog.at_level(logging.INFO, logger="lanes.runtime"):
        runtime = Runtime(Settings(device="cpu"))
        runtime.session(model)
        runtime.session(model)
    chosen = [r.getMessage() for r in caplog.records if "will use" in r.getMessage()]
    assert len(chosen) == 1
    assert CPU in chosen[0] and "device is cpu" in chosen[0]


@pytest.mark.skipif(detect_gpu().present, reason="checks the no-GPU path")
def test_auto_here_is_cpu(model: ModelSpec) -> None:
    runtime = Runtime(Settings(device="auto"))
    assert runtime.providers == (CPU,)
    assert runtime.session(model).get_providers() == [CPU]


@pytest.mark.skipif(detect_gpu().present, reason="needs CUDA to fail to load")
def test_gpu_provider_not_obtained_is_loud(
    caplog: pytest.LogCaptureFixture, model: ModelSpec
) -> None:
    # onnxruntime-gpu accepts CUDA here and silently gives the CPU: what a GPU
    # machine with broken CUDA libraries does. Force the choice to see it caught.
    runtime = Runtime(Settings(device="cpu"))
    runtime.choice = ProviderChoice((CUDA, CPU), "forced", CUDA, strict=False)
    with caplog.at_level(logging.WARNING, logger="lanes.runtime"):
        assert runtime.session(model).get_providers() == [CPU]
    assert any("asked for CUDAExecutionProvider" in r.getMessage() for r in caplog.records)
    runtime.choice = ProviderChoice((CUDA, CPU), "forced", CUDA, strict=True)
    with pytest.raises(ModelError, match="LANES_DEVICE"):
        runtime.session(model)


def test_session_options_prefer_the_model_over_settings(model: ModelSpec) -> None:
    runtime = Runtime(Settings(device="cpu", threads=2))
    assert runtime.session_options(model).intra_op_num_threads == 2
    own = model.model_copy(
        update={"session": SessionOptions(intra_op_threads=1, inter_op_threads=1)}
    )
    options = runtime.session_options(own)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)


def test_a_second_run_has_room_beside_one_in_flight_only_where_threads_leave_a_core(
    model: ModelSpec,
) -> None:
    """The online engine prefills arrivals beside a decode only then (serving/engine.py)."""
    cores = usable_cores()
    runtime = Runtime(Settings(device="cpu"))
    assert not runtime.room_beside(model), "onnxruntime's default: every core"
    every = model.model_copy(update={"session": SessionOptions(intra_op_threads=cores)})
    assert not runtime.room_beside(every)
    one = model.model_copy(update={"session": SessionOptions(intra_op_threads=1)})
    assert runtime.room_beside(one) == (cores > 1)
    assert Runtime(Settings(device="cpu", threads=1)).room_beside(model) == (cores > 1)


def test_a_container_s_cpu_limit_bounds_the_cores(tmp_path: Path) -> None:
    """A pod limited to 1.5 CPUs on a bigger node sees every node core in its affinity;
    its cgroup (v2 here, files as the kernel writes them) says what it may use."""
    membership = tmp_path / "cgroup-of-self"
    membership.write_text("0::/kubepods/pod1/app\n")
    pod, app = tmp_path / "kubepods" / "pod1", tmp_path / "kubepods" / "pod1" / "app"
    app.mkdir(parents=True)
    assert cpu_quota(tmp_path, membership) is None, "no cpu.max: unknown"
    (app / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path, membership) is None, "max: unlimited"
    (app / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(tmp_path, membership) == 2, "rounded up"
    (pod / "cpu.max").write_text("50000 100000\n")
    assert cpu_quota(tmp_path, membership) == 1, "the tightest group above counts"
    assert usable_cores(tmp_path, membership) == 1
    (pod / "cpu.max").write_text("max 100000\n")
    (app / "cpu.max").write_text(f"{1000 * 100000} 100000\n")
    assert usable_cores(tmp_path, membership) == usable_cores(tmp_path / "none", membership)


def test_a_cgroup_v1_cpu_quota_bounds_the_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    membership = tmp_path / "cgroup-of-self"
    membership.write_text("1:cpu:/\n0::/\n")
    assert cpu_quota(tmp_path, membership) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cpu_quota(tmp_path, membership) == 2


def test_a_session_beside_offline_threads_stops_spinning_when_a_run_ends(
    model: ModelSpec,
) -> None:
    """Spin-waiting threads would burn the cores the idle-priority offline runs use."""
    runtime = Runtime(Settings(device="cpu"))
    stop = "session.force_spinning_stop"
    with pytest.raises(RuntimeError, match="does not have configuration"):
        runtime.session_options(model).get_session_config_entry(stop)
    options = runtime.session_options(model, spin_between_runs=False)
    assert options.get_session_config_entry(stop) == "1"
    quiet = model.model_copy(update={"session": SessionOptions(spinning=False)})
    options = runtime.session_options(quiet, spin_between_runs=False)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_missing_file_and_garbage_file_name_the_path(tmp_path: Path) -> None:
    runtime = Runtime(Settings(device="cpu"))
    with pytest.raises(ModelError, match=r"no model file at .*absent\.onnx"):
        runtime.session(ModelSpec(path=tmp_path / "absent.onnx"))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ModelError, match=r"onnxruntime cannot load .*garbage\.onnx: "):
        runtime.session(ModelSpec(path=garbage))


def test_check_io_names_the_missing_input_and_lists_the_model(model: ModelSpec) -> None:
    session = Runtime(Settings(device="cpu")).session(model)
    check_io(session, where="m.onnx", task="infer", inputs=["x"], outputs=["y"])
    with pytest.raises(ModelError) as caught:
        check_io(session, where="m.onnx", task="embed", inputs=["input_ids", "x"])
    message = str(caught.value)
    assert "no input 'input_ids'" in message
    assert "its inputs: x tensor(float) [n]" in message
    assert "'x'" not in message.split("its inputs")[0]


def weighted_model(path: Path) -> ModelSpec:
    """x float32 [512] -> y = x + w, w an initializer of 2 KiB (an external weight when
    written as a copy)."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [512], np.arange(512, dtype=np.float32))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "weighted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return ModelSpec(path=path)


def test_an_optimized_copy_is_written_once_and_loaded_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = weighted_model(tmp_path / "weighted.onnx")
    runtime = Runtime(Settings(device="cpu"))
    copy = tmp_path / "copies" / "weighted.onnx"
    copy.parent.mkdir()
    x = {"x": np.ones(512, dtype=np.float32)}
    expected = np.arange(512, dtype=np.float32) + 1

    (first,) = runtime.session(model, optimized=copy).run(None, x)
    assert copy.is_file() and (tmp_path / "copies" / "weighted.onnx.data").is_file()
    model.path.write_bytes(b"not a model any more")  # from now on only the copy loads
    (again,) = runtime.session(model, optimized=copy).run(None, x)
    assert first.tolist() == again.tolist() == expected.tolist()

    copy.write_bytes(b"a broken copy")
    weighted_model(model.path)
    with caplog.at_level(logging.WARNING, logger="lanes.runtime"):
        (fallback,) = runtime.session(model, optimized=copy).run(None, x)
    assert fallback.tolist() == expected.tolist()
    assert f"onnxruntime cannot load {copy}" in caplog.text
    assert copy.is_file()  # written again by the load of the model itself
