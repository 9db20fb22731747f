"""A real uvicorn server on 127.0.0.1 in a thread, for tests that need the network."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from lanes.serving.app import create_app
from lanes.settings import Settings
from lanes.specfile import load_spec
from lanes.tracing import Tracing
from tests.gates import Gate, GatedRuntime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_spec(
    folder: Path, models: Path, workloads: str, more: Mapping[str, Path] | None = None
) -> Path:
    """A workloads.yaml declaring the demo models (and `more`: name -> model path) and
    the given workloads block."""
    declared = "".join(f"  {name}: {{path: {path}}}\n" for name, path in (more or {}).items())
    text = f"""\
version: 1
models:
  minilm: {{path: {models}/minilm/model.onnx, tokenizer: {models}/minilm/tokenizer.json}}
  tinycode: {{path: {models}/tinycode/model.onnx, tokenizer: {models}/tinycode/tokenizer.json}}
  classifier: {{path: {models}/classifier/model.onnx}}
{declared}workloads:
{workloads}"""
    path = folder / "workloads.yaml"
    path.write_text(text)
    return path


class ServerThread:
    """`with ServerThread(spec_path, **settings) as server:` serves until the block ends.

    Every run of a model named in `gates` waits at its gate (tests/gates.py), each of
    its rows costing at least `pad_s`; every load of a model named in `load_gates`
    waits at its own (and `runtime.loads` counts them); `clock` is the server's
    clock; `tracing` its spans' destination; `now` its wall clock (the Batch API's
    batches).
    """

    def __init__(
        self,
        spec_path: Path,
        gates: Mapping[str, Gate] | None = None,
        clock: Callable[[], float] = time.monotonic,
        pad_s: float = 0.0,
        tracing: Tracing | None = None,
        now: Callable[[], float] = time.time,
        load_gates: Mapping[str, Gate] | None = None,
        **settings: Any,
    ) -> None:
        self.settings = Settings(port=free_port(), **settings)
        self.spec = load_spec(spec_path, self.settings)
        self.runtime: GatedRuntime | None = None
        if gates or load_gates:
            paths = {self.spec.models[name].path: gate for name, gate in (gates or {}).items()}
            holds = {self.spec.models[n].path: gate for n, gate in (load_gates or {}).items()}
            self.runtime = GatedRuntime(self.settings, paths, pad_s, holds)
        self.app = create_app(self.spec, self.settings, self.runtime, clock, tracing, now)
        self.url = f"http://127.0.0.1:{self.settings.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.settings.port,
            http=self.settings.http,  # as `lanes serve` picks it
            log_level="warning",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.wait_ready()
        return self

    def __exit__(
        self, *exc: tuple[type[BaseException], BaseException, TracebackType] | None
    ) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server at {self.url} not ready after {timeout} s")

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout=30)
