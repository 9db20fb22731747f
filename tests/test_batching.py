"""The batch queue on its own: composition, waiting, deadlines and bounds."""

from __future__ import annotations

import asyncio
import time

import pytest

from lanes.errors import DeadlineExceeded, Overloaded
from serving.batching import BatchQueue


async def test_idle_queue_hands_out_a_lone_request_at_once() -> None:
    queue = BatchQueue(max_batch_size=8, max_wait_s=0, max_queue=10)
    queue.put("a")
    batch = await asyncio.wait_for(queue.next_batch(), 0.5)
    assert [p.item for p in batch] == ["a"]


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
    queue = BatchQueue(max_batch_size=2, max_wait_s=0.2, max_queue=10)
    queue.put("a")
    getting = asyncio.create_task(queue.next_batch())
    await asyncio.sleep(0.01)
    assert not getting.done()
    queue.put("b")  # fills the batch: no need to wait out the window
    batch = await asyncio.wait_for(getting, 0.1)
    assert [p.item for p in batch] == ["a", "b"]

    queue.put("c")
    alone = await asyncio.wait_for(queue.next_batch(), 1.0)  # window ends, runs alone
    assert [p.item for p in alone] == ["c"]


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
        await asyncio.wait_for(late.future, 1.0)
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
