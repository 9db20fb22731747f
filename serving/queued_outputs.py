"""A request's queued items' outputs, or `ClientGone` when its client leaves first.

While a request's items wait in a batch worker's queue (serving/worker.py), its
connection is watched for a client that left, so no run is spent on an answer nobody
reads. Apart from the worker because it is the one piece of it that watches a
connection rather than the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lanes.serving.batching import Pending
from lanes.serving.http import ClientGone

# How long a queued request waits before its connection is watched for a client that
# left (`queued_outputs`).
WATCH_AFTER_S = 0.1


async def queued_outputs(
    pendings: Sequence[Pending], gone: Callable[[], Awaitable[None]] | None
) -> list[Any]:
    """The outputs of `pendings`, in order; ClientGone first if `gone()` returns before
    they are all answered (then the caller frees their places in the queue)."""
    waited: asyncio.Future[Any] = (
        pendings[0].future if len(pendings) == 1 else asyncio.gather(*(p.future for p in pendings))
    )
    if gone is None:
        result = await waited
        return [result] if len(pendings) == 1 else list(result)
    loop = asyncio.get_running_loop()
    watch: asyncio.Future[None] | None = None
    left = False

    def leave(_: object) -> None:
        nonlocal left
        if not waited.done():
            left = True
            waited.cancel()  # a gather's cancel cancels every item's future too

    def start_watching() -> None:
        nonlocal watch
        watch = asyncio.ensure_future(gone())
        watch.add_done_callback(leave)

    # A task per queued request cost the event loop a quarter of a small model's
    # requests/s at 32 clients (bench/serve.py --models tiny): only a request still
    # queued after WATCH_AFTER_S is watched; one that leaves sooner runs, a cost bounded
    # by that wait.
    timer = loop.call_later(WATCH_AFTER_S, start_watching)
    try:
        result = await waited
    except asyncio.CancelledError:
        if left:
            raise ClientGone(
                "the client disconnected while its request waited in the queue"
            ) from None
        raise
    finally:
        timer.cancel()
        if watch is not None:
            watch.remove_done_callback(leave)
            watch.cancel()
    return [result] if len(pendings) == 1 else list(result)
