"""What tritonclient sends beyond plain inference: compressed bodies (gzip, deflate;
sync and aio clients), the model config, the statistics, and the extensions lanes
refuses with a 400 that says what to do instead. A real uvicorn on 127.0.0.1, tiny real ONNX models."""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
import yaml
from onnx import TensorProto, helper, save_model
from openai import BadRequestError, OpenAI

from tests.flows_fixtures import DIM, embed_model, infer_model
from tests.gates import wait_until
from tests.servers import ServerThread
from tests.test_triton_client import X, refused, tensor

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024
CODINGS = ["gzip", "deflate"]


def fixed_model(folder: Path, shape: list[int | str] | None = None) -> Path:
    """x float32 [2, 4] -> y = -x: its first dim is fixed, so no rows stack across
    requests (Triton's max_batch_size 0): each request is a run of its own. (Of
    another `shape`, the same graph.)"""
    folder.mkdir(parents=True, exist_ok=True)
    shape = shape or [2, 4]
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, demo_models: Path) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("triton-ext")
    enc, tokenizer = embed_model(folder / "enc")
    tinycode = demo_models / "tinycode"
    spec = {
        "version": 1,
        "models": {
            "affine": {"path": str(infer_model(folder / "affine"))},
            "fixed": {"path": str(fixed_model(folder / "fixed"))},
            # Rows first, then a free dim: rows of one length stack, of two do not.
            "ragged": {"path": str(fixed_model(folder / "ragged", ["batch", "length"]))},
            "enc": {"path": str(enc), "tokenizer": str(tokenizer)},
            "tinycode": {
                "path": str(tinycode / "model.onnx"),
                "tokenizer": str(tinycode / "tokenizer.json"),
            },
        },
        "workloads": {
            "affine": {
                "mode": "interactive",
                "task": "infer",
                "model": "affine",
                "batching": {"max_batch_size": 8, "max_wait_ms": 1.5},
            },
            "words": {"mode": "interactive", "task": "embed", "model": "enc"},
            # Two requests make a batch, however long the second takes to come.
            "fixed": {
                "mode": "interactive",
                "task": "infer",
                "model": "fixed",
                "batching": {"max_batch_size": 2, "max_wait_ms": 60_000},
            },
            "ragged": {
                "mode": "interactive",
                "task": "infer",
                "model": "ragged",
                "batching": {"max_batch_size": 2, "max_wait_ms": 60_000},
            },
            "code": {
                "mode": "interactive",
                "task": "generate",
                "model": "tinycode",
                "generation": {"max_new_tokens": 4, "temperature": 0},
            },
        },
    }
    path = folder / "workloads.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # Bodies decoded to more than 16 KiB are decoded on the offload thread.
    with ServerThread(path, max_body_bytes=LIMIT, offload_body_bytes=16 * 1024) as running:
        yield running


@pytest.fixture
def client(server: ServerThread) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


# ---- compressed request bodies ---------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("coding", CODINGS)
def test_compressed_requests_as_tritonclient_sends_them(
    client: Any, coding: str, binary: bool
) -> None:
    # Binary: Inference-Header-Content-Length counts the decoded body's JSON header.
    for x in (X, np.ones((3000, 4), np.float32)):  # 32 B; 48 kB, decoded on the thread
        sent = tensor("x", x, "FP32", binary)
        # A compressed answer asked for comes back plain, which the client reads as well.
        result = client.infer(
            "affine",
            [sent],
            request_compression_algorithm=coding,
            response_compression_algorithm=coding,
        )
        assert np.array_equal(result.as_numpy("y"), 2 * x + 1)


@pytest.mark.parametrize("coding", CODINGS)
async def test_compressed_requests_from_the_aio_client(server: ServerThread, coding: str) -> None:
    client = triton_aio.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        sent = tensor("x", X, "FP32", True)
        result = await client.infer("affine", [sent], request_compression_algorithm=coding)
        assert np.array_equal(result.as_numpy("y"), 2 * X + 1)
    finally:
        await client.close()


def test_a_compressed_tensor_over_the_limit_once_decoded_is_a_413(client: Any) -> None:
    zeros = np.zeros((5000, 4), dtype=np.float32)  # 80 kB: over 64 KiB, ~100 B as gzip
    for coding in CODINGS:
        sent = tensor("x", zeros, "FP32", True)
        error = refused(
            lambda: client.infer("affine", [sent], request_compression_algorithm=coding)  # noqa: B023
        )
        assert error.status() == "413", error
        assert f"decoded from {coding}, over the limit of {LIMIT} bytes" in error.message()


