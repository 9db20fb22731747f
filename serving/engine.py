"""Continuous batching, the thin loop: plan -> decoder.step -> update -> streams.

One `Engine` per interactive generate workload. Its loop runs on a thread of its
own (onnxruntime releases the GIL, so HTTP keeps flowing while a step runs):

    plan = scheduler.schedule()
    prefill the joiners (one left-padded run) and hand out their first tokens
    decode every row (on the decode thread; arrivals meanwhile are prefilled
        at once, from a prefill-only plan: schedule(decode=False))
    events = scheduler.update(plan, logits)
    loop.call_soon_threadsafe(dispatch, events)   # into each request's TokenStream
    the joiners' caches join the batch's (lanes/generation/kvcache.py) for the next step

Each request's `TokenStream` is on the event loop; `cancel()` (its client left)
aborts the sequence, whose row is freed at the next step.

Offline sequences (`submit_offline`: a flow's batch through the internal batch
route) share the rows: they take rows no interactive request waits for, and are
preempted at the next step when interactive ones need them, their caches kept while
memory allows (`keep_bytes`) and recomputed otherwise when they resume
(lanes/generation/preempt.py). Their tokens never reach the interactive series
(TTFT, ITL); each lane has its items, queue depth, busy time and preemptions.

A prefill or decode run that fails is run again in halves of its rows
(lanes/isolation.py, from lanes/generation/prefill.py and lanes/generation/kvcache.py): the sequences
that fail alone finish with their own error, every other one goes on with its cache
and tokens as they were. Only a failure outside the model's runs fails the step's
every row (and resets the cache).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from lanes.errors import LanesError, ModelError, Overloaded
from lanes.generation.kvcache import MAX_PADDING, BatchCache, Decoded
from lanes.generation.loop import at_position, failures, log_isolated, prompt_of
from lanes.generation.preempt import KEEP_BYTES, Preempted
from lanes.generation.prefill import Chunked, Join, prefill_apart
from lanes.generation.scheduler import (
    Chunk,
    Event,
    Lane,
    Policy,
    Scheduler,
    Seq,
    StepOutputs,
    StepPlan,
)
from lanes.generation.steer import Steer
from lanes.serving.metrics import LaneSeries, Metrics, TokenRate, Utilization
from lanes.serving.tracing import GenerateSpans
from lanes.spec import as_interactive
from lanes.tasks.decoder import Completion
from lanes.tasks.generate import GenerateRequest, GenerateTask
from lanes.tracing import Tracing

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger("lanes.serving")

Array = np.ndarray[Any, Any]
SWITCH_INTERVAL_S = 0.001
# Offline sequences one engine holds (queued or in rows): any one offline window fits;
# beyond, 503 and Retry-After, which the flow's endpoint runner waits out.
OFFLINE_MAX_SEQUENCES = 65536


@dataclass(frozen=True)
class _Series:
    """One workload's metric children, bound once: `labels()` per token adds up."""

    metrics: Metrics
    name: str
    ttft: Histogram
    itl: Histogram
    generated: Counter
    in_flight: Gauge
    queue_depth: Gauge
    prefill: Histogram
    decode: Histogram
    rows: Histogram
    busy: Counter
    rate: Gauge
    utilization: Gauge

    @classmethod
    def bind(cls, m: Metrics, name: str) -> _Series:
        return cls(
            metrics=m,
            name=name,
            ttft=m.ttft.labels(name),
            itl=m.itl.labels(name),
            generated=m.generated_tokens.labels(name),
            in_flight=m.in_flight.labels(name),
            queue_depth=m.queue_depth.labels(name),
            prefill=m.prefill_time.labels(name),
            decode=m.decode_time.labels(name),
            rows=m.batch_size.labels(name),
            busy=m.busy_seconds.labels(name),
            rate=m.tokens_per_second.labels(name),
            utilization=m.utilization.labels(name),
        )

    def finished(self, reason: str) -> None:
        self.metrics.finished.labels(self.name, reason).inc()


