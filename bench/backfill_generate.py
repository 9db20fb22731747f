"""Benchmark of a shared decoder: interactive completions first, an offline generate
job in the free rows.

    python bench/backfill_generate.py [--seconds 2] [--rotations 2] [--levels 0.3,0.7]

Starts `lanes serve` with an interactive generate workload on the tinycode demo model
(`--rows` rows) and an offline generate workload on the same model whose runner is
that endpoint. The offline job is the flow's endpoint runner itself
(flows.endpoint.EndpointModel), from two threads as two shards in flight would
(bench/backfill.py's `OfflineJob`, counting the tokens that come back).

First it measures the interactive capacity (requests/s with 2 x rows back-to-back
clients) and the offline lane alone (tokens/s). Then, at each load level (a fraction
of that capacity), a paced interactive closed loop runs with and without the offline
job, the two taking turns in short slices (a shared VM's speed drifts within
seconds). It prints per level: interactive p50/p99 with and without backfill and
their ratio, the offline tokens/s beside the alone figure (whole batches, from the
job's start until its last batch is answered) and beside the capacity the
interactive load leaves idle (the alone figure times the share of the time the engine
was idle without backfill, from its busy-seconds counter; target >= 0.8; and times
one less the load), the
engine's busy share without and with backfill, and the offline preemptions per
second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from backfill import KEY, OfflineJob, Turns, merge, paced, saturated  # noqa: E402
from serve import http_request, start, table  # noqa: E402

from lanes.flows.endpoint import EndpointModel  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks import load_task  # noqa: E402
from lanes.tasks.decoder import Completion  # noqa: E402

PROMPT = "def fibonacci(n):\n    "
MAX_TOKENS = 16
OFFLINE_PROMPTS = 8  # per batch sent: short batches, so a slice ends soon after its last
OFFLINE_MAX_TOKENS = 48
SPEC = """\
version: 1
models:
  tinycode:
    path: {m}/tinycode/model.onnx
    tokenizer: {m}/tinycode/tokenizer.json
    session: {{intra_op_threads: {threads}}}
workloads:
  code:
    mode: interactive
    task: generate
    model: tinycode
    batching: {{max_batch_size: {rows}, max_queue: 4096}}
    generation: {{max_new_tokens: {tokens}, temperature: 0}}
  nightly:
    mode: offline
    task: generate
    model: tinycode
    input: in/
    output: out/
    batch_size: {prompts}
    generation: {{max_new_tokens: {offline_tokens}, temperature: 0}}
    runner: {{kind: endpoint, workload: code}}
"""


class CountingJob(OfflineJob):
    """The offline job, counting the tokens its completions bring back."""

    def __init__(self, model: EndpointModel, items: list[Any]) -> None:
        super().__init__(model, items)
        self.tokens = 0
        self.started = 0.0

    def start(self) -> None:
        self.tokens, self.started = 0, time.perf_counter()
        super().start()

    def stop_rate(self) -> float:
        """Stop, and the tokens/s of every batch it ran since `start` (whole batches:
        from its start until the last one in flight is answered)."""
        self.stop()
        return self.tokens / (time.perf_counter() - self.started)

    def _loop(self) -> None:
        while self._go.is_set():
            done = self.model.run(self.items)
            self.tokens += sum(len(c.tokens) for c in done if isinstance(c, Completion))


def counters(url: str) -> tuple[float, float]:
    """The offline lane's preemptions and the engine's busy seconds so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = []
    for pattern in (
        r'lanes_lane_preemptions_total\{lane="offline",workload="code"\} (\S+)',
        r'lanes_executor_busy_seconds_total\{workload="code"\} (\S+)',
    ):
        hit = re.search(pattern, text)
        found.append(float(hit.group(1)) if hit else 0.0)
    return found[0], found[1]


def request() -> bytes:
    body = orjson.dumps({"model": "code", "prompt": PROMPT, "max_tokens": MAX_TOKENS})
    return http_request("POST", "/v1/completions", body)


async def measured(
    url: str, job: CountingJob | None, rate: float | None, seconds: float, clients: int
) -> tuple[Turns, float, float, float]:
    """One slice: its latencies, offline tokens/s, preemptions/s and the engine's
    busy share."""
    if job is not None:
        job.start()
        await asyncio.sleep(0.2)
    (preempted, busy), began = counters(url), time.perf_counter()
    latencies = await paced(url, rate, seconds, clients, request()) if rate else []
    if not rate:
        await asyncio.sleep(seconds)
    took = time.perf_counter() - began
    preempted_after, busy_after = counters(url)
    tokens_s = await asyncio.to_thread(job.stop_rate) if job is not None else 0.0
    return (
        Turns(latencies, took),
        tokens_s,
        (preempted_after - preempted) / took,
        (busy_after - busy) / took,
    )


