"""Replay of bench/generate.py --burst's load on the real Scheduler and Steer, with
modelled run times on a manual clock: what the admission policy does, without the
noise of a shared machine (no model, no server, no threads; a few seconds).

    python bench/steer_replay.py [--seconds 30] [--clients 16]

`--clients` closed-loop clients send 5-token prompts with `max_tokens` drawn
log-uniform between 8 and 448 (seeded); every 2 s a burst of 4 prompts of 496 tokens
(16 tokens each) arrives. A step costs what the model below says (a decode step grows
with its rows and the cache length, a prefill with its tokens) and runs as the
single-threaded step loop does: the rows' decode, then the joiners' prefill and the
part of a long prompt, then every token of the step at once. `steered` sets
`slo.ttft_ms`/`slo.itl_ms` at 2x and 3x a modelled 16-row step over a 496-long cache,
as bench/generate.py does from a measured one. Printed per server: TTFT p50/p99 of
the clients and of the long prompts (those still waiting at the end count their
wait), ITL p50/p99 of the clients, and steered/unsteered ratios.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lanes.generation.kvcache import COMPACT_FRACTION, MAX_GROUPS, MAX_PADDING, TRIM_AT
from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Seq, StepOutputs
from lanes.generation.steer import Steer
from lanes.tasks.sampling import SamplingParams

LONG, LONG_NEW, SHORT = 496, 16, 5
ROWS = 64
STALL_S = 0.030  # a run that lost the core to another process for a while
WARM_S = 2.0  # figures count from here: past the cost models' warm-up


def decode_s(rows: int, length: int) -> float:
    """One decoder run of `rows` over a past `length` long (one group of the cache)."""
    return 0.001 + 0.0006 * rows * length / 500


def prefill_s(tokens: int) -> float:
    return 0.001 + 0.00008 * tokens


@dataclass
class Group:
    """One group of the batch's KV cache (lanes/generation/kvcache.py): its rows,
    left-padded to `length`; one decoder run per step."""

    length: int
    rows: dict[int, int] = field(default_factory=dict)  # sequence id -> its positions

    def trim(self) -> None:
        """Leading padding goes once it is a quarter of the length (and TRIM_AT)."""
        longest = max(self.rows.values(), default=0)
        if self.length - longest >= max(TRIM_AT, self.length / COMPACT_FRACTION):
            self.length = longest


class Cache:
    """The engine's grouping of rows by length, on lengths alone: a joiner goes to the
    group where its padding costs least, or a group of its own past MAX_PADDING
    padded positions; neighbouring groups merge when that pads no more."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    @property
    def length(self) -> int:
        return max((g.length for g in self.groups), default=0)

    def place(self, joiners: dict[int, int]) -> None:
        """One prefill's sequences (id -> prompt length), padded to their longest."""
        width, joining = max(joiners.values()), len(joiners)
        best: tuple[int, Group] | None = None
        for g in self.groups:
            pad = (
                joining * (g.length - width)
                if g.length >= width
                else len(g.rows) * (width - g.length)
            )
            if best is None or pad < best[0]:
                best = (pad, g)
        if best is not None and (best[0] <= MAX_PADDING or len(self.groups) >= MAX_GROUPS):
            best[1].rows.update(joiners)
            best[1].length = max(best[1].length, width)
        else:
            self.groups.append(Group(width, dict(joiners)))
        self.groups.sort(key=lambda g: g.length)
        i = 0
        while i + 1 < len(self.groups):
            short, long = self.groups[i], self.groups[i + 1]
            if len(short.rows) * (long.length - short.length) <= MAX_PADDING:
                long.rows.update(short.rows)
                del self.groups[i]
            else:
                i += 1

    def keep(self, ids: set[int]) -> None:
        """Rows not in `ids` leave (finished); an empty group goes."""
        for g in self.groups:
            g.rows = {i: n for i, n in g.rows.items() if i in ids}
            g.trim()
        self.groups = [g for g in self.groups if g.rows]

    def decode(self) -> float:
        """One decode step: each group's run; every row's past grows by one."""
        took = sum(decode_s(len(g.rows), g.length) for g in self.groups)
        for g in self.groups:
            g.length += 1
            g.rows = {i: n + 1 for i, n in g.rows.items()}
        return took


