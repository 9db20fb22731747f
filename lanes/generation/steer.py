"""SLOs that steer a generate workload's steps: `slo.ttft_ms` bounds one step's
prefill, `slo.itl_ms` its rows, through costs measured on the workload's own runs.

A joiner's first token waits for the step in flight when it came (about a decode of
the rows) and the prefill it is part of, and whatever a step prefills delays every
row's next token.
The prefill budget (the scheduler's `max_prefill_tokens`, a hard one: longer prompts
are prefilled in parts over several steps) is the tokens whose prefill fits, by the
prefill cost model, in `ttft_ms` less the decode of the step's current rows by the
decode cost model (at most half of `ttft_ms`). The rows are as many as one decode
step of the current cache length fits in `itl_ms` (offline rows count like any other).

With both SLOs, parts are no gain when the waiting prompts' TTFT is the SLO nearer to
being missed: each part is a decoder run of its own beside a decode of the rows, so
the prompt's first token comes later still, and a burst in parts stretches over many
steps, each a little past the rows' usual ITL, where one whole run is one long step.
So while every waiting prompt can take a row now, the budget covers them whole when
the rows' next token with their run fits `itl_ms`, or when their TTFT (the oldest's
wait, plus the run) is at least as large a share of `ttft_ms` as the rows' ITL with
it is of `itl_ms` (`whole_tokens`). While prompts queue for rows, each whole long run
would stall the rows again as the rows free one by one: the long prompts go in parts.
Otherwise the rows' ITL is the nearer SLO, and what a step prefills is bounded by what
fits `itl_ms` beside their decode as well as by `ttft_ms` (a prompt that fits `ttft_ms`
but would hold the rows past `itl_ms` goes in parts). A prompt in parts is past
`ttft_ms` however it goes, so its parts are bounded by `itl_ms` alone.

While interactive prompts wait for a row, their time to first token grows with every
step they wait, and the row bound would hold them out until a row finishes. So the
bound then admits waiting prompts (oldest first) past it while the decode with them
still fits `itl_ms` by the cost model's mean, and beyond that while the prompt's TTFT
(waited so far, plus its step's decode and prefill) is at least as close to being
missed, as a fraction of `ttft_ms`, as the rows' ITL with it is of `itl_ms`: whichever
SLO is nearer to being missed decides (the scheduler's `past_bound`; a long prompt
starts its parts in such a row too). Offline rows are no reason to admit past the
bound (the scheduler preempts them first). With `itl_ms` alone the bound holds.

Offline rows decode beside interactive ones only where they cost those little: while
a decoder run with them costs, by a third model, of single runs (a step runs once per
KV group), at most RIDE_SLACK more than the interactive rows' run alone (and fits
`itl_ms` when declared); otherwise they sit such steps out and run in the gaps (the
scheduler's `offline_rides`). Where a run's cost hardly grows with its rows they ride
along (and join the interactive rows' KV groups: no run of their own); where each row
adds its own, an offline row would lengthen every interactive token, and waits.

The models (lanes/costmodel.py) learn from every run; until they have a fit, the
prefill budget is DEFAULT_PREFILL_TOKENS and the rows `max_batch_size`. Pure: the
engine feeds it its runs' times and, before each plan, `apply` sets the two
bounds on the scheduler from its queue and rows, on the injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from lanes.costmodel import CostModel, Fit
from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Seq

DEFAULT_PREFILL_TOKENS = 512  # a step's prefill budget before the cost model has a fit
MIN_PREFILL_TOKENS = 16  # a chunk is never smaller: each run has its fixed cost too
# Offline rows may make a step with interactive rows this much longer: the interactive
# lane's latency is the one being protected, and this is its allowance for sharing.
RIDE_SLACK = 0.1
# The run cost model is refitted for that decision once every this many runs: a refit
# is a least-squares pass over its window, dearer than a small step's Python, and
# whether rows ride along moves slowly.
RIDE_REFIT_RUNS = 64


class Steer:
    """The prefill budget and the row bound of one generate workload's steps."""

    def __init__(
        self,
        ttft_s: float | None,
        itl_s: float | None,
        max_rows: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.max_rows = max_rows
        self.clock = clock
        self.prefill_cost = CostModel(clock=clock)
        self.decode_cost = CostModel(clock=clock)  # a step's decode, all its runs
        self.run_cost = CostModel(clock=clock)  # one decoder run (one KV group)
        self._ride_fit: Fit | None = None
        self._runs_since_fit = 0

    @property
    def chunked(self) -> bool:
        """Whether prefill is bounded (and long prompts are prefilled in parts)."""
        return self.ttft_s is not None

    def observe_prefill(self, rows: int, tokens: int, seconds: float) -> None:
        """A prefill run (or a chunk) of `rows` prompts, `tokens` padded in all."""
        self.prefill_cost.observe(rows, tokens, seconds)

    def observe_decode(self, rows: int, length: int, seconds: float) -> None:
        """A decode step of `rows` over a cache `length` long."""
        self.decode_cost.observe(rows, rows * length, seconds)

    def observe_run(self, rows: int, length: int, seconds: float) -> None:
        """One decoder run of a decode step: a KV group of `rows` over `length`."""
        self.run_cost.observe(rows, rows * length, seconds)
        self._runs_since_fit += 1

    def apply(self, scheduler: Scheduler, length: int, default_prefill_tokens: int) -> None:
        """Set the next plan's prefill budget (never over `default_prefill_tokens`, the
        declared or the scheduler's own) and row bound on `scheduler`, from its rows and
        waiting prompts, over a batch cache `length` long."""
        running = sum(1 for s in scheduler.rows if not s.status.is_finished)
        waiting = [s for s in scheduler.waiting if not s.status.is_finished]
        offline = sum(1 for s in scheduler.rows if s.offline and not s.status.is_finished)
        interactive = running - offline + len(waiting)
        if offline == 0:  # what would join: the rows left
            offline = min(scheduler.num_offline_waiting, scheduler.max_running - interactive)
        # At least one interactive row: offline joiners in a gap ride from then on when
        # they would ride beside an interactive row (and join its groups).
        scheduler.offline_rides = self.offline_rides(length, max(interactive, 1), offline)
        if self.itl_s is not None:
            held = sum(1 for s in scheduler.rows if not (s.offline or s.status.is_finished))
            if scheduler.chunking is not None and not scheduler.chunking.offline:
                held += 1
            scheduler.max_running = self.rows(length)
            scheduler.past_bound = self.past_bound(length, held, waiting)
        if self.ttft_s is not None:
            budget = self.prefill_tokens(default_prefill_tokens, running, length)
            if self.itl_s is not None:
                budget = self._with_itl(scheduler, budget, running, length, waiting)
            scheduler.max_prefill_tokens = min(budget, default_prefill_tokens)

    def _with_itl(
        self, scheduler: Scheduler, budget: int, running: int, length: int, waiting: list[Seq]
    ) -> int:
        """The prefill budget `budget` (from `ttft_ms`) with `itl_ms` declared too."""
        assert self.itl_s is not None
        # Whole only when every waiting prompt can join now: while prompts queue for rows,
        # each whole long run would stall the rows again, and parts keep them within
        # itl_ms (one prompt at a time).
        free = scheduler.max_running + scheduler.past_bound - running
        if scheduler.chunking is None and len(waiting) <= free:
            whole = self.whole_tokens(length, running, waiting)
            if whole:
                return max(budget, whole)
        # The rows' ITL is the nearer SLO: what a step prefills is bounded by what fits
        # itl_ms beside their decode too. A prompt in parts is past ttft_ms however it
        # goes: only that bound is left for its parts (fewer steps when it is more).
        within = self.prefill_tokens(budget, running, length, self.itl_s)
        return within if scheduler.chunking is not None else min(budget, within)

    def whole_tokens(self, length: int, rows: int, waiting: Sequence[Seq]) -> int:
        """Padded tokens of `waiting` prefilled whole in one run, rather than in parts,
        when the rows' next token with that run still fits `itl_ms`, or its first
        tokens' TTFT (the oldest's wait so far, plus the run) is at least as close to
        being missed, as a fraction of `ttft_ms`, as the rows' ITL is of `itl_ms`:
        parts would only push the nearer SLO further (each part is a decoder run of
        its own beside a decode of the rows). 0 otherwise, and without both SLOs or
        both cost models' fits."""
        if not waiting or self.itl_s is None or self.ttft_s is None:
            return 0
        tokens = len(waiting) * max(len(s.prompt_ids) for s in waiting)
        prefill = self.prefill_cost.estimate(len(waiting), tokens)
        if prefill is None or self.decode_cost.fit is None:
            return 0
        decode = self.decode_cost.estimate(rows, rows * length) if rows else None
        decode_s = 0.0 if decode is None else decode.seconds
        itl_used = (prefill.seconds + decode_s) / self.itl_s
        ttft_used = (self.clock() - waiting[0].arrived + prefill.seconds) / self.ttft_s
        return tokens if itl_used <= 1 or ttft_used >= itl_used else 0

    def prefill_tokens(
        self, default: int, rows: int = 0, length: int = 0, within: float | None = None
    ) -> int:
        """One step's prefill budget in tokens: `default` without `ttft_ms`; what fits in
        `ttft_ms` (or, by the mean, in `within` seconds) beside the decode of `rows` over a
        cache `length` long otherwise."""
        if self.ttft_s is None:
            return default
        target = self.ttft_s if within is None else within
        fit = self.prefill_cost.fit
        if fit is None:
            return DEFAULT_PREFILL_TOKENS
        decode = self.decode_cost.estimate(rows, rows * length) if rows else None
        # The mean decode (the prefill's own spread leaves the margin), and never more
        # than half of ttft_ms: a decode that leaves less cannot be met by a smaller
        # prefill, which would only split every prompt over more steps, each paying
        # another decode.
        decode_s = 0.0 if decode is None else decode.seconds
        budget = max(target - decode_s, target / 2)
        # The spread's margin, but never more than half of it: a spread past 2 says some
        # runs stalled (another process took the core), which no smaller prefill avoids,
        # and a budget cut by it would split long prompts into parts too many to finish.
        # Within another SLO than ttft_ms (the rows' itl_ms), the mean, as past_bound
        # takes rows by the mean: the margin only made more parts, each a step longer.
        margin = 1.0 if within is not None else min(fit.spread, 2.0)
        room = budget / margin - fit.fixed_s - fit.per_item_s
        if fit.per_token_s <= 0:
            return default if room >= 0 else MIN_PREFILL_TOKENS
        # The epsilon keeps float rounding from costing a token (as in the cost model).
        return max(int(room / fit.per_token_s + 1e-9), MIN_PREFILL_TOKENS)

    def offline_rides(self, length: int, interactive: int, offline: int) -> bool:
        """Whether `offline` rows may decode beside `interactive` rows over a cache
        `length` long: while one run of them all costs, by the run cost model's mean
        (riders share the interactive rows' groups), at most RIDE_SLACK more than the
        interactive rows' run alone (and fits `itl_ms` when declared). Not before the
        model has a fit: until then they run in the gaps."""
        if interactive <= 0 or offline <= 0:
            return True
        if self._ride_fit is None or self._runs_since_fit >= RIDE_REFIT_RUNS:
            self._ride_fit, self._runs_since_fit = self.run_cost.fit, 0
        fit = self._ride_fit
        if fit is None:
            return False
        rows = interactive + offline
        bound = fit.seconds(interactive, interactive * length) * (1 + RIDE_SLACK)
        if self.itl_s is not None:
            bound = min(bound, self.itl_s)
        return fit.seconds(rows, rows * length) <= bound

    def rows(self, length: int) -> int:
        """Rows one decode step may hold over a cache `length` long (at least 1)."""
        if self.itl_s is None:
            return self.max_rows
        return self.decode_cost.largest_batch(self.itl_s, self.max_rows, length)

    def past_bound(self, length: int, held: int, waiting: Sequence[Seq]) -> int:
        """Rows past `rows(length)` that `waiting` prompts may take now (oldest first):
        those whose TTFT is the SLO nearer to being missed (`held`: interactive rows
        running, which stay; offline rows are preempted before any is admitted past)."""
        if self.itl_s is None or self.ttft_s is None or self.decode_cost.fit is None:
            return 0
        bound = self.rows(length)
        rows, now = max(bound, held), self.clock()
        for seq in waiting[max(bound - held, 0) :]:  # those the bound keeps out
            if rows >= self.max_rows:
                break
            width = max(length, len(seq.prompt_ids))  # the batch pads to its prompt
            decode = self.decode_cost.estimate(rows + 1, (rows + 1) * width)
            decode_s = 0.0 if decode is None else decode.seconds
            itl_used = decode_s / self.itl_s
            if itl_used > 1 and self._ttft_used(seq, now, decode_s) < itl_used:
                break
            rows += 1
        return rows - bound

    def _ttft_used(self, seq: Seq, now: float, decode_s: float) -> float:
        """The fraction of `ttft_ms` that `seq`'s first token takes if it joins now:
        what it waited so far, its step's decode and its prompt's prefill."""
        assert self.ttft_s is not None
        prefill = self.prefill_cost.estimate(1, len(seq.prompt_ids))
        first = now - seq.arrived + decode_s + (0.0 if prefill is None else prefill.seconds)
        return first / self.ttft_s
