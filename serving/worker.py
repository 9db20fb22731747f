"""The executor of one embed or infer workload: its task, its two lanes and its batch loop.

Interactive requests come first. On the CPU, offline items (`submit_offline`, from
flows whose runner is this endpoint) run beside them on threads at the OS's idle
priority (`batching.offline_threads`, serving/beside.py), on a one-thread session of
their own: an interactive run takes the cores the moment it starts, and offline
batches of `max_batch_size` use whatever it leaves; while interactive runs keep the
model busier than `batching.offline_beside_until`, they take turns instead, and an
arrival stops the offline run. Otherwise (a GPU, or
`offline_threads: 0`) the two lanes take turns on the model's thread: offline items
run only when no interactive request waits, in batches sized so that one run fits in
the workload's slack (serving/offline_runs.py). An interactive request that arrives
during an offline run waits for that one run at most; with `batching.preempt_offline`
it stops it instead, unless the run is nearly done (serving/offline_runs.py):
onnxruntime ends the run at its next node (`RunOptions.terminate`), and the offline
items go back to the head of their queue, to run again whole after the interactive
batch (counted as preempted). Offline runs whose every caller has gone are stopped
at once, whatever the setting.

A workload that declares `slo.p99_ms` or `slo.timeout_ms` also sizes its interactive
batches by the cost model (serving/slo.py), and answers 504 at once a request whose
run is expected to end past its deadline; until the model has a fit, and without
either, batches are formed as the queue forms them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import onnxruntime as ort

from lanes.batchframe import run_unhandled
from lanes.costmodel import CostModel
from lanes.errors import Overloaded
from lanes.isolation import Failed
from lanes.serving.access import RequestRecord
from lanes.serving.batch_observer import BatchObserver
from lanes.serving.batch_run import Result, Run, Stopped, answer, stoppable_run, timed_run
from lanes.serving.batching import (
    OFFLINE_BOUND,
    DeviceShare,
    Lane,
    LaneQueues,
    Pending,
    charge,
    never_fits,
)
from lanes.serving.beside import Beside
from lanes.serving.item_cost import ItemCost
from lanes.serving.metrics import Metrics
from lanes.serving.model_thread import ModelThread
from lanes.serving.offline_runs import OfflineLane, OfflineRun
from lanes.serving.queued_outputs import queued_outputs
from lanes.serving.residency import ScaleToZero, residency_of
from lanes.serving.slo import Steering, padded_tokens
from lanes.spec import as_interactive
from lanes.tasks import InferTask, Task
from lanes.tasks.session_slot import SlotSession
from lanes.tracing import Tracing

# Offline items one workload holds queued: any one offline batch (batch_size <= 65536)
# fits; beyond, 503 and Retry-After, which the flow's endpoint runner waits out.
OFFLINE_MAX_QUEUE = 65536


class BatchWorker:
    """Runs one workload's batches on a thread of its own, one batch at a time.

    Running off the event loop (onnxruntime releases the GIL) lets HTTP parsing and
    the next batch's assembly overlap the current run. Batches measured to run in
    under INLINE_RUN_S (serving/item_cost.py) are the exception: they run on the loop,
    cheaper than a hand-off.
    A request that finds the model free and nobody queued runs as its own batch
    from its caller's task; whatever arrives meanwhile queues and forms the next batch.

    `clock` times everything: arrivals and deadlines (it is the queue's clock too),
    runs, and so the measured cost per item that decides where a batch runs, and the
    idle time after which a workload with `idle_unload_s` unloads its model
    (serving/residency.py).
    """

    def __init__(
        self,
        task: Task,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        workload = as_interactive(task.workload)
        batching = workload.batching
        self.task = task
        self.name = task.name
        self.clock = clock
        self.lanes = LaneQueues(
            (batching.max_batch_size, batching.max_wait_ms / 1000, batching.max_queue),
            (batching.max_batch_size, OFFLINE_MAX_QUEUE),
            clock,
            left=self._set_depths,
        )
        self.queue = self.lanes.interactive
        p99 = workload.slo.p99_ms
        p99_s = p99 / 1000 if p99 is not None else None
        # Interactive batches sized by the cost model, deadlines predicted.
        self.steers = p99 is not None or workload.slo.timeout_ms is not None
        # Learned from every whole run, of either lane: sizes offline batches, and
        # interactive ones where an SLO steers them.
        self.cost = CostModel(clock=clock)
        self.steering = Steering(self.cost, p99_s, batching.max_batch_size, clock)
        self._thread = ModelThread(f"lanes-{task.name}")
        self._loop_task: asyncio.Task[None] | None = None
        self.item_cost = ItemCost()  # where a batch runs (serving/item_cost.py)
        self._free = asyncio.Event()  # set while no batch is on the model
        self._free.set()
        # Offline runs beside the interactive ones, at idle priority (0: they take turns).
        threads = task.offline_threads if isinstance(task, SlotSession) else 0
        self.offline = OfflineLane(
            self.cost,
            p99_s,
            batching.max_batch_size,
            threads,
            batching.offline_beside_until,
            batching.preempt_offline,
            clock,
        )
        stacks = task.stacks_rows if isinstance(task, InferTask) else True
        self.observer = BatchObserver(
            task.name, metrics, self.cost, self.offline, clock, tracing, stacks
        )
        self._beside = (
            Beside(
                task,
                threads,
                self.lanes,
                self.observer.lanes["offline"],
                clock,
                self._active,
                self.offline.takes_turns,
            )
            if threads
            else None
        )
        default = workload.slo.timeout_ms
        self.default_timeout_s = default / 1000 if default else None
        self.residency = residency_of(task, workload.idle_unload_s, metrics, clock)
        self.scaling = (
            ScaleToZero(
                self.name, self.residency, self._thread, self._free, self.lanes, self._beside
            )
            if self.residency is not None
            else None
        )

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run_forever(), name=f"batch-{self.name}")
        if self._beside is not None:
            self._beside.start(self.name)
        if self.scaling is not None:
            self.scaling.start()

    async def stop(self) -> None:
        """Finish what is queued (both lanes), then stop; the model's optimized copy
        (idle_unload_s) goes too."""
        if self.scaling is not None:
            await self.scaling.stop()
        self.lanes.close()
        if self._loop_task is not None:
            await self._loop_task
        if self._beside is not None:
            await self._beside.stop()
        # Off the loop: a lone request's run may still be on the thread, and the loop
        # stays free meanwhile to answer it and other workers' callers.
        await asyncio.to_thread(self._thread.stop)
        if self.residency is not None:
            self.residency.model.discard_copy()  # nothing loads again

    def hurry(self) -> None:
        """The server stopped listening: what waits for company (`max_wait_ms`) runs
        now, with what it has."""
        self.lanes.interactive.hurry()

    def admit(self, items: int, timeout_s: float | None = None, param: str | None = None) -> None:
        """Raise now what `submit` would refuse `items` inputs with, so that a caller
        can ask before it prepares them: RequestTooLarge (about the request's field
        `param`, which holds them) if they can never be queued; Overloaded while the
        queue has no room for all of them, or while its expected
        wait is past their deadline (`timeout_s`, else the workload's `slo.timeout_ms`).

        The second is what keeps goodput under overload: a FIFO queue longer than the
        deadline would let every request in only to fail it at its deadline (504),
        each having cost its parsing, tokenizing and queueing; refused at once, the
        ones let in are the ones served in time, and the refused retry elsewhere.
        """
        too_many = never_fits(items, self.queue.max_queue, param)
        if too_many is not None:
            raise too_many
        self.queue.check_room(items)
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        if timeout_s is None:
            return
        wait = self.expected_wait_s()
        if wait > timeout_s:
            raise Overloaded(
                f"workload {self.name!r} is overloaded: the queue's expected wait, about "
                f"{wait * 1000:.0f} ms, is past this request's deadline of "
                f"{timeout_s * 1000:.0f} ms; retry shortly",
                wait,
            )

    def expected_wait_s(self) -> float:
        """About how long what is queued now takes to run, at the measured cost per
        input (0 before the first run): the least a newcomer waits for its batch.

        Only the queue counts, not the rest of the batch on the model (unknown, and a
        request behind no queue is better left to its deadline: it may still make it)."""
        cost = self.item_cost.seconds
        return 0.0 if cost is None else len(self.queue) * cost

    async def submit(
        self,
        items: Sequence[Any],
        timeout_s: float | None = None,
        request: RequestRecord | None = None,
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> list[Any]:
        """Run prepared items (all or none) and wait for their outputs, in order.

        The run writes its queue wait and batch size in `request`, the caller's record.
        `gone()` returns once the caller's client has disconnected: while its items
        wait in the queue, that takes them out (ClientGone), so no run is spent on an
        answer nobody reads.

        They run at once if the model is free and nobody waits, else they queue.
        More items than the queue can hold are refused (`RequestTooLarge`), however
        idle the model is, so the answer does not depend on the moment; more than it
        has room for now, at once and all of them (`Overloaded`).
        """
        self.admit(len(items), timeout_s)
        self._wake()
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        arrived = self.clock()
        self.offline.arrived(arrived)
        deadline = arrived + timeout_s if timeout_s is not None else None
        early_s = 0.0
        if self.steers:
            busy = not self._free.is_set()
            early_s = self.steering.check_reachable(items, arrived, deadline, busy)
        pendings: list[Pending] = []
        # Items that go to the model at once end their run on the thread whoever waits:
        # only queued ones are worth taking back when the client leaves.
        now = self._runs_now(len(items))
        try:
            if now:
                loop = asyncio.get_running_loop()
                pendings = [
                    Pending(item, loop.create_future(), arrived, request=request) for item in items
                ]
                self._start(pendings, "interactive")
            else:
                for item in items:
                    # May refuse: Overloaded.
                    pendings.append(self.queue.put(item, deadline, early_s))
                    pendings[-1].request = request
                if len(pendings) > 1:
                    for pending in pendings:
                        pending.siblings = tuple(pendings)
                self.offline.interactive_waits()
                self._set_depths()
            outputs = await queued_outputs(pendings, None if now else gone)
        except BaseException as e:
            # Refused, one failed, or the caller went away: free the others' places too.
            # A run already started ends on the thread regardless and is accounted for then.
            for pending in pendings:
                pending.future.cancel()
            self.observer.failed(request, arrived, e)
            raise
        finally:
            for pending in pendings:
                pending.siblings = ()  # a cycle through each of them: freed now, not by gc
        self.observer.answered(self.clock() - arrived)
        return outputs

    async def submit_offline(
        self, items: Sequence[Any], share: DeviceShare | None = None
    ) -> list[Any]:
        """Run prepared items in the offline lane, through the model alone (no
        handler: the offline workload applies its own); per item, its raw output or
        the exception it failed with. Refused whole (Overloaded) when the offline queue
        cannot hold them all. The model time the items used is added to `share` (whole
        when this returns: each run is charged before its callers are answered)."""
        too_many = never_fits(len(items), self.lanes.offline.max_queue, bound=OFFLINE_BOUND)
        if too_many is not None:
            raise too_many
        if len(self.lanes.offline) + len(items) > self.lanes.offline.max_queue:
            raise Overloaded(
                f"the offline lane holds {len(self.lanes.offline)} items; retry shortly", 1.0
            )
        self._wake()
        pendings = [self.lanes.offline.put(item) for item in items]
        for pending in pendings:
            pending.share = share
        self._set_depths()
        try:
            outcomes = await asyncio.gather(*(p.future for p in pendings), return_exceptions=True)
        except BaseException:
            for pending in pendings:  # the flow went away: its items leave the queue
                pending.future.cancel()
            raise
        if outcomes and all(isinstance(o, Overloaded) for o in outcomes):
            raise outcomes[0]  # the model failed to load again: the flow retries the batch
        return list(outcomes)

    def _wake(self) -> None:
        if self.scaling is not None:
            self.scaling.wake()

    def _active(self) -> None:
        """Offline work beside the model was taken or ended: depths, and not idle."""
        self._set_depths()
        if self.residency is not None:
            self.residency.touch()

    def _set_depths(self) -> None:
        self.observer.depths(self.lanes)

    def _runs_now(self, items: int) -> bool:
        """Whether a request may skip the queue: the model is free, nobody waits, and
        its batch would run on the thread.

        Then the caller starts its batch itself. Through the queue it would cost two
        task switches (to the batch loop and back), ~0.15 ms of a lone request's
        latency here; nothing else changes: one batch at a time, same metrics.
        Batches cheap enough for the loop always queue: they finish before the next
        request is parsed, so the model always looks free, and only the queue lets
        requests parsed meanwhile share a run.
        """
        return (
            self._free.is_set()
            and len(self.queue) == 0
            and self.queue.max_wait_s == 0
            and items <= self.queue.max_batch_size
            and not self.queue.closed
            and not self.item_cost.runs_inline(items)
        )

    async def _run_forever(self) -> None:
        while True:
            # Waits while a batch runs; interactive requests first.
            batch = await self.lanes.next_batch(
                self._free,
                self.offline.items,
                self.steering.batch_size if self.steers else None,
            )
            self._set_depths()
            if batch is None:
                return
            if self._start(batch.items, batch.lane):
                await asyncio.sleep(0)  # an inline run: let replies go and requests arrive

    def _start(self, batch: list[Pending], lane: Lane = "interactive") -> bool:
        """Run one batch; returns whether it ran on the loop (then it is answered already).

        Otherwise it runs on the model thread, whose callback answers it: the model
        is busy (`_free` cleared) until then.
        """
        self._free.clear()
        start = self.clock()
        items = [p.item for p in batch]
        if self.steers:
            self.steering.started(start, items)
        if self.item_cost.runs_inline(len(items)):  # too short to be worth stopping
            run = partial(self._timed_run, self.task.run if lane == "interactive" else self._raw)
            try:
                result = run(items)
            except Exception as e:
                self._finish(batch, lane, start, None, e)
            else:
                self._finish(batch, lane, start, result, None)
            return True
        if lane == "offline":
            estimate = self.cost.estimate(len(items), padded_tokens(items))
            offline = OfflineRun(start, estimate.seconds if estimate is not None else None)
            self.offline.run = offline
            run = partial(self._stoppable_run, stop=offline.stop)
            for pending in batch:
                pending.future.add_done_callback(partial(self._abandoned, batch, offline))
        else:
            run = partial(self._timed_run, self.task.run)
        self._thread.call(run, items, partial(self._finish, batch, lane, start))
        return False

    def _abandoned(self, batch: list[Pending], run: OfflineRun, _: object) -> None:
        """A caller of an offline batch went or was answered: once none waits, the
        run (if still on the model) ends early, its device time saved."""
        if run is self.offline.run and not any(p.live for p in batch):
            run.end_now()

    def _raw(self, items: Sequence[Any], options: ort.RunOptions | None = None) -> list[Any]:
        return run_unhandled(self.task, items, options)

    def _finish(
        self,
        batch: list[Pending],
        lane: Lane,
        start: float,
        result: Result | None,
        error: BaseException | None,
    ) -> None:
        """Each caller's answer, then the run's metrics; frees the model for the next.
        A stopped offline run's batch goes back to its queue instead."""
        end = self.clock()
        self._free.set()
        if lane == "offline" and self.offline.run is not None:
            self.offline.run.ended()
            self.offline.run = None
        if self.residency is not None:
            self.residency.touch()
        if lane == "offline":
            charge(batch, end - start)  # before the answers: a caller reads its share then
        if isinstance(error, Stopped):
            self.lanes.offline.give_back(batch)
            live = sum(1 for p in batch if p.live)
            asyncio.get_running_loop().call_soon(self.observer.stopped, live, start, end)
            return
        outputs, error = answer(batch, start, result, error, self.name)
        # Accounted after the callers resume and send their answers (call_soon runs
        # after the wake-ups set_result scheduled): a lone request does not wait on it.
        run_s = result[1] if result is not None else None
        answered = [error is None and not isinstance(o, Failed) for o in outputs]
        whole = run_s is not None and error is None and all(answered)
        asyncio.get_running_loop().call_soon(
            self.observer.ran, batch, lane, start, end, run_s if whole else None, answered
        )

    def refresh_gauges(self) -> None:
        """The gauges read when /metrics is (`BatchObserver.refresh`)."""
        self.observer.refresh()

    def _timed_run(self, run: Run, items: list[Any]) -> Result:
        """`timed_run` (serving/batch_run.py), its duration learned (`ItemCost.learn`)."""
        return self.item_cost.learn(timed_run(run, items, self.clock, self.name))

    def _stoppable_run(self, items: list[Any], stop: ort.RunOptions) -> Result:
        """`stoppable_run` (serving/batch_run.py) of an offline batch, its duration
        learned (`ItemCost.learn`)."""
        return self.item_cost.learn(stoppable_run(self._raw, items, self.clock, self.name, stop))
