"""Offline work on the endpoint's sessions: a real uvicorn server, real onnxruntime on
the tests' tiny models, and real flow runs whose runner is that endpoint.

The server's offline lane runs only when no interactive request waits; the gated
model (tests/gates.py) holds an offline batch on the model while an interactive
request arrives, so the order of runs is forced, never timed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import orjson
import pytest
from onnx import TensorProto, helper, numpy_helper, save_model

from lanes.backfill import CONTENT_TYPE, PROVIDER_HEADER, batch_path
from lanes.batchframe import decode_outputs, encode_items
from lanes.errors import InvalidInput, JobFailed, RequestTooLarge, SpecError
from lanes.flows.batch import offline
from lanes.flows.endpoint import EndpointGone, EndpointModel
from lanes.isolation import Failed
from lanes.runtime import Runtime
from lanes.serving.batching import LaneQueues
from lanes.serving.metrics import Metrics
from lanes.serving.offline_runs import gap_filling_items, stop_delay
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.settings_groups import EndpointRetries
from lanes.specfile import load_spec
from lanes.tasks import load_task
from tests.flows_fixtures import (
    WORDS,
    errors_of,
    outputs_of,
    read_jsonl,
    stops_at_shard_2,
    text,
    wait_until,
    write_jsonl,
    write_spec,
)
from tests.gates import (
    GATE_FILE_ENV,
    PAD_S,
    Gate,
    GatedRuntime,
    ManualClock,
    eventually,
    held_marker,
)
from tests.gates import wait_until as wait_for
from tests.servers import ServerThread

ROOT = Path(__file__).resolve().parent.parent
KEY = "internal-test-key"
# The endpoint runner's attempts as by default, but a short wait between them: a test of
# a gone endpoint pays the whole round of attempts.
QUICK = {"backoff_s": 0.01}
FILLS_DEC = " ".join(["a", "b"] * 32)  # 64 tokens: the whole context of model dec


def live(task: str = "embed", **fields: Any) -> dict[str, Any]:
    model = {"embed": "enc", "infer": "affine", "generate": "dec"}[task]
    return {"mode": "interactive", "task": task, "model": model, **fields}


def batch(task: str = "embed", out: str = "out/", **fields: Any) -> dict[str, Any]:
    model = {"embed": "enc", "infer": "affine", "generate": "dec"}[task]
    return {
        "mode": "offline",
        "task": task,
        "model": model,
        "input": "in/",
        "output": out,
        "batch_size": 16,
        "retries": 0,
        **fields,
    }


def on_endpoint(**runner: Any) -> dict[str, Any]:
    return {"kind": "endpoint", **runner}


def metric(server: ServerThread, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith(name + "{"):
            found = ",".join(sorted(series[len(name) + 1 : -1].split(",")))
            if found == wanted:
                return float(value)
    return None


def send_batch(server: ServerThread, workload: str, items: list[Any], key: str | None) -> Any:
    headers = {"content-type": CONTENT_TYPE}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    url = server.url + batch_path(workload)
    return httpx.post(url, content=encode_items(items), headers=headers, timeout=60)


# ---- the lanes in the server -----------------------------------------------------------


def test_an_interactive_request_waits_behind_at_most_the_one_offline_batch_running(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    """Where the lanes take turns on the model's thread (a GPU, or offline_threads 0)."""
    taking_turns = live(batching={"offline_threads": 0})
    spec = write_spec(tmp_path, {"search": taking_turns, "corpus": batch(runner=on_endpoint())})
    gate = Gate()
    task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    texts = [text(i) for i in range(12)]
    items = [task.prepare(t) for t in texts]
    with serve(spec, gates={"enc": gate}, pad_s=PAD_S, internal_key=KEY) as server:
        results: dict[str, Any] = {}

        def offline_batch() -> None:
            results["offline"] = send_batch(server, "search", items, KEY)

        def interactive() -> None:
            body = {"model": "search", "input": "w1 w2 w3"}
            results["interactive"] = httpx.post(
                f"{server.url}/v1/embeddings", json=body, timeout=60
            )

        with gate.closed():
            sender = threading.Thread(target=offline_batch)
            sender.start()
            gate.wait_held()  # the first offline batch is on the model
            first = gate.held_rows()
            assert 1 <= first < len(items), "the offline items run in several batches"
            caller = threading.Thread(target=interactive)
            caller.start()
            wait_for(
                lambda: (
                    metric(server, "lanes_lane_queue_depth", workload="search", lane="interactive")
                    == 1
                ),
                "the interactive request is queued",
            )
            assert metric(server, "lanes_lane_queue_depth", workload="search", lane="offline") == (
                len(items) - first
            )
            gate.allow(1)  # the offline batch ends...
            gate.wait_held()
            assert gate.held_rows() == 1, "...and the next run is the interactive request's"
            gate.allow(1)
            caller.join(timeout=60)
            assert results["interactive"].status_code == 200
            assert "offline" not in results, "offline items are still waiting their turn"
        sender.join(timeout=60)

        response = results["offline"]
        assert response.status_code == 200
        vectors = decode_outputs(response.content, len(items), "embed")
        for got, want in zip(vectors, task.run(items), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        assert metric(server, "lanes_lane_items_total", workload="search", lane="offline") == 12
        assert metric(server, "lanes_lane_items_total", workload="search", lane="interactive") == 1
        for lane in ("interactive", "offline"):
            busy = metric(server, "lanes_lane_busy_seconds_total", workload="search", lane=lane)
            assert busy is not None and busy > 0
            depth = metric(server, "lanes_lane_queue_depth", workload="search", lane=lane)
            assert depth == 0


def test_an_item_the_model_fails_on_beside_the_interactive_lane_fails_alone(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    """On the CPU an offline batch runs beside the interactive lane, on a thread of its
    own: the one item the model fails on gets its error, its batch-mates their vectors
    (the halves of the failed run are run again as on the model's thread)."""
    spec = write_spec(
        tmp_path,
        {
            "live": live(batching={"offline_threads": 1}),
            "corpus": batch(runner=on_endpoint()),
        },
    )
    weights = tmp_path / "models" / "enc" / "model.onnx"
    model = onnx.load(str(weights))
    table = numpy_helper.to_array(model.graph.initializer[0])
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(table[:-1], "table"))
    save_model(model, str(weights))  # the tokenizer's last word is past the table
    task = load_task("live", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    items = [task.prepare(t) for t in ("w1 w2", f"w1 {WORDS[-1]}", "w3")]
    with serve(spec, internal_key=KEY) as server:
        response = send_batch(server, "live", items, KEY)
        ran = metric(server, "lanes_lane_items_total", workload="live", lane="offline")
    assert response.status_code == 200, response.text
    first, bad, last = decode_outputs(response.content, 3, "embed")
    assert isinstance(bad, Failed) and "Gather" in str(bad.error)
    assert not isinstance(first, Failed) and not isinstance(last, Failed)
    assert ran == 3


def send_and_leave(server: ServerThread, workload: str, items: list[Any]) -> socket.socket:
    """An offline batch sent on a raw connection, which the caller closes (a flow that
    was cancelled or killed) without reading the answer."""
    body = encode_items(items)
    head = (
        f"POST {batch_path(workload)} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: {CONTENT_TYPE}\r\nauthorization: Bearer {KEY}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", server.settings.port), timeout=60)
    sock.sendall(head.encode() + body)
    return sock


def test_an_offline_batch_whose_sender_went_away_leaves_the_queue(
    serve: type[ServerThread], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lanes.serving")
    taking_turns = live(batching={"offline_threads": 0})
    spec = write_spec(tmp_path, {"search": taking_turns, "corpus": batch(runner=on_endpoint())})
    gate = Gate()
    task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    items = [task.prepare(text(i)) for i in range(12)]
    with serve(spec, gates={"enc": gate}, pad_s=PAD_S, internal_key=KEY) as server:
        with gate.closed():
            sock = send_and_leave(server, "search", items)
            gate.wait_held()  # its first run is on the model
            first = gate.held_rows()
            assert first < len(items)
            sock.close()
            wait_for(lambda: "dropped: its sender went" in caplog.text, "the server saw it go")
        answer = httpx.post(
            f"{server.url}/v1/embeddings", json={"model": "search", "input": "w1"}, timeout=60
        )
        assert answer.status_code == 200  # the model is free
        depth = metric(server, "lanes_lane_queue_depth", workload="search", lane="offline")
        assert depth == 0, "the rest of the batch left the queue"
        ran = metric(server, "lanes_lane_items_total", workload="search", lane="offline")
        assert ran is not None and ran <= first, "only the run on the model when it left"


def test_an_offline_generate_batch_whose_sender_went_away_is_aborted(
    serve: type[ServerThread], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lanes.serving")
    spec = write_spec(tmp_path, {"complete": live("generate")})
    gate = Gate()
    task = load_task("complete", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    prompts = [{"prompt": text(i), "max_tokens": 32} for i in range(6)]
    items = [dataclasses.replace(task.prepare(p), ignore_eos=True) for p in prompts]
    with serve(spec, gates={"dec": gate}, internal_key=KEY) as server:
        with gate.closed():
            sock = send_and_leave(server, "complete", items)
            gate.wait_held()  # their prefill is on the model: none can finish before it opens
            sock.close()
            wait_for(lambda: "dropped: its sender went" in caplog.text, "the server saw it go")
        wait_for(
            lambda: (
                metric(
                    server, "lanes_sequences_finished_total", workload="complete", reason="abort"
                )
                == len(items)
            ),
            "every sequence of the batch is aborted",
        )
        assert metric(server, "lanes_sequences_in_flight", workload="complete") == 0
        finished = {
            reason: metric(
                server, "lanes_sequences_finished_total", workload="complete", reason=reason
            )
            for reason in ("length", "stop")
        }
        assert not any(finished.values()), f"none ran to its end: {finished}"
        answered = send_batch(server, "complete", items[:1], KEY)
        assert answered.status_code == 200
        assert answered.headers[PROVIDER_HEADER] == "CPUExecutionProvider"


def test_the_internal_route_refuses_a_missing_or_wrong_key(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, {"search": live()})
    task = load_task("search", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    items = [task.prepare("w1 w2")]
    with serve(spec, internal_key=KEY, api_key="public-key") as server:
        for key in (None, "wrong", "public-key"):
            refused = send_batch(server, "search", items, key)
            assert refused.status_code == 401
            assert "internal key" in refused.json()["error"]["message"]
        # A key that is not ASCII (a byte Starlette reads as Latin-1) is wrong, not a 500.
        latin = httpx.post(
            server.url + batch_path("search"),
            content=encode_items(items),
            headers={"content-type": CONTENT_TYPE, "authorization": b"Bearer \xe9"},
        )
        assert latin.status_code == 401, latin.text
        assert send_batch(server, "search", items, KEY).status_code == 200
        # The internal key opens only the internal route.
        embed = {"model": "search", "input": "w1"}
        headers = {"authorization": f"Bearer {KEY}"}
        assert (
            httpx.post(f"{server.url}/v1/embeddings", json=embed, headers=headers).status_code
            == 401
        )
        # A frame that does not parse is a 400, not a 500.
        garbage = httpx.post(
            server.url + batch_path("search"), content=b"not a frame", headers=headers
        )
        assert garbage.status_code == 400 and "frame" in garbage.json()["error"]["message"]

    with serve(spec) as open_server:  # no key at all: the route is closed
        refused = send_batch(open_server, "search", items, "anything")
        assert refused.status_code == 401
        assert "LANES_INTERNAL_KEY" in refused.json()["error"]["message"]


def spin_model(path: Path) -> Path:
    """x float32 [batch, 4], spin int64 [batch, 1] -> y = x, after a Loop of max(spin)
    empty iterations: a run of spin 10**15 never ends unless it is stopped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["v_in"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["batch", 4]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["spin"], ["trips"], keepdims=0),
            helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body),
        ],
        "spin",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("spin", TensorProto.INT64, ["batch", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(np.array(True), "go")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    save_model(model, str(path))
    return path


def spin_task(
    folder: Path, preempt: bool, offline_threads: int | None = 0, backfilled: bool = False
) -> tuple[Any, Gate]:
    """An infer workload on `spin_model` behind a gate (PAD_S: every run on the model
    thread, none on the event loop), preempting offline runs or not; its offline runs
    take turns with interactive ones unless `offline_threads` run them beside.
    `backfilled`: the spec declares an offline workload that runs on it."""
    model = spin_model(folder / "spin" / "model.onnx")
    batching = {"preempt_offline": preempt, "offline_threads": offline_threads}
    workloads = {"live": live("infer", model="spin", batching=batching)}
    if backfilled:
        workloads["corpus"] = batch("infer", model="spin", runner=on_endpoint())
    spec = {
        "version": 1,
        "models": {"spin": {"path": str(model)}},
        "workloads": workloads,
    }
    (folder / "workloads.yaml").write_text(orjson.dumps(spec).decode())
    gate = Gate()
    runtime = GatedRuntime(Settings(device="cpu"), {model: gate}, pad_s=PAD_S)
    return load_task("live", load_spec(folder / "workloads.yaml", Settings()), runtime), gate


SPIN_X = [[1.0, 2.0, 3.0, 4.0]]
FOREVER = {"x": SPIN_X, "spin": [[10**15]]}
OFFLINE = {"workload": "live", "lane": "offline"}
OFFLINE_ITEMS = ("lanes_lane_items_total", OFFLINE)
INTERACTIVE_ITEMS = ("lanes_lane_items_total", {"workload": "live", "lane": "interactive"})


def test_an_interactive_request_stops_an_offline_run_midway_and_it_runs_again(
    tmp_path: Path,
) -> None:
    """A real run that only a stop ends: the interactive request is answered while it
    runs, its item goes back to the queue and runs again, and once its caller goes
    away that run is stopped too (else the worker's stop would never return)."""
    task, gate = spin_task(tmp_path, preempt=True)

    async def scenario() -> tuple[Any, Metrics, bool]:
        metrics = Metrics()
        worker = BatchWorker(task, metrics)
        worker.start()
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([task.prepare(FOREVER)]))
            await asyncio.to_thread(gate.wait_held)  # on the model thread
        quick = task.prepare({"x": SPIN_X, "spin": [[0]]})
        [answer] = await asyncio.wait_for(worker.submit([quick]), 60)
        preempted = "lanes_lane_preemptions_total"
        await eventually(
            lambda: metrics.registry.get_sample_value(preempted, OFFLINE) == 1,
            "the stopped run's item is counted as preempted",
        )
        pending = not job.done()
        job.cancel()
        await asyncio.wait_for(worker.stop(), 60)
        return answer, metrics, pending

    answer, metrics, pending = asyncio.run(scenario())
    np.testing.assert_array_equal(answer["y"], np.asarray(SPIN_X, dtype=np.float32))
    assert pending, "the offline item never ends by itself"
    assert metrics.registry.get_sample_value("lanes_lane_items_total", OFFLINE) == 0
    busy = metrics.registry.get_sample_value("lanes_lane_busy_seconds_total", OFFLINE)
    assert busy is not None and busy > 0


def test_an_offline_run_expected_to_end_soon_is_stopped_after_the_arrival_waited_as_long(
    tmp_path: Path,
) -> None:
    """An arrival past the middle of an offline run (by the cost model) lets it end,
    and stops it once it has waited as long as the run had run. The spin run never
    ends, so the answer comes from that later stop: no sooner than that wait."""
    task, gate = spin_task(tmp_path, preempt=True)
    expected_s = 0.5

    async def scenario() -> tuple[Any, float, float]:
        metrics = Metrics()
        worker = BatchWorker(task, metrics)
        for _ in range(8):  # what the cost model needs for a fit: runs of one item
            worker.cost.observe(1, 0, expected_s)
        worker.start()
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([task.prepare(FOREVER)]))
            await asyncio.to_thread(gate.wait_held)
            held = time.monotonic()
        await asyncio.sleep(0.6 * expected_s)  # or longer: past the middle either way
        arrived = time.monotonic()
        quick = task.prepare({"x": SPIN_X, "spin": [[0]]})
        [answer] = await asyncio.wait_for(worker.submit([quick]), 60)
        waited = time.monotonic() - arrived
        job.cancel()
        await asyncio.wait_for(worker.stop(), 60)
        return answer, waited, arrived - held

    answer, waited, done_s = asyncio.run(scenario())
    np.testing.assert_array_equal(answer["y"], np.asarray(SPIN_X, dtype=np.float32))
    # The run had run at least `done_s` when the request arrived (it started before
    # the gate let it through); a timer may fire a clock tick early.
    assert waited >= done_s - 0.005, (waited, done_s)


def test_an_offline_run_past_its_middle_ends_before_the_arrival_runs(tmp_path: Path) -> None:
    """An arrival 150 s (on the worker's clock) into an offline run expected to take
    200 s leaves it to end, with a stop set for 150 s later: the run ends first, and
    nothing is given back."""
    from tests.gates import JumpClock

    task, gate = spin_task(tmp_path, preempt=True)
    quick = task.prepare({"x": SPIN_X, "spin": [[0]]})

    async def scenario() -> tuple[list[Any], Any, Metrics]:
        metrics, clock = Metrics(), JumpClock()
        worker = BatchWorker(task, metrics, clock)
        for _ in range(8):  # what the cost model needs for a fit: runs of one item
            worker.cost.observe(1, 0, 200.0)
        worker.start()
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([quick]))
            await asyncio.to_thread(gate.wait_held)
            clock.jump(150.0)
            request = asyncio.create_task(worker.submit([quick]))
            await eventually(lambda: len(worker.queue) == 1, "the request waits")
        outcomes = await asyncio.wait_for(job, 60)
        [answer] = await asyncio.wait_for(request, 60)
        await asyncio.wait_for(worker.stop(), 60)
        return outcomes, answer, metrics

    [outcome], answer, metrics = asyncio.run(scenario())
    np.testing.assert_array_equal(answer["y"], np.asarray(SPIN_X, dtype=np.float32))
    assert not isinstance(outcome, BaseException), outcome
    assert metrics.registry.get_sample_value("lanes_lane_preemptions_total", OFFLINE) == 0
    assert metrics.registry.get_sample_value("lanes_lane_items_total", OFFLINE) == 1


@pytest.mark.parametrize(
    ("done_s", "expected_s", "delay"),
    [
        (0.1, None, 0.0),  # nothing learned yet: stop at once
        (0.1, 1.0, 0.0),  # most of it left
        (0.5, 1.0, 0.5),  # half left: it may end, else stop after as long as it ran
        (0.8, 1.0, 0.8),
        (3.0, 1.0, 3.0),  # past its estimate
    ],
)
def test_stop_delay(done_s: float, expected_s: float | None, delay: float) -> None:
    assert stop_delay(done_s, expected_s) == delay


@pytest.mark.parametrize(
    ("fixed_s", "rate", "items"),
    [
        (0.0005, 0.0, 32),  # no interactive traffic: the largest run that fits
        (0.0005, 67.0, 1),  # busy traffic, little fixed cost: one item per run
        (0.0005, 10.0, 2),
        (0.01, 67.0, 2),  # a larger fixed cost is worth risking more items for
        (0.01, 10.0, 8),
        (0.01, 1.0, 27),
    ],
)
def test_gap_filling_items(fixed_s: float, rate: float, items: int) -> None:
    """Runs of fixed + 5 ms per item, at most 32: the size that does the most work per
    idle second, k rate / (exp(rate c(k)) - 1), falls as arrivals grow frequent."""
    assert gap_filling_items(lambda k: fixed_s + 0.005 * k, rate, 32) == items


def test_gap_filling_items_never_exceeds_most_nor_goes_below_one() -> None:
    assert gap_filling_items(lambda k: 0.0, 100.0, 4) == 4  # runs free of cost
    assert gap_filling_items(lambda k: 10.0 * k, 100.0, 4) == 1  # never ends in a gap


def test_rate_per_second_and_bounded_without_readers() -> None:
    from lanes.serving.metrics import Rate

    rate = Rate(window_s=10.0)
    assert rate.per_second(0.0) == 0.0
    rate.record(1.0)
    rate.record(2.0, 3)
    assert rate.per_second(5.0) == 0.4  # 4 in the last 10 s
    assert rate.per_second(11.5) == 0.3  # the first aged out
    for i in range(10_000):  # an engine's steps for an hour, nobody scraping /metrics
        rate.record(20.0 + i * 0.36)
    assert len(rate._events) <= 28, "only the window's events are kept"
    assert rate.per_second(20.0 + 9_999 * 0.36) == pytest.approx(2.8)


@pytest.mark.parametrize("offline_threads", [0, 1])
def test_an_offline_run_whose_caller_went_away_is_stopped(
    tmp_path: Path, offline_threads: int
) -> None:
    """Without preempt_offline too, and beside the interactive lane too: a run nobody
    waits for ends, and the model is free (the worker's stop returns; the run alone
    would never end)."""
    task, gate = spin_task(tmp_path, preempt=False, offline_threads=offline_threads)

    async def scenario() -> Metrics:
        metrics = Metrics()
        worker = BatchWorker(task, metrics)
        worker.start()
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([task.prepare(FOREVER)]))
            await asyncio.to_thread(gate.wait_held)
        job.cancel()
        await asyncio.wait_for(worker.stop(), 60)
        return metrics

    metrics = asyncio.run(scenario())
    sample = metrics.registry.get_sample_value
    assert sample("lanes_lane_items_total", OFFLINE) == 0
    assert sample("lanes_lane_preemptions_total", OFFLINE) == 0, "nothing was given back"


def test_beside_an_endless_offline_run_an_interactive_request_is_answered(
    tmp_path: Path,
) -> None:
    """On the CPU, offline batches run on threads at the OS's idle priority beside the
    model's own thread: an interactive request is answered while a real offline run
    that only a stop ends holds such a thread, and nothing of that run is stopped or
    given back for it."""
    task, gate = spin_task(tmp_path, preempt=True, offline_threads=1)

    async def scenario() -> tuple[Any, Metrics, list[int], bool]:
        metrics = Metrics()
        worker = BatchWorker(task, metrics)
        worker.start()
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([task.prepare(FOREVER)]))
            await asyncio.to_thread(gate.wait_held)  # on its idle thread; spins on once open
        policies = [
            os.sched_getscheduler(t.native_id)
            for t in threading.enumerate()
            if t.name.startswith("lanes-live-offline") and t.native_id is not None
        ]
        quick = task.prepare({"x": SPIN_X, "spin": [[0]]})
        [answer] = await asyncio.wait_for(worker.submit([quick]), 60)
        running = not job.done()
        job.cancel()  # its caller gone, the run is stopped
        await asyncio.wait_for(worker.stop(), 60)
        return answer, metrics, policies, running

    answer, metrics, policies, running = asyncio.run(scenario())
    np.testing.assert_array_equal(answer["y"], np.asarray(SPIN_X, dtype=np.float32))
    assert running, "the offline run went on meanwhile"
    assert policies == [os.SCHED_IDLE]
    sample = metrics.registry.get_sample_value
    assert sample("lanes_lane_items_total", {"workload": "live", "lane": "interactive"}) == 1
    assert sample("lanes_lane_items_total", OFFLINE) == 0
    assert sample("lanes_lane_preemptions_total", OFFLINE) == 0


def test_over_the_busy_bound_the_lanes_take_turns_and_an_arrival_stops_the_offline_run(
    tmp_path: Path,
) -> None:
    """On a clock that moves only when told: once interactive runs kept the model busy
    0.9 of the last second (over `offline_beside_until`, 0.8 by default), an offline run
    goes on the model's thread, not beside, and an interactive arrival stops it (its
    item goes back); once the load has fallen, offline runs go beside again."""
    task, gate = spin_task(tmp_path, preempt=False, offline_threads=1)
    clock = ManualClock()
    quick = task.prepare({"x": SPIN_X, "spin": [[0]]})

    async def scenario() -> tuple[list[str], Metrics]:
        metrics = Metrics()
        sample = metrics.registry.get_sample_value
        worker = BatchWorker(task, metrics, clock)
        worker.start()
        on: list[str] = []
        with gate.closed():
            run = asyncio.create_task(worker.submit([quick]))
            await asyncio.to_thread(gate.wait_held)
            clock.advance(0.9)
        await asyncio.wait_for(run, 60)
        await eventually(lambda: sample(*INTERACTIVE_ITEMS) == 1, "the run is counted")
        with gate.closed():
            job = asyncio.create_task(worker.submit_offline([task.prepare(FOREVER)]))
            await asyncio.to_thread(gate.wait_held)
            on.append(gate.threads[-1])
        await asyncio.wait_for(worker.submit([quick]), 60)
        preempted = ("lanes_lane_preemptions_total", OFFLINE)
        await eventually(lambda: sample(*preempted) == 1, "the arrival stops the run")
        job.cancel()
        clock.advance(10.0)  # nothing ran since: the load has fallen
        await asyncio.wait_for(worker.submit([quick]), 60)  # the worker's loop looks again
        with gate.closed():
            late = asyncio.create_task(worker.submit_offline([quick]))
            await asyncio.to_thread(gate.wait_held)
            on.append(gate.threads[-1])
        await asyncio.wait_for(late, 60)
        await asyncio.wait_for(worker.stop(), 60)
        return on, metrics

    on, metrics = asyncio.run(scenario())
    assert on[0] == "lanes-live", "over the bound, on the model's own thread"
    assert on[1].startswith("lanes-live-offline"), "under it, beside again"
    assert metrics.registry.get_sample_value(*OFFLINE_ITEMS) == 1


@pytest.mark.parametrize(
    ("declared", "backfilled", "threads"),
    [(0, True, 0), (3, False, 3), (None, False, 0), (None, True, "cores")],
)
def test_offline_threads_default_to_the_cores_where_the_spec_backfills_on_the_cpu(
    tmp_path: Path, declared: int | None, backfilled: bool, threads: int | str
) -> None:
    task, _ = spin_task(tmp_path, False, offline_threads=declared, backfilled=backfilled)
    cores = len(os.sched_getaffinity(0))
    assert BatchWorker(task, Metrics()).offline.beside_threads == (
        cores if threads == "cores" else threads
    )


def test_offline_lane_queues_take_interactive_first() -> None:
    """The choice itself, without a model: interactive waiting wins over older offline."""

    async def scenario() -> list[str]:
        lanes = LaneQueues((8, 0.0, 100), (8, 100), lambda: 0.0)
        free = asyncio.Event()
        free.set()
        for i in range(5):
            lanes.offline.put(f"o{i}")
        lanes.interactive.put("i0")
        order = []
        for _ in range(3):
            taken = await lanes.next_batch(free, lambda candidates: 2)
            assert taken is not None
            order.append(f"{taken.lane}:{','.join(p.item for p in taken.items)}")
            for pending in taken.items:
                pending.future.set_result(None)
        lanes.close()
        return order

    assert asyncio.run(scenario()) == ["interactive:i0", "offline:o0,o1", "offline:o2,o3"]


# ---- flows on the endpoint -------------------------------------------------------------


@pytest.mark.parametrize("task", ["embed", "infer", "generate"])
def test_offline_output_through_the_endpoint_equals_the_local_runners(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    task: str,
) -> None:
    if task == "embed":
        records: list[Any] = [{"id": f"d{i}", "text": text(i)} for i in range(40)]
        records.append(
            {
                "custom_id": "req-1",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "local", "input": ["w1 w2 w3", "w4"]},
            }
        )
        records.append({"id": "d-number", "text": 7})
    elif task == "generate":
        # The test decoder completes a -> b -> c -> d, then eos.
        prompts = ["a", "b", "c", "a b", "d a", "b c a"]
        records = [
            {"id": f"g{i}", "prompt": prompts[i % 6], "max_tokens": 1 + i % 4} for i in range(40)
        ]
        records[5]["stop"] = ["c"]
        records.append(
            {
                "custom_id": "req-1",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "local", "prompt": ["a", "b a"], "max_tokens": 5},
            }
        )
        records.append(  # its logprobs travel back from the endpoint with its tokens
            {
                "custom_id": "req-2",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "local", "prompt": ["b", "c a"], "max_tokens": 3, "logprobs": 2},
            }
        )
        records.append(  # texts scored, one filling the context: its logprobs travel back
            {
                "custom_id": "req-3",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "local",
                    "prompt": ["a b c", "b", FILLS_DEC],
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 1,
                },
            }
        )
        records.append(  # n sampled choices per prompt, each seeded as online
            {
                "custom_id": "req-4",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": "local",
                    "prompt": ["a", "b c"],
                    "max_tokens": 3,
                    "n": 2,
                    "temperature": 1,
                    "seed": 4,
                    "logprobs": 1,
                },
            }
        )
        records.append({"id": "g-bad", "prompt": 7})
    else:
        records = [{"id": f"r{i}", "x": [[i, 1, 2, 3]]} for i in range(40)]
        records.append({"id": "r-bad", "x": [[1, 2]]})
    # Greedy, so that the two runs may agree; on the endpoint, rows fewer than prompts.
    greedy = {"generation": {"temperature": 0}} if task == "generate" else {}
    rows = {"batching": {"max_batch_size": 4}} if task == "generate" else {}
    spec = write_spec(
        tmp_path,
        {
            "live": live(task, **rows),
            "local": batch(task, "out-local/", max_error_rate=0.5, input="in-local/", **greedy),
            "remote": batch(
                task,
                "out-remote/",
                max_error_rate=0.5,
                input="in-remote/",
                runner=on_endpoint(workload="live"),
                **greedy,
            ),
        },
    )
    # The same records for each; an OpenAI line names the workload that runs it.
    for workload in ("local", "remote"):
        named = [
            {**r, "body": {**r["body"], "model": workload}} if "body" in r else r for r in records
        ]
        write_jsonl(tmp_path / f"in-{workload}" / "a.jsonl", named[:25])
        write_jsonl(tmp_path / f"in-{workload}" / "b.jsonl", named[25:])
    with serve(spec, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
        remote = offline(workload="remote", spec=str(spec))
        served = metric(server, "lanes_lane_items_total", workload="live", lane="offline")
        online = None
        if task == "generate":  # the n-choice line, asked online
            (sampled,) = (r for r in records if r.get("custom_id") == "req-4")
            body = {**sampled["body"], "model": "live"}
            online = httpx.post(f"{server.url}/v1/completions", json=body)
    local = offline(workload="local", spec=str(spec))

    assert served is not None and served >= 40
    assert (
        remote["outputs"] == local["outputs"] == 41 + 3 * (task == "generate") - (task == "infer")
    )
    for name in ("a.jsonl", "b.jsonl"):
        there = read_jsonl(tmp_path / "out-remote" / name)
        here = read_jsonl(tmp_path / "out-local" / name)
        assert len(there) == len(here)
        for got, want in zip(there, here, strict=True):
            _assert_same_line(got, want)
    assert errors_of(tmp_path / "out-remote") == errors_of(tmp_path / "out-local") != []
    if task == "generate":
        (line,) = (
            r
            for r in read_jsonl(tmp_path / "out-remote" / "b.jsonl")
            if r.get("custom_id") == "req-2"
        )
        for choice in line["response"]["body"]["choices"]:
            assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["top_logprobs"]) > 0
        (scored,) = (
            r
            for r in read_jsonl(tmp_path / "out-remote" / "b.jsonl")
            if r.get("custom_id") == "req-3"
        )
        choices = scored["response"]["body"]["choices"]
        assert [c["text"] for c in choices] == ["a b c", "b", FILLS_DEC]
        assert [c["logprobs"]["token_logprobs"][0] for c in choices] == [None, None, None]
        assert all(lp is not None for lp in choices[0]["logprobs"]["token_logprobs"][1:])
        assert len(choices[2]["logprobs"]["token_logprobs"]) == 64
        (line,) = (
            r
            for r in read_jsonl(tmp_path / "out-remote" / "b.jsonl")
            if r.get("custom_id") == "req-4"
        )
        assert online is not None and online.status_code == 200, online
        answer = line["response"]["body"]
        assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
        assert answer["choices"] == online.json()["choices"]
        assert answer["usage"] == online.json()["usage"]


