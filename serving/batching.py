"""Dynamic batching: one small queue per workload.

The executor loop calls `next_batch()`, runs the batch, and calls it again. That
is what makes batches grow with load by themselves: whatever arrived while a batch
ran is the next batch, at once. An idle executor runs a lone request now, unless
`max_wait_s` asks it to wait for company (never longer than that).

Offline work waits in a second queue of the same workload (`LaneQueues`): a batch is
taken from it only when no interactive request waits, so an interactive request
waits behind at most the one offline batch that was on the model when it arrived
(none where its worker stops that run and gives its batch back: serving/worker.py).

A queued request whose deadline passes is failed with DeadlineExceeded at its
deadline, by a timer on the event loop, even while a batch is running; it never
reaches the model. A full queue refuses new requests at once (Overloaded).

A workload with an SLO sizes its interactive batches itself (`take(size=...)`, see
serving/slo.py): it may answer some of the waiting requests first, and its timers
fire as early as their run is known to end past the deadline (`put(early_s=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lanes.errors import DeadlineExceeded, Overloaded, RequestTooLarge
from lanes.serving.access import RequestRecord

# The code of a 504 answered before the deadline, because the run would end past it.
UNREACHABLE = "deadline_unreachable"
# How often offline items that may not run yet are looked at again: what holds them
# (the interactive lane's recent load) falls as time passes, not on an event.
LOOK_AGAIN_S = 0.05


def never_fits(
    items: int, max_queue: int, param: str | None = None, bound: str = "`batching.max_queue`"
) -> RequestTooLarge | None:
    """Why a request of `items` inputs (in its field `param`, where it has one) can never
    be queued whole (413, not a 503 to retry), or None when it can; `bound` names what
    sets `max_queue`."""
    if items <= max_queue:
        return None
    detail = (
        f"this request has {items} inputs; the workload queues at most {max_queue} "
        f"({bound}), so it can never run as sent: send at most {max_queue} per request"
    )
    return RequestTooLarge(detail) if param is None else RequestTooLarge.field(param, detail)


# What bounds an offline batch on the endpoint: the lane's own queue, no setting.
OFFLINE_BOUND = "its offline lane's queue; an offline batch_size of at most that fits"


def unreachable(left_s: float, waited_s: float = 0.0) -> DeadlineExceeded:
    """A request whose run is expected to end past its deadline, `left_s` away."""
    return DeadlineExceeded(
        f"this request cannot finish by its deadline: {left_s * 1000:.0f} ms are left, less "
        f"than its run is expected to take (waited {waited_s * 1000:.0f} ms); send it with a "
        "longer deadline (`X-Timeout-Ms`, `slo.timeout_ms`) or when the workload is less busy",
        code=UNREACHABLE,
    )


@dataclass(eq=False)
class DeviceShare:
    """The model time one offline caller's items used, in seconds: each run's time
    (stopped ones too) split among the items it held by count, as the lanes' busy
    time metric splits it. Written on the event loop (worker) or under the step
    observer's lock (engine)."""

    seconds: float = 0.0


def charge(batch: Sequence[Pending], seconds: float) -> None:
    """A run of `batch` that took `seconds`: each item's equal part into its caller's
    share (items without one are interactive, or a caller that keeps no account)."""
    if not batch:
        return
    each = seconds / len(batch)
    for pending in batch:
        if pending.share is not None:
            pending.share.seconds += each


@dataclass(eq=False)
class Pending:
    """One queued request: the prepared item and the future its caller awaits."""

    item: Any
    future: asyncio.Future[Any]
    enqueued_at: float
    deadline: float | None = None
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    queued: bool = True  # still waiting in the queue (not yet handed to a batch)
    request: RequestRecord | None = None  # its HTTP request's: the run writes its part
    share: DeviceShare | None = None  # an offline caller's: the runs' time it used
    # Every item of its request (itself too): once one reaches the model, the request is
    # answered by the model, and the others' deadlines no longer stand.
    siblings: tuple[Pending, ...] = field(default=(), repr=False)

    @property
    def live(self) -> bool:
        # Done means answered early: deadline passed, or the caller went away.
        return not self.future.done()


