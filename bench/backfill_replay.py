"""Replay of a shared decoder, interactive completions first and an offline job in the
gaps, on the real Scheduler and Steer with modelled run times on a manual clock: what
the sharing policy does, without the noise of a shared machine (no model, no server,
no threads; a few seconds).

    python bench/backfill_replay.py [--seconds 20] [--levels 0.3,0.7]

Interactive requests (5-token prompts, 16 tokens each) arrive at random (Poisson) at
a fraction of the interactive capacity (completions/s with the rows always full); an
offline job keeps 16 sequences (8-token prompts, 48 tokens each) queued. Steps run as
serving/engine.py runs them (joiners prefilled alone, then decoded; one decoder run
per KV group, offline rows that may sit a step out in groups of their own). Two
modelled devices:

- cpu: a decode run's cost grows with its rows (as this repository's 2-core VM
  measures: about 0.2 ms a row over a short past, 0.5 ms a run);
- gpu: a run costs about the same for 1 row or 64 (a fixed 5 ms, a little per row).

Three servers per device and load: the interactive load alone; with the offline job,
its rows decoding in every step (`always`: the policy before the cost model decided);
with the offline job as shipped (`steered`: the cost model decides whether offline
rows ride along, else they wait for a gap). Printed: interactive p50/p99 latency and
the ratios to alone (target p99 within +10%), offline tokens/s, that over the capacity
the interactive load leaves idle (the offline lane alone times the idle share of the
interactive-only run; target >= 0.8) and over the alone figure times one less the
load, the device's busy share, and preemptions. On the gpu model a step costs the
same for 1 row or 8, so the interactive load alone keeps it busy most of the time:
what it leaves idle is rows more than time, which the second figure counts.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from steer_replay import Cache, pct, peaked

from lanes.generation.scheduler import Scheduler
from lanes.generation.seq import Seq, StepOutputs
from lanes.generation.steer import Steer
from lanes.tasks.sampling import SamplingParams

ROWS = 8
PROMPT, NEW = 5, 16
OFFLINE_PROMPT, OFFLINE_NEW, OFFLINE_QUEUED = 8, 48, 16
WARM_S = 2.0  # figures count from here: past the cost models' warm-up

Cost = Callable[[int, int], float]
DEVICES: dict[str, tuple[Cost, Callable[[int], float]]] = {
    # (decode run of `rows` over a past `length` long, prefill of `tokens`)
    "cpu": (
        lambda rows, length: 0.0005 + 0.0002 * rows + 0.000002 * rows * length,
        lambda tokens: 0.0005 + 0.00004 * tokens,
    ),
    "gpu": (
        lambda rows, length: 0.005 + 0.00001 * rows + 0.00000002 * rows * length,
        lambda tokens: 0.003 + 0.000001 * tokens,
    ),
}


class Replay:
    """One server on one modelled device: `rate` interactive arrivals per second (None:
    the rows always full), the offline job when `offline` says how its rows share
    steps ("always" or "steered")."""

    def __init__(self, device: str, rate: float | None, offline: str | None, seconds: float):
        self.decode_s, self.prefill_s = DEVICES[device]
        self.now, self.end = 0.0, seconds
        self.rate, self.offline = rate, offline
        self.steer = Steer(None, None, ROWS, self.clock)
        self.scheduler = Scheduler(
            ROWS,
            frozenset({0}),
            lambda ids: "",
            prefill_alone=True,  # as serving/engine.py runs it
            clock=self.clock,
        )
        # Groups kept apart (rows that may sit a step out: Seq.sits_out) and the others.
        self.caches = {False: Cache(), True: Cache()}
        self.joins: dict[bool, dict[int, int]] = {False: {}, True: {}}
        self.busy = 0.0
        self.preempted = 0
        self.offline_made = 0
        self.done = 0
        self.latencies: list[float] = []
        self.arrived: dict[int, float] = {}
        self.ids = iter(range(1, 1 << 30))
        self.rng = random.Random(5)
        # rate None: the rows always full (2 x ROWS requests queued); 0: no interactive load.
        self.next_arrival = self.rng.expovariate(rate) if rate else math.inf
        if rate is None:
            for _ in range(2 * ROWS):
                self.submit(False)
        if offline is not None:
            for _ in range(OFFLINE_QUEUED):
                self.submit(True)

    def clock(self) -> float:
        return self.now

    def submit(self, offline: bool) -> None:
        i = next(self.ids)
        prompt, new = (OFFLINE_PROMPT, OFFLINE_NEW) if offline else (PROMPT, NEW)
        greedy = SamplingParams(temperature=0)
        seq = Seq(i, (1,) * prompt, new, greedy, arrived=self.now, ignore_eos=True, offline=offline)
        self.arrived[i] = self.now
        self.scheduler.add(seq)

    def run(self) -> Replay:
        s = self.scheduler
        while self.now < self.end:
            while self.now >= self.next_arrival:
                self.submit(False)
                self.next_arrival += self.rng.expovariate(self.rate or 1.0)
            length = max(max(c.length for c in self.caches.values()), 1)
            self.steer.apply(s, length, 4096)
            if self.offline == "always":
                s.offline_rides = True
            plan = s.schedule()
            if not plan.runs_model:
                self.now = min(self.next_arrival, self.end)
                continue
            took = 0.0
            if plan.decode:  # the loop settles the cache first: joiners in, leavers out
                keep = {r.id for r in s.rows}
                for lane, cache in self.caches.items():
                    if self.joins[lane]:
                        cache.place(self.joins[lane])
                        self.joins[lane] = {}
                    cache.keep(keep)
                lanes = {r.sits_out for r in plan.decode}
                decoded = max(self.caches[lane].length for lane in lanes)
                d = sum(self.decoded(self.caches[lane]) for lane in lanes)
                self.steer.observe_decode(len(plan.decode), decoded, d)
                took += d
            if plan.prefill:
                width = max(len(r.prompt_ids) for r in plan.prefill)
                tokens = len(plan.prefill) * width
                p = self.prefill_s(tokens)
                self.steer.observe_prefill(len(plan.prefill), tokens, p)
                took += p
                for r in plan.prefill:
                    self.joins[r.sits_out][r.id] = width
            self.preempted += len(plan.preempted)
            for r in plan.resumed:  # its kept cache comes back (a copy, not modelled)
                self.joins[r.sits_out][r.id] = len(r.cached_ids)
            self.now += took
            self.busy += took if self.now > WARM_S else 0.0
            outputs = StepOutputs(peaked(len(plan.prefill)), peaked(len(plan.decode)), {})
            lane_of = {r.id: r.offline for r in (*plan.prefill, *plan.decode)}
            for event in s.update(plan, outputs):
                self.observe(event.seq_id, len(event.tokens), event.finish, lane_of)
        return self

    def decoded(self, cache: Cache) -> float:
        """One decode step of a lane's groups: one run each (as Cache.decode, on this
        device's cost), each observed by the run cost model as the engine does."""
        took = 0.0
        for g in cache.groups:
            run = self.decode_s(len(g.rows), g.length)
            self.steer.observe_run(len(g.rows), g.length, run)
            took += run
        cache.decode()
        return took

    def observe(self, seq_id: int, tokens: int, finish: object, lane_of: dict[int, bool]) -> None:
        offline = lane_of.get(seq_id, False)
        if offline and self.now > WARM_S:
            self.offline_made += tokens
        if finish is None:
            return
        if offline:
            self.submit(True)  # the job keeps its queue full
        elif self.now > WARM_S:
            self.latencies.append(self.now - self.arrived[seq_id])
            self.done += 1
        if not offline and self.rate is None:
            self.submit(False)

    @property
    def seconds(self) -> float:
        return self.end - WARM_S

    @property
    def busy_share(self) -> float:
        return self.busy / self.seconds

    @property
    def offline_rate(self) -> float:
        return self.offline_made / self.seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="modelled seconds")
    parser.add_argument("--levels", default="0.3,0.7", help="fractions of interactive capacity")
    args = parser.parse_args()
    header = ["device", "load", "server", "p50/p99 ms", "p50 ratio", "p99 ratio"]
    header += ["offline tok/s", "of idle time", "of 1-load", "busy", "preempted"]
    rows = []
    for device in DEVICES:
        capacity = Replay(device, None, None, args.seconds).run().done / (args.seconds - WARM_S)
        alone = Replay(device, 0.0, "steered", args.seconds).run().offline_rate
        print(
            f"{device}: interactive capacity {capacity:.0f} req/s ({ROWS} rows), "
            f"offline lane alone {alone:.0f} tokens/s"
        )
        for level in (float(v) for v in args.levels.split(",")):
            base = Replay(device, level * capacity, None, args.seconds).run()
            idle = alone * (1 - base.busy_share)
            for name, offline in (("alone", None), ("always", "always"), ("steered", "steered")):
                r = (
                    base
                    if offline is None
                    else Replay(device, level * capacity, offline, args.seconds).run()
                )
                p50, p99 = pct(r.latencies, 50), pct(r.latencies, 99)
                b50, b99 = pct(base.latencies, 50), pct(base.latencies, 99)
                rows.append(
                    [
                        device,
                        f"{level:.0%}",
                        name,
                        f"{p50:.1f}/{p99:.1f}",
                        f"{p50 / b50:.2f}",
                        f"{p99 / b99:.2f}",
                        f"{r.offline_rate:.0f}",
                        f"{r.offline_rate / idle:.2f}" if idle > 0.01 * alone else "-",
                        f"{r.offline_rate / (alone * (1 - level)):.2f}",
                        f"{r.busy_share:.2f}",
                        str(r.preempted),
                    ]
                )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
