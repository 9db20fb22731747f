"""The batch queue on its own (composition, waiting, deadlines, bounds) and its worker."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from lanes.errors import DeadlineExceeded, Overloaded
from lanes.runtime import Runtime
from lanes.serving.batching import BatchQueue
from lanes.serving.metrics import Metrics, Utilization
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.tasks import Task, load_task
from tests.gates import Gate, ManualClock


async def test_idle_queue_hands_out_a_lone_request_at_once() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=10)
    queue.put("a")
    getting = asyncio.create_task(queue.next_batch())
    await asyncio.sleep(0)  # one turn of the loop: it never waits
    assert getting.done() and [p.item for p in getting.result()] == ["a"]


async def test_requests_that_arrive_meanwhile_form_the_next_batch() -> None:
    queue = BatchQueue(max_batch_size=3, max_wait_s=0, max_queue=10)
    for item in "abcde":
        queue.put(item)
    first = await queue.next_batch()
    second = await queue.next_batch()
    assert [p.item for p in first] == ["a", "b", "c"]
    assert [p.item for p in second] == ["d", "e"]
    assert len(queue) == 0


async def test_max_wait_waits_for_company_but_no_longer() -> None:
    queue = BatchQueue(max_batch_size=2, max_wait_s=60, max_queue=10)
    queue.put("a")
    getting = asyncio.create_task(queue.next_batch())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not getting.done()  # waiting for company
    queue.put("b")  # fills the batch: no need to wait out the window
    batch = await asyncio.wait_for(getting, 30)
    assert [p.item for p in batch] == ["a", "b"]

    # The window is counted on the queue's clock from the first arrival.
    clock = ManualClock()
    queue = BatchQueue(max_batch_size=2, max_wait_s=0.2, max_queue=10, clock=clock)
    queue.put("c")
    clock.advance(0.2)
    getting = asyncio.create_task(queue.next_batch())
    await asyncio.sleep(0)
    assert getting.done() and [p.item for p in getting.result()] == ["c"]  # alone, at once

    # And the window's end wakes a waiting executor by itself.
    queue = BatchQueue(max_batch_size=2, max_wait_s=0.01, max_queue=10)
    queue.put("d")
    alone = await asyncio.wait_for(queue.next_batch(), 30)
    assert [p.item for p in alone] == ["d"]


async def test_full_queue_refuses_at_once() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=2)
    queue.put("a")
    queue.put("b")
    with pytest.raises(Overloaded, match="queue full"):
        queue.put("c")


async def test_deadline_fires_while_queued_and_item_never_batched() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=10)
    late = queue.put("late", deadline=time.monotonic() + 0.05)
    queue.put("fine")
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        await asyncio.wait_for(late.future, 30)  # its timer comes first, whatever the load
    batch = await queue.next_batch()
    assert [p.item for p in batch] == ["fine"]
    assert len(queue) == 0


async def test_cancelled_caller_leaves_the_queue() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=1)
    gone = queue.put("gone")
    gone.future.cancel()
    await asyncio.sleep(0)
    assert len(queue) == 0
    queue.put("next")  # its place is free again
    assert [p.item for p in await queue.next_batch()] == ["next"]


async def test_close_drains_then_returns_empty() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=10)
    queue.put("a")
    queue.close()
    with pytest.raises(Overloaded):
        queue.put("b")
    assert [p.item for p in await queue.next_batch()] == ["a"]
    assert await queue.next_batch() == []


# ---- the worker that runs a queue's batches ------------------------------------


@dataclass
class SumWorker:
    """A started worker on a ReduceSum model whose handler records the thread of each
    output, and makes an item totalling over 100 cost 5 ms on the worker's clock and
    wait at a gate (tests/worker_hooks.py). Cheap items cost nothing on that clock."""

    task: Task
    worker: BatchWorker
    metrics: Metrics
    names: list[str]
    gate: Gate

    async def batches(self) -> float | None:
        await asyncio.sleep(0)  # a run is accounted for just after its callers resume
        return self.metrics.registry.get_sample_value("lanes_batch_size_count", {"workload": "w"})


@pytest.fixture
async def sums(tmp_path: Path) -> AsyncIterator[SumWorker]:
    from tests import worker_hooks
    from tests.test_tasks import io, save, spec_for, tensor

    model = save(
        [helper.make_node("ReduceSum", ["x", "axis1"], ["total"], keepdims=0)],
        [io("x", TensorProto.FLOAT, ["batch", 3])],
        [io("total", TensorProto.FLOAT, ["batch"])],
        tmp_path / "sum.onnx",
        [tensor("axis1", [1], np.int64)],
    )
    spec = spec_for(model, "infer", handler="tests.worker_hooks:threads")
    task = load_task("w", spec, Runtime(Settings(device="cpu", threads=1)))
    task.warm_up()  # as the server does before it starts a worker
    metrics = Metrics()
    hooks = worker_hooks.threads
    worker = BatchWorker(task, metrics, clock=hooks.clock)
    worker.start()
    hooks.names.clear()
    try:
        yield SumWorker(task, worker, metrics, hooks.names, hooks.gate)
    finally:
        hooks.gate.open()
        await worker.stop()


async def test_worker_runs_cheap_batches_on_the_loop_and_slow_ones_on_its_thread(
    sums: SumWorker,
) -> None:
    """Waking a thread costs more than a tiny model's run; a slow run must leave the loop.
    Where a batch runs follows its cost as the worker's clock measured it."""
    task, worker, names = sums.task, sums.worker, sums.names
    loop = threading.current_thread().name
    cheap = task.prepare({"x": [[1, 2, 3]]})
    for _ in range(8):
        [out] = await worker.submit([cheap])
        assert out["total"].tolist() == [6.0]
    # The first run is measured on the worker's thread; then the loop runs them.
    assert names == ["lanes-w"] + [loop] * 7
    assert worker.item_cost.runs_inline(1)
    # Cheap runs always queue, so requests parsed together still share a run.
    batches = await sums.batches()
    await asyncio.gather(*(worker.submit([cheap]) for _ in range(4)))
    assert await sums.batches() == batches + 1

    names.clear()
    await worker.submit([task.prepare({"x": [[100, 200, 300]]})])  # 5 ms: measured...
    await worker.submit([cheap])  # ...so the next one goes back to the thread
    assert names == [loop, "lanes-w"]
    assert not worker.item_cost.runs_inline(1)


