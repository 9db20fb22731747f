"""What runs an offline shard's batches: `ShardModel`, the protocol every runner keeps;
`Model`, a task loaded in this process; and `DeviceTime`, the model time a runner
reports batch by batch (the endpoint runner's: flows.endpoint.EndpointModel)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lanes.isolation import Failed, isolate, per_item
from lanes.tasks.base import Task
from lanes.tasks.generate import GenerateTask

log = logging.getLogger("lanes.flows.shard")


@dataclass
class DeviceTime:
    """A shard's batches' model time, as its runner reports it batch by batch."""

    seconds: float = 0.0
    reported: int = 0  # batches that reported theirs
    unreported: int = 0  # batches that ran without

    def add(self, seconds: float | None) -> None:
        if seconds is None:
            self.unreported += 1
        else:
            self.seconds += seconds
            self.reported += 1

    @property
    def total(self) -> float | None:
        """The shard's model time; None unless every batch reported its own (0 for a
        shard that ran none: all its records rejected, or none left to retry)."""
        return None if self.unreported else round(self.seconds, 9)


class ShardModel(Protocol):
    """What runs a shard's batches. `task` prepares the records and `answer`s them
    (the same in every runner, so a record's line does not depend on where it ran);
    `run` runs one batch of prepared items."""

    @property
    def task(self) -> Task: ...

    @property
    def provider(self) -> str:
        """The execution provider the batches ran on, for the shard's stats."""
        ...

    def run(self, items: Sequence[Any], device: DeviceTime | None = None) -> list[Any]:
        """One output per item (a `Failed` for an item that fails alone); raises when
        the run failed for a reason a retry might fix, or failed on every item. A
        runner that measures the model time the batch used adds it to `device`."""
        ...


@dataclass
class Model:
    """A task loaded in this process. `lock`: one batch on the device at a time,
    however many shards run at once in this process, so the rest of their work
    overlaps the model's. (flows.endpoint.EndpointModel runs on the endpoint's.)"""

    task: Task
    provider: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, items: Sequence[Any], device: DeviceTime | None = None) -> list[Any]:
        """One model run; if it fails, find the items it fails on by halving the batch
        (lanes/isolation.py). An item that fails alone becomes that record's error.
        When every item fails alone, the model (not the data) is at fault: the first
        error is raised, for the shard's retries. `device` is left as it is: a local
        run is priced on its wall time."""

        if isinstance(self.task, GenerateTask):
            return self._run_continuous(self.task, items)

        def run(part: Sequence[Any]) -> Sequence[Any]:
            with self.lock:
                return list(self.task.run(part))

        isolated = isolate(run, items)
        if isolated.all_failed:
            raise isolated.failed[0].error
        if isolated.error is not None:
            log.warning(
                "a batch of %d failed (%s: %s); %d of its items fail on their own",
                len(items),
                type(isolated.error).__name__,
                isolated.error,
                len(isolated.failed),
            )
        return per_item(isolated, len(items))

    def _run_continuous(self, task: GenerateTask, items: Sequence[Any]) -> list[Any]:
        """A generate task's items through its step loop, which isolates the rows the
        model fails on by itself (lanes/generation/loop.py); as in `run`, every item
        failing alone is the model's fault and is raised."""
        with self.lock:
            outputs = task.run_apart(items)
        failed = [o for o in outputs if isinstance(o, Failed)]
        if failed and len(failed) == len(outputs):
            raise failed[0].error
        if failed:
            log.warning("%d of a window of %d prompts fail on their own", len(failed), len(items))
        return outputs
