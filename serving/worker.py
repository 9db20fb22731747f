"""The executor of one embed or infer workload: its task, its queue and its batch loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lanes.errors import LanesError, ModelError
from lanes.tasks import Task
from serving.batching import BatchQueue, Pending
from serving.metrics import Metrics, Utilization

log = logging.getLogger("lanes.serving")


class BatchWorker:
    """Runs one workload's batches on a thread of its own, one batch at a time.

    Running off the event loop (onnxruntime releases the GIL) lets HTTP parsing and
    the next batch's assembly overlap the current run.
    """

    def __init__(self, task: Task, metrics: Metrics) -> None:
        batching = task.workload.batching
        self.task = task
        self.name = task.name
        self.queue = BatchQueue(
            batching.max_batch_size, batching.max_wait_ms / 1000, batching.max_queue
        )
        self.utilization = Utilization()
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"lanes-{task.name}")
        self._loop_task: asyncio.Task[None] | None = None
        default = task.workload.slo.timeout_ms
        self.default_timeout_s = default / 1000 if default else None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run_forever(), name=f"batch-{self.name}")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        self.queue.close()
        if self._loop_task is not None:
            await self._loop_task
        self._executor.shutdown(wait=True)

    async def submit(self, items: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """Queue prepared items (all or none) and wait for their outputs, in order."""
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        arrived = time.monotonic()
        deadline = arrived + timeout_s if timeout_s is not None else None
        queued: list[Pending] = []
        try:
            for item in items:
                queued.append(self.queue.put(item, deadline))
        except LanesError:
            for pending in queued:
                pending.future.cancel()
            raise
        self._metrics.queue_depth.labels(self.name).set(len(self.queue))
        try:
            outputs = list(await asyncio.gather(*(p.future for p in queued)))
            self._metrics.request_latency.labels(self.name).observe(time.monotonic() - arrived)
            return outputs
        except BaseException:
            # One failed or the caller went away: free the others' places too.
            for pending in queued:
                pending.future.cancel()
            raise

    async def _run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        m = self._metrics
        while True:
            batch = await self.queue.next_batch()
            m.queue_depth.labels(self.name).set(len(self.queue))
            if not batch:
                return
            start = time.monotonic()
            for pending in batch:
                m.queue_wait.labels(self.name).observe(start - pending.enqueued_at)
            try:
                outputs = await loop.run_in_executor(
                    self._executor, self.task.run, [p.item for p in batch]
                )
                error: BaseException | None = None
            except LanesError as e:
                error = e
            except Exception as e:  # a model failure must answer its callers, not kill the loop
                log.exception("workload %s: a batch of %d failed", self.name, len(batch))
                error = ModelError(f"the model failed on this batch: {e}")
            end = time.monotonic()
            self.utilization.record(start, end)
            m.run_time.labels(self.name).observe(end - start)
            m.busy_seconds.labels(self.name).inc(end - start)
            m.batch_size.labels(self.name).observe(len(batch))
            m.utilization.labels(self.name).set(self.utilization.fraction(end))
            if error is None and len(outputs) != len(batch):
                error = ModelError(
                    f"the task returned {len(outputs)} outputs for {len(batch)} inputs"
                )
            for i, pending in enumerate(batch):
                if pending.future.done():
                    continue  # the caller went away meanwhile
                if error is not None:
                    pending.future.set_exception(error)
                else:
                    pending.future.set_result(outputs[i])