class BatchQueue:
    """A bounded FIFO of requests that hands out batches of at most `max_batch_size`."""

    def __init__(
        self,
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        arrived: asyncio.Event | None = None,
        left: Callable[[], None] | None = None,
    ) -> None:
        """`arrived` is set on every `put`: queues sharing one wake one waiter. `left` is
        called when a request leaves unrun (its deadline passed, its caller went): the
        depth a gauge shows changed without a batch."""
        self.max_batch_size = max_batch_size
        self._left = left
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._clock = clock
        self._items: deque[Pending] = deque()
        self._live = 0
        self._arrived = arrived if arrived is not None else asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        """Requests waiting (not counting those already answered)."""
        return self._live

    def check_room(self, items: int) -> None:
        """Raise Overloaded now if `items` more requests cannot all be queued."""
        if self._closed:
            raise Overloaded("the server is shutting down; retry on another replica", 1.0)
        if self._live + items > self.max_queue:
            room = self.max_queue - self._live
            raise Overloaded(
                f"queue full ({self._live} waiting, room for {room} of {items}); retry shortly",
                1.0,
            )

    def put(self, item: Any, deadline: float | None = None, early_s: float = 0.0) -> Pending:
        """Queue one prepared item; raises Overloaded at once when the queue is full.

        `deadline` is on the queue's clock (time.monotonic by default). Its timer fires
        `early_s` before it: from then on even a run of its own ends too late.
        """
        if self._closed:
            raise Overloaded("the server is shutting down; retry on another replica", 1.0)
        if self._live >= self.max_queue:
            raise Overloaded(f"queue full ({self.max_queue} waiting); retry shortly", 1.0)
        loop = asyncio.get_running_loop()
        pending = Pending(item, loop.create_future(), self._clock(), deadline)
        if deadline is not None:
            delay = deadline - early_s - pending.enqueued_at
            pending.timer = loop.call_later(max(delay, 0.0), self._expire, pending)
        pending.future.add_done_callback(lambda _: self._forget(pending))
        self._items.append(pending)
        self._live += 1
        self._arrived.set()
        return pending

    def _expire(self, pending: Pending) -> None:
        if not pending.live:
            return
        now = self._clock()
        waited = (now - pending.enqueued_at) * 1000
        if pending.deadline is not None and now < pending.deadline:
            pending.future.set_exception(unreachable(pending.deadline - now, waited / 1000))
            return
        pending.future.set_exception(
            DeadlineExceeded(f"deadline passed after {waited:.0f} ms in the queue")
        )

    def _forget(self, pending: Pending) -> None:
        # Runs once per request when its future resolves, whichever way.
        if pending.timer is not None:
            pending.timer.cancel()
        if pending.queued:
            pending.queued = False
            self._live -= 1
            if self._left is not None:
                self._left()

    def give_back(self, batch: Sequence[Pending]) -> None:
        """Put the live requests of a batch taken from this queue back at its head, in
        their order (their run was stopped before its end). Their deadline timers are
        not restarted: only offline requests, which have none, come back."""
        for pending in reversed(batch):
            if pending.live:
                pending.queued = True
                self._items.appendleft(pending)
                self._live += 1
        self._arrived.set()

    def fail_waiting(self, error: BaseException) -> None:
        """Answer every waiting request with `error` (what would run them cannot)."""
        for pending in self._items:
            if pending.live:
                pending.future.set_exception(error)

    @property
    def closed(self) -> bool:
        return self._closed

    async def next_batch(self, free: asyncio.Event | None = None) -> list[Pending]:
        """Wait for at least one live request, then return up to `max_batch_size` of them.

        With `free`, the batch is taken only once it is set (the model is free), so
        what arrives while another batch runs joins this one. Always returns at least
        one item, unless the queue was closed and drained (then an empty list). Items
        it returns no longer count as waiting.
        """
        while True:
            if self.waiting():
                if free is None or free.is_set():
                    break
                await free.wait()
                continue
            if self._closed:
                return []
            self._arrived.clear()
            await self._arrived.wait()
        return await self.take()

    def waiting(self) -> bool:
        """Whether a live request waits (answered ones at the head are dropped)."""
        self._drop_answered()
        return bool(self._items)

    def head(self, most: int) -> list[Pending]:
        """The first `most` live requests, left in the queue."""
        found: list[Pending] = []
        for pending in self._items:
            if len(found) >= most:
                break
            if pending.live:
                found.append(pending)
        return found

    def peek(self, most: int) -> list[Any]:
        """The items of the first `most` live requests, left in the queue."""
        found: list[Any] = []
        for pending in self._items:
            if len(found) >= most:
                break
            if pending.live:
                found.append(pending.item)
        return found

    async def take(
        self, most: int | None = None, size: Callable[[list[Pending]], int] | None = None
    ) -> list[Pending]:
        """Up to `most` (default `max_batch_size`) live requests, after waiting for
        company as `max_wait_s` allows; may be empty if every waiting one was answered
        meanwhile. Items it returns no longer count as waiting.

        `size`, once the wait is over, is given the first `max_batch_size` live requests
        and says how many of them to take (after answering any it will not run)."""
        limit = self.max_batch_size if most is None else max(min(most, self.max_batch_size), 1)
        if self.max_wait_s > 0 and self._live < limit and self._items:
            await self._wait_for_company(self._items[0].enqueued_at + self.max_wait_s)
        if size is not None:
            limit = min(size(self.head(limit)), limit)
            if limit <= 0:
                self._drop_answered()
                return []
        batch: list[Pending] = []
        while self._items and len(batch) < limit:
            pending = self._items.popleft()
            if pending.live:
                # Once it reaches the model it is answered by the model, deadline or not:
                # its request too (the other items, in a later batch: their model time
                # would be lost with a 504).
                pending.queued = False
                for started in pending.siblings or (pending,):
                    if started.timer is not None:
                        started.timer.cancel()
                        started.timer = None
                    started.deadline = None
                batch.append(pending)
        self._live -= len(batch)
        return batch

    async def _wait_for_company(self, until: float) -> None:
        while self._live < self.max_batch_size and not self._closed and self.max_wait_s > 0:
            remaining = until - self._clock()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _drop_answered(self) -> None:
        while self._items and not self._items[0].live:
            self._items.popleft()

    def close(self) -> None:
        """Refuse new requests; `next_batch` drains what is queued, then returns []."""
        self._closed = True
        self._arrived.set()

    def hurry(self) -> None:
        """No more company is coming (the server stopped listening): from now on a
        batch waits for none, and one waiting for it is taken at once. Requests are
        still queued."""
        self.max_wait_s = 0.0
        self._arrived.set()