def post(server: ServerThread, path: str, body: bytes, encoding: str) -> httpx.Response:
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)


def test_a_gzip_bomb_is_a_413(server: ServerThread) -> None:
    bomb = gzip.compress(b" " * (32 * 1024 * 1024), 9)  # 32 MiB of spaces in ~32 kB
    assert len(bomb) < LIMIT
    answer = post(server, "/v2/models/affine/infer", bomb, "gzip")
    assert answer.status_code == 413, answer.text
    assert "decoded from gzip, over the limit" in answer.json()["error"]


def test_a_malformed_or_unknown_encoding_is_refused(server: ServerThread) -> None:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]})
    for encoding, status, message in [
        ("gzip", 400, "Content-Encoding: the body is not valid gzip data"),
        ("deflate", 400, "Content-Encoding: the body is not valid deflate data"),
        ("br", 415, "Content-Encoding: expected gzip, deflate or identity (one coding)"),
        ("zstd", 415, "found 'zstd'"),
    ]:
        answer = post(server, "/v2/models/affine/infer", body, encoding)
        assert answer.status_code == status, (encoding, answer.text)
        assert message in answer.json()["error"], answer.text
    cut = gzip.compress(body)[:-4]
    answer = post(server, "/v2/models/affine/infer", cut, "gzip")
    assert answer.status_code == 400 and "cut short" in answer.json()["error"], answer.text


def test_every_route_that_reads_a_body_decodes_it(server: ServerThread) -> None:
    body = gzip.compress(orjson.dumps({"model": "words", "input": ["one", "two"]}))
    answer = post(server, "/v1/embeddings", body, "gzip")
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2
    answer = post(server, "/v1/embeddings", body, "br")  # in the OpenAI shape
    assert answer.status_code == 415
    assert answer.json()["error"]["code"] == "unsupported_content_encoding"


# ---- model config ----------------------------------------------------------------------


def test_model_config_describes_what_metadata_does(client: Any) -> None:
    config = client.get_model_config("affine")
    assert config == {
        "name": "affine",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": 8,  # the workload's batching; rows are left out of dims
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        "dynamic_batching": {"max_queue_delay_microseconds": 1500},
    }
    assert client.get_model_config("affine", model_version="1") == config
    # An embed workload batches texts, one a row: rows alone are Triton's [1] reshaped
    # to [], and the vectors' size is the model's.
    words = client.get_model_config("words")
    assert words["max_batch_size"] == 32 and "dynamic_batching" in words
    text = {"name": "text", "data_type": "TYPE_STRING", "dims": [1], "reshape": {"shape": []}}
    assert words["input"] == [text]
    assert words["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [DIM]}]
    embedding = client.get_model_metadata("words")["outputs"]
    assert embedding == [{"name": "embedding", "datatype": "FP32", "shape": [-1, DIM]}]
    assert "model_configuration" in client.get_server_metadata()["extensions"]
    for call in (
        lambda: client.get_model_config("affine", model_version="2"),
        lambda: client.get_model_config("ghost"),
    ):
        assert refused(call).status() == "404"


# ---- statistics ------------------------------------------------------------------------


def stats_of(client: Any, name: str) -> dict[str, Any]:
    [found] = client.get_inference_statistics(name)["model_stats"]
    assert found["name"] == name and found["version"] == "1", found
    return cast(dict[str, Any], found)


def grew(before: dict[str, Any], after: dict[str, Any], figure: str) -> int:
    return int(
        after["inference_stats"][figure]["count"] - before["inference_stats"][figure]["count"]
    )


def rows_run(stats: dict[str, Any]) -> int:
    """Items over all the model's runs: batch sizes times their runs."""
    return sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])


