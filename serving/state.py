"""What the serving app holds while it runs: its workers, engines, metrics and readiness."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from lanes.errors import Overloaded, UnknownWorkload, WrongMode
from lanes.serving.engine import Engine
from lanes.serving.guard import TextGuard
from lanes.serving.metrics import Metrics
from lanes.serving.offload import Offload
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.spec import Spec, TaskName


@dataclass
class ServingState:
    spec: Spec
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    workers: dict[str, BatchWorker] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)  # generate workloads
    guards: dict[str, TextGuard] = field(default_factory=dict)  # generate workloads' guards
    ready: bool = False
    load_error: str | None = None
    # Every worker's and engine's: arrivals, deadlines, the time of each run.
    clock: Callable[[], float] = time.monotonic

    @cached_property
    def offload(self) -> Offload:
        """Where large bodies are parsed and tokenized (off the event loop)."""
        return Offload(self.settings.offload_body_bytes)

    def worker(self, name: str, tasks: tuple[TaskName, ...]) -> BatchWorker:
        """The worker of an interactive workload of one of `tasks`, or a clear error."""
        self._check(name, tasks)
        worker = self.workers.get(name)
        if worker is None:
            raise Overloaded(f"workload {name!r} is still loading; retry when /readyz is 200")
        return worker

    def engine(self, name: str) -> Engine:
        """The continuous-batching engine of an interactive generate workload."""
        self._check(name, ("generate",))
        engine = self.engines.get(name)
        if engine is None:
            raise Overloaded(f"workload {name!r} is still loading; retry when /readyz is 200")
        return engine

    def _check(self, name: str, tasks: tuple[TaskName, ...]) -> None:
        workload = self.spec.workloads.get(name)
        if workload is None:
            known = ", ".join(sorted([*self.workers, *self.engines])) or "none"
            raise UnknownWorkload(
                f"no workload named {name!r}; interactive ones: {known}", param="model"
            )
        if workload.mode == "offline":
            raise WrongMode(
                f"workload {name!r} is offline: submit it as a batch job "
                "(client.submit or `lanes submit`), not as a call",
                param="model",
            )
        if workload.task not in tasks:
            wanted = " or ".join(tasks)
            raise WrongMode(
                f"workload {name!r} is a {workload.task} workload; this route serves {wanted}",
                param="model",
            )