Lane = Literal["interactive", "offline"]
LANES: tuple[Lane, ...] = ("interactive", "offline")


@dataclass(frozen=True)
class LaneBatch:
    """Requests of one lane, to run as one batch."""

    lane: Lane
    items: list[Pending]


class LaneQueues:
    """One workload's two queues: interactive first, offline only when no interactive
    request waits (one model, one batch at a time: a request that arrives during an
    offline run is in the next batch)."""

    def __init__(
        self,
        batching: tuple[int, float, int],
        offline: tuple[int, int],
        clock: Callable[[], float] = time.monotonic,
        left: Callable[[], None] | None = None,
    ) -> None:
        """`batching`: the interactive queue's (max_batch_size, max_wait_s, max_queue);
        `offline`: the offline queue's (max_batch_size, max_queue). Offline work never
        waits for company: nobody waits for it, and the model is free now. `left`: see
        `BatchQueue`."""
        self._arrived = asyncio.Event()
        size, wait, bound = batching
        self.interactive = BatchQueue(size, wait, bound, clock, self._arrived, left)
        most, bound = offline
        self.offline = BatchQueue(most, 0.0, bound, clock, self._arrived, left)

    def of(self, lane: Lane) -> BatchQueue:
        return self.interactive if lane == "interactive" else self.offline

    async def next_batch(
        self,
        free: asyncio.Event,
        offline_items: Callable[[Sequence[Any]], int] | None,
        interactive_items: Callable[[list[Pending]], int] | None = None,
    ) -> LaneBatch | None:
        """The next batch once the model is `free`: interactive requests if any wait
        (as many as `interactive_items(first ones)` says, if given: see `take`), else up
        to `offline_items(candidates)` offline ones (`candidates`: the items of the
        first offline requests, as many as one offline batch may hold); with
        `offline_items` None, interactive ones alone (offline batches are taken by
        `next_offline`); while it says 0, offline ones wait (looked at again every
        LOOK_AGAIN_S). None once both queues are closed and drained; never an empty
        batch."""
        while True:
            interactive = self.interactive.waiting()
            offline = offline_items is not None and self.offline.waiting()
            if interactive or offline:
                if not free.is_set():
                    await free.wait()
                    continue
                if interactive:
                    taken = await self.interactive.take(size=interactive_items)
                    batch = LaneBatch("interactive", taken)
                else:
                    assert offline_items is not None
                    candidates = self.offline.peek(self.offline.max_batch_size)
                    most = offline_items(candidates)
                    if most == 0:  # not now: an arrival or the time may change that
                        self._arrived.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._arrived.wait(), LOOK_AGAIN_S)
                        continue
                    batch = LaneBatch("offline", await self.offline.take(most))
                if batch.items:
                    return batch
                continue  # every one of them was answered meanwhile (deadline, gone)
            if self.interactive.closed and self.offline.closed:
                return None
            self._arrived.clear()
            await self._arrived.wait()

    async def next_offline(self) -> LaneBatch | None:
        """The next offline batch (up to the lane's max_batch_size), whatever waits in
        the interactive queue: for offline runs that go beside interactive ones. None
        once the offline queue is closed and drained; never an empty batch."""
        while True:
            if self.offline.waiting():
                taken = await self.offline.take(self.offline.max_batch_size)
                if taken:
                    return LaneBatch("offline", taken)
                continue  # every one of them went away meanwhile
            if self.offline.closed:
                return None
            self._arrived.clear()
            await self._arrived.wait()

    def close(self) -> None:
        self.interactive.close()
        self.offline.close()
