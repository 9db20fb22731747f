"""Benchmark of the interactive endpoint against raw onnxruntime and an unbatched server.

    python bench/serve.py [--seconds 4] [--levels 1,8,32,128] [--models minilm,tiny] [--tracing]
                          [--png PATH]

Starts `lanes serve` and, as a baseline, `bench/baseline_server.py` (FastAPI, one
session.run per request) side by side, and prints per model and concurrency:
throughput, p50/p95/p99 latency, mean batch size (from /metrics), raw in-process
onnxruntime at the same batch size and at its best one, and the ratios; plus the
client's own round trip to /healthz.

The speed of a shared VM drifts by 1.5-2x within seconds (on this one a fixed numpy
matmul took 0.18-0.37 ms from one second to the next), so a figure measured after
another is no baseline for it. At each concurrency the contenders (raw runs at batch
size = concurrency, raw runs at the best batch size, lanes, the baseline) take turns
in short slices, in rotation, 30 ms apart (onnxruntime's threads spin a little after
a run, on the same cores), and every ratio compares figures from the same slices.
The concurrency-1 gap is the median over rotations of (lanes p50 - raw batch-1 p50).

`--tracing` adds a third server in the same rotations: lanes with LANES_TRACING=true,
exporting every span over OTLP/HTTP to a sink in this process that answers 200, and
prints what tracing costs at each concurrency (p50 and req/s against lanes untraced).

`--slo` is a mode of its own (see `bench_slo`): minilm with and without `slo.p99_ms`
(about twice raw onnxruntime's batch-1 run), under open-loop arrivals, interleaved.
`--png PATH` also draws p50 and p99 latency against req/s, one curve per server
(lanes.router.plot; PATH-MODEL.png when several models run).
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.router.plot import Chart, Curve, CurvePoint, plotting_missing, save_chart  # noqa: E402
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
PAUSE_S = 0.03  # between slices


@dataclass
class Turns:
    """One contender's slices at one concurrency, pooled."""

    latencies: list[float] = field(default_factory=list)  # s, every request or raw run
    done: int = 0  # items completed, counted for the rate...
    span: float = 0.0  # ...and the seconds they took
    slice_p50: list[float] = field(default_factory=list)  # ms, one per slice

    def add(self, latencies: list[float], done: int, span: float) -> None:
        self.latencies += latencies
        self.done += done
        self.span += span
        self.slice_p50.append(statistics.median(latencies) * 1000)

    @property
    def rate(self) -> float:
        return self.done / self.span if self.span else 0.0

    def ms(self, percentile: float) -> float:
        return float(np.percentile(self.latencies, percentile)) * 1000


def request_for(model: str) -> tuple[str, dict[str, object]]:
    if model == "minilm":
        return "/v1/embeddings", {"model": "minilm", "input": TEXT}
    body: dict[str, object] = {
        "inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": FEATURES[0]}]
    }
    return "/v2/models/tiny/infer", body


class Connection:
    """One keep-alive HTTP/1.1 connection that sends one fixed request, again and again.

    The lightest client asyncio allows (on uvloop): on this 2-core box aiohttp cost
    ~0.5 ms per request of its own and competed with the server for the cores, which
    is not what is being measured. Answers must carry Content-Length (uvicorn's JSON
    ones do).
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


async def served_slice(
    connections: list[Connection], request: bytes, seconds: float
) -> tuple[list[float], int, float]:
    """Closed loop on every connection for `seconds`: (latencies, completions, span).

    The rate counts completions after the first and up to the last one inside the
    window, over the time between them: a batching server answers a batch at a time,
    and the ramp at the start and the drain after the end would bias a short slice.
    """
    latencies: list[float] = []
    finished: list[float] = []
    until = time.perf_counter() + seconds

    async def caller(connection: Connection) -> None:
        while time.perf_counter() < until:
            start = time.perf_counter()
            status = await connection.send(request)
            if status != 200:
                raise RuntimeError(f"HTTP {status} for {request[:40]!r}")
            end = time.perf_counter()
            latencies.append(end - start)
            if end <= until:
                finished.append(end)

    await asyncio.gather(*(caller(c) for c in connections))
    if len(finished) < 2:
        return latencies, 0, 0.0
    return latencies, len(finished) - 1, finished[-1] - finished[0]


def raw_slice(task: Any, batch: list[Any], seconds: float) -> tuple[list[float], int, float]:
    """Back-to-back runs of the task's own batched function: (run times, items, seconds)."""
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 2:
        t = time.perf_counter()
        task.run(batch)
        times.append(time.perf_counter() - t)
    return times, len(times) * len(batch), time.perf_counter() - start


Slice = Callable[[float], Awaitable[tuple[list[float], int, float]]]


