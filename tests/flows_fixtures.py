"""Tiny real models, record files and specs for the offline flow tests.

The models are real ONNX graphs run by onnxruntime, small enough to build in
milliseconds: an embedding table behind a word-level tokenizer (task embed), and an
affine map (task infer). Their outputs are known, so tests can check values.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper, save_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tests.gates import FileGate
from tests.prefect_server import PREFECT_API_ENV

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(60)]
DIM = 8


def embed_model(folder: Path) -> tuple[Path, Path]:
    """input_ids, attention_mask -> last_hidden_state = E[input_ids]; a tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    table = np.random.default_rng(0).normal(size=(len(WORDS), DIM)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["last_hidden_state"])]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "tokens"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "tokens"]),
    ]
    outputs = [
        helper.make_tensor_value_info(
            "last_hidden_state", TensorProto.FLOAT, ["batch", "tokens", DIM]
        )
    ]
    graph = helper.make_graph(
        nodes, "embed", inputs, outputs, initializer=[numpy_helper.from_array(table, "table")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "model.onnx", folder / "tokenizer.json"


def infer_model(folder: Path) -> Path:
    """x float32 [batch, 4] -> y = 2x + 1."""
    folder.mkdir(parents=True, exist_ok=True)
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["x2"]),
        helper.make_node("Add", ["x2", "one"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            numpy_helper.from_array(np.float32(2.0), "two"),
            numpy_helper.from_array(np.float32(1.0), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def sum_model(folder: Path) -> Path:
    """a, b float32 [batch, 2] -> s = a + b: a model of two inputs."""
    folder.mkdir(parents=True, exist_ok=True)
    io = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"])],
        "sum",
        [io("a", TensorProto.FLOAT, ["batch", 2]), io("b", TensorProto.FLOAT, ["batch", 2])],
        [io("s", TensorProto.FLOAT, ["batch", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


DECODER_WORDS = ["<eos>", "a", "b", "c", "d", "[UNK]"]


def decoder_model(folder: Path) -> tuple[Path, Path]:
    """A one-layer decoder with a KV cache whose logits follow a -> b -> c -> d -> <eos>
    (greedy: the prompt "a" completes to "b c d"); chat renders each message as its
    content."""
    folder.mkdir(parents=True, exist_ok=True)
    bigram = np.full((6, 6), -5.0, dtype=np.float32)
    for src, dst in ((1, 2), (2, 3), (3, 4), (4, 0), (0, 0), (5, 0)):
        bigram[src, dst] = 5.0
    keys = np.arange(12, dtype=np.float32).reshape(6, 2)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    io = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Gather", ["L", "input_ids"], ["logits"]),
        helper.make_node("Gather", ["K", "input_ids"], ["k"]),
        helper.make_node("Unsqueeze", ["k", "axis1"], ["k4"]),
        helper.make_node("Concat", ["past_key_values.0.key", "k4"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "k4"], ["present.0.value"], axis=2),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder",
        [
            io("input_ids", i64, ["batch", "seq"]),
            io("attention_mask", i64, ["batch", "total"]),
            io("position_ids", i64, ["batch", "seq"]),
            io("past_key_values.0.key", f, ["batch", 1, "past", 2]),
            io("past_key_values.0.value", f, ["batch", 1, "past", 2]),
        ],
        [
            io("logits", f, ["batch", "seq", 6]),
            io("present.0.key", f, ["batch", 1, "total", 2]),
            io("present.0.value", f, ["batch", 1, "total", 2]),
        ],
        initializer=[
            numpy_helper.from_array(bigram, "L"),
            numpy_helper.from_array(keys, "K"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(DECODER_WORDS)}, unk_token="[UNK]")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token_id": 0, "num_layers": 1, "num_heads": 1, "head_dim": 2}
    chat = {"chat_template": "{content} ", "chat_generation_prompt": ""}
    (folder / "config.json").write_text(json.dumps({**config, **chat, "max_position": 64}))
    return folder / "model.onnx", folder / "tokenizer.json"


def write_spec(folder: Path, workloads: dict[str, dict[str, Any]]) -> Path:
    """A workloads.yaml in `folder` with models `enc` (embed), `affine` (infer) and
    `dec` (generate)."""
    model, tokenizer = embed_model(folder / "models" / "enc")
    affine = infer_model(folder / "models" / "affine")
    decoder, words = decoder_model(folder / "models" / "dec")
    spec = {
        "version": 1,
        "models": {
            "enc": {"path": str(model), "tokenizer": str(tokenizer)},
            "affine": {"path": str(affine)},
            "dec": {"path": str(decoder), "tokenizer": str(words)},
        },
        "workloads": workloads,
    }
    path = folder / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def text(i: int) -> str:
    """A text of 1..12 known words, varying with i (so sorting by length matters)."""
    return " ".join(f"w{(i * 7 + k) % 60}" for k in range(1 + i % 12))


def write_jsonl(path: Path, lines: Iterable[Any]) -> Path:
    """Each item as one line: dicts as JSON, str as given (for malformed lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outputs_of(folder: Path) -> list[dict[str, Any]]:
    """Every output line of every output shard under `folder` (not the bookkeeping)."""
    lines: list[dict[str, Any]] = []
    for path in sorted(folder.rglob("*.jsonl")):
        if not any(part.startswith("_") for part in path.relative_to(folder).parts):
            lines += read_jsonl(path)
    return lines


def errors_of(folder: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted((folder / "_errors").rglob("*.jsonl")):
        lines += read_jsonl(path)
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(check: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout} s")


@contextmanager
def moto_server() -> Iterator[str]:
    """A real S3 API (moto) over HTTP on 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_env(monkeypatch: Any, endpoint: str) -> Any:
    """boto3's usual chain, pointed at moto; wipes moto's state; returns a client."""
    import boto3
    import httpx

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    httpx.post(f"{endpoint}/moto-api/reset", timeout=10).raise_for_status()
    return boto3.client("s3", endpoint_url=endpoint)


class _HeldFromShard3:
    """A handler whose `pre` holds each record of shard 3 on (`x[0][1]` is its shard)
    at the FileGate (tests/gates.py): a job that stops mid-way, as long as a test wants."""

    @staticmethod
    def pre(item: Any) -> Any:
        if item["x"][0][1] >= 3:
            FileGate.wait()
        return item


held_from_shard_3 = _HeldFromShard3()


class _PromptHeldFromShard3:
    """`held_from_shard_3` for generate records: {"prompt", "shard"} -> the prompt,
    held at the FileGate from shard 3 on."""

    @staticmethod
    def pre(item: Any) -> Any:
        if item["shard"] >= 3:
            FileGate.wait()
        return {"prompt": item["prompt"], "max_tokens": item["max_tokens"]}


prompt_held_from_shard_3 = _PromptHeldFromShard3()


class _Broken:
    """A handler whose `post` always fails: code that is broken, not bad data."""

    @staticmethod
    def post(output: Any) -> Any:
        raise RuntimeError("the post is broken")


broken = _Broken()


class _Picky:
    """A handler whose `pre` rejects records marked `flaky` until `allow` is set: an
    error that a later --retry-errors run can fix without touching the input."""

    def __init__(self) -> None:
        self.allow = False

    def pre(self, record: Any) -> Any:
        if record.get("flaky") and not self.allow:
            raise ValueError("a flaky record")
        return record


picky = _Picky()


class _Vanishing:
    """A handler whose `pre` calls `vanish` (a test sets it: delete another shard's input)
    once, at the first record it sees: an input that goes between a run's listing and
    its shard's read."""

    def __init__(self) -> None:
        self.vanish: Callable[[], Any] | None = None

    def pre(self, record: Any) -> Any:
        vanish, self.vanish = self.vanish, None
        if vanish is not None:
            vanish()
        return record


vanishing = _Vanishing()


class _StopsAtShard2:
    """A handler whose `pre` calls `stop` (a test sets it: stop the endpoint) once, at
    the first record of shard 2 (`x[0][1]` is its shard): an endpoint that goes away
    mid-run, after shards 0 and 1 committed (with one shard at a time)."""

    def __init__(self) -> None:
        self.stop: Callable[[], Any] | None = None

    def pre(self, item: Any) -> Any:
        if item["x"][0][1] >= 2 and self.stop is not None:
            stop, self.stop = self.stop, None
            stop()
        return item


stops_at_shard_2 = _StopsAtShard2()


@contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """`folder` and every folder under it refuse new files, even to root: by mode bits
    where they bind this process, else by the immutable attribute (`chattr +i`). The
    test is skipped where neither can be had."""
    folders = [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())]
    modes = {p: p.stat().st_mode for p in folders}
    for p in folders:
        p.chmod(0o555)
    immutable = False
    try:
        if _accepts_files(folder):
            for p in folders:
                p.chmod(modes[p])
            done = subprocess.run(["chattr", "+i", *map(str, folders)], capture_output=True)
            immutable = done.returncode == 0
            if not immutable or _accepts_files(folder):
                pytest.skip("cannot make a folder read-only here (root, without chattr)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", *map(str, folders)], capture_output=True)
        for p in folders:
            p.chmod(modes[p])


# Set in a test's rerun without the capabilities that let root ignore mode bits.
UNPRIVILEGED = "LANES_TESTS_UNPRIVILEGED"
DAC_CAPS = "-dac_override,-dac_read_search"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def ran_where_modes_bind(request: pytest.FixtureRequest, folder: Path) -> bool:
    """Whether mode bits stop this process reading a file: then the test goes on here
    (True). Root ignores them (CAP_DAC_OVERRIDE), so as root the test runs again, whole,
    in a pytest of its own under `setpriv` without those capabilities, on this session's
    Prefect API, and must pass there: then it is done here (False). Skipped only where
    neither can be (no setpriv)."""
    if _modes_bind(folder):
        return True
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.environ.get(UNPRIVILEGED):
        pytest.skip("mode bits do not bind this process (root), and setpriv is missing")
    env = {**os.environ, UNPRIVILEGED: "1"}
    if "prefect_api" in request.fixturenames:
        env[PREFECT_API_ENV] = request.getfixturevalue("prefect_api")
    run = subprocess.run(
        [
            setpriv,
            f"--inh-caps={DAC_CAPS}",
            f"--bounding-set={DAC_CAPS}",
            *PYTEST,
            request.node.nodeid,
        ],
        cwd=request.config.rootpath,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    return False


def _modes_bind(folder: Path) -> bool:
    probe = folder / ".mode-probe"
    probe.write_bytes(b"")
    probe.chmod(0)
    try:
        probe.read_bytes()
    except PermissionError:
        return True
    finally:
        probe.unlink()
    return False


def _accepts_files(folder: Path) -> bool:
    probe = folder / ".write-probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return False
    probe.unlink()
    return True


_HOLD = """
import sys
from lanes.settings import Settings
from lanes.storage import Storage

with Storage(Settings()).staged(sys.argv[1]) as stage:
    stage.write_text("half an output")
    print(stage, flush=True)
    sys.stdin.readline()  # staged until the test writes a line (or kills this process)
"""


@contextmanager
def staging_writer(uri: str, timeout: float = 60) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Another process, writing `uri` through `Storage.staged` and held there: yields it
    and its staging file. Writing a line to its stdin lets it finish; killing it
    leaves the staging file behind, as a killed run does."""
    root = Path(__file__).resolve().parent.parent
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, uri],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        assert line.strip(), f"the staging writer did not start in {timeout} s"
        yield process, Path(line.strip())
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=timeout)
