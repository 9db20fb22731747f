"""What the serving app holds while it runs: its workers, engines, metrics and readiness."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from lanes.errors import ModelError, Overloaded, UnknownWorkload, WrongMode, shown
from lanes.serving.engine import Engine
from lanes.serving.guard import TextGuard
from lanes.serving.metrics import Metrics
from lanes.serving.offload import Offload
from lanes.serving.readiness import Hosted, LoadState, Readiness
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.spec import Spec, TaskName, a_task
from lanes.tracing import Tracing


@dataclass
class ServingState:
    spec: Spec
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    workers: dict[str, BatchWorker] = field(default_factory=dict)
    engines: dict[str, Engine] = field(default_factory=dict)  # generate workloads
    guards: dict[str, TextGuard] = field(default_factory=dict)  # generate workloads' guards
    # Every worker's and engine's: arrivals, deadlines, the time of each run.
    clock: Callable[[], float] = time.monotonic
    tracing: Tracing | None = None  # None: off
    # Per workload, its model's files digest (lanes.backfill.weights_digest), once read.
    weights: dict[str, str] = field(default_factory=dict)
    readiness: Readiness = field(init=False)

    def __post_init__(self) -> None:
        hosted = [n for n, w in self.spec.workloads.items() if w.mode == "interactive"]
        self.readiness = Readiness(hosted)

    @cached_property
    def offload(self) -> Offload:
        """Where large bodies are parsed and tokenized (off the event loop)."""
        return Offload(self.settings.offload_body_bytes)

    def worker(self, name: str, tasks: tuple[TaskName, ...]) -> BatchWorker:
        """The worker of an interactive workload of one of `tasks`, or a clear error."""
        self.hosted(name, tasks)
        worker = self.workers.get(name)
        if worker is None:
            raise self._not_loaded(name)
        return worker

    def engine(self, name: str) -> Engine:
        """The continuous-batching engine of an interactive generate workload."""
        self.hosted(name, ("generate",))
        engine = self.engines.get(name)
        if engine is None:
            raise self._not_loaded(name)
        return engine

    def hosted(self, name: str, tasks: tuple[TaskName, ...] | None = None) -> Hosted:
        """How interactive workload `name` stands; UnknownWorkload or WrongMode when the
        server does not host it (or not for one of `tasks`)."""
        workload = self.spec.workloads.get(name)
        if workload is None:
            known = ", ".join(n for n in self.spec.workloads if n in self.readiness) or "none"
            raise UnknownWorkload(
                f"no workload named {shown(name)}; interactive ones: {known}", param="model"
            )
        if workload.mode == "offline":
            raise WrongMode(
                f"workload {name!r} is offline: submit it as a batch job "
                "(client.submit or `lanes submit`), not as a call",
                param="model",
            )
        if tasks is not None and workload.task not in tasks:
            wanted = " or ".join(tasks)
            raise WrongMode(
                f"workload {name!r} is {a_task(workload.task)} workload; "
                f"this route serves {wanted}",
                param="model",
            )
        return self.readiness.of(name)

    def _not_loaded(self, name: str) -> ModelError | Overloaded:
        hosted = self.readiness.of(name)
        if hosted.state is LoadState.FAILED:
            return ModelError(
                f"workload {name!r} failed to load: {hosted.error}; fix it and restart the server"
            )
        return Overloaded(f"workload {name!r} is still loading; retry when /readyz is 200")
