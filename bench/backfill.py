"""Benchmark of a shared device: interactive traffic first, an offline job in the gaps.

    python bench/backfill.py [--seconds 2] [--rotations 3] [--levels 0.3,0.7] [--slo-ms 50]
        [--policies finish,preempt,idle,idle-always]

Starts `lanes serve` with an interactive embed workload on the minilm demo model
(`slo.p99_ms` from --slo-ms) and an offline workload on the same model whose runner
is that endpoint, four times (or those `--policies` name, and `finish`): as declared
on the CPU (offline batches run beside the interactive ones on threads at the OS's
idle priority, until interactive runs keep the model busier than
`batching.offline_beside_until`: `idle`), the same always beside
(`offline_beside_until: 1`: `idle-always`), and taking turns on
the model's thread (`batching.offline_threads: 0`, as on a GPU), where an interactive
request that arrives during an offline run waits for it (`finish`) or, with
`batching.preempt_offline`, stops that run unless the run is past its middle, and the
items run again after it (`preempt`). The offline job is the flow's endpoint runner itself
(flows.endpoint.EndpointModel: prepared batches to the internal batch route), driven
from two threads as two shards in flight would, without Prefect around it (whose
start-up would dwarf a slice).

First it measures the capacity: the interactive endpoint saturated by the load's own
`--clients` (4 by default, no pause: items/s; the same at 16 clients is printed beside
it) and the offline lane alone (items/s). Capacity is what the load's own callers can
get: 16 callers make batches that 4 never do, and 70% of their rate saturates 4
callers' small batches. Then, at each load level (a
fraction of the interactive capacity), an interactive closed loop paced to that rate
(`--clients`, each waits for its answer, then for its next tick) runs without the
offline job and with it on each endpoint, and the offline job runs alone on the
first, all taking turns in short slices (like bench/serve.py: a shared VM's
speed drifts within seconds, so only figures from alternating slices compare). It
prints per level and endpoint: interactive p50/p99 with and without backfill, their
ratio (target: p99 within +10%, and within the SLO), the offline items/s against the
capacity the interactive load leaves idle (the offline job alone's items per busy
second of the device on `finish`, the lanes taking turns at their best batches, x
(1 - busy fraction without backfill); target >= 0.8x), the busy fraction of the
interactive lane's executor without and with backfill (from /metrics: with `idle`,
the offline threads' time is not in it), and the offline items preempted per second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from serve import Connection, http_request, start, table  # noqa: E402

from lanes.flows.endpoint import EndpointModel  # noqa: E402
from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks import load_task  # noqa: E402

KEY = "bench-internal-key"
TEXT = " ".join(["word"] * 30)  # 32 tokens with [CLS] and [SEP]
OFFLINE_REQUEST_ITEMS = 64  # per batch sent: small enough to count per slice
# Each endpoint's preempt_offline, offline_threads and offline_beside_until.
POLICIES = {
    "finish": ("false", "0", 0.8),
    "preempt": ("true", "0", 0.8),
    "idle": ("false", "null", 0.8),
    "idle-always": ("false", "null", 1),
}
SPEC = """\
version: 1
models:
  minilm: {{path: {m}/minilm/model.onnx, tokenizer: {m}/minilm/tokenizer.json}}
workloads:
  search:
    mode: interactive
    task: embed
    model: minilm
    batching:
      max_batch_size: 32
      max_wait_ms: 0
      max_queue: 4096
      preempt_offline: {preempt}
      offline_threads: {threads}
      offline_beside_until: {until}
    slo: {{p99_ms: {slo}}}
  corpus:
    mode: offline
    task: embed
    model: minilm
    input: in/
    output: out/
    batch_size: {items}
    runner: {{kind: endpoint, workload: search}}
"""


def scrape(url: str) -> dict[str, float]:
    """Busy seconds (all lanes, and offline) and offline items so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = {}
    for key, pattern in {
        "busy": r'lanes_executor_busy_seconds_total\{workload="search"\} (\S+)',
        "offline_items": r'lanes_lane_items_total\{lane="offline",workload="search"\} (\S+)',
        "offline_busy": r'lanes_lane_busy_seconds_total\{lane="offline",workload="search"\} (\S+)',
        "preempted": r'lanes_lane_preemptions_total\{lane="offline",workload="search"\} (\S+)',
    }.items():
        hit = re.search(pattern, text)
        found[key] = float(hit.group(1)) if hit else 0.0
    return found


