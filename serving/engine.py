"""Continuous batching online: the core's step loop on a thread, arrivals, streams.

One `Engine` per interactive generate workload. One thread of its own runs the plain
step loop of lanes/generation (onnxruntime releases the GIL, so HTTP keeps flowing
while a step runs):

    take what arrived (and the aborts) since the last step
    steer: the SLOs' bounds on this plan's prefill and rows (lanes/generation/steer.py)
    plan = scheduler.schedule()     # deadlines expire here, joiners take free rows
    step = loop.run(plan, before_runs, first_tokens, beside)
                                    # the whole plan (lanes/generation/loop.py); joiners'
                                    # first tokens go to the event loop as soon as their
                                    # prefill is done (call_soon_threadsafe), into each
                                    # request's TokenStream; arrivals are prefilled
                                    # beside its decode
    report the step: its metrics, cost models and spans observed
    (serving/step_observer.py), then its events handed to the event loop

Reporting a step is Python work the next step does not need, so a second thread (the
arrivals thread below) reports decode steps: it takes the GIL when the engine thread
lets it go, which is in the next step's model runs. A step without a decode (joiners'
first tokens) the engine thread reports at once. Without that thread (no room beside
the model's runs, or the bench's other policies) the engine thread reports as the
next step's model runs begin (`before_runs`), or before it sleeps.

A request that arrives while the rows decode, and finds a free row, is prefilled
beside that decode on the second thread (`Scheduler.admit_beside`; onnxruntime releases
the GIL), where a second run has hardware of its own (`Runtime.room_beside`: a GPU,
or CPU cores the session's threads leave free): its first token goes out at once,
and it decodes with the rows from the next plan on. Arrivals taken together run
shortest first, in one run or apart as the prefill cost model says padding costs
(`prefill_groups`, lanes/generation/prefill.py). The engine thread touches only
the cache meanwhile, and waits for that prefill before it updates the scheduler.
What arrives between model runs, finds no free row or goes in parts joins at the
next plan: a step that admits joiners runs only their prefill (the scheduler's
`prefill_alone`), and one that shares its step with the rows' decode (never two such
steps in a row) has its first token sent before that decode. So a newcomer waits
for no decode of the others.
Each request's `TokenStream` (serving/token_stream.py) is on the event loop;
`cancel()` (its client left) aborts the sequence, whose row is freed at the next step.

Offline sequences (a flow's batch) share the rows, preempted when interactive ones
need them: the offline lane's side is serving/engine_offline.py.

The step loop isolates what the model fails on: a sequence that fails alone finishes
with its own error, every other one goes on; only a failure outside the model's runs
fails the step's every row (and resets the cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lanes.errors import Overloaded
from lanes.generation.batch import scheduler_for, seq_of
from lanes.generation.kvcache import MAX_PADDING, Decoded
from lanes.generation.loop import Step, StepLoop
from lanes.generation.preempt import KEEP_BYTES, Preempted
from lanes.generation.prefill import prefill_groups
from lanes.generation.prefixes import PREFIX_CACHE_BYTES
from lanes.generation.scheduler import PREFILL_TOKENS, Policy
from lanes.generation.seq import Event, Seq, StepPlan
from lanes.generation.slots import Cache
from lanes.generation.steer import Steer
from lanes.serving.engine_offline import OfflineLane
from lanes.serving.metrics import Metrics
from lanes.serving.step_observer import StepObserver
from lanes.serving.token_stream import TokenStream
from lanes.serving.tracing import GenerateSpans
from lanes.spec import as_interactive
from lanes.tasks.generate import GenerateRequest, GenerateTask
from lanes.tracing import Tracing

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

SWITCH_INTERVAL_S = 0.001


class Engine(OfflineLane):
    """The continuous-batching executor of one generate workload.

    `policy` picks how batches form (see lanes/generation/scheduler.py); anything but
    `continuous` is there for the benchmark's comparisons. `max_padding` is how many
    padded cache positions are worth one decoder run less (see lanes/generation/kvcache.py).
    `clock` is the scheduler's (arrivals, deadlines) and times every step. With
    `tracing`, a request submitted with its span gets its prefill and decode spans.
    `keep_bytes` bounds the preempted offline sequences' kept caches, `prefix_bytes`
    the recent prompts' (lanes/generation/prefixes.py).
    `prefill_beside`: whether arrivals are prefilled beside a decode (see above); by
    default where a second run has hardware of its own (`Runtime.room_beside`).
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
        prefill_beside: bool | None = None,
        prefix_bytes: int = PREFIX_CACHE_BYTES,
    ) -> None:
        workload = as_interactive(task.workload)
        self.task = task
        self.name = task.name
        self.decoder = task.decoder
        self.clock = clock
        slo, rows = workload.slo, workload.batching.max_batch_size
        declared = workload.batching.max_prefill_tokens
        self.scheduler = scheduler_for(
            self.decoder,
            rows,
            policy=policy,
            prefill_alone=True,
            # A declared budget or a TTFT target is hard: longer prompts go in parts.
            max_prefill_tokens=declared or PREFILL_TOKENS,
            chunked=declared is not None or slo.ttft_ms is not None,
            clock=clock,
            byte_text=task.byte_text,
            max_kv_bytes=task.kv_budget.max_bytes,
        )
        self.loop = StepLoop(
            self.decoder, self.scheduler, self.name, max_padding, clock, keep_bytes, prefix_bytes
        )
        self.steer = Steer(
            slo.ttft_ms / 1000 if slo.ttft_ms else None,
            slo.itl_ms / 1000 if slo.itl_ms else None,
            rows,
            clock,
        )
        # The declared budget, or the scheduler's: the steered one never exceeds it.
        self._default_prefill_tokens = self.scheduler.max_prefill_tokens
        self._offline: set[int] = set()  # offline sequences not finished (event-loop side)
        self.max_queue = workload.batching.max_queue
        self.default_timeout_s = slo.timeout_ms / 1000 if slo.timeout_ms else None
        spans = GenerateSpans(tracing, self.name, clock) if tracing is not None else None
        self.observer = StepObserver(self.name, metrics, self.steer, spans)
        lock = threading.Lock()
        self._lock = threading.Condition(lock)
        self._inbox: list[Seq] = []
        self._aborts: list[int] = []
        self._waiting = 0  # submitted, not yet running or retired (under _lock)
        self._stopping = False
        self._expiring = False  # the server's grace ends soon: streams end now (expire)
        self._ids = itertools.count(1)
        self._streams: dict[int, TokenStream] = {}  # event-loop side only
        self._unreported: list[Step] = []  # run, not reported yet (under _lock)
        self._reporting = threading.Lock()  # one report at a time, in step order
        self._loop: asyncio.AbstractEventLoop | None = None
        # Events handed over, not yet taken by the event loop (under _outbox_lock):
        # while the loop is behind, a step's events join those it has still to take,
        # so a stream wakes and writes once for several tokens, not once per token.
        self._outbox: list[Event] = []
        self._outbox_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"lanes-engine-{self.name}")
        self._thread.daemon = True
        # While the engine thread is in a decode, requests that arrive are prefilled
        # beside it on a thread of their own, which also reports the steps run
        # (continuous batching only: the other policies are the bench's baselines).
        # Both wait on `_lock`'s lock.
        self._arrivals = threading.Condition(lock)
        self._decoding = False  # the engine thread is in a decode (under _lock)
        self._prefilling = False  # the arrivals thread is prefilling (under _lock)
        self._beside_error: BaseException | None = None
        self._arrivals_thread = threading.Thread(
            target=self._prefill_arrivals, name=f"lanes-arrivals-{self.name}", daemon=True
        )
        if prefill_beside is None:
            prefill_beside = task.room_beside
        beside = prefill_beside and policy == "continuous"
        self._beside = self._decode_beside if beside else None
        # Without the arrivals thread, the last step is reported as the next one's
        # model runs begin: waking the event loop then costs no wait for the GIL.
        self._before_runs = None if beside else self._report

    @property
    def cache(self) -> Cache:
        return self.loop.cache

    @property
    def preempted(self) -> Preempted:
        return self.loop.preempted

    # ---- the event-loop side -------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # This thread and the event loop take turns at the GIL, and CPython makes a
        # waiting thread wait up to the switch interval (5 ms by default): a token
        # would sit that long between the engine and its stream. 1 ms is still long
        # enough that the switching itself costs nothing measurable.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        if self._beside is not None:
            self._arrivals_thread.start()
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is left (its clients are gone by now), then end the loop."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
            self._arrivals.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 30)

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
        deadline = now + timeout_s if timeout_s is not None else None
        seq = seq_of(
            next(self._ids), request, deadline=deadline, arrived=now, ignore_eos=ignore_eos
        )
        stream = TokenStream(seq.id, len(seq.prompt_ids), self, seq.top_logprobs)
        with self._lock:
            if self._stopping:
                raise Overloaded("the server is shutting down; retry on another replica", 1.0)
            if self._waiting >= self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} waiting); retry shortly", 1.0)
            self._waiting += 1
            if self.observer.spans is not None and trace is not None:
                self.observer.spans.submitted(seq, trace)
            self._inbox.append(seq)
            self._streams[seq.id] = stream
            self._lock.notify()
            if self._decoding:
                self._arrivals.notify()
        self.observer.series.queue_depth.set(self._waiting)
        return stream

    def expire(self) -> None:
        """The server stops within seconds: every interactive sequence ends at the next
        step as at its deadline, so its stream ends whole (finish_reason `length`, then
        `[DONE]`; 504 before its first token) rather than cut off by the server's exit."""
        with self._lock:
            self._expiring = True
            self._lock.notify()

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._aborts.append(seq_id)
            self._lock.notify()

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def refresh_gauges(self, now: float | None = None) -> None:
        """Tokens/s and busy fraction over the last 10 s (callable from any thread)."""
        self.observer.refresh(self.clock() if now is None else now)

    def _dispatch(self) -> None:
        with self._outbox_lock:
            events, self._outbox = self._outbox, []
        if len(events) > 1:
            # First tokens first: their streams' tasks then wake first, and write ahead
            # of the rows' tokens, which no TTFT waits on (a stream's own order stays).
            events.sort(key=_not_first)
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
            stopping = self._take_inbox()
            self._steer()
            plan = self.scheduler.schedule()
            self._planned(plan)
            if plan.empty:
                if stopping:
                    self._report()  # what the arrivals thread did not take
                    return
                continue
            step = self.loop.run(plan, self._before_runs, self._first_tokens, self._beside)
            with self._lock:
                self._unreported.append(step)
                self._arrivals.notify()
            # A plan without a decode made first tokens or ends only. With the arrivals
            # thread, they would wait for its wake-up, behind the next plan's Python.
            if not plan.decode and (self._beside is not None or not plan.runs_model):
                self._report()

    def _steer(self) -> None:
        """The SLOs' bounds on the next plan's prefill and rows (lanes/generation/steer.py)."""
        self.observer.bound(self.scheduler, max(self.cache.length, 1), self._default_prefill_tokens)

    def _take_inbox(self) -> bool:
        """Sleep until there is something to do, then move new requests and aborts
        into the scheduler. Returns whether the engine is stopping."""
        scheduler = self.scheduler
        if not scheduler.has_work:
            self._report()  # no model run of a next step takes them out
        with self._lock:
            while not (self._inbox or self._aborts or self._stopping or scheduler.has_work):
                self._lock.wait()
            joining, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stopping = self._stopping
            expiring, self._expiring = self._expiring, False
        for seq in joining:
            self._add(seq)
        if expiring:
            scheduler.expire()
        if stopping:
            queued = (*scheduler.waiting, *scheduler.offline, *scheduler.rows)
            chunking = [scheduler.chunking] if scheduler.chunking is not None else []
            aborts += [s.id for s in (*queued, *chunking)]
        for seq_id in aborts:
            scheduler.abort(seq_id)
        return stopping

    def _add(self, seq: Seq) -> None:
        self.scheduler.add(seq)
        self.observer.joined(seq)

    def _decode_beside(self, decode: Callable[[], Decoded]) -> Decoded:
        """`decode()` (the rows' decode), while the arrivals thread may prefill beside
        it; returns once both are done (the arrivals thread's failure raised here)."""
        with self._lock:
            self._decoding = True
            if self._inbox:
                self._arrivals.notify()
        try:
            return decode()
        finally:
            with self._lock:
                self._decoding = False
                while self._prefilling:
                    self._lock.wait()
                error, self._beside_error = self._beside_error, None
            if error is not None:
                raise error

    def _prefill_arrivals(self) -> None:
        """The arrivals thread: while the engine thread is in a decode, requests that
        arrive and find a free row (`Scheduler.admit_beside`) are prefilled here and
        their first tokens go out at once, so an arrival waits for no decode. The
        engine thread touches only the cache then, and waits for this before it goes
        on; aborts and requests that find no row wait for the next plan. Then, and
        whenever the engine thread has run a step, the steps run are reported."""
        while True:
            with self._lock:
                while not (self._stopping or self._unreported or (self._decoding and self._inbox)):
                    self._arrivals.wait()
                if self._stopping:
                    return  # the engine thread reports what is left
                arrived: list[Seq] = []
                if self._decoding:
                    arrived, self._inbox = self._inbox, []
                    self._prefilling = bool(arrived)
            if arrived:
                self._prefill(arrived)
            self._report()

    def _prefill(self, arrived: list[Seq]) -> None:
        """Arrivals during a decode into the scheduler, and those it admits beside the
        decode prefilled, group by group: each group's first tokens out as it ends."""
        try:
            for seq in arrived:
                self._add(seq)
            joiners = self.scheduler.admit_beside()
            fit = self.observer.prefill_fit()
            for group in prefill_groups(joiners, fit):  # each run's first tokens out at once
                step = self.loop.prefill_beside(group)
                step.handed, step.handed_at = len(step.events), self.clock()
                self._first_tokens(step.events)
                self._planned(step.plan)
                with self._lock:
                    self._unreported.append(step)
        except BaseException as e:  # fails the plan in flight (StepLoop.run)
            self._beside_error = e
        finally:
            with self._lock:
                self._prefilling = False
                self._lock.notify_all()

    def _planned(self, plan: StepPlan) -> None:
        """What a plan says before it runs: the queues' depths, the preemptions."""
        with self._lock:
            self._waiting = sum(not s.offline for s in self._inbox) + self.scheduler.num_waiting
            offline = sum(s.offline for s in self._inbox) + self.scheduler.num_offline_waiting
        self.observer.planned(plan, self._waiting, offline)
        if self.task.kv_budget.max_bytes is not None:  # a sum over the rows: where it bounds
            self.observer.series.kv_reserved.set(self.scheduler.kv_reserved)

    def _report(self) -> None:
        """The steps run and not reported yet: into the metrics (`StepObserver.observe`), then
        their events (those not handed out already) to their streams."""
        with self._reporting:
            with self._lock:
                steps, self._unreported = self._unreported, []
            events: list[Event] = []
            for step in steps:
                self.observer.observe(step, self.scheduler.num_running, self._waiting)
                events += step.events[step.handed :]
            self._send(events)

    def _first_tokens(self, events: list[Event]) -> None:
        """Joiners' first tokens, made before the rest of their step runs: out at once."""
        self._send(events)

    def _send(self, events: list[Event]) -> None:
        """Hand `events` to the event loop, into their streams."""
        if not events or self._loop is None:
            return
        with self._outbox_lock:
            taken = not self._outbox  # else a dispatch is on its way and takes these too
            self._outbox += events
        if taken:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                self._loop.call_soon_threadsafe(self._dispatch)


def _not_first(event: Event) -> bool:
    return not event.first
