"""Goodput under overload: the endpoint's capacity, then ten times its rate over
thousands of connections, measured in one run.

    python bench/overload.py [--connections 2000] [--overload 10] [--seconds 20]
                             [--capacity-concurrency 64] [--no-pace] [--spec FILE]

Starts `lanes serve` on one embed workload (minilm, the demo's search-query: batches
of up to 32, a 2 s deadline) and drives POST /v1/embeddings with a 32-token text:

1. capacity: a closed loop at `--capacity-concurrency` connections (twice the
   largest batch), every request sent as soon as the last one is answered: the
   answers per second (all 200) are the capacity C.
2. overload: `--connections` connections that together send `--overload` x C
   requests a second (each connection paced to its share; one request in flight per
   connection, so a slow server sees fewer), every one waiting up to 30 s for its
   answer. With `--no-pace`, each connection sends again as soon as it is answered
   (a fast 503 included), the harshest closed loop.

Printed: capacity, the overload's offered rate and its ratio to C, goodput (200s per
second) and goodput / C, every status counted, requests that got no answer within
30 s (or whose connection failed), p50/p99 latency of the 200s, and the worst
round trip of a /healthz probe sent every 100 ms during the overload.

The client is one process of raw asyncio sockets on uvloop, the cheapest here; on a
small machine it competes with the server for the cores, so a figure from one
machine is no figure for another: goodput / capacity, from the same run, is.
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
ANSWER_S = 30.0  # a request unanswered after this long has no answer
PORT = 8433
# 30 one-token words + [CLS] + [SEP] = 32 tokens for minilm.
TEXT = " ".join(["word"] * 30)

SPEC = """\
version: 1
models:
  minilm: {{path: {m}/minilm/model.onnx, tokenizer: {m}/minilm/tokenizer.json}}
workloads:
  search-query:
    mode: interactive
    task: embed
    model: minilm
    batching: {{max_batch_size: 32, max_wait_ms: 0}}
    slo: {{p99_ms: 50, timeout_ms: 2000}}
"""


def http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


EMBED = http_request(
    "POST", "/v1/embeddings", orjson.dumps({"model": "search-query", "input": TEXT})
)
HEALTH = http_request("GET", "/healthz")


class Closed(Exception):
    """The connection ended before the answer did."""


@dataclass
class Tally:
    """What one phase's requests got."""

    statuses: Counter[int] = field(default_factory=Counter)
    unanswered: int = 0  # no answer within ANSWER_S, or the connection failed
    sent: int = 0
    ok_latencies: list[float] = field(default_factory=list)
    ok_in_window: int = 0  # 200s that arrived before the phase ended
    failures: Counter[str] = field(default_factory=Counter)