def test_statistics_count_what_was_sent(client: Any) -> None:
    before = stats_of(client, "affine")
    sent_at_ms = int(time.time() * 1000)
    for _ in range(3):
        client.infer("affine", [tensor("x", X, "FP32", True)])
    bad = refused(lambda: client.infer("affine", [tensor("x", X.astype(np.float64), "FP64", True)]))
    assert bad.status() == "400", bad
    after = stats_of(client, "affine")

    assert grew(before, after, "success") == 3
    assert grew(before, after, "fail") == 1  # the refused one: no queue, no run
    for figure in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert grew(before, after, figure) == 3, figure
    # Each request's 2 rows are 2 inferences (Triton's inference_count).
    assert after["inference_count"] - before["inference_count"] == 6
    # However the batcher grouped them, the runs held the three requests' rows.
    assert rows_run(after) - rows_run(before) == 6
    runs = after["execution_count"] - before["execution_count"]
    assert 1 <= runs <= 3
    assert (
        sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    )
    stats = after["inference_stats"]
    assert stats["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    assert stats["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    assert stats["fail"]["ns"] > before["inference_stats"]["fail"]["ns"]
    assert stats["cache_hit"] == stats["cache_miss"] == {"count": 0, "ns": 0}
    assert after["last_inference"] >= sent_at_ms
    assert client.get_inference_statistics("affine", "1")["model_stats"][0]["name"] == "affine"


def batch_sizes(before: dict[str, Any], after: dict[str, Any]) -> dict[int, int]:
    """The runs between two statistics, by their rows (batch_stats' batch_size)."""
    runs = {b["batch_size"]: b["compute_infer"]["count"] for b in before["batch_stats"]}
    grown = {
        b["batch_size"]: b["compute_infer"]["count"] - runs.get(b["batch_size"], 0)
        for b in after["batch_stats"]
    }
    return {rows: count for rows, count in grown.items() if count}


def test_statistics_count_rows_as_inferences_and_runs_as_executions(client: Any) -> None:
    """As Triton counts: a request of 2 rows is one request (success, queue, compute)
    of 2 inferences (inference_count), run in one execution of batch size 2."""
    before = stats_of(client, "affine")
    client.infer("affine", [tensor("x", X, "FP32", True)])
    after = stats_of(client, "affine")
    for figure in ("success", "queue", "compute_infer"):
        assert grew(before, after, figure) == 1, figure
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["execution_count"] - before["execution_count"] == 1
    assert batch_sizes(before, after) == {2: 1}


def test_statistics_of_a_model_that_takes_no_batch_count_a_run_per_request(
    server: ServerThread, client: Any
) -> None:
    """A model whose first dim is fixed runs each request alone, though the batcher
    hands out two at once: two executions of one inference each (Triton counts a
    request to a model of max_batch_size 0 as one inference)."""
    before = stats_of(client, "fixed")
    url = server.url.removeprefix("http://")
    with triton.InferenceServerClient(url, concurrency=2) as both:
        sent = [both.async_infer("fixed", [tensor("x", X, "FP32", True)]) for _ in range(2)]
        for request in sent:
            assert np.array_equal(request.get_result().as_numpy("y"), -X)
    after = stats_of(client, "fixed")
    assert grew(before, after, "success") == 2
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["execution_count"] - before["execution_count"] == 2
    assert batch_sizes(before, after) == {1: 2}


def test_statistics_count_a_run_per_shape_of_a_batch_of_two_lengths(
    server: ServerThread, client: Any
) -> None:
    """Two requests in one batch whose rows differ in length cannot stack: two
    executions of one inference each, as Triton's batcher runs them."""
    before = stats_of(client, "ragged")
    url = server.url.removeprefix("http://")
    xs = [X, X[:, :3].copy()]
    with triton.InferenceServerClient(url, concurrency=2) as both:
        sent = [both.async_infer("ragged", [tensor("x", x[:1], "FP32", True)]) for x in xs]
        for x, request in zip(xs, sent, strict=True):
            assert np.array_equal(request.get_result().as_numpy("y"), -x[:1])
    after = stats_of(client, "ragged")
    assert grew(before, after, "success") == 2
    assert after["execution_count"] - before["execution_count"] == 2
    assert batch_sizes(before, after) == {1: 2}


def test_statistics_of_an_embed_workload_count_each_text(client: Any) -> None:
    before = stats_of(client, "words")
    texts = np.array([b"one", b"two"], dtype=np.object_)
    result = client.infer("words", [tensor("text", texts, "BYTES", True)])
    assert result.as_numpy("embedding").shape[0] == 2
    after = stats_of(client, "words")
    assert grew(before, after, "success") == 1 and grew(before, after, "queue") == 1
    assert after["inference_count"] - before["inference_count"] == 2
    assert rows_run(after) - rows_run(before) == 2


def test_statistics_of_a_generate_workload_count_each_sequence(
    server: ServerThread, client: Any
) -> None:
    before = stats_of(client, "code")
    openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    whole = openai.completions.create(model="code", prompt="def f(x):")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    chunks = openai.completions.create(model="code", prompt="class A:", stream=True)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length")
    with pytest.raises(BadRequestError, match="expected token ids from 0 to"):
        openai.completions.create(model="code", prompt=[10**9])  # beyond the vocabulary

    def settled() -> bool:  # a step is observed just after its tokens are handed out
        now = stats_of(client, "code")
        return grew(before, now, "success") >= 2 and grew(before, now, "queue") >= 2

    wait_until(settled, "two sequences in the statistics")
    after = stats_of(client, "code")
    assert grew(before, after, "success") == 2
    assert grew(before, after, "fail") == 1
    for figure in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert grew(before, after, figure) == 2, figure
    assert after["inference_count"] - before["inference_count"] == 2
    # One after the other: each sequence's own prefill, and its decode steps if any.
    assert after["execution_count"] - before["execution_count"] >= 2
    assert (
        sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    )
    assert after["inference_stats"]["compute_infer"]["ns"] > 0


def test_statistics_of_every_workload_and_of_unknown_ones(client: Any) -> None:
    every = client.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == ["affine", "words", "fixed", "ragged", "code"]
    assert "statistics" in client.get_server_metadata()["extensions"]
    for call in (
        lambda: client.get_inference_statistics("ghost"),
        lambda: client.get_inference_statistics("affine", "2"),
    ):
        error = refused(call)
        assert error.status() == "404", error
        assert error.message(), error


# ---- extensions lanes refuses ----------------------------------------------------------

REFUSED: list[tuple[str, Callable[[Any], Any], str]] = [
    (
        "shm register",
        lambda c: c.register_system_shared_memory("r", "/k", 64),
        "system shared memory",
    ),
    ("shm status", lambda c: c.get_system_shared_memory_status(), "system shared memory"),
    ("shm region", lambda c: c.get_system_shared_memory_status("r"), "system shared memory"),
    ("shm unregister", lambda c: c.unregister_system_shared_memory(), "system shared memory"),
    (
        "cuda register",
        lambda c: c.register_cuda_shared_memory("r", "aGk=", 0, 64),
        "CUDA shared memory",
    ),
    ("cuda status", lambda c: c.get_cuda_shared_memory_status(), "CUDA shared memory"),
    ("cuda unregister", lambda c: c.unregister_cuda_shared_memory("r"), "CUDA shared memory"),
    ("index", lambda c: c.get_model_repository_index(), "model repository"),
    ("load", lambda c: c.load_model("affine"), "model repository"),
    ("unload", lambda c: c.unload_model("affine"), "model repository"),
    ("trace", lambda c: c.get_trace_settings(), "trace"),
    ("model trace", lambda c: c.get_trace_settings("affine"), "trace"),
    ("trace update", lambda c: c.update_trace_settings(settings={"trace_rate": "1"}), "trace"),
    ("log", lambda c: c.get_log_settings(), "logging"),
    ("log update", lambda c: c.update_log_settings({"log_verbose_level": 1}), "logging"),
]
INSTEAD = {
    "system shared memory": "send tensors in the request body",
    "CUDA shared memory": "send tensors in the request body",
    "model repository": "workloads.yaml",
    "trace": "LANES_TRACING",
    "logging": "LANES_LOG_LEVEL",
}


@pytest.mark.parametrize(
    ("call", "extension"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_an_extension_lanes_lacks_is_a_400_saying_what_to_do(
    client: Any, call: Callable[[Any], Any], extension: str
) -> None:
    error = refused(lambda: call(client))
    assert error.status() == "400", error
    assert "lanes does not support Triton's" in error.message(), error
    assert extension in error.message() and INSTEAD[extension] in error.message(), error


def test_a_404_lists_every_route(server: ServerThread) -> None:
    for path in ("/v2/nowhere", "/nowhere"):
        answer = httpx.get(f"{server.url}{path}", timeout=30)
        assert answer.status_code == 404
        body = answer.json()
        message = body["error"] if path.startswith("/v2") else body["error"]["message"]
        for served in (
            "/healthz",
            "/v2/health/ready",
            "/v1/models/{name}",
            "/v2/models/{name}, ",
            "/v2/models/{name}/ready",
            "/v2/models/{name}/config",
            "/v1/files/{file_id}/content",
            "/v1/batches/{batch_id}/cancel",
            "/versions/1/",
        ):
            assert served in message, (served, message)
        assert "/internal" not in message and "sharedmemory" not in message
