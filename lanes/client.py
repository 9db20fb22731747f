"""The SDK client: one door for every workload, routed by its label in workloads.yaml.

    with lanes.Client() as client:
        vector = client.call("search-query", "how do I reverse a list")
        for chunk in client.stream("code-complete", "def fib(n):"):
            print(chunk, end="")
        job = client.submit("embed-corpus", [{"id": "a", "text": "hello"}], when="now")
        job.wait(600)

`Client` and `AsyncClient` share one core (`_Core`): request building, response
parsing, typed errors and the retry policy. Each holds one pooled httpx client.
Interactive calls speak the server's own protocols (OpenAI for embed and generate,
Open Inference v2 for infer); `submit` creates Prefect flow runs (prefect is
imported only then).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import numpy as np

from lanes.errors import (
    AuthError,
    DeadlineExceeded,
    InvalidInput,
    LanesError,
    Overloaded,
    UnknownWorkload,
    WrongMode,
)
from lanes.settings import Settings
from lanes.spec import Spec, Workload
from lanes.specfile import load_spec

if TYPE_CHECKING:
    from lanes.jobs import Job

When = Literal["offpeak", "now"]
RETRY_STATUSES = frozenset({503})
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Completion:
    """A whole generated text, why it ended ("stop", "length", "content_filter"), usage."""

    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]


class _Core:
    """What both clients share. No I/O here: requests in, results or typed errors out."""

    def __init__(
        self,
        endpoint: str | None,
        api_key: str | None,
        spec: Spec | str | Path | None,
        settings: Settings | None,
        max_retries: int,
    ) -> None:
        self.settings = settings or Settings()
        self.endpoint = (endpoint or self.settings.endpoint).rstrip("/")
        key = api_key or (
            self.settings.api_key.get_secret_value() if self.settings.api_key else None
        )
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._spec = spec
        # Relative input/output paths in the spec are read against its folder.
        where = spec if isinstance(spec, str | Path) else self.settings.spec
        self.base = Path(where).resolve().parent
        self.max_retries = max_retries

    @property
    def spec(self) -> Spec:
        # Loaded on first use: a client that only calls needs no model files.
        if not isinstance(self._spec, Spec):
            self._spec = load_spec(self._spec, self.settings, check_files=False)
        return self._spec

    def workload(self, name: str, mode: Literal["interactive", "offline"]) -> Workload:
        w = self.spec.workload(name)
        if w.mode != mode:
            if mode == "interactive":
                raise WrongMode(
                    f"workload {name!r} is offline: submit its records with "
                    f"client.submit({name!r}, records) instead of call/stream"
                )
            raise WrongMode(
                f"workload {name!r} is interactive: use client.call({name!r}, ...) "
                "or client.stream, not submit"
            )
        return w

    def call_request(
        self, name: str, input: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.workload(name, "interactive")
        headers = dict(self.headers)
        if timeout_ms is not None:
            headers["X-Timeout-Ms"] = str(timeout_ms)
        if w.task == "embed":
            return Request(
                "POST", "/v1/embeddings", {"model": name, "input": input, **options}, headers
            )
        if w.task == "generate":
            return self._generate_request(name, input, options, headers, stream=False)
        tensors = [_tensor(k, v) for k, v in _mapping(input).items()]
        return Request("POST", f"/v2/models/{name}/infer", {"inputs": tensors, **options}, headers)

    def stream_request(
        self, name: str, prompt: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.workload(name, "interactive")
        if w.task != "generate":
            raise WrongMode(f"workload {name!r} is a {w.task} workload: use call, not stream")
        headers = dict(self.headers)
        if timeout_ms is not None:
            headers["X-Timeout-Ms"] = str(timeout_ms)
        return self._generate_request(name, prompt, options, headers, stream=True)

    @staticmethod
    def _generate_request(
        name: str, prompt: Any, options: dict[str, Any], headers: dict[str, str], stream: bool
    ) -> Request:
        body: dict[str, Any] = {"model": name, "stream": stream, **options}
        if isinstance(prompt, str):
            return Request("POST", "/v1/completions", {**body, "prompt": prompt}, headers)
        # A list of {"role", "content"} messages is a chat.
        return Request("POST", "/v1/chat/completions", {**body, "messages": list(prompt)}, headers)

    def call_result(self, name: str, input: Any, body: Any) -> Any:
        task = self.spec.workload(name).task
        if task == "embed":
            vectors = np.asarray([d["embedding"] for d in body["data"]], dtype=np.float32)
            return vectors[0] if isinstance(input, str) else vectors
        if task == "generate":
            choice = body["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            usage = Usage(**{k: body["usage"][k] for k in Usage.__dataclass_fields__})
            return Completion(text, choice["finish_reason"], usage)
        return {o["name"]: _array(o) for o in body["outputs"]}

    @staticmethod
    def chunk_text(event: dict[str, Any]) -> str:
        choices = event.get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if "delta" in choice:
            return str(choice["delta"].get("content") or "")
        return str(choice.get("text") or "")

    @staticmethod
    def error(status: int, body: bytes, headers: Mapping[str, str]) -> LanesError:
        """The typed error for a failed response, with the server's own message."""
        message = _message(body) or f"HTTP {status}"
        if status == 401:
            return AuthError(message)
        if status == 404:
            return UnknownWorkload(message)
        if status == 503:
            return Overloaded(message, _retry_after(headers))
        if status == 504:
            return DeadlineExceeded(message)
        if 400 <= status < 500:
            return InvalidInput(message)
        return LanesError(f"server error {status}: {message}")

    def backoff(self, attempt: int, error: Exception) -> float:
        """Exponential backoff with full jitter; a server's Retry-After is a floor."""
        delay = random.uniform(0, min(MAX_BACKOFF_S, 0.1 * 2**attempt))
        if isinstance(error, Overloaded):
            delay = max(delay, min(error.retry_after, MAX_BACKOFF_S))
        return delay

    def retryable(self, error: Exception, attempt: int) -> bool:
        if attempt >= self.max_retries:
            return False
        return isinstance(error, Overloaded | httpx.TransportError) and not isinstance(
            error, httpx.ReadTimeout | httpx.WriteTimeout
        )