class Replay:
    def __init__(
        self,
        steered: bool,
        clients: int,
        seconds: float,
        stalls: float = 0.0,
        factors: tuple[float, float] = (2.0, 3.0),
    ) -> None:
        self.now = 0.0
        self.end = seconds
        self.steered = steered
        step16 = decode_s(16, LONG)
        self.steer = Steer(factors[0] * step16, factors[1] * step16, ROWS, self.clock)
        self.scheduler = Scheduler(
            ROWS,
            frozenset({0}),
            lambda ids: "a" * len(ids),
            max_position=512,
            prefill_alone=True,  # as serving/engine.py runs it
            chunked=steered,
            clock=self.clock,
        )
        self.cache = Cache()
        self.joins: dict[int, int] = {}  # prefilled, entering the cache at the next decode
        self.busy = 0.0
        self.made = 0
        self.errors: list[float] = []  # decode cost model: predicted / modelled
        self.rng = random.Random(7)
        self.stalls = stalls
        self.noise = random.Random(11)  # its own stream: the load stays the same
        self.ids = iter(range(1, 1 << 30))
        self.kind: dict[int, str] = {}
        self.arrived: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.gaps: list[float] = []
        self.gap_at: list[float] = []
        for _ in range(clients):
            self.submit(SHORT, self.draw(), "short")

    def clock(self) -> float:
        return self.now

    def draw(self) -> int:
        return int(math.exp(self.rng.uniform(math.log(8), math.log(448))))

    def submit(self, prompt: int, new: int, kind: str) -> None:
        i = next(self.ids)
        greedy = SamplingParams(temperature=0)
        seq = Seq(i, (1,) * prompt, new, greedy, arrived=self.now, ignore_eos=True)
        self.kind[i], self.arrived[i] = kind, self.now
        self.scheduler.add(seq)

    def run(self) -> None:
        s, burst = self.scheduler, 1.0
        while self.now < self.end:
            if self.now >= burst:
                for _ in range(4):
                    self.submit(LONG, LONG_NEW, "long")
                burst += 2.0
            # As the engine: the bounds from the cache as it stands, before this plan's
            # joiners (prefilled at the last step) enter it.
            length = max(self.cache.length, 1)
            if self.steered:
                self.steer.apply(s, length, 4096)
            plan = s.schedule()
            if not plan.runs_model:
                self.now += 0.001
                continue
            took = 0.0
            if plan.decode:  # the loop settles the cache first: joiners in, leavers out
                if self.joins:
                    self.cache.place(self.joins)
                    self.joins = {}
                self.cache.keep({r.id for r in s.rows})
                decoded = self.cache.length
                d = self.stalled(self.cache.decode())
                self.check(len(plan.decode), decoded, d)
                self.steer.observe_decode(len(plan.decode), decoded, d)
                took += d
            if plan.prefill:
                width = max(len(r.prompt_ids) for r in plan.prefill)
                tokens = len(plan.prefill) * width
                p = self.stalled(prefill_s(tokens))
                self.steer.observe_prefill(len(plan.prefill), tokens, p)
                took += p
                self.joins.update({r.id: width for r in plan.prefill})
            chunk = None
            if plan.chunk is not None:
                tokens = plan.chunk.stop - plan.chunk.start
                p = self.stalled(prefill_s(tokens))
                self.steer.observe_prefill(1, tokens, p)
                took += p
                if plan.chunk.final:
                    chunk = peaked(1)
                    self.joins[plan.chunk.seq.id] = len(plan.chunk.seq.prompt_ids)
            self.now += took
            self.busy += took
            outputs = StepOutputs(peaked(len(plan.prefill)), peaked(len(plan.decode)), {}, chunk)
            for event in s.update(plan, outputs):
                self.observe(event.seq_id, len(event.tokens), event.finish is not None)

    def stalled(self, seconds: float) -> float:
        """A run's time on a shared machine: a `stalls` share of runs waits STALL_S more."""
        return seconds + (STALL_S if self.noise.random() < self.stalls else 0.0)

    def check(self, rows: int, length: int, seconds: float) -> None:
        """The decode cost model's prediction against the step's modelled cost."""
        guess = self.steer.decode_cost.estimate(rows, rows * length)
        if guess is not None and self.now > WARM_S:
            self.errors.append(guess.seconds / seconds)

    def observe(self, seq_id: int, tokens: int, finished: bool) -> None:
        if self.now > WARM_S:
            self.made += tokens
        if tokens:
            if seq_id in self.last and self.kind[seq_id] == "short":
                self.gaps.append(self.now - self.last[seq_id])
                self.gap_at.append(self.now)
            self.last[seq_id] = self.now
            self.first.setdefault(seq_id, self.now)
        if finished and self.kind[seq_id] == "short" and self.now < self.end:
            self.submit(SHORT, self.draw(), "short")

    def cells(self) -> list[float]:
        out = []
        for kind in ("short", "long"):
            waits = [
                self.first.get(i, self.end) - at
                for i, at in self.arrived.items()
                if self.kind[i] == kind and at > WARM_S  # past the cost models' warm-up
            ]
            out += [pct(waits, 50), pct(waits, 99)]
        gaps = [g for g, at in zip(self.gaps, self.gap_at, strict=True) if at > WARM_S]
        rate = self.made / (self.end - WARM_S)
        return [*out, pct(gaps, 50), pct(gaps, 99), pct(gaps, 100), rate]


