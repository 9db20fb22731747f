"""What an engine in a process of its own would give over HTTP: a measurement before
building one, not a feature.

    python bench/engine_apart.py [--levels 1,16] [--seconds 6] [--repeats 2]

Over HTTP the engine's threads share the server's GIL with its event loop (README,
Streaming and generate). vLLM's V1 runs its engine core in a process of its own,
requests in and outputs out over a socket. This serves tinycode's slot graph twice,
in interleaved slices of bench/generate.py's closed loop:

- `slots`: bench/generate.py's server (the app, its engine on threads of its process);
- `apart`: the same app and routes, whose engine is a stand-in (`Remote`) that sends
  each prepared request over a Unix socket to a second process. There the same
  `Engine` runs, its `_send` wrapped to write each hand-over's events back from the
  engine's own threads (one pickled frame), with no event loop turning; the app's
  process pushes them into the requests' streams.

Printed per level: tokens/s (each engine's own counters), TTFT p50/p99 and ITL p99
of both and apart/slots, then each one's TTFT p99 at the highest level over its p50
at the lowest (the target of bench/generate.py). The stand-in does what a streamed
completion needs (submit, abort, events); an engine apart for real needs the rest
(offline lane, metrics, readiness, a dying engine process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import generate  # noqa: E402
from generate import SLOTS, SPEC, WORKLOAD, Run, closed_loop, serve, start_server  # noqa: E402

from lanes.generation.kvcache import MAX_PADDING  # noqa: E402
from lanes.generation.seq import Event  # noqa: E402
from lanes.spec import as_interactive  # noqa: E402
from lanes.tasks import GenerateTask  # noqa: E402
from lanes.tasks.generate import GenerateRequest  # noqa: E402

if TYPE_CHECKING:
    from lanes.serving.state import ServingState
    from lanes.serving.token_stream import TokenStream

APART = "apart"
HEADER = 4  # bytes of a frame's length


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(HEADER, "little") + data


def engine_main(spec_path: str, socket_path: str, metrics_port: int) -> None:
    """The engine's process: one `Engine`, fed and read over the socket."""
    import prometheus_client

    from lanes.runtime import Runtime
    from lanes.serving.engine import Engine
    from lanes.serving.metrics import Metrics
    from lanes.settings import Settings
    from lanes.specfile import load_spec
    from lanes.tasks import load_task

    settings = Settings()
    task = load_task(WORKLOAD, load_spec(Path(spec_path), settings), Runtime(settings))
    assert isinstance(task, GenerateTask)
    task.warm_up()
    metrics = Metrics()
    prometheus_client.start_http_server(metrics_port, "127.0.0.1", metrics.registry)
    engine = Engine(task, metrics)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(1)
    conn, _ = listener.accept()
    writing = threading.Lock()

    def handed(events: list[Event]) -> None:  # the engine's threads: straight out
        if events:
            data = frame([(e.seq_id, e.tokens, e.text, e.finish, e.first, e.error) for e in events])
            with writing:
                conn.sendall(data)
        for event in events:
            if event.finish is not None:
                engine._streams.pop(event.seq_id, None)

    class Given:
        """Stream ids: the app's own, so events need no mapping."""

        value = 0

        def __next__(self) -> int:
            return self.value

    given = Given()
    engine._send = handed  # type: ignore[method-assign]
    engine._ids = given  # type: ignore[assignment]

    def read() -> None:
        stream = conn.makefile("rb")
        while head := stream.read(HEADER):
            message = pickle.loads(stream.read(int.from_bytes(head, "little")))
            if message[0] == "submit":
                _, given.value, request, timeout_s, ignore_eos = message
                engine.submit(request, timeout_s, ignore_eos=ignore_eos)
            else:
                engine.abort(message[1])

    async def run() -> None:
        engine.start()  # its threads; this loop only waits for the socket to close
        try:
            await asyncio.to_thread(read)
        finally:
            await engine.stop()

    with contextlib.suppress(KeyboardInterrupt):  # the bench's way to stop it
        asyncio.run(run())


