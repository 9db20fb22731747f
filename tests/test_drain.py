"""`lanes serve` stops as a load balancer needs it to: on SIGTERM readiness drops while
requests are still served (each answer closing its connection), then the listener
closes and work in flight and queued finishes. Real server processes, real signals,
a gated handler instead of timing windows; and a rolling restart of two replicas
behind a real haproxy with closed-loop load and no failed request.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from lanes.serving.server import DrainingServer
from tests.gates import GATE_FILE_ENV, Gate, held_marker
from tests.servers import ServerThread, free_port

ROOT = Path(__file__).resolve().parents[1]
LANES = str(Path(sys.executable).with_name("lanes"))
WAIT_S = 120.0
ROW = {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what} after {timeout} s")


def write_spec(folder: Path, models: Path) -> Path:
    path = folder / "workloads.yaml"
    path.write_text(
        f"""\
version: 1
models:
  classifier: {{path: {models}/classifier/model.onnx}}
workloads:
  fast: {{task: infer, mode: interactive, model: classifier}}
  held:
    task: infer
    mode: interactive
    model: classifier
    handler: tests.gates:held_by_file
    batching: {{max_batch_size: 1}}
"""
    )
    return path


@dataclass
class Replica:
    """One `lanes serve` process on its own port."""

    spec: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.spec.with_name(f"serve-{self.port}.log")

    def start(self) -> Replica:
        self.launch()
        wait_until(self._ready, f"lanes serve on {self.port} ready")
        return self

    def launch(self) -> None:
        """Start it, not waiting for anything."""
        # Its log goes to a file: a pipe nobody reads fills up with access lines and
        # stops the server at its next write.
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                [LANES, "serve", str(self.spec), "--port", str(self.port)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"lanes serve exited: {self.log.read_text()}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def signal(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self) -> str:
        """Its exit, which must be clean; its stderr."""
        assert self.process is not None
        self.process.wait(timeout=WAIT_S)
        stderr = self.log.read_text()
        # uvicorn re-raises the signal it stopped on, as a process killed by it would.
        assert self.process.returncode in (0, -signal.SIGTERM), stderr
        assert "Application shutdown complete" in stderr, stderr
        assert "Traceback" not in stderr, stderr
        return stderr

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=WAIT_S)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANES_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


def queued(url: str, workload: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "lanes_queue_depth":
            for sample in family.samples:
                if sample.labels.get("workload") == workload:
                    return sample.value
    return 0.0


def answered(url: str) -> float:
    """How many inference calls the server at `url` has answered."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "lanes_responses"
        for sample in family.samples
        if sample.name == "lanes_responses_total" and "infer" in sample.labels.get("route", "")
    )


def refused(url: str) -> bool:
    """True once the listener refuses connections."""
    try:
        httpx.get(f"{url}/healthz", timeout=5)
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError):
        pass  # reset unanswered: the listener closed under this connection; ask again
    return False


def infer(client: httpx.Client, workload: str) -> httpx.Response:
    return client.post(f"/v2/models/{workload}/infer", json={"inputs": [ROW]})


@pytest.fixture
def replica(tmp_path: Path, demo_models: Path) -> Iterator[Replica]:
    gate = tmp_path / "gate"
    env = environment(LANES_DRAIN_S="600", **{GATE_FILE_ENV: str(gate)})
    server = Replica(write_spec(tmp_path, demo_models), env)
    try:
        yield server
    finally:
        gate.touch()  # never leave a run waiting
        server.kill()