async def test_a_lone_request_runs_at_once_and_what_arrives_meanwhile_forms_one_batch(
    sums: SumWorker,
) -> None:
    task, worker, names, gate = sums.task, sums.worker, sums.names, sums.gate
    with gate.closed():
        alone = asyncio.create_task(worker.submit([task.prepare({"x": [[100, 200, 300]]})]))
        await asyncio.to_thread(gate.wait_held)  # it is on the model, held there...
        assert len(worker.queue) == 0  # ...and never was in the queue
        later = [
            asyncio.create_task(worker.submit([task.prepare({"x": [[i, 1, 1]]})])) for i in range(3)
        ]
        await asyncio.sleep(0)
        assert len(worker.queue) == 3  # the model is busy: these wait, together
    [first] = await alone
    rest = await asyncio.gather(*later)
    assert first["total"].tolist() == [600.0]
    assert [out["total"].tolist() for [out] in rest] == [[2.0], [3.0], [4.0]]
    assert names[0] == "lanes-w"  # the caller's batch still ran off the loop
    assert await sums.batches() == 2  # 1, then 3
    sizes = sums.metrics.registry.get_sample_value("lanes_batch_size_sum", {"workload": "w"})
    assert sizes == 4

    # A caller that leaves mid-run: its run still ends, is counted, and frees the model.
    with gate.closed():
        gone = asyncio.create_task(worker.submit([task.prepare({"x": [[100, 200, 300]]})]))
        await asyncio.to_thread(gate.wait_held)
        gone.cancel()
        after = asyncio.create_task(worker.submit([task.prepare({"x": [[1, 1, 1]]})]))
        await asyncio.sleep(0)
        assert len(worker.queue) == 1  # the run its caller left still holds the model
    [out] = await after
    assert out["total"].tolist() == [3.0]
    assert gone.cancelled()
    assert await sums.batches() == 4


def test_utilization_is_the_busy_share_of_the_window() -> None:
    use = Utilization(window_s=10.0)
    use.record(0.0, 2.0)
    use.record(5.0, 6.0)
    use.record(8.0, 10.0)
    assert use.fraction(now=11.0) == pytest.approx(0.4)  # 1 s of the first run is inside
    assert use.fraction(now=15.5) == pytest.approx(0.25)  # the first left, the second straddles
    assert use.fraction(now=30.0) == 0.0
    for i in range(100_000):  # a day of runs nobody scraped: only the window is kept
        use.record(100.0 + i, 100.5 + i)
    assert len(use._runs) <= 11
    assert use.fraction(now=100_100.0) == pytest.approx(0.5)
