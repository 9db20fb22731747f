"""Where a streamed request's time to first token goes, in the engine, without HTTP.

    python bench/ttft_parts.py [--model model-slots.onnx] [--levels 1,16] [--seconds 10]

One in-process `Engine` (continuous batching, the demo tinycode) and closed-loop
clients as in bench/generate.py (asyncio tasks in this process, `max_tokens`
log-uniform, `ignore_eos`), each submitting its next request as its last stream ends.
Every request whose first token came in the measured time is split into:

- inbox: from `Engine.submit` until the engine takes it: its arrivals thread during
  a decode (the model runs on one thread here, so a second run has a core of its
  own), else the engine thread between steps, after the step running when it came;
- to plan: until the plan (or the prefill beside a decode) that prefills it starts;
- step: that plan's runs until its first token is made (its prefill: the rows'
  decode of a step it shares runs after its first token is handed out);
- to flush: until its first token is handed to the event loop;
- to client: until the client's stream reads it.

Printed per level: p50/p99 of each part and of the whole, the share of joiners that
prefilled alone and the mean joiners per prefill, the tokens/s made against raw
onnxruntime (`Decoder.step`, or a `SlotRun`) at the same rows a step on the rows'
mean past, measured right after (the loop's own cost: no HTTP, no clients' process
on the cores), and the ratio the bench/generate.py
target is judged by (TTFT p99 at the highest level over TTFT p50 at the lowest), here
without HTTP. The same ratio of a raw decode step (`Decoder.step` or a `SlotRun`, 16
rows) to a raw lone prefill of a bench prompt is printed beside it: an arrival waits a
step, then prefills. The hooks wrap the engine's own methods; nothing is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import (  # noqa: E402
    COUNTERS,
    MAX_TOKENS,
    PROMPTS,
    WORKLOAD,
    draw_lengths,
    raw_tokens_per_s,
)

from lanes.generation.kvcache import MAX_PADDING  # noqa: E402
from lanes.generation.loop import Beside, Step  # noqa: E402
from lanes.generation.seq import Event, Seq, StepPlan  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.serving.engine import Engine  # noqa: E402
from lanes.serving.metrics import Metrics  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.spec import Spec  # noqa: E402
from lanes.tasks import GenerateTask, load_task  # noqa: E402

PARTS = ("inbox", "to plan", "step", "to flush", "to client")


class Marks:
    """Per sequence id, when it passed each point; wraps the engine's own methods."""

    def __init__(self, engine: Engine) -> None:
        self.at: dict[int, dict[str, float]] = {}
        self.joiners: dict[int, tuple[bool, int]] = {}  # id -> (prefilled alone, joiners)
        add, run, send = engine.scheduler.add, engine.loop.run, engine._send
        prefill_beside = engine.loop.prefill_beside

        def taken(seq: Seq) -> None:  # the engine thread, out of its inbox
            add(seq)
            self._mark([seq.id], "taken")

        def ran(
            plan: StepPlan,
            before_runs: Callable[[], None] | None = None,
            first_tokens: Callable[[list[Event]], None] | None = None,
            beside: Beside | None = None,
        ) -> Step:
            start = time.perf_counter()

            def handed(events: list[Event]) -> None:  # their step's prefill is done
                self._mark([e.seq_id for e in events], "stepped")
                if first_tokens is not None:
                    first_tokens(events)

            step = run(plan, before_runs, handed, beside)
            for seq in plan.prefill:
                self._mark([seq.id], "plan", start)
                self._mark([seq.id], "stepped")
                self.joiners[seq.id] = (not plan.decode, len(plan.prefill))
            return step

        def prefilled_beside(joiners: Sequence[Seq]) -> Step:  # during a decode
            start = time.perf_counter()
            step = prefill_beside(joiners)
            for seq in joiners:
                self._mark([seq.id], "plan", start)
                self._mark([seq.id], "stepped")
                self.joiners[seq.id] = (True, len(joiners))
            return step

        def sent(events: list[Event]) -> None:
            self._mark([e.seq_id for e in events if e.first], "flushed")
            send(events)

        engine.scheduler.add = taken  # type: ignore[method-assign]
        engine.loop.run = ran  # type: ignore[method-assign]
        engine.loop.prefill_beside = prefilled_beside  # type: ignore[method-assign]
        engine._send = sent  # type: ignore[method-assign]

    def _mark(self, ids: list[int], point: str, at: float | None = None) -> None:
        now = time.perf_counter() if at is None else at
        for sid in ids:
            self.at.setdefault(sid, {}).setdefault(point, now)


def counters(metrics: Metrics) -> dict[str, float]:
    """The engine's counters, read in process as bench/generate.py reads /metrics."""
    sample = metrics.registry.get_sample_value
    return {k: sample(name, {"workload": WORKLOAD}) or 0.0 for k, name in COUNTERS.items()}