def test_sigterm_drains_then_finishes_work_in_flight_and_queued(
    replica: Replica, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()  # open while the held workload warms up
    replica.start()
    gate.unlink()
    answers: list[httpx.Response] = []

    def held_call() -> None:
        with httpx.Client(base_url=replica.url, timeout=WAIT_S) as c:
            answers.append(infer(c, "held"))

    # One call runs at the gate, a second waits in the queue behind it.
    callers = [threading.Thread(target=held_call) for _ in range(2)]
    callers[0].start()
    wait_until(held_marker(gate).exists, "the first held call at the gate")
    callers[1].start()
    wait_until(lambda: queued(replica.url, "held") >= 1, "the second held call queued")

    with httpx.Client(base_url=replica.url, timeout=WAIT_S) as kept:
        before = infer(kept, "fast")
        assert before.status_code == 200 and "connection" not in before.headers

        replica.signal()  # the first: drain
        wait_until(
            lambda: httpx.get(f"{replica.url}/readyz", timeout=10).json()["status"] == "draining",
            "/readyz to say draining",
        )
        ready = httpx.get(f"{replica.url}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        # Still served while draining, on the kept connection, which the answer closes.
        during = infer(kept, "fast")
        assert during.status_code == 200, during.text
        assert during.headers["connection"] == "close"

    replica.signal()  # the second: the drain ends, the listener closes
    wait_until(lambda: refused(replica.url), "the listener to close")
    assert replica.process is not None and replica.process.poll() is None
    assert answers == []  # both held calls still in the server

    gate.touch()
    for caller in callers:
        caller.join(timeout=WAIT_S)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert all(a.json()["outputs"][0]["name"] == "logits" for a in answers)
    stderr = replica.wait()
    assert "draining for 600.0 s" in stderr


def test_sigterm_before_ready_stops_at_once_without_draining(
    replica: Replica, tmp_path: Path
) -> None:
    """A load still in progress (held at the gate: the held workload's warm-up runs its
    `post`) was never ready, so no balancer sent anything: no 600 s drain, and the
    load is abandoned, not waited for."""
    replica.launch()
    wait_until(held_marker(tmp_path / "gate").exists, "the held workload's load at the gate")

    def loading() -> bool:
        try:
            answer = httpx.get(f"{replica.url}/readyz", timeout=10)
        except httpx.TransportError:
            return False
        return answer.status_code == 503 and answer.json()["status"] == "loading"

    wait_until(loading, "/readyz to say loading")
    replica.signal()
    stderr = replica.wait()  # within WAIT_S, where a drain would take 600 s
    assert "stopping before every workload was ready: no drain" in stderr
    assert "draining for" not in stderr
    assert not (tmp_path / "gate").exists()  # the load never went on


HAPROXY = shutil.which("haproxy")


def haproxy_config(port: int, replicas: list[Replica], sock: Path) -> str:
    servers = "\n".join(
        f"    server r{i} 127.0.0.1:{r.port} check inter 100ms fall 2 rise 1"
        for i, r in enumerate(replicas)
    )
    # Health checks on /readyz take a draining replica out. No retries (retry-on,
    # redispatch): they would hide a request the server dropped, and a POST is not
    # always safe to send twice.
    return f"""\
global
    maxconn 256
    stats socket {sock} level admin
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout check 30s
frontend lanes
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
{servers}
"""


def haproxy_status(sock: Path, server: str) -> str:
    """What haproxy's stats say of backend server `server` (UP, DOWN, ...)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    header = lines[0].lstrip("# ").split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "replicas" and row.get("svname") == server:
            return row["status"]
    raise AssertionError(f"haproxy has no server {server}: {data.decode()}")


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt install haproxy)")
def test_rolling_restart_behind_haproxy_fails_no_request(tmp_path: Path, demo_models: Path) -> None:
    assert HAPROXY is not None
    spec = write_spec(tmp_path, demo_models)
    (tmp_path / "gate").touch()  # the held workload is not used here
    # Each drain lasts until haproxy has taken its replica out (then a second signal
    # ends it), whatever the time its health checks take on this machine.
    env = environment(LANES_DRAIN_S="600", **{GATE_FILE_ENV: str(tmp_path / "gate")})
    replicas = [Replica(spec, env), Replica(spec, env)]
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    sock = tmp_path / "haproxy.sock"
    config.write_text(haproxy_config(port, replicas, sock))
    balancer: subprocess.Popen[bytes] | None = None
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            for _ in range(100_000):  # bounded; the test stops it long before
                if stop.is_set():
                    return
                try:
                    answer = infer(c, "fast")
                    status = str(answer.status_code)
                    if answer.status_code != 200:
                        failures.append(answer.text[:200])
                except httpx.TransportError as err:
                    status = type(err).__name__
                with lock:
                    outcomes[status] += 1

    def served() -> int:
        with lock:
            return sum(outcomes.values())

    try:
        for r in replicas:
            r.start()
        balancer = subprocess.Popen([HAPROXY, "-f", str(config), "-db"])
        wait_until(lambda: not refused(f"http://127.0.0.1:{port}"), "haproxy listening")
        clients = [threading.Thread(target=client) for _ in range(8)]
        for c in clients:
            c.start()
        for i, r in enumerate(replicas):
            name = f"r{i}"
            mark = served()
            wait_until(lambda m=mark: served() >= m + 200, "load through both replicas")
            r.signal()  # drain
            wait_until(lambda n=name: haproxy_status(sock, n).startswith("DOWN"), "out")
            r.signal()  # the drain ends: the listener closes, work in flight finishes
            r.wait()
            mark = served()
            wait_until(lambda m=mark: served() >= m + 200, "load on the other replica alone")
            r.start()
            wait_until(lambda n=name: haproxy_status(sock, n) == "UP", f"{name} back in")
            wait_until(lambda r=r: answered(r.url) >= 50, "haproxy sending to the new replica")
        mark = served()
        wait_until(lambda m=mark: served() >= m + 200, "load after the restarts")
        stop.set()
        for c in clients:
            c.join(timeout=WAIT_S)
    finally:
        stop.set()
        for r in replicas:
            r.kill()
        if balancer is not None:
            balancer.kill()
            balancer.wait(timeout=WAIT_S)
    print(f"rolling restart carried {dict(outcomes)}")
    assert set(outcomes) == {"200"}, (outcomes, failures[:3])
    assert outcomes["200"] >= 800


# ---- a stream that outlasts the server's grace ends whole -------------------------------

GRACE_S = 8  # the test server's graceful timeout; its streams are ended 3 s before it
STEP_S = 0.05  # every decoder run takes at least this: 500 tokens take 25 s or more


class StoppingServer(ServerThread):
    """A ServerThread run by `lanes serve`'s DrainingServer (no drain), with a graceful
    timeout of `grace_s`."""

    def __init__(self, spec_path: Path, grace_s: int, **kwargs: Any) -> None:
        super().__init__(spec_path, **kwargs)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.settings.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=grace_s,
        )
        app = self.app
        self.server = DrainingServer(config, 0.0, app.drain, app.closed, app.expire, app.ready)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


def test_a_stream_still_running_when_the_grace_runs_out_ends_whole(
    tmp_path: Path, demo_models: Path
) -> None:
    """A stream that would outlast the graceful timeout after SIGTERM (a long answer)
    ends before uvicorn cancels it: the client gets its text so far, finish_reason
    `length` and `[DONE]`, not a connection cut mid-answer (httpx: an incomplete
    chunked read), and the server exits."""
    spec = tmp_path / "workloads.yaml"
    spec.write_text(
        f"""\
version: 1
models:
  tinycode: {{path: {demo_models}/tinycode/model.onnx, tokenizer: {demo_models}/tinycode/tokenizer.json}}
workloads:
  code: {{task: generate, mode: interactive, model: tinycode}}
"""
    )
    body = {"model": "code", "prompt": "def f(x):", "max_tokens": 500, "stream": True}
    body |= {"ignore_eos": True}
    events: list[dict[str, Any]] = []
    with StoppingServer(spec, GRACE_S, gates={"tinycode": Gate()}, pad_s=STEP_S) as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
                    break
            server.server.should_exit = True  # what SIGTERM does once the drain ends
            rest = [line for line in lines if line.startswith("data: ")]
        server.thread.join(timeout=WAIT_S)
        assert not server.thread.is_alive()
    assert rest[-1] == "data: [DONE]"
    events += [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(events) < 500  # ended early, not run to max_tokens


def test_a_batch_waiting_for_company_runs_once_the_listener_closes(
    tmp_path: Path, demo_models: Path
) -> None:
    """A request queued for a batch that waits up to a minute for company
    (`max_wait_ms`) is answered once the server stops listening, since nothing can
    join its batch any more: not held until uvicorn's graceful timeout cancels it
    (a plain-text 500 and a traceback)."""
    spec = tmp_path / "workloads.yaml"
    spec.write_text(
        f"""\
version: 1
models:
  classifier: {{path: {demo_models}/classifier/model.onnx}}
workloads:
  eights:
    task: infer
    mode: interactive
    model: classifier
    batching: {{max_batch_size: 8, max_wait_ms: 60000}}
"""
    )
    answers: list[httpx.Response] = []
    with StoppingServer(spec, GRACE_S) as server:

        def call() -> None:
            with httpx.Client(base_url=server.url, timeout=WAIT_S) as c:
                answers.append(infer(c, "eights"))

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: queued(server.url, "eights") >= 1, "the call queued")
        server.server.should_exit = True  # what SIGTERM does once the drain ends
        caller.join(timeout=WAIT_S)
        server.thread.join(timeout=WAIT_S)
        assert not server.thread.is_alive()
    assert [a.status_code for a in answers] == [200], [a.text for a in answers]
    assert answers[0].json()["outputs"][0]["name"] == "logits"


def test_a_stopped_server_leaves_no_copy_of_an_idle_unload_model(
    tmp_path: Path, demo_models: Path
) -> None:
    """A workload with `idle_unload_s` keeps an optimized copy of its model in a folder
    of the server's own, to load again from; the folder goes when the server stops on
    SIGTERM, though uvicorn then ends the process by the signal, running no exit
    handlers: no restart leaves a model's size behind in the temporary folder."""
    spec = tmp_path / "workloads.yaml"
    spec.write_text(
        f"""\
version: 1
models:
  classifier: {{path: {demo_models}/classifier/model.onnx}}
workloads:
  napping: {{task: infer, mode: interactive, model: classifier, idle_unload_s: 3600}}
"""
    )
    temp = tmp_path / "tmp"
    temp.mkdir()
    server = Replica(spec, environment(LANES_DRAIN_S="0", TMPDIR=str(temp)))
    try:
        server.start()
        assert len(list(temp.glob("lanes-session-*"))) == 1
        server.signal()
        server.wait()
    finally:
        server.kill()
    assert list(temp.glob("lanes-session-*")) == []


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that counts the span exports it is sent."""

    exports: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        Collector.exports.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_stopped_server_exports_its_last_spans(tmp_path: Path, demo_models: Path) -> None:
    """Spans wait in OpenTelemetry's batch processor (here for 10 minutes) until they
    are exported in a batch: the server exports what is pending as it stops, since a
    process that uvicorn ends by the signal it stopped on runs no exit handlers."""
    Collector.exports.clear()
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    env = environment(
        LANES_DRAIN_S="0",
        LANES_TRACING="true",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.server_address[1]}",
        OTEL_BSP_SCHEDULE_DELAY="600000",
    )
    server = Replica(write_spec(tmp_path, demo_models), env)
    try:
        server.start()
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            assert infer(client, "fast").status_code == 200
        assert Collector.exports == []
        server.signal()
        server.wait()
    finally:
        server.kill()
        collector.shutdown()
    assert Collector.exports == ["/v1/traces"]
