"""Scale to zero inside a replica: a workload's model session, unloaded after
`idle_unload_s` without requests and loaded again by the next one.

`Residency` is the state and the bookkeeping; the workload's `BatchWorker` drives it
(serving/worker.py). A load holds the model the way a batch does, so a request that
arrives while the model is unloaded or loading waits in the queue, its deadline
running (504 when it passes, as ever), and runs once the model is back: it is
answered, not refused. Only an arrival while unloaded starts a load, and the state
changes on the event loop, so concurrent arrivals share one load.

Idleness is measured on the worker's clock (injected in tests); the check runs every
`poll_s` of real time, a cheap comparison. An unload, like a load, runs on the
model's thread and holds the model meanwhile; what arrives during it waits for the
load that follows.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from lanes.errors import ModelError
from lanes.serving.memory import Trimmer
from lanes.serving.metrics import Metrics, ResidencySeries
from lanes.tasks import Task
from lanes.tasks.session_slot import Releasable

# The longest gap between two idle checks: how late past idle_unload_s an unload may come.
IDLE_POLL_S = 0.5


class Presence(enum.Enum):
    LOADED = "loaded"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    LOADING = "loading"


class Residency:
    """Whether one workload's model is in memory, and since when it was last used."""

    def __init__(
        self,
        model: Releasable,
        idle_s: float,
        series: ResidencySeries,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.idle_s = idle_s
        self.poll_s = min(idle_s / 4, IDLE_POLL_S)
        self.state = Presence.LOADED if model.loaded else Presence.UNLOADED
        self.checks = 0  # idle checks made so far (tests wait on it)
        self._series = series
        self._clock = clock
        self._last_used = clock()
        self._load_started = 0.0
        self._trimmer = Trimmer()
        series.loaded.set(1 if model.loaded else 0)

    def touch(self) -> None:
        """A request arrived or a run ended: idleness counts from now."""
        self._last_used = self._clock()

    def idle(self) -> bool:
        """Whether `idle_s` has passed since the last `touch`."""
        return self._clock() - self._last_used >= self.idle_s

    def begin_load(self) -> bool:
        """True when the model is unloaded: the caller starts the one load (`load`,
        then `end_load`); False while it is loaded or a load is under way."""
        if self.state is not Presence.UNLOADED:
            return False
        self.state = Presence.LOADING
        self._load_started = self._clock()
        return True

    def load(self, _: object = None) -> None:
        """The load itself, off the event loop (the worker's model thread)."""
        self.model.load()

    def end_load(self, error: BaseException | None) -> None:
        """The load ended, failed with `error` or not; a failed one leaves the model
        unloaded, so the next arrival tries again."""
        self._series.loads.inc()
        self._series.load_time.observe(self._clock() - self._load_started)
        self.touch()
        if error is None:
            self._series.loaded.set(1)
        # The state last: a reader on another thread that sees it sees the rest.
        self.state = Presence.LOADED if error is None else Presence.UNLOADED

    def begin_unload(self) -> None:
        """The worker found the model idle and free; `release` follows, then `end_unload`."""
        self.state = Presence.UNLOADING

    def release(self, _: object = None) -> None:
        """Off the event loop (the worker's model thread): destroying a large session
        takes tens of ms. Then the heap's free pages go back to the system
        (serving/memory.py): without it glibc keeps most of the session's memory."""
        self.model.unload()
        self._trimmer.trim()

    def end_unload(self) -> None:
        self._series.loaded.set(0)
        self._series.unloads.inc()
        self.state = Presence.UNLOADED


def residency_of(
    task: Task, idle_s: float | None, metrics: Metrics, clock: Callable[[], float]
) -> Residency | None:
    """The residency of a workload with `idle_unload_s`, else None."""
    if idle_s is None:
        return None
    if not isinstance(task, Releasable):
        raise ModelError(
            f"workload {task.name!r} sets idle_unload_s, but its {task.kind} task cannot "
            "unload its model; remove idle_unload_s"
        )
    return Residency(task, idle_s, ResidencySeries.of(metrics, task.name), clock)
