"""Content digests (lanes.digests) and the model key built on them (flows.job.model_key):
what a model's files hold decides, never where they lie or when they were copied."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import orjson
import yaml
from onnx import TensorProto, helper, numpy_helper, save_model
from typer.testing import CliRunner

from lanes.digests import SEAL_SUFFIX, Digests, model_key
from lanes.router.cli import app
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.flows_fixtures import embed_model, read_only


def external_model(folder: Path, scale: float) -> Path:
    """y = x * w with w [4] kept in weights.bin beside model.onnx (external data)."""
    folder.mkdir(parents=True, exist_ok=True)
    io = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "scaled",
        [io("x", TensorProto.FLOAT, ["batch", 4])],
        [io("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(np.full(4, scale, dtype=np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=0,
    )
    return folder / "model.onnx"


def project(folder: Path) -> Path:
    """A project whose spec names its models relative to itself, as users write it."""
    external_model(folder / "models" / "scaled", 2.0)
    embed_model(folder / "models" / "enc")
    spec = {
        "version": 1,
        "models": {
            "scaled": {"path": "models/scaled/model.onnx"},
            "enc": {"path": "models/enc/model.onnx", "tokenizer": "models/enc/tokenizer.json"},
        },
        "workloads": {
            "scale": {
                "mode": "offline",
                "task": "infer",
                "model": "scaled",
                "input": "in/",
                "output": "out/",
            },
            "embed": {
                "mode": "offline",
                "task": "embed",
                "model": "enc",
                "input": "in/",
                "output": "out2/",
            },
        },
    }
    (folder / "workloads.yaml").write_text(yaml.safe_dump(spec))
    return folder / "workloads.yaml"


def keys(spec_file: Path, settings: Settings) -> dict[str, str]:
    spec = load_spec(spec_file, settings)
    return {name: model_key(spec, w, settings) for name, w in spec.workloads.items()}


def test_an_onnx_models_external_data_files_are_found_and_digested(tmp_path: Path) -> None:
    model = external_model(tmp_path / "m", 2.0)
    digests = Digests(tmp_path / "home")
    files = digests.model_files(model)
    assert [name for name, _ in files] == ["", "weights.bin"]
    assert all(d is not None for _, d in files)
    assert digests.model_files(tmp_path / "missing.onnx") == [("", None)]


def test_a_digest_is_cached_per_file_version_and_recomputed_when_the_file_changes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"one")
    digests = Digests(tmp_path / "home")
    first = digests.of(path)
    assert first is not None
    (entry,) = (tmp_path / "home" / "digests").iterdir()
    # The cached value is what a second ask returns: the file is not read again.
    cached = orjson.loads(entry.read_bytes())
    entry.write_bytes(orjson.dumps({**cached, "blake2b": "from-the-cache"}))
    assert Digests(tmp_path / "home").of(path) == first.__class__("from-the-cache", ())
    # Another version of the file (its size and mtime differ) is read again.
    path.write_bytes(b"two!")
    second = digests.of(path)
    assert second is not None and second.blake2b not in (first.blake2b, "from-the-cache")
    # The same bytes give the same digest wherever they lie.
    shutil.copy(path, tmp_path / "copy.bin")
    assert digests.of(tmp_path / "copy.bin") == second


def test_a_read_only_home_only_costs_reading_the_file_again(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"bytes")
    home = tmp_path / "home"
    (home / "digests").mkdir(parents=True)
    with read_only(home):
        assert Digests(home).of(path) == Digests(tmp_path / "other").of(path)
        assert list((home / "digests").iterdir()) == []


def test_the_model_key_is_the_same_for_a_project_moved_or_copied_elsewhere(
    tmp_path: Path,
) -> None:
    settings = Settings(home=tmp_path / "home")
    spec_file = project(tmp_path / "laptop")
    before = keys(spec_file, settings)
    # Copied without keeping times (cp -r), as an image build at /app does...
    shutil.copytree(tmp_path / "laptop", tmp_path / "app", copy_function=shutil.copy)
    # ...and moved.
    shutil.move(tmp_path / "laptop", tmp_path / "moved")
    assert keys(tmp_path / "app" / "workloads.yaml", settings) == before
    assert keys(tmp_path / "moved" / "workloads.yaml", settings) == before
    # A fresh LANES_HOME (a Job's) computes the same.
    assert keys(tmp_path / "app" / "workloads.yaml", Settings(home=tmp_path / "h2")) == before


def test_the_model_key_changes_with_any_file_the_model_reads(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    spec_file = project(tmp_path)
    before = keys(spec_file, settings)

    weights = tmp_path / "models" / "scaled" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # the external data alone: the .onnx is unchanged
    after = keys(spec_file, settings)
    assert after["scale"] != before["scale"] and after["embed"] == before["embed"]

    tokenizer = tmp_path / "models" / "enc" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"w1"', '"w1x"'))
    assert keys(spec_file, settings)["embed"] != after["embed"]

    # A config a decoder reads beside the model counts once it is there.
    now = keys(spec_file, settings)
    (tmp_path / "models" / "scaled" / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert keys(spec_file, settings)["scale"] != now["scale"]


def test_touching_a_model_without_changing_it_keeps_its_key(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    spec_file = project(tmp_path)
    before = keys(spec_file, settings)
    model = tmp_path / "models" / "scaled" / "model.onnx"
    os.utime(model, ns=(1, 1))
    assert keys(spec_file, settings) == before


def _swap_bytes_keeping_size_and_mtime(path: Path) -> None:
    """Other bytes in `path`, its size and mtime as they were: a digest read from the
    file would change, one read from its seal would not."""
    info = path.stat()
    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def _model_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in (folder / "models").rglob("*") if p.is_file() and SEAL_SUFFIX not in p.name
    )


def test_a_fresh_home_reads_sealed_models_from_their_seals_not_their_bytes(
    tmp_path: Path,
) -> None:
    spec_file = project(tmp_path / "laptop")
    before = keys(spec_file, Settings(home=tmp_path / "home"))
    done = CliRunner().invoke(
        app, ["models", "seal", str(spec_file)], env={"LANES_HOME": str(tmp_path / "h0")}
    )
    assert done.exit_code == 0, done.output
    assert "models.scaled: sealed 2 files" in done.output
    # The models copied with their times, as an image layer or `rsync -a` keeps them.
    shutil.copytree(tmp_path / "laptop", tmp_path / "app")
    for path in _model_files(tmp_path / "app"):
        _swap_bytes_keeping_size_and_mtime(path)
    # A Job's empty LANES_HOME: each key is the sealed one, so no model byte was hashed.
    assert keys(tmp_path / "app" / "workloads.yaml", Settings(home=tmp_path / "job")) == before


def test_a_seal_holds_only_for_the_size_and_mtime_it_was_written_for(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"sealed bytes")
    os.utime(path, ns=(1, 5_000_000_123))
    sealed = Digests(tmp_path / "h0", seal=True).of(path)
    assert sealed is not None and (tmp_path / f"weights.bin{SEAL_SUFFIX}").is_file()
    # The mtime cut to whole seconds (an image layer, tar): still this version.
    _swap_bytes_keeping_size_and_mtime(path)
    os.utime(path, ns=(1, 5_000_000_000))
    assert Digests(tmp_path / "h1").of(path) == sealed
    # Any other mtime, or another size, is another version: the file is read again.
    os.utime(path, ns=(1, 5_000_000_124))
    assert Digests(tmp_path / "h2").of(path) not in (sealed, None)
    path.write_bytes(b"rewritten, longer bytes")
    os.utime(path, ns=(1, 5_000_000_123))
    rewritten = Digests(tmp_path / "h3").of(path)
    assert rewritten == Digests(tmp_path / "h4").of(shutil.copy(path, tmp_path / "plain.bin"))
    assert rewritten != sealed


def test_sealing_a_read_only_model_folder_says_where_to_seal(tmp_path: Path) -> None:
    spec_file = project(tmp_path)
    with read_only(tmp_path / "models" / "scaled"):
        done = CliRunner().invoke(
            app, ["models", "seal", str(spec_file)], env={"LANES_HOME": str(tmp_path / "h")}
        )
    assert done.exit_code == 1
    assert "models.scaled: cannot write a seal beside its files" in done.output
