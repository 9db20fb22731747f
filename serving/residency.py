"""Scale to zero inside a replica: a workload's model session, unloaded after
`idle_unload_s` without requests and loaded again by the next one.

`Residency` is the state and the bookkeeping; `ScaleToZero` drives it on the event
loop for the workload's `BatchWorker` (serving/worker.py). A load holds the model the
way a batch does, so a request that arrives while the model is unloaded or loading
waits in the queue, its deadline running (504 when it passes, as ever), and runs once
the model is back: it is answered, not refused. Only an arrival while unloaded starts
a load, and the state changes on the event loop, so concurrent arrivals share one load.

Idleness is measured on the worker's clock (injected in tests); the check runs every
`poll_s` of real time, a cheap comparison. An unload, like a load, runs on the
model's thread and holds the model meanwhile; what arrives during it waits for the
load that follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

from lanes.errors import LanesError, ModelError, Overloaded
from lanes.serving.batching import LaneQueues
from lanes.serving.beside import Beside
from lanes.serving.memory import Trimmer
from lanes.serving.metrics import Metrics, ResidencySeries
from lanes.serving.model_thread import ModelThread
from lanes.tasks import Task
from lanes.tasks.session_slot import Releasable

log = logging.getLogger("lanes.serving")

# The longest gap between two idle checks: how late past idle_unload_s an unload may come.
IDLE_POLL_S = 0.5
RELOAD_RETRY_S = 1.0  # Retry-After of the requests a failed reload answers


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


class ScaleToZero:
    """Drives one worker's `Residency` from the event loop: an arrival loads the model
    again on the model's thread, and a watcher unloads it there once it is idle.

    A load (or an unload) holds the model as a batch would (`free` cleared), so what
    arrives meanwhile queues, its deadlines running, and forms the first batch after
    the load."""

    def __init__(
        self,
        name: str,
        residency: Residency,
        thread: ModelThread,
        free: asyncio.Event,
        lanes: LaneQueues,
        beside: Beside | None,
    ) -> None:
        self.name = name
        self.residency = residency
        self._thread = thread
        self._free = free
        self._lanes = lanes
        self._beside = beside
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name=f"idle-{self.name}")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def wake(self) -> None:
        """An arrival: idleness counts from now, and an unloaded model starts loading."""
        self.residency.touch()
        self._load()

    def unload_if_idle(self) -> bool:
        """Start unloading the model if it is loaded, free, nothing waits for it in
        either lane, and `idle_unload_s` has passed on the clock since its last arrival
        or run; returns whether it did. On the loop, so no arrival slips in between."""
        residency, lanes, beside = self.residency, self._lanes, self._beside
        if (
            residency.state is not Presence.LOADED
            or not self._free.is_set()
            or len(lanes.interactive) > 0
            or len(lanes.offline) > 0
            or (beside is not None and beside.running > 0)
            or not residency.idle()
        ):
            return False
        residency.begin_unload()
        if beside is not None:
            beside.release()  # its session goes too
        self._free.clear()
        self._thread.call(residency.release, None, self._unloaded)
        return True

    def _load(self) -> None:
        if self.residency.begin_load():
            log.info("workload %s: loading its model again (idle_unload_s)", self.name)
            self._free.clear()
            self._thread.call(self.residency.load, None, self._loaded)

    def _loaded(self, result: object, error: BaseException | None) -> None:
        """The load's end, on the loop: a failed one fails what waits for it."""
        self.residency.end_load(error)
        if error is not None:
            ours = isinstance(error, LanesError)
            log.error(
                "workload %s: its model failed to load again: %s",
                self.name,
                error,
                exc_info=None if ours else error,
            )
            # Not the request's fault, and maybe not for long (a file being replaced, a
            # full device): a 503 to retry, as the next arrival tries to load again.
            failure = Overloaded(
                f"the model failed to load again ({error}); the next request tries again",
                RELOAD_RETRY_S,
                "model_unavailable",
            )
            self._lanes.interactive.fail_waiting(failure)
            self._lanes.offline.fail_waiting(failure)
        self._free.set()

    def _unloaded(self, result: object, error: BaseException | None) -> None:
        if error is not None:  # the session is dropped whatever failed after
            log.error("workload %s: unloading failed: %s", self.name, error, exc_info=error)
        self.residency.end_unload()
        log.info("workload %s: model unloaded after %g s idle", self.name, self.residency.idle_s)
        if len(self._lanes.interactive) > 0 or len(self._lanes.offline) > 0:
            self._load()  # they arrived during the unload
        else:
            self._free.set()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.residency.poll_s)
            self.unload_if_idle()
            self.residency.checks += 1