class Remote:
    """The app's stand-in for the engine: what the generate routes call."""

    def __init__(self, task: GenerateTask, reader: Any, writer: Any) -> None:
        self.task, self.decoder, self.name = task, task.decoder, task.name
        self.max_queue = as_interactive(task.workload).batching.max_queue
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._streams: dict[int, TokenStream] = {}
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, task: GenerateTask, socket_path: str) -> Remote:
        deadline = time.monotonic() + 120
        while True:  # the engine's process loads the model first
            try:
                reader, writer = await asyncio.open_unix_connection(socket_path)
                return cls(task, reader, writer)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def submit(
        self,
        request: GenerateRequest,
        timeout_s: float | None = None,
        ignore_eos: bool = False,
        trace: object = None,
    ) -> TokenStream:
        from lanes.serving.token_stream import TokenStream

        stream = TokenStream(next(self._ids), len(request.prompt_ids), self)
        self._streams[stream.id] = stream
        self._writer.write(frame(("submit", stream.id, request, timeout_s, ignore_eos)))
        return stream

    def abort(self, seq_id: int) -> None:
        self._writer.write(frame(("abort", seq_id)))

    async def _read(self) -> None:
        while True:
            head = await self._reader.readexactly(HEADER)
            events = pickle.loads(await self._reader.readexactly(int.from_bytes(head, "little")))
            for seq_id, tokens, text, finish, first, error in events:
                stream = self._streams.get(seq_id)
                if stream is not None:
                    stream._push(Event(seq_id, tokens, text, finish, first, error))
                    if finish is not None:
                        del self._streams[seq_id]

    async def stop(self) -> None:
        self._reading.cancel()
        self._writer.close()


def serve_apart(spec_path: str, port: int, socket_path: str) -> None:
    async def remote(state: ServingState, task: GenerateTask) -> Remote:
        engine = await Remote.connect(task, socket_path)
        state.engines[WORKLOAD] = engine  # type: ignore[assignment]
        return engine

    with contextlib.suppress(KeyboardInterrupt):
        serve(spec_path, SLOTS, port, MAX_PADDING, remote)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warm", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--engine", nargs=3, help=argparse.SUPPRESS)  # spec socket port
    parser.add_argument("--front", nargs=3, help=argparse.SUPPRESS)  # spec port socket
    args = parser.parse_args()
    if args.engine:
        engine_main(args.engine[0], args.engine[1], int(args.engine[2]))
        return
    if args.front:
        serve_apart(args.front[0], int(args.front[1]), args.front[2])
        return
    models = Path(os.environ.get("LANES_MODELS_DIR", ROOT / ".lanes" / "models")).resolve()
    folder = Path(tempfile.mkdtemp(prefix="lanes-apart-"))
    spec = folder / "workloads.yaml"
    spec.write_text(
        SPEC.format(m=models / "tinycode", file="model-slots.onnx", batch=64, threads=1, slo="")
    )
    sock, metrics_port = str(folder / "engine.sock"), args.port + 2
    urls = {SLOTS: f"http://127.0.0.1:{args.port}", APART: f"http://127.0.0.1:{args.port + 1}"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    engine = subprocess.Popen(
        [sys.executable, __file__, "--engine", str(spec), sock, str(metrics_port)], env=env
    )
    front = [sys.executable, __file__, "--front", str(spec), str(args.port + 1), sock]
    servers = [
        start_server(spec, SLOTS, args.port, MAX_PADDING),
        start_server(spec, SLOTS, args.port + 1, MAX_PADDING, command=front),
        engine,
    ]
    # The apart engine's counters are in its own process.
    read = generate.server_counters
    engine_url = f"http://127.0.0.1:{metrics_port}"
    generate.server_counters = lambda url: read(engine_url if url == urls[APART] else url)
    levels = [int(x) for x in args.levels.split(",")]
    runs = {(p, c): Run(p, c) for c in levels for p in urls}
    try:
        for clients in levels:
            for rep in range(args.repeats):
                order = [SLOTS, APART] if rep % 2 == 0 else [APART, SLOTS]
                for policy in order:
                    part = asyncio.run(
                        closed_loop(urls[policy], policy, clients, args.seconds, args.warm)
                    )
                    runs[policy, clients].add(part)
    finally:
        for server in servers:
            server.send_signal(signal.SIGINT)
        for server in servers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(30)
    print("policy  clients  tok/s  TTFT p50 ms  TTFT p99 ms  ITL p99 ms")
    for (policy, clients), run in runs.items():
        p50, p99 = np.percentile(run.ttft, [50, 99]) * 1000
        itl = np.percentile(run.itl, 99) * 1000
        print(
            f"{policy:>6}  {clients:>7}  {run.tokens_per_s:5.0f}  {p50:11.2f}  {p99:11.2f}  {itl:10.2f}"
        )
    for clients in levels:
        a, s = runs[APART, clients], runs[SLOTS, clients]
        ttft = [np.percentile(r.ttft, q) for r in (a, s) for q in (50, 99)]
        itl = np.percentile(a.itl, 99) / np.percentile(s.itl, 99)
        print(
            f"apart / slots at {clients} clients: tokens/s {a.tokens_per_s / s.tokens_per_s:.2f}x, "
            f"TTFT p50 {ttft[0] / ttft[2]:.2f}x, p99 {ttft[1] / ttft[3]:.2f}x, ITL p99 {itl:.2f}x"
        )
    low, high = min(levels), max(levels)
    for policy in urls:
        ratio = np.percentile(runs[policy, high].ttft, 99) / np.percentile(
            runs[policy, low].ttft, 50
        )
        print(f"{policy}: TTFT p99 at {high} / TTFT p50 at {low}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