class Client:
    """The synchronous client. See the module docstring."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        api_key: str | None = None,
        spec: Spec | str | Path | None = None,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._core = _Core(endpoint, api_key, spec, settings, max_retries)
        self._http = httpx.Client(
            base_url=self._core.endpoint, timeout=timeout, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def call(
        self, workload: str, input: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Any:
        """Run one interactive request. embed: a vector (or [n, dim] for a list of texts);
        infer: named arrays; generate: a Completion. Options go into the request body."""
        request = self._core.call_request(workload, input, timeout_ms, options)
        return self._core.call_result(workload, input, self._send(request))

    def stream(
        self, workload: str, prompt: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Iterator[str]:
        """Yield text chunks as the server makes them. Closing the iterator early
        closes the connection, and the server frees the sequence's slot."""
        request = self._core.stream_request(workload, prompt, timeout_ms, options)
        with self._open_stream(request) as response:
            for event in _sse_events(response.iter_lines()):
                text = self._core.chunk_text(event)
                if text:
                    yield text

    def submit(
        self, workload: str, records: Sequence[Mapping[str, Any]] | str, *, when: When = "offpeak"
    ) -> Job:
        """Stage `records` (or use the input URI given) and schedule a run of the workload's
        deployment, at the next off-peak window or now. Returns its Job."""
        from lanes.jobs import submit

        core = self._core
        return submit(
            core.workload(workload, "offline"), workload, records, when, core.settings, core.base
        )

    def job(self, id: str) -> Job:
        """A job submitted earlier, from any process."""
        from lanes.jobs import Job

        return Job(id, self._core.settings)

    def _send(self, request: Request) -> Any:
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    request.method, request.path, json=request.body, headers=request.headers
                )
                if response.status_code >= 400:
                    raise self._core.error(response.status_code, response.content, response.headers)
                return response.json()
            except (LanesError, httpx.TransportError) as error:
                if not self._core.retryable(error, attempt):
                    raise _surface(error) from None
                time.sleep(self._core.backoff(attempt, error))
                attempt += 1

    @contextmanager
    def _open_stream(self, request: Request) -> Iterator[httpx.Response]:
        attempt = 0
        while True:
            try:
                stream = self._http.stream(
                    request.method, request.path, json=request.body, headers=request.headers
                )
                response = stream.__enter__()
                if response.status_code >= 400:
                    response.read()
                    stream.__exit__(None, None, None)
                    raise self._core.error(response.status_code, response.content, response.headers)
                break
            except (LanesError, httpx.TransportError) as error:
                if not self._core.retryable(error, attempt):
                    raise _surface(error) from None
                time.sleep(self._core.backoff(attempt, error))
                attempt += 1
        try:
            yield response
        finally:
            stream.__exit__(None, None, None)


