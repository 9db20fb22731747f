"""Benchmark of the interactive endpoint against raw onnxruntime and an unbatched server.

    python bench/serve.py [--seconds 4] [--levels 1,8,32,128] [--rounds 3]

Starts `lanes serve` (and, as a baseline, `bench/baseline_server.py`: FastAPI, one
session.run per request) in their own processes, drives closed-loop load at each
concurrency (one keep-alive connection per caller, asyncio streams), and prints per
model: throughput, p50/p95/p99 latency, mean batch size (from /metrics), and the
ratio to raw in-process onnxruntime at the same batch sizes measured in the same
run, plus the client's own round trip to /healthz. Ratios travel between machines;
absolute times on a shared 2-core box do not. `--rounds N` repeats raw and served
load N times and prints per-figure medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.runtime import Runtime  # noqa: E402
from lanes.settings import Settings  # noqa: E402
from lanes.specfile import load_spec  # noqa: E402
from lanes.tasks import load_task  # noqa: E402

# 30 one-token words + [CLS] + [SEP] = 32 tokens for minilm.
TEXT = " ".join(["word"] * 30)
FEATURES = [[5.1, 3.5, 1.4, 0.2]]

SPEC = """\
version: 1
models:
  minilm: {{path: {m}/minilm/model.onnx, tokenizer: {m}/minilm/tokenizer.json}}
  classifier: {{path: {m}/classifier/model.onnx}}
workloads:
  minilm:
    mode: interactive
    task: embed
    model: minilm
    batching: {{max_batch_size: 128, max_wait_ms: 0, max_queue: 4096}}
  tiny:
    mode: interactive
    task: infer
    model: classifier
    batching: {{max_batch_size: 128, max_wait_ms: 0, max_queue: 4096}}
"""


PERCENTILES = (50, 95, 99)


@dataclass
class Load:
    """What one closed-loop run measured: req/s, latency percentiles (ms), mean batch."""

    rps: float
    ms: dict[int, float]  # percentile -> latency
    mean_batch: float | None

    @classmethod
    def of(cls, latencies: list[float], seconds: float, mean_batch: float | None) -> Load:
        ms = {q: float(np.percentile(latencies, q)) * 1000 for q in PERCENTILES}
        return cls(len(latencies) / seconds, ms, mean_batch)

    @classmethod
    def median(cls, loads: list[Load]) -> Load:
        """Per figure, the median over rounds of the same concurrency."""
        batches = [x.mean_batch for x in loads if x.mean_batch is not None]
        return cls(
            statistics.median(x.rps for x in loads),
            {q: statistics.median(x.ms[q] for x in loads) for q in PERCENTILES},
            statistics.median(batches) if batches else None,
        )


def request_for(model: str) -> tuple[str, dict[str, object]]:
    if model == "minilm":
        return "/v1/embeddings", {"model": "minilm", "input": TEXT}
    body = {
        "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": FEATURES[0]}]
    }
    return "/v2/models/tiny/infer", body


class Connection:
    """One keep-alive HTTP/1.1 connection that sends one fixed request, again and again.

    The lightest client asyncio allows: on this 2-core box aiohttp cost ~0.5 ms per
    request of its own and competed with the server for the cores, which is not what
    is being measured. Answers must carry Content-Length (uvicorn's JSON ones do).
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer)

    async def send(self, request: bytes) -> int:
        """Send `request`, read its whole answer; returns the status code."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if found is None:
            raise RuntimeError(f"an answer without Content-Length: {head[:200]!r}")
        await self.reader.readexactly(int(found.group(1)))
        return int(head[9:12])

    def close(self) -> None:
        self.writer.close()


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def http_floor(url: str, requests: int = 600) -> float:
    """p50 ms of GET /healthz, one at a time: what the client and loopback cost alone."""
    request = http_request("GET", "/healthz")
    connection = await Connection.open(url)
    latencies = []
    try:
        for _ in range(requests):
            start = time.perf_counter()
            await connection.send(request)
            latencies.append(time.perf_counter() - start)
    finally:
        connection.close()
    return statistics.median(latencies[requests // 10 :]) * 1000


async def closed_loop(url: str, model: str, concurrency: int, seconds: float) -> Load:
    path, body = request_for(model)
    # Encoded once: the client's own JSON encoding is not what is being measured.
    request = http_request("POST", path, orjson.dumps(body))
    latencies: list[float] = []
    connections = [await Connection.open(url) for _ in range(concurrency)]

    async def caller(connection: Connection, until: float) -> None:
        while time.perf_counter() < until:
            start = time.perf_counter()
            status = await connection.send(request)
            if status != 200:
                raise RuntimeError(f"{path}: HTTP {status}")
            latencies.append(time.perf_counter() - start)

    try:
        warm = time.perf_counter() + min(1.0, seconds / 4)
        await asyncio.gather(*(caller(c, warm) for c in connections))
        latencies.clear()
        before = batch_stats(url, model)
        start = time.perf_counter()
        await asyncio.gather(*(caller(c, start + seconds) for c in connections))
        elapsed = time.perf_counter() - start
        after = batch_stats(url, model)
    finally:
        for connection in connections:
            connection.close()
    mean_batch = None
    if before and after and after[1] > before[1]:
        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    return Load.of(latencies, elapsed, mean_batch)


def batch_stats(url: str, model: str) -> tuple[float, float] | None:
    """(items, runs) so far, from lanes' /metrics; None for the baseline server."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    values = {}
    for key in ("sum", "count"):
        found = re.search(rf'lanes_batch_size_{key}{{workload="{model}"}} (\S+)', text)
        if not found:
            return None
        values[key] = float(found.group(1))
    return values["sum"], values["count"]


