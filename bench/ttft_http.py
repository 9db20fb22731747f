"""Where a streamed request's time to first token goes over HTTP.

    python bench/ttft_http.py [--model model-slots.onnx] [--levels 1,16] [--seconds 10]

bench/ttft_parts.py splits the TTFT inside the engine, with no HTTP; this one serves
tinycode as bench/generate.py does (the app's own routes, Edge and engine, in a
process of its own; one server per level) to that script's closed-loop streaming
clients, and splits each request's time in the server by when it passed:

- prepare: from the app being called (uvicorn has parsed the request) until
  `Engine.submit` (the body read and parsed, the prompt tokenized);
- engine: until the engine hands its first token to the event loop (`Engine._send`,
  on the engine's threads);
- hand-over: until the event loop pushes it into the request's stream;
- write: until the send of the first chunk returns (it is in the socket).

Both processes read the same monotonic clock, so only requests the server took in the
measured time count. Printed per level: p50, p90 and p99 of each part, of the server's
whole (app called to chunk written), and of the client's TTFT, whose excess over the
server's whole is outside the app: uvicorn before it calls the app, the kernel, and
the clients' process, all on the same cores; and the mean of each part over the
server's slowest 5%, the requests its tail is made of. Then TTFT p99 at the highest level over
TTFT p50 at the lowest, the ratio bench/generate.py's target judges. The hooks wrap
the app's and the engine's own methods; nothing is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import SPEC, closed_loop, serve, start_server  # noqa: E402

from lanes.generation.kvcache import MAX_PADDING  # noqa: E402

PARTS = (
    ("prepare", "in", "submit"),
    ("engine", "submit", "made"),
    ("hand-over", "made", "pushed"),
    ("write", "pushed", "written"),
)
POINTS = ("in", "submit", "made", "pushed", "written")


def hooked_serve(spec: str, port: int, out: Path) -> None:
    """`serve` with each request's points recorded, written to `out` as it stops."""
    from lanes.serving.access import RequestIds
    from lanes.serving.engine import Engine
    from lanes.serving.token_stream import TokenStream

    marks: dict[int, dict[str, float]] = {}  # stream id -> point -> when
    current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
        "ttft_marks", default=None
    )
    called, submit, send, push = RequestIds.__call__, Engine.submit, Engine._send, TokenStream._push

    async def call(self: RequestIds, scope: Any, receive: Any, send_: Any) -> None:
        at: dict[str, float] = {"in": time.perf_counter()}
        current.set(at)

        async def sent(message: Any) -> None:
            await send_(message)
            if message["type"] == "http.response.body":
                at.setdefault("written", time.perf_counter())

        await called(self, scope, receive, sent)

    def submitted(self: Engine, *args: Any, **kwargs: Any) -> TokenStream:
        now = time.perf_counter()
        stream = submit(self, *args, **kwargs)
        at = current.get()
        if at is not None:
            at["submit"] = now
            marks[stream.id] = at
        return stream

    def handed(self: Engine, events: list[Any]) -> None:  # the engine's threads
        now = time.perf_counter()
        for event in events:
            at = marks.get(event.seq_id)
            if at is not None:
                at.setdefault("made", now)
        send(self, events)

    def pushed(self: TokenStream, event: Any) -> None:
        at = marks.get(self.id)
        if at is not None:
            at.setdefault("pushed", time.perf_counter())
        push(self, event)

    RequestIds.__call__ = call  # type: ignore[method-assign,assignment]
    Engine.submit = submitted  # type: ignore[method-assign]
    Engine._send = handed  # type: ignore[method-assign]
    TokenStream._push = pushed  # type: ignore[method-assign]
    try:
        with contextlib.suppress(KeyboardInterrupt):
            serve(spec, "slots", port, MAX_PADDING)
    finally:
        whole = [at for at in marks.values() if all(p in at for p in POINTS)]
        out.write_bytes(orjson.dumps(whole))


def percentiles(values: list[float]) -> str:
    ms = np.asarray(values) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"p50 {p50:6.2f} ms  p90 {p90:6.2f} ms  p99 {p99:6.2f} ms"


def level(spec: Path, clients: int, port: int, warm: float, seconds: float) -> list[float]:
    """One server, `clients` closed-loop clients: prints the parts; the client's TTFTs."""
    out = spec.parent / f"marks-{clients}.json"
    env = {**os.environ, "TTFT_HTTP_MARKS": str(out)}
    cmd = [sys.executable, __file__, "--serve", str(spec), "--port", str(port)]
    server = start_server(spec, "slots", port, MAX_PADDING, command=cmd, env=env)
    try:
        start = time.perf_counter() + warm
        run = asyncio.run(closed_loop(f"http://127.0.0.1:{port}", "slots", clients, seconds, warm))
    finally:
        # SIGINT: uvicorn raises it again once stopped, and KeyboardInterrupt lets the
        # marks be written (its SIGTERM would end the process there).
        server.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
    measured = [at for at in orjson.loads(out.read_bytes()) if start <= at["in"]]
    print(f"{clients} client(s): {len(run.ttft)} requests, {len(measured)} seen by the server")
    for name, a, b in PARTS:
        print(f"  {name:<10} {percentiles([at[b] - at[a] for at in measured])}")
    whole = np.asarray([at["written"] - at["in"] for at in measured])
    print(f"  {'server':<10} {percentiles(list(whole))}")
    print(f"  {'client':<10} {percentiles(run.ttft)}")
    slowest = [at for at, w in zip(measured, whole, strict=True) if w >= np.percentile(whole, 95)]
    means = ", ".join(
        f"{name} {np.mean([at[b] - at[a] for at in slowest]) * 1000:.2f}" for name, a, b in PARTS
    )
    print(f"  the server's slowest 5% ({len(slowest)}), mean ms: {means}")
    return run.ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="model-slots.onnx", help="tinycode's graph")
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--warm", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8461)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        hooked_serve(args.serve, args.port, Path(os.environ["TTFT_HTTP_MARKS"]))
        return
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    spec = Path(tempfile.mkdtemp(prefix="lanes-ttft-")) / "workloads.yaml"
    spec.write_text(
        SPEC.format(m=models / "tinycode", file=args.model, batch=64, threads=1, slo="")
    )
    levels = [int(x) for x in args.levels.split(",")]
    ttft = {c: level(spec, c, args.port, args.warm, args.seconds) for c in levels}
    low, high = min(levels), max(levels)
    ratio = np.percentile(ttft[high], 99) / np.percentile(ttft[low], 50)
    print(f"TTFT p99 at {high} / TTFT p50 at {low}, over HTTP: {ratio:.2f}x")


if __name__ == "__main__":
    main()
