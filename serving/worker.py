"""The executor of one embed or infer workload: its task, its queue and its batch loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from lanes.errors import LanesError, ModelError
from lanes.isolation import Failed, Isolated, failed_alone, isolate, per_item
from lanes.serving.access import RequestRecord
from lanes.serving.batching import BatchQueue, Pending, never_fits
from lanes.serving.metrics import Metrics, Utilization
from lanes.serving.model_thread import ModelThread
from lanes.serving.tracing import batch_spans
from lanes.spec import as_interactive
from lanes.tasks import Task
from lanes.tracing import Tracing

log = logging.getLogger("lanes.serving")

# A batch expected to run shorter than this runs on the event loop itself: waking
# the model thread and then the loop again costs ~0.15-0.2 ms on a small VM (see
# serving/model_thread.py), ten times a tiny model's run, and a loop blocked this
# long holds up other requests for little more than those two wake-ups would.
INLINE_RUN_S = 0.0005
_COST_WEIGHT = 0.5  # of the newest batch in the running per-item cost: adapts in a few runs


class BatchWorker:
    """Runs one workload's batches on a thread of its own, one batch at a time.

    Running off the event loop (onnxruntime releases the GIL) lets HTTP parsing and
    the next batch's assembly overlap the current run. Batches measured to run in
    under INLINE_RUN_S are the exception: they run on the loop, cheaper than a hand-off.
    A request that finds the model free and nobody queued runs as its own batch
    from its caller's task; whatever arrives meanwhile queues and forms the next batch.

    `clock` times everything: arrivals and deadlines (it is the queue's clock too),
    runs, and so the measured cost per item that decides where a batch runs.
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
        self.queue = BatchQueue(
            batching.max_batch_size, batching.max_wait_ms / 1000, batching.max_queue, clock
        )
        self.utilization = Utilization()
        self._tracing = tracing
        self._metrics = metrics
        # Children looked up once: labels() per observation is measurable at c=1.
        self._queue_wait = metrics.queue_wait.labels(task.name)
        self._queue_depth = metrics.queue_depth.labels(task.name)
        self._latency = metrics.request_latency.labels(task.name)
        self._run_time = metrics.run_time.labels(task.name)
        self._busy = metrics.busy_seconds.labels(task.name)
        self._batch_size = metrics.batch_size.labels(task.name)
        self._thread = ModelThread(f"lanes-{task.name}")
        self._loop_task: asyncio.Task[None] | None = None
        self._item_cost_s: float | None = None  # running mean of run time per item
        self._free = asyncio.Event()  # set while no batch is on the model
        self._free.set()
        default = workload.slo.timeout_ms
        self.default_timeout_s = default / 1000 if default else None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run_forever(), name=f"batch-{self.name}")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        self.queue.close()
        if self._loop_task is not None:
            await self._loop_task
        # Off the loop: a lone request's run may still be on the thread, and the loop
        # stays free meanwhile to answer it and other workers' callers.
        await asyncio.to_thread(self._thread.stop)

    async def submit(
        self,
        items: Sequence[Any],
        timeout_s: float | None = None,
        request: RequestRecord | None = None,
    ) -> list[Any]:
        """Run prepared items (all or none) and wait for their outputs, in order.

        The run writes its queue wait and batch size in `request`, the caller's record.

        They run at once if the model is free and nobody waits, else they queue.
        More items than the queue can hold are refused (`RequestTooLarge`), however
        idle the model is, so the answer does not depend on the moment.
        """
        too_many = never_fits(len(items), self.queue.max_queue)
        if too_many is not None:
            raise too_many
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        arrived = self.clock()
        pendings: list[Pending] = []
        try:
            if self._runs_now(len(items)):
                loop = asyncio.get_running_loop()
                pendings = [
                    Pending(item, loop.create_future(), arrived, request=request) for item in items
                ]
                self._start(pendings)
            else:
                deadline = arrived + timeout_s if timeout_s is not None else None
                for item in items:
                    pendings.append(self.queue.put(item, deadline))  # may refuse: Overloaded
                    pendings[-1].request = request
                self._queue_depth.set(len(self.queue))
            if len(pendings) == 1:
                outputs = [await pendings[0].future]
            else:
                outputs = list(await asyncio.gather(*(p.future for p in pendings)))
        except BaseException:
            # Refused, one failed, or the caller went away: free the others' places too.
            # A run already started ends on the thread regardless and is accounted for then.
            for pending in pendings:
                pending.future.cancel()
            raise
        self._latency.observe(self.clock() - arrived)
        return outputs

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
            and not self.runs_inline(items)
        )

    async def _run_forever(self) -> None:
        while True:
            batch = await self.queue.next_batch(self._free)  # waits while a batch runs
            self._queue_depth.set(len(self.queue))
            if not batch:
                return
            if self._start(batch):
                await asyncio.sleep(0)  # an inline run: let replies go and requests arrive

    def _start(self, batch: list[Pending]) -> bool:
        """Run one batch; returns whether it ran on the loop (then it is answered already).

        Otherwise it runs on the model thread, whose callback answers it: the model
        is busy (`_free` cleared) until then.
        """
        self._free.clear()
        start = self.clock()
        items = [p.item for p in batch]
        if self.runs_inline(len(items)):
            try:
                result = self._timed_run(items)
            except Exception as e:
                self._finish(batch, start, None, e)
            else:
                self._finish(batch, start, result, None)
            return True
        self._thread.call(self._timed_run, items, partial(self._finish, batch, start))
        return False

    def _finish(
        self,
        batch: list[Pending],
        start: float,
        result: tuple[list[Any], float] | None,
        error: BaseException | None,
    ) -> None:
        """Each caller's answer, then the run's metrics; frees the model for the next."""
        end = self.clock()
        self._free.set()
        outputs: list[Any] = []
        if error is not None and not isinstance(error, LanesError):
            # A model failure must answer its callers, not kill the loop.
            log.error(
                "workload %s: a batch of %d failed (requests %s)",
                self.name,
                len(batch),
                _ids(batch),
                exc_info=error,
            )
            error = ModelError(f"the model failed on this batch: {error}")
        elif result is not None:
            outputs = result[0]
            if len(outputs) != len(batch):
                error = ModelError(
                    f"the task returned {len(outputs)} outputs for {len(batch)} inputs"
                )
        for i, pending in enumerate(batch):
            if pending.request is not None:  # before its answer: the access line reads it
                pending.request.queue_wait_s = start - pending.enqueued_at
                pending.request.batch_size = len(batch)
            if pending.future.done():
                continue  # the caller went away meanwhile
            if error is not None:
                pending.future.set_exception(error)
            elif isinstance(outputs[i], Failed):  # the model fails on this item alone
                pending.future.set_exception(outputs[i].error)
            else:
                pending.future.set_result(outputs[i])
        # Accounted after the callers resume and send their answers (call_soon runs
        # after the wake-ups set_result scheduled): a lone request does not wait on it.
        run_s = result[1] if result is not None else None
        asyncio.get_running_loop().call_soon(self._record, batch, start, end, run_s)

    def _record(self, batch: list[Pending], start: float, end: float, run_s: float | None) -> None:
        for pending in batch:
            self._queue_wait.observe(start - pending.enqueued_at)
        self.utilization.record(start, end)  # the gauge is set when /metrics is read
        self._busy.inc(end - start)
        self._batch_size.observe(len(batch))
        if run_s is not None:
            self._run_time.observe(run_s)
        if self._tracing is not None:
            batch_spans(self._tracing, self.name, batch, start, end, run_s, self.clock)

    def busy_fraction(self) -> float:
        """The model's busy share of the last 10 s, on the worker's clock."""
        return self.utilization.fraction(self.clock())

    def runs_inline(self, items: int) -> bool:
        """Whether a batch of `items` would run on the event loop (see INLINE_RUN_S)."""
        return self._item_cost_s is not None and self._item_cost_s * items < INLINE_RUN_S

    def _timed_run(self, items: list[Any]) -> tuple[list[Any], float]:
        """The task's run and its own duration, without any thread hand-off.

        A run that fails is run again in halves (lanes/isolation.py): an item that
        fails alone gets a `Failed` holding its own error, the others their outputs.
        Only a whole run's duration teaches the cost per item."""
        start = self.clock()
        isolated = isolate(self.task.run, items)
        took = self.clock() - start
        if isolated.whole:
            cost = took / len(items)
            old = self._item_cost_s
            self._item_cost_s = cost if old is None else old + _COST_WEIGHT * (cost - old)
        else:
            self._log_failures(isolated, len(items))
        return _with_errors(isolated, len(items)), took

    def _log_failures(self, isolated: Isolated[Any], items: int) -> None:
        log.error(
            "workload %s: a batch of %d failed; %d of its items fail on their own",
            self.name,
            items,
            len(isolated.failed),
            exc_info=isolated.error,
        )


def _ids(batch: list[Pending]) -> str:
    """The request ids of a batch, for a line about the whole batch."""
    return ", ".join(sorted({p.request.id for p in batch if p.request is not None})) or "none"


def _with_errors(isolated: Isolated[Any], items: int) -> list[Any]:
    """Each item's output; where it failed alone, a `Failed` holding the error its
    caller gets (every item failing alone is the model's fault, and says so)."""
    every = isolated.all_failed and items > 1
    return [
        Failed(o.index, failed_alone(o.error, every=every)) if isinstance(o, Failed) else o
        for o in per_item(isolated, items)
    ]