@dataclass(eq=False)
class TokenStream:
    """One request's events, in order, on the event loop; the last has `finish` set.

    `cancel()` (the client went away) aborts the sequence: its row is freed at the
    engine's next step.
    """

    id: int
    prompt_tokens: int
    _engine: Engine = field(repr=False)
    completion_tokens: int = 0
    finished: bool = False
    _events: deque[Event] = field(default_factory=deque, repr=False)
    _signal: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def _push(self, event: Event) -> None:
        self.completion_tokens += len(event.tokens)
        self.finished = self.finished or event.finish is not None
        self._events.append(event)
        self._signal.set()

    async def next(self) -> list[Event]:
        """Every event that arrived since the last call (at least one); waits for one."""
        while not self._events:
            self._signal.clear()
            await self._signal.wait()
        events = list(self._events)
        self._events.clear()
        return events

    async def __aiter__(self) -> AsyncIterator[Event]:
        """One event at a time, up to the finish; leaving early loses none."""
        while True:
            while not self._events:
                self._signal.clear()
                await self._signal.wait()
            event = self._events.popleft()
            yield event
            if event.finish is not None:
                return

    def cancel(self) -> None:
        if not self.finished:
            self._engine.abort(self.id)


class Engine:
    """The continuous-batching executor of one generate workload.

    `policy` picks how batches form (see lanes/generation/scheduler.py); anything but
    `continuous` is there for the benchmark's comparisons. `max_padding` is how many
    padded cache positions are worth one decoder run less (see lanes/generation/kvcache.py).
    `clock` is the scheduler's (arrivals, deadlines) and times every step. With
    `tracing`, a request submitted with its span gets its prefill and decode spans.
    `keep_bytes` bounds the preempted offline sequences' kept caches.
    """

    def __init__(
        self,
        task: GenerateTask,
        metrics: Metrics,
        policy: Policy = "continuous",
        max_padding: float = MAX_PADDING,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
        keep_bytes: int = KEEP_BYTES,
    ) -> None:
        workload = as_interactive(task.workload)
        self.task = task
        self.name = task.name
        self.decoder = task.decoder
        self.clock = clock
        config = self.decoder.config
        tokenizer = self.decoder.tokenizer
        self.scheduler = Scheduler(
            workload.batching.max_batch_size,
            config.eos_token_ids,
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
            policy=policy,
            max_position=config.max_position,
            chunked=workload.slo.ttft_ms is not None,
            clock=clock,
        )
        slo = workload.slo
        self.steer = Steer(
            slo.ttft_ms / 1000 if slo.ttft_ms else None,
            slo.itl_ms / 1000 if slo.itl_ms else None,
            workload.batching.max_batch_size,
            clock,
        )
        self._default_prefill_tokens = self.scheduler.max_prefill_tokens
        self.chunked = Chunked()  # the prompt being prefilled in parts (engine thread)
        self.cache = BatchCache(self.decoder, max_padding)
        self.preempted = Preempted(keep_bytes)
        self._lanes = {lane: LaneSeries.of(metrics, self.name, lane) for lane in _LANES}
        self._offline: set[int] = set()  # offline sequences not finished (event-loop side)
        self._lane_of: dict[int, Lane] = {}  # engine-thread side: unfinished sequences' lanes
        self.max_queue = workload.batching.max_queue
        default = workload.slo.timeout_ms
        self.default_timeout_s = default / 1000 if default else None
        self.utilization = Utilization()
        self.rate = TokenRate()
        self._series = _Series.bind(metrics, self.name)
        self._spans = GenerateSpans(tracing, self.name, clock) if tracing is not None else None
        self._stats = threading.Lock()  # rate and utilization: engine thread and /metrics
        self._lock = threading.Condition()
        self._inbox: list[Seq] = []
        self._aborts: list[int] = []
        self._waiting = 0  # submitted, not yet running or retired (under _lock)
        self._stopping = False
        self._ids = itertools.count(1)
        self._streams: dict[int, TokenStream] = {}  # event-loop side only
        self._last_token_at: dict[int, float] = {}  # engine-thread side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"lanes-engine-{self.name}")
        self._decoding = ThreadPoolExecutor(1, thread_name_prefix=f"lanes-decode-{self.name}")
        # Prefilled caches not yet in the batch (engine thread only).
        self._joins: list[Join] = []
        self._thread.daemon = True

    # ---- the event-loop side -------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # This thread and the event loop take turns at the GIL, and CPython makes a
        # waiting thread wait up to the switch interval (5 ms by default): a token
        # would sit that long between the engine and its stream. 1 ms is still long
        # enough that the switching itself costs nothing measurable.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is left (its clients are gone by now), then end the loop."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)
        self._decoding.shutdown(wait=False)

    def submit(
        self,
        request: GenerateRequest,
        timeout_s: float | None = None,
        ignore_eos: bool = False,
        trace: SpanContext | None = None,
    ) -> TokenStream:
        """Queue a prepared request; its tokens arrive on the returned stream. `trace`:
        its HTTP request's span (spans of its own hang below it when tracing is on).

        Raises `Overloaded` at once when `max_queue` requests are already waiting.
        """
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        now = self.clock()
        seq = Seq(
            id=next(self._ids),
            prompt_ids=request.prompt_ids,
            max_new_tokens=request.max_new_tokens,
            sampling=request.sampling,
            stop=request.stop,
            seed=request.seed,
            deadline=now + timeout_s if timeout_s is not None else None,
            ignore_eos=ignore_eos or request.ignore_eos,
            arrived=now,
        )
        stream = TokenStream(seq.id, len(seq.prompt_ids), self)
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", 1.0)
            if self._waiting >= self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} waiting); retry shortly", 1.0)
            self._waiting += 1
            if self._spans is not None and trace is not None:
                self._spans.submitted(seq, trace)
            self._inbox.append(seq)
            self._streams[seq.id] = stream
            self._lock.notify()
        self._series.queue_depth.set(self._waiting)
        return stream

    async def submit_offline(
        self, requests: Sequence[GenerateRequest]
    ) -> list[Completion | LanesError]:
        """Run prepared requests in the offline lane (free rows only, preempted when
        interactive requests need them) and wait for all of them: per request its
        `Completion` (the model's, no handler: the offline workload applies its own)
        or the error it failed with alone. Overloaded, whole, when the lane cannot
        hold them or the server stops before they are done (the flow retries)."""
        seqs = [
            Seq(
                id=next(self._ids),
                prompt_ids=r.prompt_ids,
                max_new_tokens=r.max_new_tokens,
                sampling=r.sampling,
                stop=r.stop,
                seed=r.seed,
                ignore_eos=r.ignore_eos,
                offline=True,
            )
            for r in requests
        ]
        streams = [TokenStream(seq.id, len(seq.prompt_ids), self) for seq in seqs]
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", 1.0)
            if len(self._offline) + len(seqs) > OFFLINE_MAX_SEQUENCES:
                raise Overloaded(
                    f"the offline lane holds {len(self._offline)} sequences; retry shortly", 1.0
                )
            self._inbox += seqs
            for stream in streams:
                self._streams[stream.id] = stream
                self._offline.add(stream.id)
            self._lock.notify()
        try:
            done = await asyncio.gather(*(_completion(s) for s in streams))
        except BaseException:
            for stream in streams:  # the flow went away: its sequences leave
                stream.cancel()
            raise
        if any(d is None for d in done):
            raise Overloaded("the server stopped before this batch was done; retry it", 1.0)
        return [d for d in done if d is not None]

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._aborts.append(seq_id)
            self._lock.notify()

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def refresh_gauges(self, now: float | None = None) -> None:
        """Tokens/s and busy fraction over the last 10 s (callable from any thread)."""
        now = self.clock() if now is None else now
        with self._stats:
            rate, busy = self.rate.per_second(now), self.utilization.fraction(now)
        self._series.rate.set(rate)
        self._series.utilization.set(busy)

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            stream = self._streams.get(event.seq_id)
            if stream is not None:
                stream._push(event)
                if event.finish is not None:
                    del self._streams[event.seq_id]
                    self._offline.discard(event.seq_id)

    # ---- the engine thread -------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._take_inbox(wait=True)
            self._steer()
            plan = self.scheduler.schedule()
            self._count_waiting()
            if plan.empty:
                if stopping:
                    return
                continue
            self._step(plan)

    def _steer(self) -> None:
        """The SLOs' bounds on the next full plan's prefill and rows (lanes/generation/steer.py)."""
        self.steer.apply(self.scheduler, max(self.cache.length, 1), self._default_prefill_tokens)

    def _take_inbox(self, wait: bool) -> bool:
        """Move new requests and aborts into the scheduler (with `wait`, first sleep
        until there is something to do). Returns whether the engine is stopping."""
        scheduler = self.scheduler
        with self._lock:
            while wait and not (
                self._inbox or self._aborts or self._stopping or scheduler.has_work
            ):
                self._lock.wait()
            joining, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
        for seq in joining:
            scheduler.add(seq)
            self._lane_of[seq.id] = seq.lane
        if stopping:
            queued = (*scheduler.waiting, *scheduler.offline, *scheduler.rows)
            chunking = [scheduler.chunking] if scheduler.chunking is not None else []
            aborts += [s.id for s in (*queued, *chunking)]
        for seq_id in aborts:
            scheduler.abort(seq_id)
        return stopping

    def _count_waiting(self) -> None:
        with self._lock:
            self._waiting = sum(not s.offline for s in self._inbox) + self.scheduler.num_waiting
            offline = sum(s.offline for s in self._inbox) + self.scheduler.num_offline_waiting
        self._lanes["interactive"].queue_depth.set(self._waiting)
        self._lanes["offline"].queue_depth.set(offline)

    def _step(self, plan: StepPlan) -> None:
        """Prefill the joiners and hand out their first tokens at once, then decode
        every row (prefilling whoever arrives meanwhile, so time to first token never
        waits for a decode step). Joiners' caches enter the batch on the decode thread,
        just before the next decode, with every other copy of the cache: this thread
        stays free to prefill newcomers while those copies run."""
        start = self.clock()
        reported = False
        # Prefilled before this plan was made: each is in plan.decode or has finished.
        joins = self._take_joins()
        if plan.preempted:
            self._lanes["offline"].preemptions.inc(len(plan.preempted))
        try:
            if plan.prefill or plan.retired or plan.resumed or plan.chunk:
                self._join(
                    StepPlan(
                        plan.prefill, retired=plan.retired, resumed=plan.resumed, chunk=plan.chunk
                    )
                )
            reported = True
            keep = {s.id for s in plan.decode}
            if plan.decode:
                decoding = self.clock()
                decoded = self._decode(plan.decode, joins, keep, plan.preempted)
                took = self.clock() - decoding
                self._series.decode.observe(took)
                self.steer.observe_decode(len(plan.decode), self.cache.length, took)
                self._series.rows.observe(len(plan.decode))
                rows = StepPlan(decode=plan.decode)
                log_isolated(
                    self.name, "decode step", len(plan.decode), decoded.error, decoded.failed
                )
                failed = failures(plan.decode, decoded.failed, at_position)
                outputs = StepOutputs(decode=decoded.logits, failed=failed)
                self._publish(rows, self.scheduler.update(rows, outputs))
            elif joins or plan.preempted:  # nobody to decode: they all finished or left
                self._settle(joins, keep, plan.preempted)
        except Exception as error:  # not one row's fault: it answers them all, never kills the loop
            log.exception("workload %s: a step of %d rows failed", self.name, len(plan.decode))
            self.cache = BatchCache(self.decoder, self.cache.max_padding)
            self._joins = []
            failed_plan = StepPlan(decode=plan.decode) if reported else plan
            message = (
                f"the server failed on a step of this sequence's batch "
                f"({type(error).__name__}: {error}); the server's log has the details"
            )
            self._publish(failed_plan, self.scheduler.fail(failed_plan, message))
        finally:
            end = self.clock()
            with self._stats:
                self.utilization.record(start, end)
            self._series.busy.inc(end - start)
            self._lane_busy(plan, end - start)

    def _lane_busy(self, plan: StepPlan, seconds: float) -> None:
        """A step's time, shared between the lanes by the rows each had in it."""
        seqs = (*plan.decode, *plan.prefill, *plan.resumed)
        offline = sum(s.offline for s in seqs)
        if seqs:
            self._lanes["offline"].busy.inc(seconds * offline / len(seqs))
            self._lanes["interactive"].busy.inc(seconds * (len(seqs) - offline) / len(seqs))

    def _join(self, plan: StepPlan) -> None:
        """Run a prefill-only plan and hand out its first tokens; the joiners' caches
        wait in `_joins` until the next step takes them into the batch."""
        outputs = StepOutputs()
        if plan.prefill:
            start = self.clock()
            done = prefill_apart(self.decoder, plan.prefill)
            end = self.clock()
            self._series.prefill.observe(end - start)
            width = max(len(s.prompt_ids) for s in plan.prefill)
            self.steer.observe_prefill(len(plan.prefill), len(plan.prefill) * width, end - start)
            if self._spans is not None:
                self._spans.prefilled(plan.prefill, start, end)
            self._joins += done.joins
            log_isolated(self.name, "prefill", len(plan.prefill), done.error, done.failed)
            failed = failures(plan.prefill, done.failed, prompt_of)
            outputs = StepOutputs(prefill=done.logits, failed=failed)
        if plan.resumed:
            back = self.preempted.resume(self.decoder, plan.resumed)
            self._joins += back.joins
            log_isolated(self.name, "recompute", len(plan.resumed), back.error, back.failed)
            failed = {**outputs.failed, **failures(plan.resumed, back.failed, prompt_of)}
            outputs = StepOutputs(prefill=outputs.prefill, failed=failed)
        if plan.chunk is not None:
            outputs = self._run_chunk(plan.chunk, outputs)
        self._publish(plan, self.scheduler.update(plan, outputs))

    def _run_chunk(self, chunk: Chunk, outputs: StepOutputs) -> StepOutputs:
        """One part of a long prompt; the final part's cache joins the batch next step."""
        start = self.clock()
        part = self.chunked.run(self.decoder, chunk)
        took = self.clock() - start
        self._series.prefill.observe(took)
        self.steer.observe_prefill(1, chunk.stop - chunk.start, took)
        self._joins += part.joins
        log_isolated(self.name, "prefill chunk", 1, part.error, part.failed)
        failed = {**outputs.failed, **failures((chunk.seq,), part.failed, prompt_of)}
        return StepOutputs(outputs.prefill, outputs.decode, failed, part.logits)

    def _take_joins(self) -> list[Join]:
        joins, self._joins = self._joins, []
        return joins

    def _settle(self, joins: list[Join], keep: set[int], preempted: Sequence[Seq] = ()) -> None:
        """The batch's cache for the next decode: joiners in (into holes where they
        fit), preempted rows' caches kept, then leavers out (rows not in `keep` become
        holes, a joiner that already finished too), holes compacted away once they
        are worth a copy."""
        for join in joins:
            self.cache.place(join.ids, join.past, join.mask)
        self.preempted.keep(self.cache, preempted)
        self.cache.release(keep)
        self.cache.compact()

    def _publish(self, plan: StepPlan, events: list[Event]) -> None:
        self._observe(plan, events)
        self._hand_over(events)

    def _decode(
        self, seqs: Sequence[Seq], joins: list[Join], keep: set[int], preempted: Sequence[Seq]
    ) -> Decoded:
        """One token for every row, on the decode thread (which first settles the
        cache); logits come back in `seqs`' order, with the rows the model failed on
        alone. Requests arriving meanwhile are prefilled on this thread (onnxruntime
        runs both at once, each releasing the GIL)."""

        def settle_and_decode() -> Decoded:
            self._settle(joins, keep, preempted)
            return self.cache.decode(seqs)

        running = self._decoding.submit(settle_and_decode)
        running.add_done_callback(lambda _: self._notify())
        try:
            while True:
                with self._lock:
                    while not (self._inbox or self._aborts or running.done()):
                        self._lock.wait()
                if running.done():
                    break
                self._take_inbox(wait=False)
                early = self.scheduler.schedule(decode=False)
                self._count_waiting()
                if not early.empty:
                    self._join(early)
        finally:
            concurrent.futures.wait([running])
        return running.result()

    def _notify(self) -> None:
        with self._lock:
            self._lock.notify()

    def _observe(self, plan: StepPlan, events: list[Event]) -> None:
        m = self._series
        now = self.clock()
        made = 0
        # First tokens come from prefills only (a prompt's final chunk among them).
        joined = {s.id: s for s in (*plan.prefill, *([plan.chunk.seq] if plan.chunk else []))}
        for event in events:
            lane = self._lane_of.get(event.seq_id, "interactive")
            if event.tokens:
                made += len(event.tokens)
                last = self._last_token_at.get(event.seq_id)
                if lane == "offline":
                    pass  # nobody waits on it: its latencies are no interactive figure
                elif event.first and event.seq_id in joined:
                    m.ttft.observe(now - joined[event.seq_id].arrived)
                elif last is not None:
                    m.itl.observe(now - last)
                self._last_token_at[event.seq_id] = now
            if event.finish is not None:
                self._last_token_at.pop(event.seq_id, None)
                self._lane_of.pop(event.seq_id, None)
                self.preempted.drop(event.seq_id)
                self._lanes[lane].items.inc()
                m.finished(event.finish)
        m.generated.inc(made)
        with self._stats:
            self.rate.record(time.monotonic(), made)
        self.refresh_gauges()
        m.in_flight.set(self.scheduler.num_running)
        m.queue_depth.set(self._waiting)
        if self._spans is not None:
            self._spans.observed(plan, events, now)

    def _hand_over(self, events: list[Event]) -> None:
        if not events or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self._loop.call_soon_threadsafe(self._dispatch, events)


_LANES: tuple[Lane, ...] = ("interactive", "offline")


async def _completion(stream: TokenStream) -> Completion | LanesError | None:
    """An offline sequence's whole output from its events; its error when the model
    failed on it alone; None when it was aborted (the server is stopping)."""
    tokens: list[int] = []
    text: list[str] = []
    async for event in stream:
        tokens += event.tokens
        text.append(event.text)
        if event.finish in ("stop", "length"):
            return Completion("".join(text), tokens, event.finish, stream.prompt_tokens)
        if event.finish == "error":
            return ModelError(event.error or "the model failed on this sequence")
        if event.finish is not None:
            return None
    return None
