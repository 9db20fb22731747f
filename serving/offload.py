"""Parsing and tokenizing of large request bodies, off the event loop.

A request's preparation (JSON decoding, validation, tokenizing each input) is pure
CPU work, and bodies may be up to `max_body_bytes`: on the event loop, one large body
stops every other request, `/healthz` included, until it is done. Above
`offload_body_bytes` it runs on a thread of its own instead; the loop then gets the
GIL back at least every switch interval (5 ms) and keeps serving.

One thread: large bodies are prepared one after another, so however many arrive, the
loop competes for the GIL with one thread, not with a pool of them. Small bodies
stay on the loop, where they cost less than the hand-off to the thread and back.

After a body of TRIM_AFTER_BODY_BYTES or more, the thread hands the memory its
preparation freed back to the system (serving/memory.py), so that RSS does not stay at
the peak of the largest requests.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from lanes.serving.memory import TRIM_AFTER_BODY_BYTES, Trimmer

P = ParamSpec("P")
T = TypeVar("T")


class Offload:
    """Runs `fn(*args)` on the loop for bodies up to `threshold_bytes`, else on its thread."""

    def __init__(self, threshold_bytes: int) -> None:
        self.threshold_bytes = threshold_bytes
        self._pool: ThreadPoolExecutor | None = None  # started by the first large body
        self.trimmer = Trimmer()

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` for a body of `size` bytes; its exception, if it raises.

        Off the loop, `fn` must not touch the loop's objects (queues, futures): it
        runs concurrently with the loop's own work.
        """
        if size <= self.threshold_bytes:
            return fn(*args, **kwargs)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lanes-parse")
        call = functools.partial(fn, *args, **kwargs)
        if size >= TRIM_AFTER_BODY_BYTES:
            call = functools.partial(self._trimmed, call)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def _trimmed(self, call: Callable[[], T]) -> T:
        try:
            return call()
        finally:
            self.trimmer.trim()

    def close(self) -> None:
        """Let the preparation under way end; drop those waiting (nobody reads them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