class OfflineJob:
    """Two threads sending prepared batches to the endpoint's offline lane, until stopped."""

    def __init__(self, model: EndpointModel, items: list[object]) -> None:
        self.model, self.items = model, items
        self._go = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._go.set()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(2)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop sending; returns once the batches in flight are answered."""
        self._go.clear()
        for thread in self._threads:
            thread.join(timeout=120)

    def _loop(self) -> None:
        while self._go.is_set():
            self.model.run(self.items)


@dataclass
class Turns:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    busy: float = 0.0
    offline_items: float = 0.0
    preempted: float = 0.0

    def ms(self, percentile: float) -> float:
        return float(np.percentile(self.latencies, percentile)) * 1000 if self.latencies else 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy / self.seconds if self.seconds else 0.0

    @property
    def offline_rate(self) -> float:
        return self.offline_items / self.seconds if self.seconds else 0.0

    @property
    def offline_per_busy_s(self) -> float:
        """Offline items per second of device time: what an idle second could hold."""
        return self.offline_items / self.busy if self.busy else 0.0


def embed_request() -> bytes:
    return http_request("POST", "/v1/embeddings", orjson.dumps({"model": "search", "input": TEXT}))


async def paced(
    url: str, rate: float, seconds: float, clients: int = 4, request: bytes | None = None
) -> list[float]:
    """A closed loop paced to `rate` requests/s in all: each client sends `request`
    (an embedding by default), waits for its answer, then for its next tick (at once
    when it is late)."""
    request = request or embed_request()
    connections = [await Connection.open(url) for _ in range(clients)]
    latencies: list[float] = []
    period = clients / rate
    until = time.perf_counter() + seconds

    async def client(i: int, connection: Connection) -> None:
        tick = time.perf_counter() + period * i / clients
        while tick < until:
            await asyncio.sleep(max(tick - time.perf_counter(), 0))
            began = time.perf_counter()
            if await connection.send(request) != 200:
                raise RuntimeError("an interactive request failed")
            latencies.append(time.perf_counter() - began)
            tick += period

    try:
        await asyncio.gather(*(client(i, c) for i, c in enumerate(connections)))
    finally:
        for connection in connections:
            connection.close()
    return latencies


async def saturated(
    url: str, seconds: float, clients: int = 16, request: bytes | None = None
) -> float:
    """Interactive requests/s with `clients` back-to-back callers of `request` (an
    embedding by default)."""
    request = request or embed_request()
    connections = [await Connection.open(url) for _ in range(clients)]
    done = 0
    until = time.perf_counter() + seconds

    async def client(connection: Connection) -> None:
        nonlocal done
        while time.perf_counter() < until:
            await connection.send(request)
            done += 1

    began = time.perf_counter()
    await asyncio.gather(*(client(c) for c in connections))
    for connection in connections:
        connection.close()
    return done / (time.perf_counter() - began)


async def measured(
    url: str, job: OfflineJob | None, rate: float | None, seconds: float, clients: int = 4
) -> Turns:
    """One slice: the interactive load at `rate` (None: none) from `clients` callers, with
    `job` running or not."""
    if job is not None:
        job.start()
        await asyncio.sleep(0.2)  # its first batches are queued
    before, began = scrape(url), time.perf_counter()
    if rate is not None:
        latencies = await paced(url, rate, seconds, clients)
    else:
        latencies = []
        await asyncio.sleep(seconds)
    after, ended = scrape(url), time.perf_counter()
    if job is not None:
        await asyncio.to_thread(job.stop)
    turns = Turns(latencies, ended - began)
    turns.busy = after["busy"] - before["busy"]
    turns.offline_items = after["offline_items"] - before["offline_items"]
    turns.preempted = after["preempted"] - before["preempted"]
    return turns


def merge(into: Turns, one: Turns) -> None:
    into.latencies += one.latencies
    into.seconds += one.seconds
    into.busy += one.busy
    into.offline_items += one.offline_items
    into.preempted += one.preempted


async def run(args: argparse.Namespace) -> None:
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT.parent / ".lanes" / "models")).resolve()
    folder = Path(tempfile.mkdtemp(prefix="lanes-backfill-"))
    env = {**os.environ, "LANES_INTERNAL_KEY": KEY}
    urls: dict[str, str] = {}
    servers = []
    try:
        # `finish` always runs: the offline job alone on it is the capacity's reference.
        chosen = [p for p in POLICIES if p in args.policies or p == "finish"]
        for i, policy in enumerate(chosen):
            preempt, threads, until = POLICIES[policy]
            spec_path = folder / f"{policy}.yaml"
            spec = SPEC.format(
                m=models,
                slo=args.slo_ms,
                items=OFFLINE_REQUEST_ITEMS,
                preempt=preempt,
                threads=threads,
                until=until,
            )
            spec_path.write_text(spec)
            port = 8600 + (os.getpid() + i) % 300
            urls[policy] = f"http://127.0.0.1:{port}"
            cmd = [
                sys.executable,
                "-m",
                "lanes.router.cli",
                "serve",
                str(spec_path),
                "--port",
                str(port),
            ]
            servers.append(start(cmd, urls[policy], env))
        settings = Settings(device="cpu")
        task = load_task("corpus", load_spec(spec_path, settings), Runtime(settings))
        texts = [" ".join(["word"] * (8 + i % 40)) for i in range(OFFLINE_REQUEST_ITEMS)]
        items = sorted((task.prepare(t) for t in texts), key=lambda item: item.n_tokens)
        jobs = {
            p: OfflineJob(EndpointModel(task, u, "search", KEY), list(items))
            for p, u in urls.items()
        }
        url = urls["finish"]

        # Warm both lanes of both (the cost model learns from the first runs), then capacity.
        for policy, at in urls.items():
            await measured(at, jobs[policy], None, 1.0)
            await saturated(at, 1.0)
        interactive_capacity = statistics.median(
            [await saturated(url, args.seconds, args.clients) for _ in range(args.rotations)]
        )
        widest = statistics.median(
            [await saturated(url, args.seconds) for _ in range(args.rotations)]
        )
        alone = Turns()
        for _ in range(args.rotations):
            merge(alone, await measured(url, jobs["finish"], None, args.seconds))
        print(
            f"capacity: interactive {interactive_capacity:.0f} items/s ({args.clients} clients; "
            f"{widest:.0f} with 16), "
            f"offline lane alone {alone.offline_rate:.0f} items/s "
            f"(busy {alone.busy_fraction:.2f}); SLO p99 {args.slo_ms:g} ms"
        )

        rows = []
        for level in args.levels:
            rate = level * interactive_capacity
            solo = Turns()
            without = {policy: Turns() for policy in urls if policy in args.policies}
            with_ = {policy: Turns() for policy in without}
            slices: list[tuple[Turns, str, OfflineJob | None, float | None]]
            slices = [(solo, url, jobs["finish"], None)]
            slices += [(without[p], urls[p], None, rate) for p in without]
            slices += [(with_[p], urls[p], jobs[p], rate) for p in with_]
            for i in range(args.rotations):
                turn = i % len(slices)
                for turns, at, job, load in slices[turn:] + slices[:turn]:
                    merge(turns, await measured(at, job, load, args.seconds, args.clients))
            for policy, turns in with_.items():
                alone = without[policy]
                idle = solo.offline_per_busy_s * max(1 - alone.busy_fraction, 0.0)
                rows.append(
                    [
                        f"{level:.0%}",
                        policy,
                        f"{rate:.0f}",
                        f"{alone.ms(50):.1f}/{alone.ms(99):.1f}",
                        f"{turns.ms(50):.1f}/{turns.ms(99):.1f}",
                        f"{turns.ms(99) / max(alone.ms(99), 1e-9):.2f}",
                        "yes" if turns.ms(99) <= args.slo_ms else "no",
                        f"{turns.offline_rate:.0f}",
                        f"{idle:.0f}",
                        f"{turns.offline_rate / max(idle, 1e-9):.2f}",
                        f"{alone.busy_fraction:.2f}/{turns.busy_fraction:.2f}",
                        f"{turns.preempted / max(turns.seconds, 1e-9):.0f}",
                    ]
                )
        header = [
            "load",
            "offline",
            "req/s",
            "p50/p99 ms alone",
            "p50/p99 ms +backfill",
            "p99 ratio (<=1.10)",
            "in SLO",
            "offline items/s",
            "idle capacity",
            "ratio (>=0.8)",
            "busy alone/+backfill",
            "preempted/s",
        ]
        table("minilm: interactive closed loop with and without an offline job", rows, header)
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rotations", type=int, default=3)
    parser.add_argument("--levels", default="0.3,0.7", help="fractions of interactive capacity")
    parser.add_argument("--slo-ms", type=float, default=50.0)
    parser.add_argument("--clients", type=int, default=4, help="callers of the interactive load")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"which endpoints take the load, of {', '.join(POLICIES)}",
    )
    args = parser.parse_args()
    args.levels = [float(v) for v in args.levels.split(",")]
    args.policies = args.policies.split(",")
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        expected = ", ".join(POLICIES)
        parser.error(
            f"--policies: unknown {', '.join(sorted(unknown))}; expected some of {expected}"
        )
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
