"""What a generate engine learns from its steps (serving/engine.py): its metrics, per
lane too, the steer's cost models, and the spans.

The engine thread and its arrivals thread both report steps here, one report at a
time and in step order (the engine's `_reporting` lock). The steer's cost models, the
token rate and the busy fraction are written by those reports and read by the engine
thread (the next plan's bounds) and by /metrics, under this object's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from lanes.costmodel import Fit
from lanes.generation.loop import Step
from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Lane, Seq, StepPlan
from lanes.generation.steer import Steer
from lanes.serving.batching import DeviceShare
from lanes.serving.metrics import GenerateSeries, LaneSeries, Metrics, Rate, Utilization
from lanes.serving.tracing import GenerateSpans

LANES: tuple[Lane, ...] = ("interactive", "offline")


@dataclass(frozen=True)
class Joined:
    """When an interactive sequence's prefill started, and how long it waited for it."""

    queue_s: float
    at: float


class StepObserver:
    """One generate workload's steps into its series, its lanes' series, its steer
    and its spans (None: tracing is off)."""

    def __init__(
        self, name: str, metrics: Metrics, steer: Steer, spans: GenerateSpans | None
    ) -> None:
        self.series = GenerateSeries.of(metrics, name)
        self.stats = metrics.statistics.of(name)
        self.lanes = {lane: LaneSeries.of(metrics, name, lane) for lane in LANES}
        self.steer = steer
        self.spans = spans
        self.rate = Rate()  # tokens
        self.utilization = Utilization()
        self._lock = threading.Lock()
        self._lane_of: dict[int, Lane] = {}  # unfinished sequences' lanes
        # Offline sequences whose caller keeps an account of their steps' time, and per
        # account the sequences it still waits on and what to call once none (_lock).
        self._shares: dict[int, DeviceShare] = {}
        self._open: dict[DeviceShare, tuple[int, Callable[[], None]]] = {}
        self._last_token_at: dict[int, float] = {}
        self._joined_at: dict[int, Joined] = {}  # interactive sequences in the batch
        self._kv_peak = 0  # lanes_kv_cache_peak_bytes: across the caches a failure resets

    def joined(self, seq: Seq) -> None:
        """A sequence the scheduler took: its tokens count in its lane."""
        self._lane_of[seq.id] = seq.lane

    def charge_to(
        self, seq_ids: list[int], share: DeviceShare, settled: Callable[[], None]
    ) -> None:
        """Add offline sequences' parts of their steps' time (`_lane_busy`) to `share`,
        from before they join until each one's finish is observed; then call `settled`
        (on the observing thread): a finish handed out early (with a first token)
        reaches its caller before its step is observed."""
        with self._lock:
            for seq_id in seq_ids:
                self._shares[seq_id] = share
            self._open[share] = (len(seq_ids), settled)

    def forget(self, share: DeviceShare) -> None:
        """Stop charging `share` (its caller has its answer, or has gone)."""
        with self._lock:
            self._open.pop(share, None)
            for seq_id in [i for i, s in self._shares.items() if s is share]:
                del self._shares[seq_id]

    def bound(self, scheduler: Scheduler, length: int, default_prefill_tokens: int) -> None:
        """The SLOs' bounds on the scheduler's next plan (lanes/generation/steer.py)."""
        with self._lock:
            self.steer.apply(scheduler, length, default_prefill_tokens)

    def prefill_fit(self) -> Fit | None:
        """The prefill cost model's fit so far."""
        with self._lock:
            return self.steer.prefill_cost.fit

    def planned(self, plan: StepPlan, waiting: int, offline_waiting: int) -> None:
        """What a plan says before it runs: the queues' depths, the preemptions."""
        if plan.preempted:
            self.lanes["offline"].preemptions.inc(len(plan.preempted))
        self.lanes["interactive"].queue_depth.set(waiting)
        self.lanes["offline"].queue_depth.set(offline_waiting)

    def refresh(self, now: float) -> None:
        """Tokens/s and busy fraction over the last 10 s (callable from any thread)."""
        with self._lock:
            rate, busy = self.rate.per_second(now), self.utilization.fraction(now)
        self.series.rate.set(rate)
        self.series.utilization.set(busy)

    def observe(self, step: Step, running: int, waiting: int) -> None:
        """A step's runs into the metrics, the cost models and the spans; its events'
        tokens into TTFT, ITL and the lanes' items. `running` and `waiting`: the
        scheduler's rows and interactive queue after it."""
        m, plan = self.series, step.plan
        self._ran(step)
        if step.prefill is not None:
            took = step.prefill.seconds
            m.prefill.observe(took)
            rows, tokens = step.prefill_rows, step.prefill_tokens
            # Beside a decode, each run is stretched by the other; a run that failed
            # whole (rows 0) says nothing of its cost.
            if not step.beside and rows:
                with self._lock:
                    self.steer.observe_prefill(rows, tokens, took)
            if self.spans is not None:
                self.spans.prefilled(plan.prefill, step.prefill.start, step.prefill.end)
        if step.chunk is not None and plan.chunk is not None:
            m.prefill.observe(step.chunk.seconds)
            tokens = plan.chunk.stop - plan.chunk.start
            with self._lock:
                self.steer.observe_prefill(1, tokens, step.chunk.seconds)
        if step.decode is not None:
            rows = len(plan.decode)
            m.decode.observe(step.decode.seconds)
            m.rows.observe(rows)
            m.positions.inc(step.positions)
            with self._lock:
                self.steer.observe_decode(rows, step.decoded_length, step.decode.seconds)
                for run in step.runs:
                    self.steer.observe_run(run.rows, run.length, run.seconds)
        made = 0
        finished: list[int] = []
        # First tokens come from prefills only (a prompt's final chunk among them).
        joined = {s.id: s for s in (*plan.prefill, *([plan.chunk.seq] if plan.chunk else []))}
        for i, event in enumerate(step.events):
            lane = self._lane_of.get(event.seq_id, "interactive")
            at = step.handed_at if i < step.handed else step.end
            made += event.made  # as usage counts them: the eos that ended a text too
            if event.tokens:
                last = self._last_token_at.get(event.seq_id)
                if lane == "offline":
                    pass  # nobody waits on it: its latencies are no interactive figure
                elif event.first and event.seq_id in joined:
                    m.ttft.observe(at - joined[event.seq_id].arrived)
                elif last is not None:
                    m.itl.observe(at - last)
                self._last_token_at[event.seq_id] = at
            if event.finish is not None:
                finished.append(event.seq_id)
                self._last_token_at.pop(event.seq_id, None)
                joined_at = self._joined_at.pop(event.seq_id, None)
                if joined_at is not None and event.finish in ("stop", "length"):
                    self.stats.served(joined_at.queue_s, at - joined_at.at, 1)
                self._lane_of.pop(event.seq_id, None)
                self.lanes[lane].items.inc()
                m.finished(event.finish)
        m.generated.inc(made)
        with self._lock:
            self.rate.record(step.end, made)  # on the engine's clock, as `refresh` reads it
        if not step.beside:  # else its time is within the step in flight's
            busy = step.end - step.start
            with self._lock:
                self.utilization.record(step.start, step.end)
            m.busy.inc(busy)
            self._lane_busy(step, busy)
        if finished:
            self._settle(finished)
        m.in_flight.set(running)
        m.queue_depth.set(waiting)
        if step.cache is not None:
            m.kv_cache.set(step.cache.held)
            self._kv_peak = max(self._kv_peak, step.cache.peak)
            m.kv_cache_peak.set(self._kv_peak)
        if self.spans is not None:
            self.spans.observed(plan, step.events, step.end)

    def _ran(self, step: Step) -> None:
        """A step's model runs in the Triton statistics (serving/model_stats.py), and
        when each interactive sequence whose prompt it took joined the batch."""
        plan = step.plan
        if step.prefill is not None:
            self.stats.ran(len(plan.prefill), step.prefill.seconds)
            for seq in plan.prefill:
                self._joined(seq, step.prefill.start)
        if step.chunk is not None and plan.chunk is not None:
            self.stats.ran(1, step.chunk.seconds)
            if plan.chunk.start == 0:  # its prompt's first part
                self._joined(plan.chunk.seq, step.chunk.start)
        if step.decode is not None:
            self.stats.ran(len(plan.decode), step.decode.seconds)

    def _joined(self, seq: Seq, at: float) -> None:
        if not seq.offline and seq.id not in self._joined_at:  # not on a resume
            self._joined_at[seq.id] = Joined(at - seq.arrived, at)

    def _lane_busy(self, step: Step, seconds: float) -> None:
        """A step's time, shared between the lanes by the rows each had in it (a
        part of a long prompt counts as its sequence's row)."""
        plan = step.plan
        chunk = (plan.chunk.seq,) if plan.chunk is not None else ()
        seqs = (*plan.decode, *plan.prefill, *plan.resumed, *chunk)
        offline = sum(s.offline for s in seqs)
        if seqs:
            self.lanes["offline"].busy.inc(seconds * offline / len(seqs))
            self.lanes["interactive"].busy.inc(seconds * (len(seqs) - offline) / len(seqs))
        if offline and self._shares:
            with self._lock:
                for seq in seqs:
                    share = self._shares.get(seq.id) if seq.offline else None
                    if share is not None:
                        share.seconds += seconds / len(seqs)

    def _settle(self, seq_ids: list[int]) -> None:
        """Finished sequences leave their accounts; an account left by all is settled."""
        done: list[Callable[[], None]] = []
        with self._lock:
            for seq_id in seq_ids:
                share = self._shares.pop(seq_id, None)
                if share is None or share not in self._open:
                    continue
                left, settled = self._open[share]
                if left > 1:
                    self._open[share] = (left - 1, settled)
                else:
                    del self._open[share]
                    done.append(settled)
        for settled in done:
            settled()


def resolve_from_thread(future: asyncio.Future[None]) -> None:
    """Resolve `future` from another thread, once; not after its loop has closed."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
        future.get_loop().call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
