"""A closed-loop HTTP load generator in a child process, for `lanes calibrate` and `lanes tune`.

    with LoadGenerator(url, requests) as load:
        level = load.run(concurrency=8, seconds=3.0)   # Level(items_per_second, p99_ms, ...)

Each of `concurrency` clients holds one keep-alive HTTP/1.1 connection and sends the
next request as soon as its answer is read (closed loop), cycling through `requests`
from its own offset. A level runs `warm_s` untimed, then a timed window of at least
`seconds` (longer, until it holds two answers per client): its rate counts the
answers that arrive inside the window, over the window's length, and its latencies
are those answers' round trips, so the ramp at the start and requests cut off at the
end bias neither.

The clients run in a process of their own (`python -m lanes.router.loadgen`), so the
endpoint being measured never shares a GIL with them. The parent writes one level per
line on the child's stdin and reads one JSON answer per line.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import orjson

# A request whose answer takes longer than this is counted as an error, so a level
# always ends.
REQUEST_TIMEOUT_S = 120.0
# A level's timed window stays open until it holds this many answers per client.
MIN_ANSWERS_PER_CLIENT = 2


@dataclass(frozen=True)
class HttpRequest:
    """One POST the clients send: a path and its JSON body."""

    path: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Level:
    """What one level of closed-loop load measured."""

    concurrency: int
    seconds: float  # the timed window
    completed: int  # successful answers inside it
    errors: int  # answers other than 200, timeouts and broken connections, anywhere
    first_error: str | None
    items_per_second: float
    p50_ms: float | None
    p99_ms: float | None
    # The round trips of the `completed` answers, for pooling several levels' latencies.
    latencies_ms: list[float] = field(default_factory=list)


class LoadGenerator:
    """The child process, started on entry and stopped on exit. `headers` go with every
    request (an Authorization header for an endpoint that wants a key)."""

    def __init__(
        self,
        url: str,
        requests: list[HttpRequest],
        timeout_s: float = 600,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not requests:
            raise ValueError("requests: expected at least one request to send")
        self.url = url
        self.timeout_s = timeout_s
        # A folder only this user can read: the headers may hold a key.
        self._folder = tempfile.TemporaryDirectory(prefix="lanes-loadgen-")
        self._requests = Path(self._folder.name) / "requests.json"
        listed = {"headers": headers or {}, "requests": [asdict(r) for r in requests]}
        self._requests.write_bytes(orjson.dumps(listed))
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> LoadGenerator:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "lanes.router.loadgen", self.url, str(self._requests)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        process = self._process
        if process is not None:
            if process.stdin is not None:
                process.stdin.close()  # end of levels: the child exits
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._folder.cleanup()

    def run(self, concurrency: int, seconds: float, warm_s: float | None = None) -> Level:
        """One level: `warm_s` (default: a quarter of `seconds`, at most 1 s) untimed,
        then `seconds` timed."""
        process = self._process
        if process is None or process.stdin is None or process.stdout is None:
            raise RuntimeError("use LoadGenerator as a context manager")
        warm = min(seconds / 4, 1.0) if warm_s is None else warm_s
        order = {"concurrency": concurrency, "seconds": seconds, "warm_s": warm}
        process.stdin.write(json.dumps(order) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            code = process.wait(timeout=self.timeout_s)
            raise RuntimeError(f"the load generator exited ({code}) before answering a level")
        return Level(**json.loads(line))


# ---- the child -------------------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    start: float
    end: float
    status: int  # 0: no answer (a timeout or a broken connection)
    error: str | None


class _Connection:
    """One keep-alive connection: the lightest client asyncio allows, so the client's
    own cost per request stays small beside the server's."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def send(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if found is None:
            raise ConnectionError(f"an answer without Content-Length: {head[:120]!r}")
        body = await self.reader.readexactly(int(found.group(1)))
        return int(head[9:12]), body

    def close(self) -> None:
        self.writer.close()