class Connection:
    """One keep-alive HTTP/1.1 connection; reopened when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, request: bytes) -> int:
        """Send `request`, read its answer: the status. Raises Closed or OSError."""
        if self.reader is not None and self.reader.at_eof():
            self.close()  # the server closed it while it was idle (keep-alive timeout)
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        try:
            self.writer.write(request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if found is None:
                raise Closed(f"an answer without Content-Length: {head[:120]!r}")
            await self.reader.readexactly(int(found.group(1)))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self.close()
            raise Closed(type(e).__name__) from None
        except OSError:
            self.close()
            raise
        if re.search(rb"(?i)\r\nconnection: *close", head):
            self.close()
        return int(head[9:12])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def drive(
    connections: int, seconds: float, rate: float | None, request: bytes = EMBED
) -> tuple[Tally, float]:
    """`connections` connections for `seconds`, each one request in flight, together
    at most `rate` requests a second (None: each sends again once answered).
    Returns the tally and the time the phase took, its answers waited for."""
    tally = Tally()
    start = time.perf_counter()
    until = start + seconds
    interval = connections / rate if rate else 0.0

    async def one(index: int) -> None:
        connection = Connection(PORT)
        next_send = start + (index / rate if rate else 0.0)
        try:
            while True:
                now = time.perf_counter()
                if next_send >= until:
                    return  # its next turn is past the phase: no sleep beyond it
                if next_send > now:
                    await asyncio.sleep(next_send - now)
                sent = time.perf_counter()
                if sent >= until:
                    return
                next_send = max(next_send + interval, sent)
                tally.sent += 1
                try:
                    status = await asyncio.wait_for(connection.exchange(request), ANSWER_S)
                except (TimeoutError, Closed, OSError) as e:
                    tally.unanswered += 1
                    tally.failures[type(e).__name__] += 1
                    connection.close()
                    continue
                answered = time.perf_counter()
                tally.statuses[status] += 1
                if status == 200:
                    tally.ok_latencies.append(answered - sent)
                    if answered <= until:
                        tally.ok_in_window += 1
        finally:
            connection.close()

    await asyncio.gather(*(one(i) for i in range(connections)))
    return tally, time.perf_counter() - start


async def probe_health(stop: asyncio.Event, every_s: float = 0.1) -> list[float]:
    """Round trips of GET /healthz, one every `every_s`, until `stop` (ANSWER_S: none)."""
    connection = Connection(PORT)
    trips = []
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            await asyncio.wait_for(connection.exchange(HEALTH), ANSWER_S)
            trips.append(time.perf_counter() - sent)
        except (TimeoutError, Closed, OSError):
            trips.append(ANSWER_S)
            connection.close()
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - sent)))
    connection.close()
    return trips


def ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return (
        f"{statistics.quantiles(values, n=100)[int(q) - 1] * 1000:.0f}" if len(values) > 1 else "-"
    )


async def run(args: argparse.Namespace) -> None:
    # Warm-up: the first batches of each size, the tokenizer, the allocator.
    await drive(args.capacity_concurrency, 3.0, None)
    capacity_tally, _ = await drive(args.capacity_concurrency, args.seconds, None)
    capacity = capacity_tally.ok_in_window / args.seconds
    refused = sum(n for s, n in capacity_tally.statuses.items() if s != 200)
    print(
        f"capacity: {capacity:.0f} req/s at {args.capacity_concurrency} connections, closed loop "
        f"(p50 {ms(capacity_tally.ok_latencies, 50)} ms, p99 {ms(capacity_tally.ok_latencies, 99)}"
        f" ms; {refused} not 200, {capacity_tally.unanswered} unanswered)"
    )
    rate = None if args.no_pace else args.overload * capacity
    await asyncio.sleep(2.0)  # the server's queue empties, idle connections close
    stop = asyncio.Event()
    probe = asyncio.create_task(probe_health(stop))
    tally, took = await drive(args.connections, args.seconds, rate)
    stop.set()
    trips = await probe
    offered = tally.sent / args.seconds
    goodput = tally.ok_in_window / args.seconds
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
    pacing = "unpaced (each sends again once answered)" if rate is None else "paced"
    print(
        f"overload: {args.connections} connections, {pacing}, {args.seconds:.0f} s: offered "
        f"{offered:.0f} req/s = {offered / capacity:.1f}x capacity"
    )
    print(f"  answers: {statuses}; sent {tally.sent}")
    failures = ", ".join(f"{k}: {n}" for k, n in tally.failures.items()) or "none"
    print(
        f"  unanswered (no answer in {ANSWER_S:.0f} s, or the connection failed): "
        f"{tally.unanswered} ({failures})"
    )
    print(
        f"  200 latency p50 {ms(tally.ok_latencies, 50)} ms, p99 {ms(tally.ok_latencies, 99)} ms;"
        f" /healthz worst {max(trips) * 1000:.0f} ms over {len(trips)} probes; "
        f"all answered {took - args.seconds:.1f} s after the phase"
    )
    print(f"goodput: {goodput:.0f} req/s = {goodput / capacity:.2f} of capacity")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--overload", type=float, default=10.0, help="x capacity, offered")
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--capacity-concurrency", type=int, default=64)
    parser.add_argument("--no-pace", action="store_true")
    parser.add_argument("--spec", type=Path, help="a workloads.yaml with search-query")
    parser.add_argument("--server", help="an endpoint already running (127.0.0.1:PORT)")
    args = parser.parse_args()
    global PORT
    proc = None
    if args.server:
        PORT = int(args.server.rsplit(":", 1)[1])
    else:
        proc = start_server(args.spec)
    try:
        uvloop.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


def start_server(spec: Path | None) -> subprocess.Popen[bytes]:
    if spec is None:
        models = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
        spec = Path(tempfile.mkdtemp(prefix="lanes-overload-")) / "workloads.yaml"
        spec.write_text(SPEC.format(m=models))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "lanes.router.cli", "serve", str(spec), "--port", str(PORT)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become ready")


if __name__ == "__main__":
    main()
