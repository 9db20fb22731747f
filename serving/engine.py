"""Continuous batching online: the step loop on a thread, arrivals, streams to clients.

One `Engine` per interactive generate workload. Its thread runs the plain step
loop of lanes/generation (onnxruntime releases the GIL, so HTTP keeps flowing while
a step runs):

    take what arrived (and the aborts) since the last step
    plan = scheduler.schedule()        # deadlines expire here, joiners take free rows
    step = loop.run(plan, flush)       # the whole plan, one update; just before its
                                       # model run, flush() hands the last step's events
                                       # to the event loop (into each TokenStream)

What arrives during a step joins at the next one. A step that admits joiners runs
only their prefill (the scheduler's `prefill_alone`), so a newcomer waits for at most
the step in flight and its own prefill, never for a decode of the others.

Each request's `TokenStream` is on the event loop; `cancel()` (its client left)
aborts the sequence, whose row is freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from lanes.errors import Overloaded
from lanes.generation.batch import scheduler_for
from lanes.generation.kvcache import MAX_PADDING, BatchCache
from lanes.generation.loop import Step, StepLoop
from lanes.generation.scheduler import Event, Policy, Seq
from lanes.serving.metrics import Metrics, TokenRate, Utilization
from lanes.spec import as_interactive
from lanes.tasks.generate import GenerateRequest, GenerateTask

SWITCH_INTERVAL_S = 0.001


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
    padded cache positions are worth one decoder run less (lanes/generation/kvcache.py).
    `clock` is the scheduler's (arrivals, deadlines) and times every step.
    """

    def __init__(
        self,
        task: GenerateTask,
        metrics: Metrics,
        policy: Policy = "continuous",
        max_padding: float = MAX_PADDING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        workload = as_interactive(task.workload)
        self.task = task
        self.name = task.name
        self.decoder = task.decoder
        self.clock = clock
        self.scheduler = scheduler_for(
            self.decoder,
            workload.batching.max_batch_size,
            policy=policy,
            prefill_alone=True,
            clock=clock,
        )
        self.loop = StepLoop(self.decoder, self.scheduler, self.name, max_padding, clock)
        self.max_queue = workload.batching.max_queue
        default = workload.slo.timeout_ms
        self.default_timeout_s = default / 1000 if default else None
        self.utilization = Utilization()
        self.rate = TokenRate()
        self._series = _Series.bind(metrics, self.name)
        self._stats = threading.Lock()  # rate and utilization: engine thread and /metrics
        self._lock = threading.Condition()
        self._inbox: list[Seq] = []
        self._aborts: list[int] = []
        self._waiting = 0  # submitted, not yet running or retired (under _lock)
        self._stopping = False
        self._ids = itertools.count(1)
        self._streams: dict[int, TokenStream] = {}  # event-loop side only
        # Events handed over, not yet dispatched (under _outbox_lock): while the event
        # loop has not drained them, a step adds to them instead of waking it again
        # (each wake-up is a write to its self-pipe, from a thread that then waits
        # for the GIL).
        self._outbox: list[Event] = []
        self._outbox_lock = threading.Lock()
        self._last_token_at: dict[int, float] = {}  # engine-thread side only
        self._unsent: list[Event] = []  # engine-thread side only: for the next _flush
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"lanes-engine-{self.name}")
        self._thread.daemon = True

    @property
    def cache(self) -> BatchCache:
        return self.loop.cache

    # ---- the event-loop side -------------------------------------------------

    def start(self) -> None:
        self._event_loop = asyncio.get_running_loop()
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

    def submit(
        self, request: GenerateRequest, timeout_s: float | None = None, ignore_eos: bool = False
    ) -> TokenStream:
        """Queue a prepared request; its tokens arrive on the returned stream.

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
            self._inbox.append(seq)
            self._streams[seq.id] = stream
            self._lock.notify()
        self._series.queue_depth.set(self._waiting)
        return stream

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

    def _drain(self) -> None:
        with self._outbox_lock:
            events, self._outbox = self._outbox, []
        self._dispatch(events)

    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            stream = self._streams.get(event.seq_id)
            if stream is not None:
                stream._push(event)
                if event.finish is not None:
                    del self._streams[event.seq_id]

    # ---- the engine thread -------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._take_inbox()
            plan = self.scheduler.schedule()
            with self._lock:
                self._waiting = len(self._inbox) + self.scheduler.num_waiting
            if plan.empty:
                if stopping:
                    self._flush()
                    return
                continue
            start = self.clock()
            # The last step's events go out as this step's model run starts: the
            # event loop's wake-up then costs this thread no wait for the GIL.
            step = self.loop.run(plan, self._flush)
            end = self.clock()
            self._observe(step)
            self._unsent += step.events
            if not plan.runs_model:
                self._flush()
            with self._stats:
                self.utilization.record(start, end)
            self._series.busy.inc(end - start)

    def _take_inbox(self) -> bool:
        """Sleep until there is something to do, then move new requests and aborts
        into the scheduler. Returns whether the engine is stopping."""
        scheduler = self.scheduler
        if self._unsent and not (self._inbox or scheduler.has_work):
            self._flush()  # no step is coming to take them out (a racy peek: at worst later)
        with self._lock:
            while not (self._inbox or self._aborts or self._stopping or scheduler.has_work):
                self._lock.wait()
            joining, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
        for seq in joining:
            scheduler.add(seq)
        if stopping:
            aborts += [s.id for s in (*scheduler.waiting, *scheduler.rows)]
        for seq_id in aborts:
            scheduler.abort(seq_id)
        return stopping

    def _observe(self, step: Step) -> None:
        m = self._series
        plan = step.plan
        if plan.prefill:
            m.prefill.observe(step.prefill_s)
        if plan.decode:
            m.decode.observe(step.decode_s)
            m.rows.observe(len(plan.decode))
        now = self.clock()
        made = 0
        last_at = self._last_token_at
        joined = {s.id: s for s in plan.prefill}  # first tokens come from prefills only
        for event in step.events:
            if event.tokens:
                made += len(event.tokens)
                if event.first and event.seq_id in joined:
                    m.ttft.observe(now - joined[event.seq_id].arrived)
                else:
                    last = last_at.get(event.seq_id)
                    if last is not None:
                        m.itl.observe(now - last)
                last_at[event.seq_id] = now
            if event.finish is not None:
                last_at.pop(event.seq_id, None)
                m.finished(event.finish)
        m.generated.inc(made)
        with self._stats:
            self.rate.record(time.monotonic(), made)
        self.refresh_gauges()
        m.in_flight.set(self.scheduler.num_running)
        m.queue_depth.set(self._waiting)

    def _flush(self) -> None:
        events, self._unsent = self._unsent, []
        self._hand_over(events)

    def _hand_over(self, events: list[Event]) -> None:
        if not events or self._event_loop is None:
            return
        with self._outbox_lock:
            waking = not self._outbox  # else a drain is due already and takes these too
            self._outbox += events
        if waking:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                self._event_loop.call_soon_threadsafe(self._drain)
