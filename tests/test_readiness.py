"""Readiness over real HTTP: one registry answers /readyz, /v2/health/ready and
/v2/models/{name}/ready for every workload the server hosts, generate included, and a
workload that fails to load with any exception says so, once, by name."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper, save_model

import lanes
from tests import servers
from tests.flows_fixtures import wait_until, write_spec
from tests.servers import ServerThread

WORKLOADS: dict[str, dict[str, Any]] = {
    "affine": {"mode": "interactive", "task": "infer", "model": "affine"},
    "code": {"mode": "interactive", "task": "generate", "model": "dec"},
    "broken": {"mode": "interactive", "task": "infer", "model": "broken"},
    "nightly": {
        "mode": "offline",
        "task": "infer",
        "model": "affine",
        "input": "in/",
        "output": "out/",
    },
}


def reshape_model(path: Path) -> Path:
    """x float32 [batch, 3] -> x reshaped to [2, 2]: it loads, and fails on any input
    (3 values are not 4), so the server's warm-up fails with onnxruntime's own error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        initializer=[numpy_helper.from_array(np.array([2, 2], dtype=np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


class Started(ServerThread):
    """A server that is up (live), whether or not its workloads load."""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_until(self._live, 60, "the server answers /healthz")
        return self

    def _live(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("readiness")
    path = write_spec(folder, WORKLOADS)
    spec = yaml.safe_load(path.read_text())
    spec["models"]["broken"] = {"path": str(reshape_model(folder / "models" / "broken.onnx"))}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def loaded(spec_path: Path) -> Iterator[tuple[str, list[logging.LogRecord]]]:
    """The server once loading has settled, and the lanes.serving error records."""
    records: list[logging.LogRecord] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    kept = Kept(logging.ERROR)
    logger = logging.getLogger("lanes.serving")
    logger.addHandler(kept)
    try:
        with Started(spec_path) as server:
            wait_until(lambda: _status(server.url) != "loading", 120, "loading settles")
            yield server.url, records
    finally:
        logger.removeHandler(kept)


def _status(url: str) -> str:
    body: dict[str, Any] = httpx.get(f"{url}/readyz", timeout=5).json()
    return str(body["status"])


def test_a_load_failure_of_any_kind_is_reported_by_name(
    loaded: tuple[str, list[logging.LogRecord]],
) -> None:
    url, records = loaded
    for path in ("/readyz", "/v2/health/ready"):
        answer = httpx.get(url + path, timeout=5)
        assert answer.status_code == 503
        body = answer.json()
        assert body["status"] == "failed" and body["ready"] is False
        assert body["error"].startswith("workload broken: ")
        states = {name: w["state"] for name, w in body["workloads"].items()}
        assert states == {"affine": "ready", "code": "ready", "broken": "failed"}
    # Logged once, with the workload's name.
    failures = [r for r in records if "broken" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in records]
    assert failures[0].getMessage().startswith("workload broken failed to load: ")


def test_model_ready_answers_for_every_task(loaded: tuple[str, list[logging.LogRecord]]) -> None:
    url, _ = loaded
    for name in ("affine", "code"):  # code is a generate workload
        answer = httpx.get(f"{url}/v2/models/{name}/ready", timeout=5)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"name": name, "ready": True}
    assert httpx.get(f"{url}/v2/models/code/versions/1/ready", timeout=5).status_code == 200
    broken = httpx.get(f"{url}/v2/models/broken/ready", timeout=5)
    assert broken.status_code == 503
    assert broken.json()["error"].startswith("workload 'broken' failed to load: ")
    assert httpx.get(f"{url}/v2/models/nightly/ready", timeout=5).status_code == 400
    assert httpx.get(f"{url}/v2/models/nope/ready", timeout=5).status_code == 404


def test_a_call_to_a_failed_workload_says_it_failed(
    loaded: tuple[str, list[logging.LogRecord]], spec_path: Path
) -> None:
    url, records = loaded
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    answer = httpx.post(f"{url}/v2/models/broken/infer", json=body, timeout=5)
    assert answer.status_code == 500
    assert "failed to load" in answer.json()["error"]
    assert answer.json()["code"] == "model_error"  # beside v2's "error", for the SDK
    with lanes.Client(url, spec=spec_path) as client:
        with pytest.raises(lanes.ModelError, match="failed to load") as failed:
            client.call("broken", {"x": [[1.0, 2.0, 3.0]]})
        assert failed.value.code == "model_error"
    good = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    answer = httpx.post(f"{url}/v2/models/affine/infer", json=good, timeout=5)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [3, 5, 7, 9]
    # The load's failure was logged once; the calls to it add no tracebacks.
    failures = [r.getMessage() for r in records if "broken" in r.getMessage()]
    assert len(failures) == 1, failures


def test_every_readiness_route_answers_503_while_draining(
    demo_models: Path, tmp_path: Path
) -> None:
    """On SIGTERM the server drains: a balancer's health check on any readiness route,
    the model's own included, takes the replica out, while requests are still served."""
    workloads = "  flowers: {mode: interactive, task: infer, model: classifier}\n"
    spec = servers.write_spec(tmp_path, demo_models, workloads)
    model_ready = ("/v2/models/flowers/ready", "/v2/models/flowers/versions/1/ready")
    with ServerThread(spec) as server:
        for path in model_ready:
            assert httpx.get(f"{server.url}{path}", timeout=5).status_code == 200
        server.app.drain()  # what SIGTERM does first
        for path in ("/readyz", "/v2/health/ready", *model_ready):
            answer = httpx.get(f"{server.url}{path}", timeout=5)
            assert answer.status_code == 503, (path, answer.text)
        assert "stopping" in httpx.get(f"{server.url}{model_ready[0]}", timeout=5).json()["error"]
        row = {
            "name": "features",
            "shape": [1, 4],
            "datatype": "FP32",
            "data": [5.1, 3.5, 1.4, 0.2],
        }
        served = httpx.post(f"{server.url}/v2/models/flowers/infer", json={"inputs": [row]})
        assert served.status_code == 200, served.text