class AsyncClient:
    """The asynchronous client: the same methods, awaited (`stream` with `async for`)."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        api_key: str | None = None,
        spec: Spec | str | Path | None = None,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = _Core(endpoint, api_key, spec, settings, max_retries)
        self._http = httpx.AsyncClient(
            base_url=self._core.endpoint, timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self, workload: str, input: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Any:
        request = self._core.call_request(workload, input, timeout_ms, options)
        return self._core.call_result(workload, input, await self._send(request))

    async def stream(
        self, workload: str, prompt: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> AsyncIterator[str]:
        request = self._core.stream_request(workload, prompt, timeout_ms, options)
        async with self._open_stream(request) as response:
            async for event in _async_sse_events(response.aiter_lines()):
                text = self._core.chunk_text(event)
                if text:
                    yield text

    async def submit(
        self, workload: str, records: Sequence[Mapping[str, Any]] | str, *, when: When = "offpeak"
    ) -> Job:
        from lanes.jobs import submit

        core = self._core
        w = core.workload(workload, "offline")
        return await asyncio.to_thread(submit, w, workload, records, when, core.settings, core.base)

    def job(self, id: str) -> Job:
        from lanes.jobs import Job

        return Job(id, self._core.settings)

    async def _send(self, request: Request) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    request.method, request.path, json=request.body, headers=request.headers
                )
                if response.status_code >= 400:
                    raise self._core.error(response.status_code, response.content, response.headers)
                return response.json()
            except (LanesError, httpx.TransportError) as error:
                if not self._core.retryable(error, attempt):
                    raise _surface(error) from None
                await asyncio.sleep(self._core.backoff(attempt, error))
                attempt += 1

    @asynccontextmanager
    async def _open_stream(self, request: Request) -> AsyncIterator[httpx.Response]:
        attempt = 0
        while True:
            try:
                stream = self._http.stream(
                    request.method, request.path, json=request.body, headers=request.headers
                )
                response = await stream.__aenter__()
                if response.status_code >= 400:
                    await response.aread()
                    await stream.__aexit__(None, None, None)
                    raise self._core.error(response.status_code, response.content, response.headers)
                break
            except (LanesError, httpx.TransportError) as error:
                if not self._core.retryable(error, attempt):
                    raise _surface(error) from None
                await asyncio.sleep(self._core.backoff(attempt, error))
                attempt += 1
        try:
            yield response
        finally:
            await stream.__aexit__(None, None, None)


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        event = _sse_data(line)
        if event is _DONE:
            return
        if event is not None:
            yield event


async def _async_sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    async for line in lines:
        event = _sse_data(line)
        if event is _DONE:
            return
        if event is not None:
            yield event


_DONE: dict[str, Any] = {}


def _sse_data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event: dict[str, Any] = json.loads(data)
    if "error" in event:
        raise LanesError(f"the stream failed: {_message(data.encode())}")
    return event


def _message(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500] or None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error) if error is not None else None


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return float(headers.get("retry-after", "1"))
    except ValueError:
        return 1.0


def _surface(error: Exception) -> LanesError:
    if isinstance(error, LanesError):
        return error
    return LanesError(f"cannot reach the lanes endpoint: {error!r}; is `lanes serve` running?")


def _mapping(input: Any) -> Mapping[str, Any]:
    if not isinstance(input, Mapping):
        raise InvalidInput("input: an infer workload takes a mapping of input name -> array")
    return input


_V2_TYPES = {"f": "FP32", "i": "INT64", "u": "UINT64", "b": "BOOL"}


def _tensor(name: str, value: Any) -> dict[str, Any]:
    array = np.asarray(value)
    if array.dtype.kind in "OUS":
        return {
            "name": name,
            "shape": list(array.shape),
            "datatype": "BYTES",
            "data": array.reshape(-1).tolist(),
        }
    datatype = {
        np.dtype(np.float64): "FP32",
        np.dtype(np.float32): "FP32",
        np.dtype(np.float16): "FP16",
    }.get(array.dtype, _V2_TYPES.get(array.dtype.kind, "FP32"))
    return {
        "name": name,
        "shape": list(array.shape),
        "datatype": datatype,
        "data": array.reshape(-1).tolist(),
    }


def _array(output: Mapping[str, Any]) -> Any:
    if output["datatype"] == "BYTES" and output["name"] == "result":
        # A handler's JSON results, one per row.
        return [json.loads(v) for v in output["data"]]
    return np.asarray(output["data"]).reshape(output["shape"])
