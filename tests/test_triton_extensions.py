"""What tritonclient sends beyond plain inference: compressed bodies (gzip, deflate;
sync and aio clients), the model config, and the extensions lanes refuses with a 400
that says what to do instead. A real uvicorn on 127.0.0.1, tiny real ONNX models."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
import yaml

from tests.flows_fixtures import embed_model, infer_model
from tests.servers import ServerThread
from tests.test_triton_client import X, refused, tensor

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024
CODINGS = ["gzip", "deflate"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("triton-ext")
    enc, tokenizer = embed_model(folder / "enc")
    spec = {
        "version": 1,
        "models": {
            "affine": {"path": str(infer_model(folder / "affine"))},
            "enc": {"path": str(enc), "tokenizer": str(tokenizer)},
        },
        "workloads": {
            "affine": {
                "mode": "interactive",
                "task": "infer",
                "model": "affine",
                "batching": {"max_batch_size": 8, "max_wait_ms": 1.5},
            },
            "words": {"mode": "interactive", "task": "embed", "model": "enc"},
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
    # One text per row and no dim after it: whole shapes, as metadata gives them.
    words = client.get_model_config("words")
    assert words["max_batch_size"] == 0 and "dynamic_batching" not in words
    assert words["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": [-1]}]
    assert words["output"] == [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [-1, -1]}]
    assert "model_configuration" in client.get_server_metadata()["extensions"]
    for call in (
        lambda: client.get_model_config("affine", model_version="2"),
        lambda: client.get_model_config("ghost"),
    ):
        assert refused(call).status() == "404"


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
    ("stats", lambda c: c.get_inference_statistics(), "statistics"),
    ("model stats", lambda c: c.get_inference_statistics("affine"), "statistics"),
    ("version stats", lambda c: c.get_inference_statistics("affine", "1"), "statistics"),
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
    "statistics": "/metrics",
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