async def rotate(contenders: dict[str, Slice], seconds: float, slice_s: float) -> dict[str, Turns]:
    """Each contender runs `seconds` in all, in slices of `slice_s`, taking turns."""
    turns = {name: Turns() for name in contenders}
    names = list(contenders)
    for i in range(max(3, round(seconds / slice_s))):
        shift = i % len(names)  # a different one goes first each round
        for name in names[shift:] + names[:shift]:
            await asyncio.sleep(PAUSE_S)
            turns[name].add(*await contenders[name](slice_s))
    return turns


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


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that reads every export and keeps nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def otlp_sink() -> str:
    """Start the sink on a free port; its URL, for OTEL_EXPORTER_OTLP_ENDPOINT."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


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


async def bench_model(
    model: str, spec_path: Path, urls: dict[str, str], levels: list[int], seconds: float
) -> list[Curve]:
    """Prints the model's table; returns each server's curve (for --png)."""
    settings = Settings()
    task = load_task(model, load_spec(spec_path, settings), Runtime(settings))
    item = task.prepare(TEXT if model == "minilm" else {"features": FEATURES})
    task.warm_up()
    # The best batch size, from a short scan; its figures come from the rotations.
    scan = {size: raw_slice(task, [item] * size, 0.3) for size in levels}
    best = max(levels, key=lambda size: scan[size][1] / scan[size][2])
    path, body = request_for(model)
    # Encoded once: the client's own JSON encoding is not what is being measured.
    request = http_request("POST", path, orjson.dumps(body))
    floor = await http_floor(urls["lanes"])

    def raw(size: int) -> Slice:
        async def take(seconds: float) -> tuple[list[float], int, float]:
            return raw_slice(task, [item] * size, seconds)

        return take

    def served(url: str, concurrency: int) -> Slice:
        async def take(seconds: float) -> tuple[list[float], int, float]:
            # Fresh connections each slice: the server closes those idle for 5 s
            # while the others take their turns.
            connections = [await Connection.open(url) for _ in range(concurrency)]
            try:
                return await served_slice(connections, request, seconds)
            finally:
                for connection in connections:
                    connection.close()

        return take

    rows, notes = [], []
    curves = {name: Curve(name, []) for name in urls}
    for c in levels:
        # Warm each server at this load, and size the slices: several round trips.
        p50 = 0.0
        for url in urls.values():
            latencies, _, _ = await served(url, c)(1.0)
            p50 = max(p50, statistics.median(latencies))
        slice_s = min(3.0, max(0.2, 8 * p50))
        contenders: dict[str, Slice] = {f"raw b={c}": raw(c), f"raw b={best}": raw(best)}
        contenders |= {name: served(url, c) for name, url in urls.items()}
        before = batch_stats(urls["lanes"], model)
        turns = await rotate(contenders, seconds, slice_s)
        after = batch_stats(urls["lanes"], model)
        raw_c, raw_best = turns[f"raw b={c}"], turns[f"raw b={best}"]
        mean_batch = None
        if before and after and after[1] > before[1]:
            mean_batch = (after[0] - before[0]) / (after[1] - before[1])
        for name in urls:
            load = turns[name]
            curves[name].points.append(CurvePoint(load.rate, load.ms(50), load.ms(99), f"x{c}"))
            rows.append(
                [
                    name,
                    str(c),
                    f"{load.rate:.0f}",
                    *(f"{load.ms(q):.2f}" for q in PERCENTILES),
                    f"{mean_batch:.1f}" if name == "lanes" and mean_batch else "-",
                    f"{raw_c.rate:.0f}",
                    f"{statistics.median(raw_c.latencies) * 1000:.2f}",
                    f"{load.rate / raw_best.rate:.2f}",
                ]
            )
        if c == 1:
            gaps = [s - r for s, r in zip(turns["lanes"].slice_p50, raw_c.slice_p50, strict=True)]
            q1, q2, q3 = statistics.quantiles(gaps, n=4)
            notes.append(
                f"  concurrency 1: lanes p50 minus raw batch-1 p50, paired by rotation: {q2:+.2f} ms"
                f" (quartiles {q1:+.2f} .. {q3:+.2f}, {len(gaps)} rotations); this client's"
                f" GET /healthz round trip, no model: {floor:.2f} ms"
            )
        if "traced" in turns:
            on, off = turns["traced"], turns["lanes"]
            notes.append(
                f"  concurrency {c}: tracing on costs {on.ms(50) - off.ms(50):+.2f} ms at p50"
                f" ({on.ms(50):.2f} vs {off.ms(50):.2f}), {on.ms(99) - off.ms(99):+.2f} ms at"
                f" p99; req/s on/off {on.rate / off.rate:.2f}x"
            )
        if c >= 32:
            vs_baseline = ""
            if "baseline" in turns:
                ratio = turns["lanes"].rate / turns["baseline"].rate
                vs_baseline = f"; lanes / baseline req/s: {ratio:.2f}x"
            notes.append(
                f"  concurrency {c}: lanes {turns['lanes'].rate / raw_best.rate:.2f} of raw best"
                f" ({raw_best.rate:.0f} items/s at batch {best}, same rotations){vs_baseline}"
            )
    header = ["server", "conc", "req/s", "p50 ms", "p95 ms", "p99 ms", "batch"]
    header += ["raw items/s@b=conc", "raw ms/run", "x raw best"]
    table(f"{model}: raw onnxruntime's best batch size here: {best}", rows, header)
    print("\n".join(notes))
    return list(curves.values())


# ---- --slo: does slo.p99_ms steer the batcher? --------------------------------------

SLO_SPEC = """\
version: 1
models:
  minilm: {{path: {m}/minilm/model.onnx, tokenizer: {m}/minilm/tokenizer.json}}
