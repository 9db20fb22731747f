"""A generate engine's offline lane: a flow's batch submitted whole, waited for whole.

Offline sequences (`submit_offline`: a flow's batch through the internal batch
route) share the rows: they take rows no interactive request waits for, and are
preempted at the next step when interactive ones need them, their caches kept while
memory allows (`keep_bytes`) and recomputed otherwise when they resume
(lanes/generation/preempt.py). Their tokens never reach the interactive series
(TTFT, ITL); each lane has its items, queue depth, busy time and preemptions.

Apart from serving/engine.py because it is the event-loop side of one lane only: it
queues sequences into the engine's inbox as `submit` does, and the engine thread
runs them as any other. `Engine` inherits it (`OfflineLane`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial

from lanes.errors import InvalidInput, LanesError, Overloaded
from lanes.generation.batch import seq_of
from lanes.generation.seq import Seq
from lanes.serving.batching import OFFLINE_BOUND, DeviceShare, never_fits
from lanes.serving.step_observer import StepObserver, resolve_from_thread
from lanes.serving.token_stream import TokenStream, completion
from lanes.tasks.decoder import Completion
from lanes.tasks.generate import GenerateRequest, GenerateTask

log = logging.getLogger("lanes.serving")

# Offline sequences one engine holds (queued or in rows): beyond, 503 and Retry-After,
# which the flow's endpoint runner waits out; a batch of more, 413, which it halves.
OFFLINE_MAX_SEQUENCES = 65536
# How long an offline batch waits for its last step's report (its device time), at
# most: a report follows its step at once unless the engine is stuck.
SETTLE_TIMEOUT_S = 30.0


class OfflineLane:
    """`submit_offline` over the engine's inbox and streams; `Engine` is the one
    subclass, and `abort` its own (a stream's client went away)."""

    task: GenerateTask
    name: str
    observer: StepObserver
    _ids: itertools.count[int]
    _lock: threading.Condition
    _stopping: bool
    _inbox: list[Seq]
    _streams: dict[int, TokenStream]  # event-loop side only
    _offline: set[int]  # offline sequences not finished (event-loop side)
    abort: Callable[[int], None]

    async def submit_offline(
        self, requests: Sequence[GenerateRequest], share: DeviceShare | None = None
    ) -> list[Completion | LanesError]:
        """Run prepared requests in the offline lane (free rows only, preempted when
        interactive requests need them) and wait for all of them: per request its
        `Completion` (the model's, no handler: the offline workload applies its own)
        or the error it failed with alone. A request over the workload's whole
        batching.max_kv_bytes gets its `InvalidInput` (the flow settled it under its
        own workload's budget, if any): alone it would run past the budget."""
        refused = [self._over_kv_budget(r) for r in requests]
        kept = [r for r, no in zip(requests, refused, strict=True) if no is None]
        done = iter(await self._run_offline(kept, share) if kept else ())
        return [next(done) if no is None else no for no in refused]

    def _over_kv_budget(self, request: GenerateRequest) -> InvalidInput | None:
        try:
            self.task.kv_budget.check(len(request.prompt_ids), request.max_new_tokens)
        except InvalidInput as refused:
            return refused
        return None

    async def _run_offline(
        self, requests: Sequence[GenerateRequest], share: DeviceShare | None
    ) -> list[Completion | LanesError]:
        """`submit_offline` of requests within the budget. RequestTooLarge when the
        lane can never hold them all; Overloaded, whole, when it cannot now or the
        server stops before they are done (the flow retries). Each sequence's part of
        the steps it was in (as the lanes' busy time splits a step) is added to
        `share`, whole when this returns."""
        too_many = never_fits(len(requests), OFFLINE_MAX_SEQUENCES, bound=OFFLINE_BOUND)
        if too_many is not None:
            raise too_many  # a 503 would be refused as often as it is retried
        # Their text is read whole, at the finish (_completion): decoded once, then.
        seqs = [seq_of(next(self._ids), r, offline=True, stream=False) for r in requests]
        streams = [TokenStream(seq.id, len(seq.prompt_ids), self, seq.top_logprobs) for seq in seqs]
        settled = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", 1.0)
            if len(self._offline) + len(seqs) > OFFLINE_MAX_SEQUENCES:
                raise Overloaded(
                    f"the offline lane holds {len(self._offline)} sequences; retry shortly", 1.0
                )
            if share is not None:
                ids = [seq.id for seq in seqs]
                self.observer.charge_to(ids, share, partial(resolve_from_thread, settled))
            self._inbox += seqs
            for stream in streams:
                self._streams[stream.id] = stream
                self._offline.add(stream.id)
            self._lock.notify()
        try:
            try:
                done = await asyncio.gather(*(completion(s) for s in streams))
            except BaseException:
                for stream in streams:  # the flow went away: its sequences leave
                    stream.cancel()
                raise
            if any(d is None for d in done):
                raise Overloaded("the server stopped before this batch was done; retry it", 1.0)
            if share is not None:
                await self._settled(settled)
        finally:
            if share is not None:
                self.observer.forget(share)
        return [d for d in done if d is not None]

    async def _settled(self, settled: asyncio.Future[None]) -> None:
        """Once every step of the batch's sequences is charged to its share: at once but
        where a finish went out with a first token, ahead of its step's report."""
        try:
            await asyncio.wait_for(settled, SETTLE_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "%s: an offline batch's last steps were not reported within %.0f s: its "
                "device time may be short of them",
                self.name,
                SETTLE_TIMEOUT_S,
            )
