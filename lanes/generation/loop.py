"""The step loop, plain and synchronous: plan -> prefill and decode runs -> update.

    loop = StepLoop(decoder, scheduler, name)
    step = loop.run(scheduler.schedule())     # one whole plan
    step.events                               # tokens, text and finishes of this step
    step.prefill, step.decode, step.chunk     # when each model run began and ended

Both lanes drive it: the offline batch (lanes/generation/batch.py) until every
sequence is done, the online engine (serving/engine.py) on a thread of its own, one
plan at a time, with arrivals taken between steps. Each plan runs whole here: its
rows decode one token each over the batch's KV cache (lanes/generation/kvcache.py;
lanes/generation/slots.py for a decoder that keeps its cache in slots),
its joiners' prompts are prefilled in one left-padded run
(lanes/generation/prefill.py), and the scheduler updates the plan with both. The
prefill runs first: given `first_tokens`, interactive joiners' first tokens are
sampled and handed to it as soon as their prefill is done, before the rows' decode,
so a joiner that shares its step with the rows waits for its own prefill only.
The joiners' caches enter the batch's when the next plan settles it, with the rows
the scheduler no longer holds going out, so each decode sees exactly its plan's
rows. So do those of joiners prefilled beside a decode (`prefill_beside`, which the
online engine calls from `run`'s `beside` while the decode runs on another thread).
Preempted rows' caches are kept on their way out, and resumed sequences' caches
come back (kept, or recomputed) beside the joiners' (lanes/generation/preempt.py).

A prefill or decode run that fails is run again in halves of its rows
(lanes/isolation.py): the sequences that fail alone finish with their own error,
every other one goes on as if they had never been there. Only a failure outside the
model's runs fails every row of the plan (and resets the cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from lanes.generation.kvcache import MAX_PADDING, Decoded, GroupRun
from lanes.generation.preempt import KEEP_BYTES, Preempted
from lanes.generation.prefill import Chunked, Join, prefill_apart
from lanes.generation.prefixes import PREFIX_CACHE_BYTES, PrefixCache
from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Event, Seq, StepOutputs, StepPlan
from lanes.generation.slots import new_cache
from lanes.isolation import failed_alone
from lanes.tasks.decoder import Decoder

log = logging.getLogger("lanes.generation")


@dataclass(frozen=True)
class Timed:
    """When one model run of a step began and ended, on the loop's clock."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CacheBytes:
    """The bytes the batch's KV cache arrays held as a step ended (padding and holes
    included), and the most they held at once so far (a decode's copy included)."""

    held: int
    peak: int


@dataclass
class Step:
    """What one run of a plan did, filled in as it runs: its events, when the step
    began and ended, and its model runs (None where the plan had none): the joiners'
    prefill, the part of a long prompt, and the rows' decode over a cache
    `decoded_length` positions long (its longest group, before the step), at
    `positions` (its rows' positions, summed). The first
    `handed` events went to `first_tokens` at `handed_at`, before the step's decode.
    `cache` is what the cache held after it (None for `prefill_beside`'s, which end
    while another thread's decode changes the cache)."""

    plan: StepPlan
    start: float
    end: float = 0.0
    events: list[Event] = field(default_factory=list)
    prefill: Timed | None = None
    # What the prefill ran: rows and padded tokens (lanes/generation/prefill.py: joiners
    # of one prompt share a row, a long shared prefix runs once).
    prefill_rows: int = 0
    prefill_tokens: int = 0
    chunk: Timed | None = None
    decode: Timed | None = None
    decoded_length: int = 0
    positions: int = 0
    runs: tuple[GroupRun, ...] = ()  # the decode's, one per KV group
    failed: bool = False  # the step failed outside any one row: every row errored
    handed: int = 0
    handed_at: float = 0.0
    beside: bool = False  # a prefill run beside another plan's decode (`prefill_beside`)
    cache: CacheBytes | None = None


# Runs a plan's decode (the callable) and returns what it returned; meanwhile the
# caller may prefill joiners beside it (`StepLoop.prefill_beside`).
Beside = Callable[[Callable[[], Decoded]], Decoded]


def _now(decode: Callable[[], Decoded]) -> Decoded:
    return decode()