def _assert_same_line(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal lines; vectors to float32 rounding (batched with other neighbours, a sum
    may round differently in its last bits)."""
    got, want = orjson.loads(orjson.dumps(got)), orjson.loads(orjson.dumps(want))
    if "embedding" in want:
        np.testing.assert_allclose(
            got.pop("embedding"), want.pop("embedding"), rtol=1e-6, atol=1e-7
        )
    if "response" in want:
        for g, w in zip(
            got["response"]["body"].get("data", []),
            want["response"]["body"].get("data", []),
            strict=True,
        ):
            np.testing.assert_allclose(g.pop("embedding"), w.pop("embedding"), rtol=1e-6, atol=1e-7)
        got.pop("id"), want.pop("id")  # batch_req_ ids are random per run
        for line in (got, want):  # and so are a completion's id and its time
            line["response"].pop("request_id", None)
            line["response"]["body"].pop("id", None)
            line["response"]["body"].pop("created", None)
            line["response"]["body"].pop("model", None)  # the workload that ran it
    assert got == want


@pytest.mark.parametrize("task", ["infer", "generate"])
def test_a_sigkilled_backfill_job_rerun_gives_every_id_exactly_once(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    task: str,
) -> None:
    held = "held_from_shard_3" if task == "infer" else "prompt_held_from_shard_3"
    workload = batch(
        task,
        handler=f"tests.flows_fixtures:{held}",
        runner=on_endpoint(max_concurrent_shards=1),
    )
    spec = write_spec(tmp_path, {"live": live(task), "slow": workload})
    ids = []
    for shard in range(8):
        shard_records: list[dict[str, Any]] = [
            {"id": f"s{shard}-{i}", "x": [[i, shard, 0, 0]]}
            if task == "infer"
            else {"id": f"s{shard}-{i}", "prompt": "ab"[i % 2], "max_tokens": 3, "shard": shard}
            for i in range(30)
        ]
        ids += [r["id"] for r in shard_records]
        write_jsonl(tmp_path / "in" / f"part-{shard:02d}.jsonl", shard_records)
    markers = tmp_path / "out" / "_committed"
    gate = tmp_path / "gate-open"  # never opens for the first run: shard 3 waits there
    with serve(spec, internal_key=KEY) as server:
        code = f"from flows.batch import offline; offline(workload='slow', spec={str(spec)!r})"
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            GATE_FILE_ENV: str(gate),
            "LANES_ENDPOINT": server.url,
            "LANES_INTERNAL_KEY": KEY,
        }
        worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
        try:
            wait_until(held_marker(gate).exists, 90, "the job held at shard 3")
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=30)
        at_kill = len(list(markers.glob("*.json")))
        assert worker.returncode == -signal.SIGKILL
        assert at_kill == 3, "the kill lands mid-job, after shards 0-2 committed"

        gate.touch()
        monkeypatch.setenv(GATE_FILE_ENV, str(gate))
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
        summary = offline(workload="slow", spec=str(spec))

    assert summary["shards_skipped"] == at_kill and summary["shards_failed"] == 0
    seen = Counter(line["id"] for line in outputs_of(tmp_path / "out"))
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}
    assert errors_of(tmp_path / "out") == []


def test_a_flow_without_the_internal_key_fails_before_any_shard(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = write_spec(tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint())})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "d0", "text": "w1"}])
    monkeypatch.delenv("LANES_INTERNAL_KEY", raising=False)
    monkeypatch.delenv("LANES_API_KEY", raising=False)
    with pytest.raises(Exception, match="LANES_INTERNAL_KEY"):
        offline(workload="corpus", spec=str(spec))
    assert not (tmp_path / "out" / "a.jsonl").exists()


def test_a_flow_whose_endpoint_does_not_answer_fails_before_any_shard(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not each shard after every batch's retries (and Prefect's): the job, once."""
    spec = write_spec(tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint())})
    for name in ("a", "b"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", [{"id": name, "text": "w1"}])
    with socket.socket() as closed:  # a port nothing listens on once this closes
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setenv("LANES_ENDPOINT", url)
    monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
    monkeypatch.setenv("LANES_ENDPOINT_RETRIES__BACKOFF_S", str(QUICK["backoff_s"]))
    with pytest.raises(JobFailed, match=f"the endpoint at {url} does not answer"):
        offline(workload="corpus", spec=str(spec))
    assert not (tmp_path / "out" / "a.jsonl").exists()


def test_a_flow_with_a_key_the_endpoint_refuses_fails_before_any_shard(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong key fails the job once, naming the setting: not every shard after each
    batch (and Prefect's retries of each shard) was refused."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    spec = write_spec(tmp_path, {"live": live(), "wrong-key": batch(runner=on_endpoint())})
    for name in ("a", "b"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", [{"id": name, "text": "w1"}])
    with serve(spec, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", "wrong")
        with pytest.raises(
            JobFailed, match=f"the endpoint at {server.url} refused the internal key"
        ) as failed:
            offline(workload="wrong-key", spec=str(spec))
    assert "set LANES_INTERNAL_KEY" in str(failed.value)
    assert not (tmp_path / "out" / "a.jsonl").exists()
    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if r.parameters.get("workload") == "wrong-key"]
        assert len(runs) == 1 and runs[0].state is not None and runs[0].state.is_failed()
        only = FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id]))
        assert client.read_task_runs(flow_run_filter=only) == []  # no shard task ran


def test_an_endpoint_not_serving_the_workload_fails_the_job_before_any_shard(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not each shard, after its retries, on the endpoint's 404: the job, once, saying
    which workloads the endpoint serves."""
    spec = write_spec(tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint())})
    for name in ("a", "b"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", [{"id": name, "text": "w1"}])
    served = write_spec(tmp_path / "server", {"search": live()})
    with serve(served, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
        with pytest.raises(JobFailed) as failed:
            offline(workload="corpus", spec=str(spec))
    assert str(failed.value).startswith(f"{server.url}: "), "not a shard's failure"
    assert "no workload named 'live'; interactive ones: search" in str(failed.value)
    assert not (tmp_path / "out" / "a.jsonl").exists()


def _other_weights(model: Path) -> None:
    loaded = onnx.load(str(model / "model.onnx"))
    table = numpy_helper.to_array(loaded.graph.initializer[0])
    loaded.graph.initializer[0].CopyFrom(numpy_helper.from_array(table + 1, "table"))
    save_model(loaded, str(model / "model.onnx"))


def _other_tokenizer(model: Path) -> None:
    """The same words under other ids: the same weights give other vectors."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["w1"], vocab["w2"] = vocab["w2"], vocab["w1"]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize("other", [_other_weights, _other_tokenizer], ids=["weights", "tokenizer"])
def test_an_endpoint_serving_the_workload_with_another_model_is_refused_before_any_shard(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    other: Callable[[Path], None],
) -> None:
    """The flow's token ids on another model's weights, or made by another tokenizer,
    would be answered, wrongly and unsaid: the digest of its model's and tokenizer's
    files goes with each batch, and a job whose endpoint serves the workload with other
    ones fails before any shard, saying so."""
    spec = write_spec(tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint())})
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "d0", "text": "w1"}])
    served = write_spec(tmp_path / "server", {"live": live()})
    other(tmp_path / "server" / "models" / "enc")
    with serve(served, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
        with pytest.raises(JobFailed, match="serves workload 'live' with another model") as failed:
            offline(workload="corpus", spec=str(spec))
        assert metric(server, "lanes_lane_items_total", workload="live", lane="offline") == 0
    assert "model 'enc'" in str(failed.value)
    assert not (tmp_path / "out" / "a.jsonl").exists()


def test_an_endpoint_gone_fails_a_batch_after_one_round_of_attempts_unretried(
    serve: type[ServerThread], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused connection through a batch's every attempt fails its shard without
    Prefect's retries (they would repeat the attempts), and each later batch at its
    first refusal; an endpoint that answers again is used again."""
    spec = write_spec(tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint())})
    task = load_task("live", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    items = [task.prepare(text(0))]
    with socket.socket() as closed:  # a port nothing listens on once this closes
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    model = EndpointModel(task, url, "live", KEY, retries=EndpointRetries(attempts=3, **QUICK))

    def retries() -> int:
        return sum("retrying" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="lanes.flows.endpoint"):
        with pytest.raises(EndpointGone, match=f"the endpoint at {url} is gone") as gone:
            model.run(items)
        assert retries() == 2  # the batch's own attempts, as for a restart
        assert gone.value.repeats  # the shard's retries would only repeat them
        with pytest.raises(EndpointGone):
            model.run(items)
        assert retries() == 2  # the next batch fails at its first refusal
        with serve(spec, internal_key=KEY) as server:
            model.url = server.url
            (vector,) = model.run(items)
    assert not model.gone and len(vector) > 0
    model.close()


def test_a_generate_batch_over_the_endpoints_body_limit_goes_in_parts(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    """A shard hands the endpoint a window of batches at once, each `n` choice an
    item: its frame may pass the server's body limit though every item fits. The
    items go in parts and are answered as in one batch; only an item refused alone
    fails, and alone."""
    spec = write_spec(tmp_path, {"live": live("generate"), "nightly": batch("generate")})
    task = load_task("live", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    prompts = ["a", "b", "c", "a b", "d a", "b c a", "c a", "a a"]
    items = [task.prepare({"prompt": p, "max_tokens": 3}) for p in prompts]
    # A limit that two items fit but not the batch, nor one item with a long prompt.
    limit = 1200
    big = task.prepare({"prompt": " ".join(["a"] * 60), "max_tokens": 1, "stop": ["x" * 200] * 4})
    assert (
        len(encode_items(items[:2]))
        < limit
        < min(len(encode_items(items)), len(encode_items([big])))
    )
    with serve(spec, internal_key=KEY) as roomy:
        model = EndpointModel(task, roomy.url, "live", KEY)
        want = model.run(items)
    with serve(spec, internal_key=KEY, max_body_bytes=limit) as tight:
        model = EndpointModel(task, tight.url, "live", KEY)
        got = model.run(items)
        assert [c.text for c in got] == [c.text for c in want]
        assert [c.tokens for c in got] == [c.tokens for c in want]
        *answered, refused = model.run([*items[:2], big])
        assert [c.text for c in answered] == [c.text for c in want[:2]]
        assert isinstance(refused, Failed) and refused.index == 2
        assert isinstance(refused.error, RequestTooLarge), refused.error
    model.close()


def test_an_item_over_the_endpoints_kv_budget_is_refused_alone(
    serve: type[ServerThread], tmp_path: Path
) -> None:
    """The flow settles records under its own workload (here without a budget); the
    interactive workload's batching.max_kv_bytes refuses an item that could never fit
    it (alone it would run past it) as that item's error, naming max_tokens: the
    others are answered, and a batch of only such items fails no shard."""
    workloads = {"nightly": batch("generate")}
    spec = write_spec(tmp_path, {"live": live("generate"), **workloads})
    task = load_task("nightly", load_spec(spec, Settings()), Runtime(Settings(device="cpu")))
    budget = 20 * task.decoder.position_bytes  # 20 positions: prompt and max_tokens
    write_spec(tmp_path, {"live": live("generate", batching={"max_kv_bytes": budget}), **workloads})
    small, huge = (task.prepare({"prompt": "a b", "max_tokens": n}) for n in (3, 40))
    with serve(spec, internal_key=KEY) as server:
        model = EndpointModel(task, server.url, "live", KEY)
        answered, refused = model.run([small, huge])
        (alone,) = model.run([huge])
    model.close()
    assert answered.finish_reason in ("stop", "length")
    for failed in (refused, alone):
        assert isinstance(failed, Failed) and isinstance(failed.error, InvalidInput)
        # The field travels as its own (a Batch API output line's `param`), not only as
        # the message's prefix.
        assert failed.error.param == "max_tokens"
        assert str(failed.error).startswith("max_tokens: ")
        assert f"batching.max_kv_bytes ({budget} bytes)" in str(failed.error)


def test_once_the_endpoint_is_gone_no_further_shard_starts_and_a_rerun_finishes(
    prefect_api: str,
    serve: type[ServerThread],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The endpoint stops during shard 2 of 5: that shard fails after its batch's
    attempts, and shards 3 and 4 never start (each would only meet the same refusal).
    The run fails at once, naming the endpoint and counting every shard; a rerun once
    it is back runs the three left, and every id is written once."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    workload = batch(
        "infer",
        handler="tests.flows_fixtures:stops_at_shard_2",
        runner=on_endpoint(max_concurrent_shards=1),
    )
    spec = write_spec(tmp_path, {"live": live("infer"), "corpus": workload})
    ids = []
    for shard in range(5):
        records = [{"id": f"s{shard}-{i}", "x": [[i, shard, 0, 0]]} for i in range(4)]
        ids += [r["id"] for r in records]
        write_jsonl(tmp_path / "in" / f"part-{shard:02d}.jsonl", records)
    monkeypatch.setenv("LANES_INTERNAL_KEY", KEY)
    monkeypatch.setenv("LANES_ENDPOINT_RETRIES__BACKOFF_S", str(QUICK["backoff_s"]))
    with serve(spec, internal_key=KEY) as server:
        monkeypatch.setenv("LANES_ENDPOINT", server.url)
        stops_at_shard_2.stop = server.stop
        state = offline(workload="corpus", spec=str(spec), return_state=True)
    assert state.is_failed()
    with pytest.raises(JobFailed) as failed:
        state.result()
    message = str(failed.value)
    assert message.startswith("1 of 5 shards failed (")
    assert f"2 did not start, as the endpoint at {server.url} is gone" in message
    assert f"rerun the job once the endpoint at {server.url} is back" in message
    with get_client(sync_client=True) as client:
        only = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        shards = client.read_task_runs(flow_run_filter=only)
    assert sorted(r.name for r in shards) == [f"shard part-{n:02d}.jsonl" for n in range(3)]
    manifest = orjson.loads((tmp_path / "out" / "_manifest.json").read_bytes())
    assert [manifest[k] for k in ("shards", "shards_failed", "shards_not_started")] == [5, 1, 2]

    with serve(spec, internal_key=KEY) as back:
        monkeypatch.setenv("LANES_ENDPOINT", back.url)
        summary = offline(workload="corpus", spec=str(spec))
    assert (summary["shards_run"], summary["shards_skipped"]) == (3, 2)
    seen = Counter(line["id"] for line in outputs_of(tmp_path / "out"))
    assert sorted(seen) == sorted(ids) and set(seen.values()) == {1}


# ---- the spec --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workloads", "where", "says"),
    [
        (
            {"gen": batch("generate", runner=on_endpoint())},
            "workloads.gen.runner.workload",
            "no interactive generate workload serves model 'dec'",
        ),
        (
            {"live": live("infer"), "corpus": batch(runner=on_endpoint(workload="live"))},
            "workloads.corpus.runner.workload",
            "same model and task",
        ),
        (
            {"corpus": batch(runner=on_endpoint())},
            "workloads.corpus.runner.workload",
            "no interactive embed workload serves model 'enc'",
        ),
        (
            {"a": live(), "b": live(), "corpus": batch(runner=on_endpoint())},
            "workloads.corpus.runner.workload",
            "name one in `runner.workload`",
        ),
        (
            {"live": live(), "corpus": batch(runner={"kind": "local", "url": "http://h:1"})},
            "workloads.corpus.runner.url",
            "is for `kind: endpoint`",
        ),
    ],
)
def test_the_spec_says_what_an_endpoint_runner_needs(
    tmp_path: Path, workloads: dict[str, Any], where: str, says: str
) -> None:
    spec = write_spec(tmp_path, workloads)
    with pytest.raises(SpecError) as raised:
        load_spec(spec, Settings())
    message = str(raised.value)
    assert where in message and says in message


def test_an_endpoint_runner_may_name_the_model_instead_of_a_workload(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path, {"live": live(), "corpus": batch(runner=on_endpoint(workload="enc"))}
    )
    from lanes.backfill import served_workload

    assert served_workload(load_spec(spec, Settings()).workloads, "corpus") == "live"


# ---- offline batch size ----------------------------------------------------------------


@pytest.mark.parametrize(("slo", "slack_ms", "items"), [({"p99_ms": 50}, 48, 47), ({}, 20, 19)])
def test_offline_runs_are_sized_to_the_interactive_slack(
    tmp_path: Path, slo: dict[str, Any], slack_ms: float, items: int
) -> None:
    """One run fits in p99 minus the service time (or the default slack), by the cost
    model: here 1 ms fixed + 1 ms per item, so an interactive batch of 1 takes 2 ms."""
    from lanes.serving.metrics import Metrics
    from lanes.serving.offline_runs import DEFAULT_SLACK_S, LEARNING_ITEMS
    from lanes.serving.worker import BatchWorker
    from tests.gates import ManualClock

    batching = {"max_batch_size": 64, "offline_threads": 0}
    workloads = {"live": live("infer", slo=slo, batching=batching)}
    spec = load_spec(write_spec(tmp_path, workloads), Settings())
    task = load_task("live", spec, Runtime(Settings(device="cpu")))
    clock = ManualClock()

    async def sized() -> tuple[int, float, int]:
        worker = BatchWorker(task, Metrics(), clock)
        candidates = [task.prepare({"x": [[1, 2, 3, 4]]})]
        before = worker.offline.items(candidates)  # nothing measured yet
        for n in (1, 2, 4, 8, 16, 1, 2, 4, 8, 16):
            worker.cost.observe(n, 0, 0.001 + 0.001 * n)
        return before, worker.offline.slack_s(), worker.offline.items(candidates)

    before, slack, after = asyncio.run(sized())
    assert before == LEARNING_ITEMS
    assert slack == pytest.approx(slack_ms / 1000)
    assert after == items
    assert DEFAULT_SLACK_S == 0.020


@pytest.mark.parametrize(
    ("preempt", "arrivals", "items"),
    [(False, 1000, 8), (True, 0, 8), (True, 1000, 1)],
)
def test_offline_runs_that_arrivals_stop_are_sized_to_their_gaps(
    tmp_path: Path, preempt: bool, arrivals: int, items: int
) -> None:
    """Runs of 1 ms + 5 ms per item and a 50 ms p99: 8 items fit in the slack. Where
    interactive arrivals stop offline runs and came every 10 ms for the last 10 s (the
    rate's window), a run of one item is the one that wastes least
    (serving/offline_runs.py: gap_filling_items); with no arrivals, or without
    preemption, the run fills the slack."""
    from lanes.serving.metrics import Metrics
    from lanes.serving.worker import BatchWorker
    from tests.gates import ManualClock

    batching = {"max_batch_size": 64, "preempt_offline": preempt, "offline_threads": 0}
    workloads = {"live": live("infer", slo={"p99_ms": 50}, batching=batching)}
    spec = load_spec(write_spec(tmp_path, workloads), Settings())
    task = load_task("live", spec, Runtime(Settings(device="cpu")))
    clock = ManualClock()

    async def sized() -> int:
        worker = BatchWorker(task, Metrics(), clock)
        worker.start()
        request = task.prepare({"x": [[1, 2, 3, 4]]})
        for _ in range(arrivals):
            await asyncio.wait_for(worker.submit([request]), 60)
            clock.advance(0.010)
        # Taught last, they fill the cost model's window: the real runs took no time
        # on this clock.
        for n in [1, 2, 4, 8, 16] * 52:
            worker.cost.observe(n, 0, 0.001 + 0.005 * n)
        sized = worker.offline.items([request])
        await asyncio.wait_for(worker.stop(), 60)
        return sized

    assert asyncio.run(sized()) == items