workloads:
  minilm:
    mode: interactive
    task: embed
    model: minilm
    batching: {{max_batch_size: 128, max_wait_ms: 0, max_queue: 4096}}
{slo}"""


@dataclass
class OpenTurns:
    """One server's open-loop slices at one arrival rate, pooled."""

    latencies: list[float] = field(default_factory=list)  # s, from each scheduled arrival
    refused: int = 0  # answers other than 200
    done: int = 0
    span: float = 0.0

    @property
    def rate(self) -> float:
        return self.done / self.span if self.span else 0.0

    def ms(self, percentile: float) -> float:
        return float(np.percentile(self.latencies, percentile)) * 1000 if self.latencies else 0.0


async def open_slice(
    url: str, request: bytes, rate: float, seconds: float, seed: int, turns: OpenTurns
) -> None:
    """Poisson arrivals at `rate` for `seconds` (the same times for every server: one
    seed per slice), each sent on an idle connection or a new one, and timed from its
    scheduled arrival, so a server that falls behind pays for its backlog. The rate
    counts 200s over the time from the first arrival to the last answer."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, int(rate * seconds * 2) + 10)
    offsets = np.cumsum(gaps)
    offsets = offsets[offsets < seconds]
    idle: list[Connection] = []
    start = time.perf_counter()
    last = start

    async def one(offset: float) -> None:
        nonlocal last
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        connection = idle.pop() if idle else await Connection.open(url)
        status = await connection.send(request)
        last = max(last, time.perf_counter())
        if status == 200:
            turns.latencies.append(time.perf_counter() - start - offset)
            turns.done += 1
        else:
            turns.refused += 1
        idle.append(connection)

    try:
        await asyncio.gather(*(one(float(o)) for o in offsets))
    finally:
        for connection in idle:
            connection.close()
    turns.span += last - start


def batch_1_ms(spec_path: Path, runs: int = 300) -> float:
    """Raw onnxruntime's median batch-1 run of the bench's text, in process."""
    settings = Settings()
    task = load_task("minilm", load_spec(spec_path, settings), Runtime(settings))
    task.warm_up()
    item = task.prepare(TEXT)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        task.run([item])
        times.append(time.perf_counter() - t)
    return statistics.median(times[runs // 10 :]) * 1000


async def bench_slo(
    urls: dict[str, str], p99_ms: float, rates: list[float], seconds: float
) -> None:
    """Each rate: both servers take turns in slices of the same arrivals; p50/p99 of
    what was served, req/s served, answers refused, mean batch size (from /metrics)."""
    path, body = request_for("minilm")
    request = http_request("POST", path, orjson.dumps(body))
    for url in urls.values():  # warm up: connections, sessions, and the cost model's fit
        await open_slice(url, request, rates[0], 1.0, 0, OpenTurns())
    rows = []
    slice_s = 0.5
    for rate in rates:
        turns = {name: OpenTurns() for name in urls}
        before = {name: batch_stats(url, "minilm") for name, url in urls.items()}
        names = list(urls)
        for i in range(max(2, round(seconds / slice_s))):
            for name in names[i % 2 :] + names[: i % 2]:
                await asyncio.sleep(PAUSE_S * 3)  # the previous slice's backlog drains
                await open_slice(urls[name], request, rate, slice_s, i, turns[name])
        for name, url in urls.items():
            after, was = batch_stats(url, "minilm"), before[name]
            mean = (after[0] - was[0]) / (after[1] - was[1]) if after and was else 0.0
            load = turns[name]
            rows.append(
                [
                    name,
                    f"{rate:.0f}",
                    f"{load.rate:.0f}",
                    f"{load.ms(50):.2f}",
                    f"{load.ms(99):.2f}",
                    "yes" if load.ms(99) <= p99_ms else "no",
                    str(load.refused),
                    f"{mean:.1f}",
                ]
            )
    header = ["server", "arrivals/s", "served/s", "p50 ms", "p99 ms", "p99 in SLO", "refused"]
    table(
        f"minilm, open-loop arrivals; slo.p99_ms = {p99_ms:.1f} on the 'slo' server only",
        rows,
        [*header, "batch"],
    )
    print(f"  the 'slo' server's cost model, from /metrics: {cost_fit(urls['slo'], 'minilm')}")


def cost_fit(url: str, model: str) -> str:
    """The lanes_cost_* gauges of one workload, as one line."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.findall(rf'lanes_cost_(\w+){{workload="{model}"}} (\S+)', text)
    return ", ".join(f"{name} {float(value):.4g}" for name, value in found) or "none"