async def run(args: argparse.Namespace) -> None:
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT.parent / ".lanes" / "models")).resolve()
    folder = Path(tempfile.mkdtemp(prefix="lanes-backfill-generate-"))
    spec_path = folder / "workloads.yaml"
    spec_path.write_text(
        SPEC.format(
            m=models,
            rows=args.rows,
            threads=args.threads,
            tokens=MAX_TOKENS,
            prompts=OFFLINE_PROMPTS,
            offline_tokens=OFFLINE_MAX_TOKENS,
        )
    )
    port = 8600 + os.getpid() % 300
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LANES_INTERNAL_KEY": KEY}
    cmd = [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path), "--port", str(port)]
    server = start(cmd, url, env)
    clients = 2 * args.rows
    try:
        settings = Settings(device="cpu")
        task = load_task("nightly", load_spec(spec_path, settings), Runtime(settings))
        prompts = [PROMPT + "x" * (i % 7) for i in range(OFFLINE_PROMPTS)]
        job = CountingJob(EndpointModel(task, url, "code", KEY), [task.prepare(p) for p in prompts])
        await measured(url, job, None, 1.0, clients)  # warm both lanes
        await saturated(url, 1.0, clients, request())
        capacity = statistics.median(
            [await saturated(url, args.seconds, clients, request()) for _ in range(args.rotations)]
        )
        alone = [(await measured(url, job, None, args.seconds, clients))[1] for _ in range(2)]
        alone_rate = statistics.median(alone)
        print(
            f"capacity: interactive {capacity:.1f} req/s ({clients} clients, "
            f"{MAX_TOKENS} tokens each), offline lane alone {alone_rate:.0f} tokens/s; "
            f"{args.rows} rows"
        )
        rows = []
        for level in args.levels:
            rate = level * capacity
            without, with_ = Turns(), Turns()
            offline_rates, preempt_rates, busy_alone, busy_with = [], [], [], []
            for i in range(args.rotations):
                order: list[tuple[Turns, CountingJob | None]] = [(without, None), (with_, job)]
                for turns, offline in order if i % 2 == 0 else order[::-1]:
                    one, tokens_s, preempt_s, busy = await measured(
                        url, offline, rate, args.seconds, clients
                    )
                    merge(turns, one)
                    if offline is not None:
                        offline_rates.append(tokens_s)
                        preempt_rates.append(preempt_s)
                        busy_with.append(busy)
                    else:
                        busy_alone.append(busy)
            offline_rate = statistics.mean(offline_rates)
            # What the interactive load leaves idle: the offline lane alone, in the share
            # of the time the engine did not run without backfill.
            idle = alone_rate * max(1 - statistics.mean(busy_alone), 0.0)
            rows.append(
                [
                    f"{level:.0%}",
                    f"{rate:.1f}",
                    f"{without.ms(50):.1f}/{without.ms(99):.1f}",
                    f"{with_.ms(50):.1f}/{with_.ms(99):.1f}",
                    f"{with_.ms(50) / max(without.ms(50), 1e-9):.2f}",
                    f"{with_.ms(99) / max(without.ms(99), 1e-9):.2f}",
                    f"{offline_rate:.0f}",
                    f"{offline_rate / max(alone_rate, 1e-9):.2f}",
                    f"{offline_rate / max(idle, 1e-9):.2f}",
                    f"{offline_rate / max(alone_rate * (1 - level), 1e-9):.2f}",
                    f"{statistics.mean(busy_alone):.2f}/{statistics.mean(busy_with):.2f}",
                    f"{statistics.mean(preempt_rates):.1f}",
                ]
            )
        header = [
            "load",
            "req/s",
            "p50/p99 ms alone",
            "p50/p99 ms +backfill",
            "p50 ratio",
            "p99 ratio",
            "offline tokens/s",
            "of alone",
            "of idle time",
            "of 1-load",
            "busy alone/+backfill",
            "preemptions/s",
        ]
        table("tinycode: interactive completions with and without an offline job", rows, header)
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rotations", type=int, default=2)
    parser.add_argument("--levels", default="0.3,0.7", help="fractions of interactive capacity")
    parser.add_argument("--rows", type=int, default=8, help="the interactive workload's rows")
    parser.add_argument(
        "--threads", type=int, default=1, help="the model's intra-op threads (the demo's: 1)"
    )
    args = parser.parse_args()
    args.levels = [float(v) for v in args.levels.split(",")]
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
