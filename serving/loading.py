"""Loading a spec's interactive workloads at start-up, in the background of a serving
app (serving/app.py's lifespan): each one's task loaded and warmed off the event loop,
then its worker or engine started, and readiness told how it went.
"""

from __future__ import annotations

import gc
import logging

from lanes.errors import LanesError
from lanes.runtime import Runtime
from lanes.serving import generate_routes
from lanes.serving.metrics import STARTUP
from lanes.serving.model_thread import on_own_thread
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.tasks import GenerateTask, Task, load_task

log = logging.getLogger("lanes.serving")


async def load_workloads(state: ServingState, runtime: Runtime | None) -> None:
    """Load every interactive workload, one after another, into `state.readiness`.

    A workload that fails to load (any exception: a broken model, a user's handler, a
    bug) is logged once with its name and marked failed with the message; the others
    still load, and /readyz answers failed.
    """
    try:
        runtime = Runtime(state.settings) if runtime is None else runtime
    except Exception as err:
        for name in state.spec.workloads:
            if name in state.readiness:
                _failed(state, name, err)
        return
    for name, workload in state.spec.workloads.items():
        if name not in state.readiness:
            continue
        try:
            task = await _load_task(state, name, runtime)
            if isinstance(task, GenerateTask):
                generate_routes.start_engine(state, task)  # continuous batching
            else:
                worker = BatchWorker(task, state.metrics, state.clock, state.tracing)
                worker.start()
                state.workers[name] = worker
            freeze_heap()
        except Exception as err:
            _failed(state, name, err)
            continue
        state.readiness.ready(name)
        log.info("workload %s ready (%s, %s)", name, workload.task, workload.model)


async def _load_task(state: ServingState, name: str, runtime: Runtime) -> Task:
    """Workload `name`'s task, loaded and warm, off the event loop: one start-up load
    in the metrics, failed or not (lanes_model_loads, its time, lanes_model_loaded)."""
    started = state.clock()
    try:
        task = await on_own_thread(lambda: load_task(name, state.spec, runtime))
        await on_own_thread(task.warm_up)
    except Exception:
        _loaded(state, name, started, False)
        raise
    _loaded(state, name, started, True)
    return task


def _loaded(state: ServingState, name: str, started: float, ok: bool) -> None:
    m = state.metrics
    m.model_loads.labels(name, STARTUP).inc()
    m.model_load_time.labels(name, STARTUP).observe(state.clock() - started)
    m.model_loaded.labels(name).set(1 if ok else 0)


def _failed(state: ServingState, name: str, err: Exception) -> None:
    # A LanesError's message is the whole story; anything else is a bug somewhere,
    # and its traceback says where.
    ours = isinstance(err, LanesError)
    message = str(err) if ours else f"{type(err).__name__}: {err}"
    log.error("workload %s failed to load: %s", name, message, exc_info=None if ours else err)
    state.readiness.failed(name, message)


def freeze_heap() -> None:
    """Move everything loaded so far out of the garbage collector's sight.

    A full collection walks every tracked object while holding the GIL: with the
    libraries and sessions loaded that was a 30 ms stall of the event loop and the
    engine threads (once every ~10 s under streaming load), the worst
    time-to-first-token of the run. What start-up loaded lives as long as the server.
    """
    gc.collect()
    gc.freeze()