def peaked(rows: int) -> np.ndarray | None:
    if not rows:
        return None
    logits = np.zeros((rows, 4), dtype=np.float32)
    logits[:, 1] = 9.0
    return logits


def pct(values: list[float], q: float) -> float:
    return 1000 * float(np.percentile(values, q)) if values else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="modelled seconds")
    parser.add_argument("--clients", default="16,64", help="comma-separated concurrencies")
    parser.add_argument(
        "--stalls", type=float, default=0.0, help=f"share of runs {STALL_S * 1000:.0f} ms late"
    )
    parser.add_argument("--ttft-factor", type=float, default=2.0, help="ttft_ms / the step")
    parser.add_argument("--itl-factor", type=float, default=3.0, help="itl_ms / the step")
    args = parser.parse_args()
    step16 = decode_s(16, LONG)
    print(
        f"modelled 16-row step over a {LONG}-long cache {1000 * step16:.1f} ms: steered "
        f"ttft_ms {1000 * args.ttft_factor * step16:.1f}, "
        f"itl_ms {1000 * args.itl_factor * step16:.1f}"
    )
    for clients in (int(c) for c in args.clients.split(",")):
        runs, fits = {}, []
        for steered in (False, True):
            factors = (args.ttft_factor, args.itl_factor)
            replay = Replay(steered, clients, args.seconds, args.stalls, factors)
            replay.run()
            runs[steered] = replay.cells()
            fits = replay.errors
        table(clients, runs)
        print(
            f"decode cost model, predicted / modelled step: p1 {np.percentile(fits, 1):.2f}, "
            f"p50 {np.percentile(fits, 50):.2f}, p99 {np.percentile(fits, 99):.2f}\n"
        )


def table(clients: int, runs: dict[bool, list[float]]) -> None:
    header = ["server", "TTFT p50", "TTFT p99", "long TTFT p50", "long TTFT p99"]
    header += ["ITL p50", "ITL p99", "ITL max", "tokens/s"]
    rows = [
        ["unsteered", *(f"{v:.1f}" for v in runs[False])],
        ["steered", *(f"{v:.1f}" for v in runs[True])],
        ["steered/unsteered"]
        + [f"{a / b:.2f}x" for a, b in zip(runs[True], runs[False], strict=True)],
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"{clients} clients")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
