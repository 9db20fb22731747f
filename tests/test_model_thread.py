"""The model thread: calls run in order on one named thread, answers reach the loop; the
idle threads: side by side at the OS's idle priority."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from lanes.serving.model_thread import IdleThreads, ModelThread
from tests.gates import WAIT_S


def _where(tag: str) -> tuple[str, str]:
    return tag, threading.current_thread().name


def call(thread: ModelThread, fn: Callable[[Any], Any], arg: Any) -> asyncio.Future[Any]:
    """The call's outcome as a future, settled by its callback; checks the callback's thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    caller = threading.current_thread()

    def done(result: Any, error: BaseException | None) -> None:
        assert threading.current_thread() is caller, "answered on the caller's loop"
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    thread.call(fn, arg, done)
    return future


async def test_calls_run_in_order_on_its_own_thread() -> None:
    thread = ModelThread("lanes-test")
    try:
        answers = await asyncio.gather(*(call(thread, _where, str(i)) for i in range(5)))
    finally:
        thread.stop()
    assert answers == [(str(i), "lanes-test") for i in range(5)]


async def test_an_exception_reaches_the_caller_and_the_thread_keeps_serving() -> None:
    def fail(message: str) -> None:
        raise ValueError(message)

    thread = ModelThread("lanes-test")
    try:
        with pytest.raises(ValueError, match="bad batch"):
            await call(thread, fail, "bad batch")
        assert await call(thread, _where, "next") == ("next", "lanes-test")
    finally:
        thread.stop()


async def test_a_caller_that_leaves_does_not_stop_the_run() -> None:
    release, finished = threading.Event(), threading.Event()

    def held(_: None) -> None:
        assert release.wait(WAIT_S), "never released"
        finished.set()

    thread = ModelThread("lanes-test")
    try:
        running = call(thread, held, None)
        with pytest.raises(TimeoutError):  # the caller gives up: the run waits for `release`
            await asyncio.wait_for(asyncio.shield(running), 0.01)
        release.set()
        assert await call(thread, _where, "after") == ("after", "lanes-test")
        assert finished.is_set()  # it ran to its end before the next call
        assert running.result() is None  # and it was answered all the same
    finally:
        thread.stop()


async def test_stop_runs_what_was_called_then_ends_the_thread() -> None:
    ran: list[str] = []
    thread = ModelThread("lanes-test")
    pending = [call(thread, ran.append, tag) for tag in "abc"]
    await asyncio.to_thread(thread.stop)
    await asyncio.gather(*pending)
    assert ran == ["a", "b", "c"]
    assert not any(t.name == "lanes-test" for t in threading.enumerate())


async def test_idle_threads_run_calls_side_by_side_at_idle_priority() -> None:
    """Two calls at once on two threads, each at the OS's idle priority: both are held
    at one barrier, which only two threads running together can pass."""
    both = threading.Barrier(2, timeout=WAIT_S)

    def meet(_: None) -> tuple[int, str]:
        both.wait()
        return os.sched_getscheduler(0), threading.current_thread().name

    threads = IdleThreads("lanes-idle", 2)
    try:
        answers = await asyncio.gather(call(threads, meet, None), call(threads, meet, None))
    finally:
        await asyncio.to_thread(threads.stop)
    assert sorted(answers) == [(os.SCHED_IDLE, "lanes-idle-0"), (os.SCHED_IDLE, "lanes-idle-1")]
    assert len(threads.native_ids) == 2
    assert not any(t.name.startswith("lanes-idle") for t in threading.enumerate())