class StepLoop:
    """Runs a scheduler's plans on one decoder, keeping the batch's KV cache between
    them. Single-threaded: one plan at a time, from one thread."""

    def __init__(
        self,
        decoder: Decoder,
        scheduler: Scheduler,
        name: str,
        max_padding: float = MAX_PADDING,
        clock: Callable[[], float] = time.monotonic,
        keep_bytes: int = KEEP_BYTES,
        prefix_bytes: int = PREFIX_CACHE_BYTES,
    ) -> None:
        self.decoder = decoder
        self.scheduler = scheduler
        self.name = name
        self.clock = clock
        self.cache = new_cache(decoder, max_padding, clock, scheduler.max_running)
        self._joins: list[Join] = []  # prefilled, entering the cache at the next settle
        self.preempted = Preempted(keep_bytes)
        self.chunked = Chunked()
        self.prefixes = PrefixCache(prefix_bytes)  # prompts' caches, for later joiners
        if not decoder.slots:  # it shares prefixes (prefill.py): the budget charges so
            scheduler.prefixes = self.prefixes

    def run(
        self,
        plan: StepPlan,
        before_runs: Callable[[], None] | None = None,
        first_tokens: Callable[[list[Event]], None] | None = None,
        beside: Beside | None = None,
    ) -> Step:
        """Run `plan` whole and update the scheduler with it; never raises for what
        the model does (a failure becomes the rows' error events). `before_runs` is
        called once as the plan's model runs begin (not at all for a plan without
        any): what the caller does there overlaps them, as they release the GIL.
        `first_tokens` takes interactive joiners' events (`step.events[:step.handed]`)
        when the plan has more runs after their prefill; they are not given again.
        `beside` runs the rows' decode, while its caller may prefill arrivals beside
        it (`prefill_beside`, from this thread)."""
        step = Step(plan, self.clock())
        try:
            if plan.runs_model and before_runs is not None:
                before_runs()
            left, outputs = self._model_runs(step, first_tokens, beside)
            step.events += self.scheduler.update(left, outputs)
            events = step.events
            if self.preempted:  # a kept cache whose sequence finished goes
                for event in events:
                    if event.finish is not None:
                        self.preempted.drop(event.seq_id)
            if (self._joins or self.cache.rows) and not self.scheduler.any_running:
                self._settle(set())  # nobody is left to decode: free the whole cache
        except Exception as error:  # not one row's fault: it answers them all
            log.exception(
                "workload %s: a step of %d rows failed",
                self.name,
                len(plan.decode) + len(plan.prefill),
            )
            rows = self.scheduler.max_running
            self.cache = new_cache(self.decoder, self.cache.max_padding, self.clock, rows)
            self._joins = []
            message = (
                f"the server failed on a step of this sequence's batch "
                f"({type(error).__name__}: {error}); the server's log has the details"
            )
            step.events, step.failed = self.scheduler.fail(plan, message), True
            step.handed = 0  # those handed out already stay out; these are all new
        step.cache = CacheBytes(self.cache.nbytes, self.cache.peak_nbytes)
        step.end = self.clock()
        return step

    def prefill_beside(self, joiners: Sequence[Seq]) -> Step:
        """The prefill of joiners the scheduler admitted while a plan's decode runs
        (`Scheduler.admit_beside`), called from `run`'s `beside` on the thread that
        called `run`: their first tokens in `events`; their caches enter the batch's
        at the next plan, which they decode in. What fails outside the model's run
        raises, and fails the plan in flight with them."""
        plan = StepPlan(prefill=tuple(joiners))
        step = Step(plan, self.clock(), beside=True)
        done = prefill_apart(self.decoder, plan.prefill, prefixes=self.prefixes)
        step.prefill = Timed(step.start, self.clock())
        step.prefill_rows, step.prefill_tokens = done.rows_run, done.tokens_run
        self._joins += done.joins
        self._log_isolated("prefill", len(plan.prefill), done.error, done.failed)
        failed = failures(plan.prefill, done.failed, prompt_of)
        step.events = self.scheduler.update(plan, StepOutputs(done.logits, failed=failed))
        step.end = self.clock()
        return step

    def _model_runs(
        self,
        step: Step,
        first_tokens: Callable[[list[Event]], None] | None,
        beside: Beside | None,
    ) -> tuple[StepPlan, StepOutputs]:
        """The plan's prefill, decode, recompute and chunk runs, each isolated (rows
        the model fails on alone are in `failed`), timed into `step`; the part of the
        plan the scheduler has yet to update with, and their outputs."""
        plan = left = step.plan
        failed: dict[int, str] = {}
        if plan.decode or plan.preempted:
            # Every row the scheduler holds stays: a prefill-only plan's decode at the next.
            self._settle({s.id for s in self.scheduler.rows}, plan.preempted)
        prefill = None
        if plan.prefill:
            at = self.clock()
            done = prefill_apart(self.decoder, plan.prefill, prefixes=self.prefixes)
            step.prefill = Timed(at, self.clock())
            step.prefill_rows, step.prefill_tokens = done.rows_run, done.tokens_run
            self._joins += done.joins
            self._log_isolated("prefill", len(plan.prefill), done.error, done.failed)
            failed.update(failures(plan.prefill, done.failed, prompt_of))
            prefill = done.logits
            more = plan.decode or plan.resumed or plan.chunk is not None
            if first_tokens is not None and more and not all(s.offline for s in plan.prefill):
                joined = StepPlan(prefill=plan.prefill)
                step.events = self.scheduler.update(joined, StepOutputs(prefill, failed=failed))
                step.handed, step.handed_at = len(step.events), self.clock()
                first_tokens(step.events)
                left, prefill = replace(plan, prefill=()), None
        decode = None
        if plan.decode:
            at = self.clock()
            cache, rows = self.cache, plan.decode
            step.positions = sum(s.position for s in rows)
            run = beside or _now
            decoded = run(lambda: cache.decode(rows))
            step.decode = Timed(at, self.clock())
            step.decoded_length, step.runs = decoded.length, decoded.runs
            self._log_isolated("decode step", len(plan.decode), decoded.error, decoded.failed)
            failed.update(failures(plan.decode, decoded.failed, at_position))
            decode = decoded.logits
        if plan.resumed:
            back = self.preempted.resume(self.decoder, plan.resumed)
            self._joins += back.joins
            self._log_isolated("recompute", len(plan.resumed), back.error, back.failed)
            failed.update(failures(plan.resumed, back.failed, prompt_of))
        chunk = None
        if plan.chunk is not None:
            at = self.clock()
            part = self.chunked.run(self.decoder, plan.chunk)
            step.chunk = Timed(at, self.clock())
            self._joins += part.joins
            self._log_isolated("prefill chunk", 1, part.error, part.failed)
            failed.update(failures((plan.chunk.seq,), part.failed, prompt_of))
            chunk = part.logits
        return left, StepOutputs(prefill, decode, failed, chunk)

    def _settle(self, keep: set[int], preempted: Sequence[Seq] = ()) -> None:
        """The batch's cache for the next decode: joiners in (into holes where they
        fit), preempted rows' caches kept, then leavers out (rows not in `keep` become
        holes, a joiner that already finished too), holes compacted away once they are
        worth a copy."""
        joins, self._joins = self._joins, []
        for join in joins:
            self.cache.place(join.ids, join.past, join.mask, join.apart)
        self.preempted.keep(self.cache, preempted)
        self.cache.release(keep)
        self.cache.compact()

    def _log_isolated(
        self, run: str, rows: int, error: Exception | None, failed: dict[int, Exception]
    ) -> None:
        log_isolated(self.name, run, rows, error, failed)


def log_isolated(
    workload: str, run: str, rows: int, error: Exception | None, failed: dict[int, Exception]
) -> None:
    """One log line, with the traceback, for a run of `rows` rows that failed and was
    split (`failed`: the rows that fail on their own); nothing when it did not fail."""
    if error is not None:
        log.error(
            "workload %s: a %s of %d rows failed; %d of them fail on their own",
            workload,
            run,
            rows,
            len(failed),
            exc_info=error,
        )


def failures(
    seqs: Sequence[Seq], failed: dict[int, Exception], what: Callable[[Seq], str]
) -> dict[int, str]:
    """What each sequence the model failed on alone tells its caller (`what` names
    the sequence's input): every row failing is the model's fault, and says so."""
    if not failed:
        return {}
    every = len(failed) == len(seqs) > 1
    return {s.id: str(failed_alone(failed[s.id], what(s), every)) for s in seqs if s.id in failed}


def prompt_of(seq: Seq) -> str:
    return "this prompt"


def at_position(seq: Seq) -> str:
    return f"this sequence at position {seq.position}"
