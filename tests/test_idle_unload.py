"""Scale to zero inside a replica (`idle_unload_s`): a workload idle that long unloads
its model session, and the next requests wait for one load and are answered.

Real uvicorn on 127.0.0.1 and the demo models. The server's clock is a JumpClock, so
the idle time passes when a test jumps it; a load after an unload waits at a gate
(tests/gates.py: `load_gates`) as long as a test needs it to be "loading".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from lanes.backfill import CONTENT_TYPE, batch_path
from lanes.batchframe import decode_outputs, encode_items
from lanes.errors import SpecError
from lanes.serving.residency import Presence, Residency
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.gates import WAIT_S, Gate, JumpClock, wait_until
from tests.servers import ServerThread, write_spec

pytestmark = pytest.mark.slow

INTERNAL_KEY = "internal-test-key"
IDLE_S = 3600  # far beyond the real time a test takes: only a jump makes it idle
WORKLOADS = f"""\
  search:
    mode: interactive
    task: embed
    model: minilm
    idle_unload_s: {IDLE_S}
  tiny:
    mode: interactive
    task: infer
    model: classifier
    idle_unload_s: {IDLE_S}
  always:
    mode: interactive
    task: embed
    model: minilm
"""
TEXT = "a search query, embedded after a nap"
FEATURES = {
    "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1, 0]}]
}


class Served:
    def __init__(self, server: ServerThread, clock: JumpClock, load: Gate) -> None:
        self.server = server
        self.clock = clock
        self.load = load  # held closed: a load after an unload waits at it
        self.http = httpx.Client(base_url=server.url, timeout=WAIT_S)

    def worker(self, name: str) -> BatchWorker:
        return self.server.app.state.workers[name]

    def residency(self, name: str) -> Residency:
        residency = self.worker(name).residency
        assert residency is not None
        return residency

    def loads(self, model: str) -> int:
        assert self.server.runtime is not None
        return self.server.runtime.loads[self.server.spec.models[model].path]

    def embed(self, text: str = TEXT, timeout_ms: int | None = None) -> httpx.Response:
        headers = {"X-Timeout-Ms": str(timeout_ms)} if timeout_ms is not None else {}
        body = {"model": "search", "input": text}
        return self.http.post("/v1/embeddings", json=body, headers=headers)

    def unload(self, name: str) -> None:
        """Jump past idle_unload_s and wait for the idle check to unload `name`."""
        self.clock.jump(IDLE_S + 1)
        residency = self.residency(name)
        wait_until(lambda: residency.state is Presence.UNLOADED, f"{name} unloaded")

    def metric(self, name: str, workload: str, reason: str | None = None) -> float:
        """One sample; `reason`: the label of the model-load series."""
        text = self.http.get("/metrics").text
        # prometheus_client writes labels sorted by name.
        labels = (f'reason="{reason}",' if reason else "") + f'workload="{workload}"'
        found = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M)
        assert found is not None, f"no {name}{{{labels}}} in /metrics"
        return float(found.group(1))


@pytest.fixture
def served(demo_models: Path, tmp_path: Path) -> Iterator[Served]:
    clock, load = JumpClock(), Gate()
    spec = write_spec(tmp_path, demo_models, WORKLOADS)
    gates = {"minilm": load, "classifier": load}
    with ServerThread(spec, clock=clock, load_gates=gates, internal_key=INTERNAL_KEY) as s:
        yield Served(s, clock, load)
        load.open()  # never leave a load waiting at the end


def vector(response: httpx.Response) -> list[float]:
    assert response.status_code == 200, response.text
    data: list[float] = response.json()["data"][0]["embedding"]
    return data


def test_requests_while_unloaded_and_loading_are_answered_after_one_load(served: Served) -> None:
    warm = vector(served.embed())
    assert served.loads("minilm") == 2  # search and always, at start-up
    served.unload("search")
    assert served.residency("search").model.loaded is False
    assert served.worker("always").residency is None  # without idle_unload_s: stays loaded
    assert served.http.get("/readyz").status_code == 200
    assert served.metric("lanes_model_loaded", "search") == 0

    calls = 8
    with ThreadPoolExecutor(calls) as pool, served.load.closed():
        # The first arrival finds the model unloaded and starts its load, which waits
        # at the gate; the others arrive while it loads. All of them wait in the queue.
        answers: list[Future[httpx.Response]] = [pool.submit(served.embed)]
        served.load.wait_held(1)
        answers += [pool.submit(served.embed) for _ in range(calls - 1)]
        worker = served.worker("search")
        wait_until(lambda: len(worker.queue) == calls, f"{calls} requests queued")
        assert served.residency("search").state is Presence.LOADING
        ready = served.http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["workloads"]["search"] == {"state": "ready"}
        served.load.open()
        vectors = [vector(a.result(WAIT_S)) for a in answers]

    assert vectors == [warm] * calls  # the same session's answers, none failed
    assert served.loads("minilm") == 3  # one load for all of them
    assert served.metric("lanes_model_loads_total", "search", "wake") == 1
    assert served.metric("lanes_model_loads_total", "search", "startup") == 1
    assert served.metric("lanes_model_unloads_total", "search") == 1
    assert served.metric("lanes_model_loaded", "search") == 1
    assert served.metric("lanes_model_load_seconds_count", "search", "wake") == 1


def test_every_workload_s_start_up_load_counts_as_a_load(served: Served) -> None:
    for name in ("search", "tiny", "always"):  # with idle_unload_s or without
        assert served.metric("lanes_model_loads_total", name, "startup") == 1
        assert served.metric("lanes_model_load_seconds_count", name, "startup") == 1
        assert served.metric("lanes_model_loaded", name) == 1
    for name in ("search", "tiny"):  # nothing unloaded yet, so nothing woke
        assert served.metric("lanes_model_loads_total", name, "wake") == 0
    help_text = served.http.get("/metrics").text
    assert "startup (the server's start, every interactive workload)" in help_text


def test_the_idle_timer_unloads_after_idle_unload_s_on_the_clock_and_not_before(
    served: Served,
) -> None:
    infer = "/v2/models/tiny/infer"
    first = served.http.post(infer, json=FEATURES)
    assert first.status_code == 200, first.text
    residency = served.residency("tiny")

    served.clock.jump(IDLE_S - 600)  # idle, but for less than idle_unload_s
    seen = residency.checks
    wait_until(lambda: residency.checks >= seen + 3, "three idle checks")
    assert residency.state is Presence.LOADED
    assert served.metric("lanes_model_loaded", "tiny") == 1

    served.clock.jump(601)
    wait_until(lambda: residency.state is Presence.UNLOADED, "tiny unloaded")
    search = served.residency("search")  # idle just as long, checked by its own watcher
    wait_until(lambda: search.state is Presence.UNLOADED, "search unloaded")
    assert served.metric("lanes_model_loaded", "tiny") == 0
    assert served.http.get("/readyz").status_code == 200

    again = served.http.post(infer, json=FEATURES)  # the gate is open: loads at once
    assert again.status_code == 200, again.text
    assert again.json()["outputs"] == first.json()["outputs"]
    assert served.loads("classifier") == 2


def test_a_deadline_that_passes_while_loading_is_a_504_and_the_load_serves_the_rest(
    served: Served,
) -> None:
    warm = vector(served.embed())
    served.unload("search")
    with ThreadPoolExecutor(2) as pool, served.load.closed():
        late = pool.submit(served.embed, TEXT, 200)  # starts the load, which waits
        served.load.wait_held(1)
        patient = pool.submit(served.embed)
        worker = served.worker("search")
        wait_until(lambda: late.done() or len(worker.queue) == 2, "both queued")
        # Its deadline passes in the queue while the load is held at the gate.
        answer = late.result(WAIT_S)
        assert answer.status_code == 504, answer.text
        assert "deadline" in answer.json()["error"]["message"]
        assert served.residency("search").state is Presence.LOADING
        assert not patient.done()
        served.load.open()
        assert vector(patient.result(WAIT_S)) == warm
    assert served.loads("minilm") == 3


def test_offline_items_on_the_endpoint_wake_an_unloaded_model_too(served: Served) -> None:
    warm = vector(served.embed())
    served.unload("search")
    task = served.worker("search").task
    items = [task.prepare(TEXT), task.prepare("another text")]
    headers = {"content-type": CONTENT_TYPE, "authorization": f"Bearer {INTERNAL_KEY}"}
    answer = served.http.post(batch_path("search"), content=encode_items(items), headers=headers)
    assert answer.status_code == 200, answer.text
    vectors = decode_outputs(answer.content, len(items), "embed")
    np.testing.assert_allclose(vectors[0], warm, atol=1e-5)  # batched with another text
    assert served.residency("search").state is Presence.LOADED
    assert served.loads("minilm") == 3


def test_idle_unload_s_is_checked_when_the_spec_loads(demo_models: Path, tmp_path: Path) -> None:
    bad = """\
  zero:
    mode: interactive
    task: embed
    model: minilm
    idle_unload_s: 0
  writer:
    mode: interactive
    task: generate
    model: tinycode
    idle_unload_s: 60
  nightly:
    mode: offline
    task: embed
    model: minilm
    input: data/
    output: out/
    idle_unload_s: 60