def _encoded(request: HttpRequest, host: str, headers: dict[str, str]) -> bytes:
    body = orjson.dumps(request.body)
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head = (
        f"POST {request.path} HTTP/1.1\r\nHost: {host}\r\n{extra}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _level(
    host: str, port: int, requests: list[bytes], concurrency: int, seconds: float, warm_s: float
) -> Level:
    answers: list[_Answer] = []
    began = time.perf_counter()
    opens = began + warm_s
    window = _Window(opens, minimum=MIN_ANSWERS_PER_CLIENT * concurrency)

    async def client(offset: int) -> None:
        connection: _Connection | None = None
        i = offset
        try:
            # A failed answer fails the level: no client sends more (against a server
            # that is down or refuses, each would fail at once, thousands a second).
            while window.closes is None and not window.failed:
                start = time.perf_counter()
                try:
                    if connection is None:
                        connection = await _Connection.open(host, port)
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        status, body = await connection.send(requests[i % len(requests)])
                    error = None if status == 200 else f"HTTP {status}: {body[:200]!r}"
                except (OSError, TimeoutError, asyncio.IncompleteReadError) as err:
                    status, error = 0, f"{type(err).__name__}: {err}"
                    if connection is not None:
                        connection.close()
                    connection = None
                answer = _Answer(start, time.perf_counter(), status, error)
                answers.append(answer)
                window.count(answer)
                i += 1
        finally:
            if connection is not None:
                connection.close()

    clients = [asyncio.ensure_future(client(k * 7919)) for k in range(concurrency)]
    await window.close_after(seconds, limit_s=seconds * 10 + 30)
    await asyncio.gather(*clients)
    closes = window.closes
    assert closes is not None
    timed = [a for a in answers if opens <= a.end <= closes and a.status == 200]
    failed = [a for a in answers if a.status != 200]
    latencies = np.array([a.end - a.start for a in timed]) * 1000
    return Level(
        concurrency=concurrency,
        seconds=closes - opens,
        completed=len(timed),
        errors=len(failed),
        first_error=failed[0].error if failed else None,
        items_per_second=len(timed) / (closes - opens) if closes > opens else 0.0,
        p50_ms=float(np.percentile(latencies, 50)) if len(timed) else None,
        p99_ms=float(np.percentile(latencies, 99)) if len(timed) else None,
        latencies_ms=latencies.tolist(),
    )


class _Window:
    """The timed window of a level: it opens at `opens` and closes once `seconds` have
    passed and it holds `minimum` good answers (answers slower than the window would
    otherwise leave it empty), at once if any answer failed (the level has failed),
    and at `limit_s` regardless."""

    def __init__(self, opens: float, minimum: int) -> None:
        self.opens, self.minimum = opens, minimum
        self.closes: float | None = None
        self.good = 0
        self.failed = False

    def count(self, answer: _Answer) -> None:
        if answer.status != 200:
            self.failed = True
        elif answer.end >= self.opens and self.closes is None:
            self.good += 1

    async def close_after(self, seconds: float, limit_s: float) -> None:
        ends, limit = self.opens + seconds, self.opens + limit_s
        # Checks every 10 ms: at most limit_s / 0.01 checks.
        while not self.failed and time.perf_counter() < limit:
            if time.perf_counter() >= ends and self.good >= self.minimum:
                break
            await asyncio.sleep(0.01)
        self.closes = max(time.perf_counter(), self.opens)  # failed in its warm-up: empty


async def _serve_levels(url: str, requests_file: Path) -> None:
    found = re.fullmatch(r"http://([^:/]+):(\d+)/?", url)
    if found is None:
        raise SystemExit(f"url: expected http://HOST:PORT, found {url!r}")
    host, port = found.group(1), int(found.group(2))
    listed = orjson.loads(requests_file.read_bytes())
    headers = listed["headers"]
    requests = [
        _encoded(HttpRequest(r["path"], r["body"]), host, headers) for r in listed["requests"]
    ]
    loop = asyncio.get_running_loop()
    while order := await loop.run_in_executor(None, sys.stdin.readline):
        level = json.loads(order)
        result = await _level(
            host, port, requests, level["concurrency"], level["seconds"], level["warm_s"]
        )
        sys.stdout.write(json.dumps(asdict(result)) + "\n")
        sys.stdout.flush()


def main() -> None:
    url, requests_file = sys.argv[1], Path(sys.argv[2])
    try:
        import uvloop
    except ImportError:  # the client's own cost is a little higher without it
        asyncio.run(_serve_levels(url, requests_file))
    else:
        uvloop.run(_serve_levels(url, requests_file))


if __name__ == "__main__":
    main()
