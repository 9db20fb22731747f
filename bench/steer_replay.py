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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lanes.generation.scheduler import Scheduler, Seq, StepOutputs
from lanes.generation.steer import Steer
from lanes.tasks.sampling import SamplingParams

LONG, LONG_NEW, SHORT = 496, 16, 5
ROWS = 64


def decode_s(rows: int, length: int) -> float:
    return 0.001 + 0.0006 * rows * length / 500


def prefill_s(tokens: int) -> float:
    return 0.001 + 0.00008 * tokens


class Replay:
    def __init__(self, steered: bool, clients: int, seconds: float) -> None:
        self.now = 0.0
        self.end = seconds
        self.steered = steered
        step16 = decode_s(16, LONG)
        self.steer = Steer(2 * step16, 3 * step16, ROWS, self.clock)
        self.scheduler = Scheduler(
            ROWS,
            frozenset({0}),
            lambda ids: "a" * len(ids),
            max_position=512,
            chunked=steered,
            clock=self.clock,
        )
        self.rng = random.Random(7)
        self.ids = iter(range(1, 1 << 30))
        self.kind: dict[int, str] = {}
        self.arrived: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.gaps: list[float] = []
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
            length = max((len(r.prompt_ids) + len(r.tokens) for r in s.rows), default=1)
            if self.steered:
                self.steer.apply(s, length, 4096)
            plan = s.schedule()
            if not plan.runs_model:
                self.now += 0.001
                continue
            took = 0.0
            if plan.decode:
                d = decode_s(len(plan.decode), length)
                self.steer.observe_decode(len(plan.decode), length, d)
                took += d
            if plan.prefill:
                tokens = len(plan.prefill) * max(len(r.prompt_ids) for r in plan.prefill)
                p = prefill_s(tokens)
                self.steer.observe_prefill(len(plan.prefill), tokens, p)
                took += p
            chunk = None
            if plan.chunk is not None:
                tokens = plan.chunk.stop - plan.chunk.start
                p = prefill_s(tokens)
                self.steer.observe_prefill(1, tokens, p)
                took += p
                chunk = peaked(1) if plan.chunk.final else None
            self.now += took
            outputs = StepOutputs(peaked(len(plan.prefill)), peaked(len(plan.decode)), {}, chunk)
            for event in s.update(plan, outputs):
                self.observe(event.seq_id, bool(event.tokens), event.finish is not None)

    def observe(self, seq_id: int, token: bool, finished: bool) -> None:
        if token:
            if seq_id in self.last and self.kind[seq_id] == "short":
                self.gaps.append(self.now - self.last[seq_id])
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
                if self.kind[i] == kind and at > 2.0  # past the cost models' warm-up
            ]
            out += [pct(waits, 50), pct(waits, 99)]
        return [*out, pct(self.gaps, 50), pct(self.gaps, 99)]


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
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    runs = {}
    for steered in (False, True):
        replay = Replay(steered, args.clients, args.seconds)
        replay.run()
        runs[steered] = replay.cells()
    step16 = decode_s(16, LONG)
    print(
        f"modelled 16-row step over a {LONG}-long cache {1000 * step16:.1f} ms: steered "
        f"ttft_ms {2000 * step16:.1f}, itl_ms {3000 * step16:.1f}; {args.clients} clients"
    )
    header = ["server", "TTFT p50", "TTFT p99", "long TTFT p50", "long TTFT p99"]
    header += ["ITL p50", "ITL p99"]
    rows = [
        ["unsteered", *(f"{v:.1f}" for v in runs[False])],
        ["steered", *(f"{v:.1f}" for v in runs[True])],
        ["steered/unsteered"]
        + [f"{a / b:.2f}x" for a, b in zip(runs[True], runs[False], strict=True)],
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