"""
    with pytest.raises(SpecError) as raised:
        load_spec(write_spec(tmp_path, demo_models, bad), Settings())
    message = str(raised.value)
    assert "workloads.zero.idle_unload_s: expected a value > 0, found 0" in message
    assert "workloads.writer.idle_unload_s: `idle_unload_s` unloads an embed or infer" in message
    assert "workloads.nightly.idle_unload_s: `idle_unload_s` applies to interactive" in message


def test_a_load_that_fails_answers_its_waiting_requests_and_the_next_one_tries_again(
    demo_models: Path, tmp_path: Path
) -> None:
    model = tmp_path / "classifier.onnx"
    model.write_bytes((demo_models / "classifier" / "model.onnx").read_bytes())
    spec = tmp_path / "workloads.yaml"
    spec.write_text(f"""\
version: 1
models:
  mine: {{path: {model}}}
workloads:
  tiny:
    mode: interactive
    task: infer
    model: mine
    idle_unload_s: {IDLE_S}
""")
    clock = JumpClock()
    with ServerThread(spec, clock=clock) as server:
        served = Served(server, clock, Gate())
        infer = "/v2/models/tiny/infer"
        assert served.http.post(infer, json=FEATURES).status_code == 200
        served.unload("tiny")
        model.rename(tmp_path / "elsewhere.onnx")  # the file is gone when it must load

        lost = served.http.post(infer, json=FEATURES)
        # Retryable, as the next request loads again: no x-should-retry: false.
        assert lost.status_code == 503, lost.text
        assert lost.headers["retry-after"] == "1" and "x-should-retry" not in lost.headers
        assert f"no model file at {model}" in lost.json()["error"]
        assert lost.json()["code"] == "model_unavailable"
        assert served.residency("tiny").state is Presence.UNLOADED
        assert served.http.get("/readyz").status_code == 200  # it can still wake

        (tmp_path / "elsewhere.onnx").rename(model)
        back = served.http.post(infer, json=FEATURES)
        assert back.status_code == 200, back.text
        assert served.metric("lanes_model_loads_total", "tiny", "wake") == 2
        assert served.metric("lanes_model_loaded", "tiny") == 1


def test_offline_threads_session_goes_with_an_unload_and_comes_back_with_the_next_batch(
    demo_models: Path, tmp_path: Path
) -> None:
    """The offline threads' own session (loaded with the first offline batch) is
    released with the model, and the next offline batch loads both again."""
    beside = f"""\
  beside:
    mode: interactive
    task: embed
    model: minilm
    idle_unload_s: {IDLE_S}
    batching: {{offline_threads: 1}}
"""
    clock, load = JumpClock(), Gate()  # open: it only counts the loads
    spec = write_spec(tmp_path, demo_models, beside)
    gates = {"minilm": load}
    with ServerThread(spec, clock=clock, load_gates=gates, internal_key=INTERNAL_KEY) as server:
        served = Served(server, clock, load)
        assert served.worker("beside").offline.beside_threads == 1
        task = served.worker("beside").task
        items = [task.prepare(TEXT), task.prepare("another text")]
        headers = {"content-type": CONTENT_TYPE, "authorization": f"Bearer {INTERNAL_KEY}"}

        def offline_batch() -> list[np.ndarray]:
            answer = served.http.post(
                batch_path("beside"), content=encode_items(items), headers=headers
            )
            assert answer.status_code == 200, answer.text
            return list(decode_outputs(answer.content, len(items), "embed"))

        first = offline_batch()
        assert served.loads("minilm") == 2, "the model's session and the offline threads' own"
        served.unload("beside")
        again = offline_batch()
        # The model's own load runs on its thread meanwhile, the batch not waiting for it.
        wait_until(lambda: served.loads("minilm") == 4, "both loaded again")
        for got, want in zip(again, first, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6)
