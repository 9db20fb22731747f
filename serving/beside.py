"""An embed or infer workload's offline batches beside its interactive ones, on the CPU.

They run on threads at the OS's idle priority (`IdleThreads`, serving/model_thread.py),
as many at once as there are threads, each batch up to the offline lane's
`max_batch_size`, on a one-thread session of the model of their own
(`SlotSession.on_one_thread`), loaded with the first offline batch: an interactive run
on the model's own thread takes the cores the moment it starts, and nothing offline
is lost. A run's time is stretched by the interactive runs that took its cores, so it
teaches the worker's cost model nothing.

The cores are the OS's to give; the memory bandwidth and caches are not, so each
interactive run beside an offline one is a little slower, and near saturation a
little slower multiplies the queueing. So while `turns()` (the interactive lane is
busier than `batching.offline_beside_until`) no batch starts here: the worker's own
loop takes them, in turns with interactive runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import onnxruntime as ort

from lanes.batchframe import run_unhandled
from lanes.serving.batch_run import Result, Stopped, answer, stoppable_run
from lanes.serving.batching import LOOK_AGAIN_S, LaneQueues, Pending, charge
from lanes.serving.metrics import LaneSeries
from lanes.serving.model_thread import IdleThreads
from lanes.tasks import Task
from lanes.tasks.session_slot import SlotSession


class Beside:
    """The offline lane of `task` on `threads` idle-priority threads. `active` is called
    on the event loop whenever a batch is taken or ends (queue depths, idleness);
    while `turns()` none is taken."""

    def __init__(
        self,
        task: Task,
        threads: int,
        lanes: LaneQueues,
        series: LaneSeries,
        clock: Callable[[], float],
        active: Callable[[], None],
        turns: Callable[[], bool],
    ) -> None:
        self.task = task
        self.threads = threads
        self._lanes = lanes
        self._series = series
        self._clock = clock
        self._active = active
        self._turns = turns
        self.running = 0  # batches on the threads now
        self._room = asyncio.Event()
        self._twin: Task | None = None  # the task on its one-thread session
        self._twin_lock = threading.Lock()
        self._idle: IdleThreads | None = None
        self._loop_task: asyncio.Task[None] | None = None

    def start(self, name: str) -> None:
        self._idle = IdleThreads(f"lanes-{name}-offline", self.threads)
        self._loop_task = asyncio.create_task(self._run_forever(), name=f"offline-{name}")

    async def stop(self) -> None:
        """Once the offline queue is closed: run what it holds, then end the threads."""
        if self._loop_task is not None:
            await self._loop_task
        if self._idle is not None:
            await asyncio.to_thread(self._idle.stop)

    def release(self) -> None:
        """Drop the one-thread session (the model unloads; none running): the next
        offline batch loads it again."""
        self._twin = None

    async def _run_forever(self) -> None:
        while True:
            while self.running >= self.threads:
                self._room.clear()
                await self._room.wait()
            while self._turns() and not self._lanes.offline.closed:
                await asyncio.sleep(LOOK_AGAIN_S)
            batch = await self._lanes.next_offline()
            self._active()
            if batch is None:
                return
            if self._twin is None:
                # Loaded at the OS's normal priority: a load is no offline work to yield,
                # and at idle priority it waits for every other busy thread (on a machine
                # busy elsewhere, the first batch's load outlasted a minute).
                self.running += 1  # an unload waits for it, as for a batch
                try:
                    await asyncio.to_thread(self._load_twin)
                finally:
                    self.running -= 1
            self._start(batch.items)

    def _start(self, batch: list[Pending]) -> None:
        """One batch on a thread; its callers all gone, the run stops."""
        assert self._idle is not None
        self.running += 1
        stop = ort.RunOptions()
        for pending in batch:
            pending.future.add_done_callback(partial(_stop_if_abandoned, batch, stop))
        run = partial(
            stoppable_run, self._run_on_twin, clock=self._clock, name=self.task.name, stop=stop
        )
        done = partial(self._finish, batch, self._clock())
        self._idle.call(run, [p.item for p in batch], done)

    def _load_twin(self) -> Task:
        """The task on its one-thread session, loaded now if it is not (again after a
        release)."""
        with self._twin_lock:
            if self._twin is None:
                assert isinstance(self.task, SlotSession)
                self._twin = self.task.on_one_thread()
            return self._twin

    def _run_on_twin(
        self, items: Sequence[Any], options: ort.RunOptions | None = None
    ) -> list[Any]:
        # Without `options`: the halves of a failed run (batch_run.stoppable_run).
        return run_unhandled(self._load_twin(), items, options)

    def _finish(
        self, batch: list[Pending], start: float, result: Result | None, error: BaseException | None
    ) -> None:
        self.running -= 1
        self._room.set()
        took = self._clock() - start
        self._series.busy.inc(took)
        charge(batch, took)  # before the answers: a caller reads its share then
        if isinstance(error, Stopped):  # nobody waited for it any more
            self._lanes.offline.give_back(batch)
        else:
            answer(batch, start, result, error, self.task.name)
            self._series.items.inc(len(batch))
        self._active()


def _stop_if_abandoned(batch: list[Pending], stop: ort.RunOptions, _: object) -> None:
    """Once no caller of an offline batch waits, its run (if still going) ends early."""
    if not any(p.live for p in batch):
        stop.terminate = True