def run_slo_mode(args: argparse.Namespace, models_dir: Path, work: Path) -> None:
    """Two `lanes serve`: the same minilm workload without an SLO and with p99_ms."""
    plain = work / "plain.yaml"
    plain.write_text(SLO_SPEC.format(m=models_dir, slo=""))
    t1 = batch_1_ms(plain)
    p99_ms = round(args.slo_factor * t1, 1)
    steered = work / "slo.yaml"
    steered.write_text(SLO_SPEC.format(m=models_dir, slo=f"    slo: {{p99_ms: {p99_ms}}}\n"))
    # Arrival rates as multiples of raw batch-1 capacity (1 / its run time).
    rates = [float(x) * 1000 / t1 for x in args.slo_loads.split(",")]
    print(f"raw onnxruntime batch-1 run: {t1:.2f} ms (median); slo.p99_ms = {p99_ms}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = {"no slo": (plain, 8431), "slo": (steered, 8434)}
    procs, urls = [], {}
    try:
        for name, (spec, port) in servers.items():
            cmd = [sys.executable, "-m", "lanes.router.cli", "serve", str(spec), "--port"]
            urls[name] = f"http://127.0.0.1:{port}"
            procs.append(start([*cmd, str(port)], urls[name], env))
        uvloop.run(bench_slo(urls, p99_ms, rates, args.seconds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per contender and level")
    parser.add_argument("--levels", default="1,8,32,128")
    parser.add_argument("--models", default="minilm,tiny")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--tracing", action="store_true", help="also lanes with tracing on (see above)"
    )
    parser.add_argument(
        "--slo", action="store_true", help="the p99_ms steering mode instead (see above)"
    )
    parser.add_argument("--slo-factor", type=float, default=2.0, help="p99_ms / batch-1 run")
    parser.add_argument(
        "--slo-loads", default="0.5,1,2", help="arrival rates, x raw batch-1 capacity"
    )
    parser.add_argument("--png", type=Path, help="draw latency against req/s here (see above)")
    args = parser.parse_args()
    if args.png and (missing := plotting_missing()):
        print(missing, file=sys.stderr)
        args.png = None
    levels = [int(x) for x in args.levels.split(",")]
    models_dir = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    work = Path(tempfile.mkdtemp(prefix="lanes-bench-"))
    spec_path = work / "workloads.yaml"
    spec_path.write_text(SPEC.format(m=models_dir))
    if args.slo:
        run_slo_mode(args, models_dir, work)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lanes = [sys.executable, "-m", "lanes.router.cli", "serve", str(spec_path), "--port", "8431"]
    traced_env = dict(env)
    if args.tracing:
        traced_env |= {"LANES_TRACING": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink()}
    for model in args.models.split(","):
        servers = {"lanes": (lanes, "http://127.0.0.1:8431", env)}
        if args.tracing:
            traced = [*lanes[:-1], "8433"]
            servers["traced"] = (traced, "http://127.0.0.1:8433", traced_env)
        if not args.no_baseline:
            baseline = [sys.executable, str(ROOT / "bench" / "baseline_server.py")]
            servers["baseline"] = (
                [*baseline, str(spec_path), model, "8432"],
                "http://127.0.0.1:8432",
                env,
            )
        procs = [start(cmd, url, server_env) for cmd, url, server_env in servers.values()]
        try:
            urls = {name: url for name, (_, url, _) in servers.items()}
            # uvloop: the client's own share of each round trip is not what is measured.
            curves = uvloop.run(bench_model(model, spec_path, urls, levels, args.seconds))
            if args.png:
                many = "," in args.models
                png = args.png.with_stem(f"{args.png.stem}-{model}") if many else args.png
                title = f"bench/serve.py {model}: latency against throughput"
                note = f"closed loop at {args.levels} clients, {args.seconds:g} s per server"
                save_chart(Chart(title, curves, "req/s", note=note), png)
                print(f"chart: {png}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