def raw_onnxruntime(
    spec_path: Path, model: str, sizes: list[int], seconds: float
) -> tuple[dict[int, tuple[float, float]], float]:
    """items/s and median ms per run of the task's own batched function, no HTTP; and
    the median ms of a batch-1 run after 2 ms idle, as a lone request meets the model
    (a core left idle wakes slowly on a VM: up to 2 ms more for minilm here)."""
    settings = Settings()
    task = load_task(model, load_spec(spec_path, settings), Runtime(settings))
    item = task.prepare(TEXT if model == "minilm" else {"features": FEATURES})
    task.warm_up()
    out = {}
    for size in sizes:
        batch = [item] * size
        task.run(batch)
        runs, start = 0, time.perf_counter()
        times = []
        while time.perf_counter() - start < seconds or runs < 3:
            t = time.perf_counter()
            task.run(batch)
            times.append(time.perf_counter() - t)
            runs += 1
        elapsed = time.perf_counter() - start
        out[size] = (runs * size / elapsed, statistics.median(times) * 1000)
    idle = []
    for _ in range(max(20, min(200, int(seconds / (out[min(sizes)][1] / 1000 + 0.002))))):
        time.sleep(0.002)
        t = time.perf_counter()
        task.run([item])
        idle.append(time.perf_counter() - t)
    return out, statistics.median(idle) * 1000


def start(cmd: list[str], url: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become ready")


def table(title: str, rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--levels", default="1,8,32,128")
    parser.add_argument("--models", default="minilm,tiny")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat raw and served load; print medians"
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    models_dir = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    work = Path(tempfile.mkdtemp(prefix="lanes-bench-"))
    spec_path = work / "workloads.yaml"
    spec_path.write_text(SPEC.format(m=models_dir))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lanes_url, base_url = "http://127.0.0.1:8431", "http://127.0.0.1:8432"

    for model in args.models.split(","):
        raws: list[dict[int, tuple[float, float]]] = []
        floors: list[float] = []
        idles: list[float] = []
        runs: dict[str, list[dict[int, Load]]] = {}
        servers = {
            "lanes": [sys.executable, "-m", "router.cli", "serve", str(spec_path), "--port", "8431"]
        }
        if not args.no_baseline:
            servers["baseline"] = [
                sys.executable,
                str(ROOT / "bench" / "baseline_server.py"),
                str(spec_path),
                model,
                "8432",
            ]
        # Rounds alternate raw and served load, so a neighbour's burst on a shared box
        # hits one round, and the median across rounds shrugs it off.
        for _ in range(args.rounds):
            raw_round, idle = raw_onnxruntime(spec_path, model, levels, max(1.0, args.seconds / 2))
            raws.append(raw_round)
            idles.append(idle)
            for name, cmd in servers.items():
                url = lanes_url if name == "lanes" else base_url
                proc = start(cmd, url, env)
                try:
                    # A fresh process runs its first seconds slower (page faults, first
                    # shapes, cold caches): load it before measuring anything.
                    asyncio.run(closed_loop(url, model, 8, 2.0))
                    if name == "lanes":
                        floors.append(asyncio.run(http_floor(url)))
                    runs.setdefault(name, []).append(
                        {c: asyncio.run(closed_loop(url, model, c, args.seconds)) for c in levels}
                    )
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
        raw = {
            c: (
                statistics.median(r[c][0] for r in raws),
                statistics.median(r[c][1] for r in raws),
            )
            for c in levels
        }
        best = max(v[0] for v in raw.values())
        results = {
            name: {c: Load.median([r[c] for r in rs]) for c in levels} for name, rs in runs.items()
        }
        rows = []
        for c in levels:
            raw_items, raw_ms = raw[c]
            for name, loads in results.items():
                load = loads[c]
                rows.append(
                    [
                        name,
                        str(c),
                        f"{load.rps:.0f}",
                        f"{load.ms[50]:.2f}",
                        f"{load.ms[95]:.2f}",
                        f"{load.ms[99]:.2f}",
                        f"{load.mean_batch:.1f}" if load.mean_batch else "-",
                        f"{raw_items:.0f}",
                        f"{raw_ms:.2f}",
                        f"{load.rps / best:.2f}",
                    ]
                )
        header = [
            "server",
            "conc",
            "req/s",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "batch",
            "raw items/s@b=conc",
            "raw ms/run",
            "x raw best",
        ]
        table(
            f"{model}: raw onnxruntime best {best:.0f} items/s (batch {max(raw, key=lambda k: raw[k][0])})",
            rows,
            header,
        )
        lanes1 = results["lanes"][levels[0]].ms[50]
        print(
            f"  lanes p50 at concurrency {levels[0]} minus raw batch-1 run: {lanes1 - raw[levels[0]][1]:+.2f} ms"
            f" (this client's GET /healthz round trip, no model: {statistics.median(floors):.2f} ms;"
            f" raw batch-1 after 2 ms idle: {statistics.median(idles):.2f} ms)"
        )
        if "baseline" in results:
            for c in levels:
                if c >= 32:
                    ratio = results["lanes"][c].rps / results["baseline"][c].rps
                    print(f"  lanes / baseline req/s at concurrency {c}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
