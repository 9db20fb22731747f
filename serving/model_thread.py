"""A thread of its own for a worker's model runs, with the cheapest hand-off to it and back.

`loop.run_in_executor` on a one-thread ThreadPoolExecutor passes each call through a
work item, a concurrent Future (whose Condition is Python-level locking) and a
chained asyncio Future. Measured on a 2-vCPU VM with the thread idle 1 ms before a
call, that was 0.15 ms to start the call and 0.20 ms to get its result back; here it
is one queue put (one futex wake) and one call_soon_threadsafe (one eventfd write):
0.07 and 0.13 ms. A lone request pays both hand-offs.

The answer is a callback run on the caller's loop, not a future: whoever awaits the
outcome awaits futures the callback settles, one loop iteration sooner than through
a future of the thread's own (and no caller can cancel a run through it).

`IdleThreads` are the same hand-off to several threads at the operating system's idle
priority: the offline lane's on a CPU. There the OS scheduler is the finest preemption
there is: a thread at SCHED_IDLE (Linux) runs only on a core nothing else wants, so an
interactive run that starts takes the cores at once, in the middle of an offline run,
which loses nothing and goes on when they are free again. Stopping offline runs at their
boundaries instead (serving/offline_runs.py) keeps an arrival waiting for a run or
throws the run's work away; bench/backfill.py measures both beside this.

`on_own_thread` awaits one call on a daemon thread of its own: a workload's load at
start-up (serving/loading.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from lanes.runtime import idle_priority_available

T = TypeVar("T")

# What a call hands the loop when it ends: its result, or the exception it raised.
Done = Callable[[Any, BaseException | None], None]
_Job = tuple[Callable[[Any], Any], Any, Done, asyncio.AbstractEventLoop]


class ModelThread:
    """Runs `fn(arg)` calls one at a time, in order, on one thread named `name`
    (`count` threads, `name`-0, `name`-1..., take calls side by side: IdleThreads)."""

    def __init__(self, name: str, count: int = 1) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        names = [name] if count == 1 else [f"{name}-{i}" for i in range(count)]
        self._threads = [threading.Thread(target=self._serve, name=n, daemon=True) for n in names]
        for thread in self._threads:
            thread.start()

    def call(self, fn: Callable[[Any], Any], arg: Any, done: Done) -> None:
        """`fn(arg)` on the thread, then `done(result, None)` or `done(None, error)` on
        the calling event loop. Every call runs to its end and is answered."""
        self._jobs.put((fn, arg, done, asyncio.get_running_loop()))

    def stop(self) -> None:
        """Run what was called already, then end the thread (blocks until it has)."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()

    def _begin(self) -> None:
        """Runs first on each thread, before any call."""

    def _serve(self) -> None:
        self._begin()
        while (job := self._jobs.get()) is not None:
            fn, arg, done, loop = job
            result, error = None, None
            try:
                result = fn(arg)
            except BaseException as e:  # the caller decides what it means
                error = e
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to answer
                loop.call_soon_threadsafe(done, result, error)


class IdleThreads(ModelThread):
    """`count` threads at the OS's idle priority, named `name`-0, `name`-1..., each
    running one `fn(arg)` call at a time (so up to `count` at once, started in order).

    `native_ids`: the OS's ids of the threads that have lowered their priority."""

    def __init__(self, name: str, count: int) -> None:
        if not idle_priority_available():
            raise RuntimeError("this OS has no idle priority for threads (SCHED_IDLE)")
        self.native_ids: list[int] = []
        super().__init__(name, count)

    def _begin(self) -> None:
        # 0: the calling thread (Linux schedules threads, not processes).
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        self.native_ids.append(threading.get_native_id())


async def on_own_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread of its own. A load that a server stopping before it was
    ready abandons (a TensorRT engine's build takes minutes) must not hold the process's
    exit until it ends, as a thread of asyncio's default executor would."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def deliver(settle: Callable[[], None]) -> None:
        def on_loop() -> None:
            if not done.cancelled():
                settle()

        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(on_loop)

    def run() -> None:
        try:
            result = fn()
        except BaseException as err:  # handed to the awaiting coroutine, whatever it is
            deliver(functools.partial(done.set_exception, err))
            return
        deliver(functools.partial(done.set_result, result))

    threading.Thread(target=run, name="lanes-load", daemon=True).start()
    return await done