async def closed_loop(
    engine: Engine,
    metrics: Metrics,
    task: GenerateTask,
    clients: int,
    warm: float,
    seconds: float,
) -> tuple[list[tuple[int, float, float]], dict[str, float]]:
    """(id, sent, first token read) of each request sent in the measured time, and how
    much each counter grew in it."""
    got: list[tuple[int, float, float]] = []
    start = time.perf_counter() + warm
    end = start + seconds

    async def counted() -> dict[str, float]:
        await asyncio.sleep(start - time.perf_counter())
        before = counters(metrics)
        await asyncio.sleep(end - time.perf_counter())
        after = counters(metrics)
        return {k: after[k] - before[k] for k in COUNTERS}

    async def client(k: int) -> None:
        lengths = iter(draw_lengths(1000 + k, 100_000))
        i = 0
        while time.perf_counter() < end:
            item = {
                "prompt": PROMPTS[(k + i) % len(PROMPTS)],
                "max_tokens": min(next(lengths), MAX_TOKENS),
            }
            i += 1
            sent = time.perf_counter()
            stream = engine.submit(task.prepare(item), ignore_eos=True)
            first = True
            async for event in stream:
                if first and event.tokens:
                    first = False
                    if sent >= start:
                        got.append((stream.id, sent, time.perf_counter()))

    grown = asyncio.create_task(counted())
    await asyncio.gather(*(client(k) for k in range(clients)))
    return got, await grown


IDLE_S = 0.003  # about a lone client's gap between its stream's end and its next request


def raw_prefill_s(task: GenerateTask, repeats: int = 50, idle_s: float = 0.0) -> float:
    """The median lone prefill of the bench's first prompt, each after `idle_s` asleep
    (a lone client's request finds the engine idle since its last stream ended)."""
    decoder = task.decoder
    ids = np.asarray([decoder.encode(PROMPTS[0])], dtype=np.int64)
    mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None, :]
    times = []
    for _ in range(repeats):
        if idle_s:
            time.sleep(idle_s)
        at = time.perf_counter()
        decoder.step(ids, mask, positions, decoder.empty_past(1))
        times.append(time.perf_counter() - at)
    return float(np.median(times))


async def measure(task: GenerateTask, levels: list[int], warm: float, seconds: float) -> None:
    metrics = Metrics()
    engine = Engine(task, metrics, "continuous", MAX_PADDING)
    marks = Marks(engine)
    engine.start()
    totals: dict[int, np.ndarray] = {}
    try:
        for clients in levels:
            rows, grown = await closed_loop(engine, metrics, task, clients, warm, seconds)
            parts: dict[str, list[float]] = {p: [] for p in (*PARTS, "total")}
            alone, joiners = [], []
            for sid, sent, read in rows:
                at = marks.at.get(sid, {})
                points = [sent, *(at.get(p) for p in ("taken", "plan", "stepped", "flushed"))]
                if any(p is None for p in points):
                    continue
                ends = [float(p) for p in points if p is not None] + [read]
                for name, a, b in zip(PARTS, ends[:-1], ends[1:], strict=True):
                    parts[name].append(b - a)
                parts["total"].append(read - sent)
                alone.append(marks.joiners[sid][0])
                joiners.append(marks.joiners[sid][1])
            totals[clients] = np.asarray(parts["total"]) * 1000
            print(
                f"{clients} client(s): {len(totals[clients])} requests, {np.mean(alone):.0%} "
                f"prefilled alone, {np.mean(joiners):.2f} joiners per prefill"
            )
            for name, values in parts.items():
                ms = np.asarray(values) * 1000
                p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
                print(f"  {name:<10} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms")
            # The loop's own cost: tokens/s against raw at the same rows and past,
            # measured right after, with no HTTP and no clients' process on the cores.
            per_step = grown["rows"] / max(grown["steps"], 1)
            past = grown["positions"] / max(grown["rows"], 1)
            raw = raw_tokens_per_s(task, max(1, round(per_step)), max(1, round(past)), 1.0)
            tokens = grown["tokens"] / seconds
            print(
                f"  tokens/s {tokens:.0f}, {per_step:.1f} rows a step on a mean past of "
                f"{past:.0f}: {tokens / raw:.2f}x raw at those rows and past ({raw:.0f})"
            )
    finally:
        await engine.stop()
    low, high = min(levels), max(levels)
    ratio = np.percentile(totals[high], 99) / np.percentile(totals[low], 50)
    print(f"TTFT p99 at {high} / TTFT p50 at {low}, in process: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="model-slots.onnx", help="tinycode's graph")
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--warm", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    folder = ROOT / ".lanes" / "models" / "tinycode"
    model = {
        "path": folder / args.model,
        "tokenizer": folder / "tokenizer.json",
        "session": {"intra_op_threads": 1},
    }
    workload = {
        "mode": "interactive",
        "task": "generate",
        "model": "tinycode",
        "batching": {"max_batch_size": 64},
        "generation": {"temperature": 0},
    }
    spec = Spec.model_validate({"models": {"tinycode": model}, "workloads": {WORKLOAD: workload}})
    task = load_task(WORKLOAD, spec, Runtime(Settings(device="cpu")))
    assert isinstance(task, GenerateTask)
    task.warm_up()
    asyncio.run(measure(task, [int(x) for x in args.levels.split(",")], args.warm, args.seconds))
    step = 16 / raw_tokens_per_s(task, 16, 128, 1.0)
    prefill = raw_prefill_s(task)
    idle = raw_prefill_s(task, idle_s=IDLE_S)
    print(
        f"raw: a 16-row decode step (past 128) {step * 1000:.2f} ms, a lone prefill "
        f"{prefill * 1000:.2f} ms; (step + prefill) / prefill = {(step + prefill) / prefill:.2f}x"
    )
    print(
        f"raw: a lone prefill after {IDLE_S * 1000:.0f} ms asleep {idle * 1000:.2f} ms "
        f"({idle / prefill:.2f}x back to back): what a lone client's prefill starts from"
    )


if __name__ == "__main__":
    main()
