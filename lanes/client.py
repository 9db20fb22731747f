"""The SDK client: one door for every workload, routed by its label in workloads.yaml.

    with lanes.Client() as client:
        vector = client.call("search-query", "how do I reverse a list")
        for chunk in client.stream("code-complete", "def fib(n):"):
            print(chunk, end="")
        job = client.submit("embed-corpus", [{"id": "a", "text": "hello"}], when="now")
        job.wait(600)

`Client` and `AsyncClient` share one core (`_Core`): request building, response
parsing, typed errors and the retry policy; each holds one pooled httpx client.
Interactive calls speak the server's own protocols (OpenAI for embed and generate,
Open Inference v2 for infer). Failed requests are retried, a bounded number of
times with exponential backoff and full jitter, on connection errors and on 503
(never sooner than its `Retry-After`), never on a 4xx or a read timeout.
`submit` creates a Prefect flow run of the workload's deployment (lanes.jobs;
prefect is imported only then).

Configuration: arguments, else settings (`LANES_ENDPOINT`, `LANES_API_KEY`,
`LANES_SPEC`), and for jobs `prefect_api_url`, else Prefect's `PREFECT_API_URL`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
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
from lanes.protocols.v2 import DTYPES
from lanes.settings import Settings
from lanes.spec import Spec, Workload
from lanes.specfile import load_spec

if TYPE_CHECKING:
    from lanes.jobs import AsyncJob, Job

When = Literal["offpeak", "now"]
# What `submit` takes: records (mappings, staged as JSONL) or an input URI as it is.
Records = Iterable[Mapping[str, Any]] | str | Path
TIMEOUT_HEADER = "X-Timeout-Ms"
BACKOFF_BASE_S = 0.2
# The longest a client sleeps before a retry; a longer Retry-After is the caller's call.
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
    body: dict[str, Any]
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
        prefect_api_url: str | None,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries: expected 0 or more, found {max_retries}")
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
        self.prefect_api_url = prefect_api_url

    @property
    def spec(self) -> Spec:
        # Loaded on first use: a client that only follows jobs needs no spec at all.
        if not isinstance(self._spec, Spec):
            self._spec = load_spec(self._spec, self.settings, check_files=False)
        return self._spec

    def workload(self, name: str, mode: Literal["interactive", "offline"]) -> Workload:
        """The workload, if it runs in `mode`; else WrongMode naming the method to use."""
        w = self.spec.workload(name)
        if w.mode == mode:
            return w
        if mode == "interactive":
            raise WrongMode(
                f"workload {name!r} is offline: submit its records with "
                f"client.submit({name!r}, records) instead of call or stream"
            )
        raise WrongMode(
            f"workload {name!r} is interactive: use client.call({name!r}, ...) "
            "(or client.stream), not submit"
        )

    # ---- requests -----------------------------------------------------------------

    def call_request(
        self, name: str, input: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.workload(name, "interactive")
        headers = self._headers(timeout_ms)
        if w.task == "embed":
            # base64 float32 is a quarter of the JSON and decodes without parsing floats.
            body = {**options, "model": name, "input": input, "encoding_format": "base64"}
            return Request("POST", "/v1/embeddings", body, headers)
        if w.task == "generate":
            return self._generate_request(name, input, options, headers, stream=False)
        tensors = [_tensor(k, v) for k, v in _mapping(input).items()]
        return Request("POST", f"/v2/models/{name}/infer", {**options, "inputs": tensors}, headers)

    def stream_request(
        self, name: str, prompt: Any, timeout_ms: float | None, options: dict[str, Any]
    ) -> Request:
        w = self.workload(name, "interactive")
        if w.task != "generate":
            raise WrongMode(
                f"workload {name!r} is a {w.task} workload: use client.call, not stream"
            )
        return self._generate_request(name, prompt, options, self._headers(timeout_ms), True)

    def _headers(self, timeout_ms: float | None) -> dict[str, str]:
        if timeout_ms is None:
            return dict(self.headers)
        return {**self.headers, TIMEOUT_HEADER: f"{timeout_ms:g}"}

    @staticmethod
    def _generate_request(
        name: str, prompt: Any, options: dict[str, Any], headers: dict[str, str], stream: bool
    ) -> Request:
        body: dict[str, Any] = {**options, "model": name, "stream": stream}
        if isinstance(prompt, str):
            return Request("POST", "/v1/completions", {**body, "prompt": prompt}, headers)
        # A list of {"role", "content"} messages is a chat.
        return Request("POST", "/v1/chat/completions", {**body, "messages": list(prompt)}, headers)

    # ---- responses ----------------------------------------------------------------

    def call_result(self, name: str, input: Any, body: Any) -> Any:
        task = self.spec.workload(name).task
        try:
            if task == "embed":
                vectors = np.stack([_vector(d["embedding"]) for d in body["data"]])
                return vectors[0] if isinstance(input, str) else vectors
            if task == "generate":
                choice = body["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                usage = Usage(**{k: int(body["usage"][k]) for k in Usage.__dataclass_fields__})
                return Completion(text, choice["finish_reason"], usage)
            return {o["name"]: _array(o) for o in body["outputs"]}
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise LanesError(
                f"{self.endpoint}: the answer for {name!r} is not the {task} shape lanes "
                f"serves ({type(e).__name__}: {e}); is this a lanes endpoint?"
            ) from None

    def chunk_text(self, event: dict[str, Any]) -> str:
        """The text of one SSE event; an error event raises its typed error."""
        error = event.get("error")
        if error is not None:
            code = str(error.get("code")) if isinstance(error, dict) else ""
            status = int(code) if code.isdigit() else 500
            raise self.error(status, json.dumps(event).encode(), {})
        choices = event.get("choices") or []
        if not choices:
            return ""  # a usage chunk
        choice = choices[0]
        if "delta" in choice:
            return str(choice["delta"].get("content") or "")
        return str(choice.get("text") or "")

    def error(self, status: int, body: bytes, headers: Mapping[str, str]) -> LanesError:
        """The typed error for a failed response, with the server's own message."""
        message = _message(body) or f"HTTP {status} from {self.endpoint}"
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
        return LanesError(f"{self.endpoint} failed with HTTP {status}: {message}")

    def failure(self, error: Exception) -> LanesError:
        """What the caller sees once retries are over: always a LanesError."""
        if isinstance(error, LanesError):
            return error
        if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
            return LanesError(
                f"cannot reach the lanes endpoint at {self.endpoint} ({error}); is `lanes serve` "
                "running there? (LANES_ENDPOINT or Client(endpoint=...))"
            )
        if isinstance(error, httpx.TimeoutException):
            return DeadlineExceeded(
                f"no answer from {self.endpoint} within the client's timeout "
                f"({type(error).__name__}); raise Client(timeout=...) or send less"
            )
        return LanesError(f"the connection to {self.endpoint} failed: {error!r}")

    # ---- retries ------------------------------------------------------------------

    def retryable(self, error: Exception, attempt: int) -> bool:
        """Connection errors and 503s, while attempts are left; never a 4xx, never a
        read or write timeout (the server may still be working on the request)."""
        if attempt >= self.max_retries:
            return False
        if isinstance(error, Overloaded):
            return error.retry_after <= MAX_BACKOFF_S
        return isinstance(error, httpx.TransportError) and not isinstance(
            error, httpx.ReadTimeout | httpx.WriteTimeout | httpx.PoolTimeout
        )

    @staticmethod
    def backoff(attempt: int, error: Exception) -> float:
        """Exponential backoff with full jitter; a server's Retry-After is a floor."""
        delay = random.uniform(0, min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2**attempt))
        if isinstance(error, Overloaded):
            delay = max(delay, error.retry_after)
        return delay


class Client:
    """The synchronous client. See the module docstring.

    `timeout` bounds each HTTP exchange (seconds, or an httpx.Timeout); a call's
    `timeout_ms` is its deadline on the server (X-Timeout-Ms). `max_retries` bounds
    the retries of one request. `transport` is httpx's (e.g. httpx.MockTransport).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        api_key: str | None = None,
        spec: Spec | str | Path | None = None,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        prefect_api_url: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._core = _Core(endpoint, api_key, spec, settings, max_retries, prefect_api_url)
        self._http = httpx.Client(
            base_url=self._core.endpoint, timeout=timeout, transport=transport
        )

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def call(
        self, workload: str, input: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Any:
        """Run one interactive request and return its result:
        embed: a float32 vector for a text, [n, dim] for a list of texts;
        infer: a dict of output name -> array (a handler's workload: its JSON values);
        generate: a Completion (a str prompt, or a list of chat messages).
        `options` go into the request body (e.g. max_tokens, temperature)."""
        request = self._core.call_request(workload, input, timeout_ms, options)
        response = self._send(request)
        try:
            body = _json_body(response, self._core.endpoint)
        finally:
            response.close()
        return self._core.call_result(workload, input, body)

    def stream(
        self, workload: str, prompt: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Iterator[str]:
        """The text of a generate workload's answer, chunk by chunk as it is made.
        The request is sent on the first `next()`; closing the iterator early
        (`.close()`, or leaving a `for` loop over it) closes the connection, and the
        server frees the sequence's slot."""
        return self._chunks(self._core.stream_request(workload, prompt, timeout_ms, options))

    def submit(self, workload: str, records: Records, *, when: When = "offpeak") -> Job:
        """Stage `records` beside the workload's input (or take an input URI as it is)
        and create a run of the workload's deployment, at its next off-peak window or
        now. Returns its Job."""
        from lanes.jobs import submit

        core = self._core
        w = core.workload(workload, "offline")
        return submit(w, workload, records, when, core.settings, core.base, core.prefect_api_url)

    def job(self, id: str) -> Job:
        """A job submitted earlier, from any process that reaches the same Prefect API."""
        from lanes.jobs import Job

        return Job(id, self._core.settings, prefect_api_url=self._core.prefect_api_url)

    def _send(self, request: Request, stream: bool = False) -> httpx.Response:
        """The response of the first attempt that is not retried; raises typed errors."""
        core = self._core
        for attempt in range(core.max_retries + 1):
            try:
                response = self._http.send(
                    self._http.build_request(
                        request.method, request.path, json=request.body, headers=request.headers
                    ),
                    stream=stream,
                )
                if response.status_code < 400:
                    return response
                try:
                    response.read()
                finally:
                    response.close()
                raise core.error(response.status_code, response.content, response.headers)
            except (LanesError, httpx.TransportError) as error:
                if not core.retryable(error, attempt):
                    raise core.failure(error) from None
                time.sleep(core.backoff(attempt, error))
        raise AssertionError("unreachable: the last attempt is never retried")

    def _chunks(self, request: Request) -> Iterator[str]:
        response = self._send(request, stream=True)
        try:
            for line in response.iter_lines():
                event = _sse_data(line)
                if event is _DONE:
                    return
                if event is not None:
                    text = self._core.chunk_text(event)
                    if text:
                        yield text
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            response.close()
        raise _cut_short(self._core.endpoint)


class AsyncClient:
    """The asynchronous client: the same methods, awaited; `stream` with `async for`;
    jobs as `AsyncJob`s (lanes.jobs). `transport=httpx.ASGITransport(app)` runs it
    against a serving app in-process."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        api_key: str | None = None,
        spec: Spec | str | Path | None = None,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        prefect_api_url: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = _Core(endpoint, api_key, spec, settings, max_retries, prefect_api_url)
        self._http = httpx.AsyncClient(
            base_url=self._core.endpoint, timeout=timeout, transport=transport
        )

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self, workload: str, input: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> Any:
        """See `Client.call`."""
        request = self._core.call_request(workload, input, timeout_ms, options)
        response = await self._send(request)
        try:
            body = _json_body(response, self._core.endpoint)
        finally:
            await response.aclose()
        return self._core.call_result(workload, input, body)

    def stream(
        self, workload: str, prompt: Any, *, timeout_ms: float | None = None, **options: Any
    ) -> AsyncIterator[str]:
        """See `Client.stream`: `async for chunk in client.stream(...)`; `aclose()` on
        the iterator (or leaving the loop) closes the connection and frees the slot."""
        return self._chunks(self._core.stream_request(workload, prompt, timeout_ms, options))

    async def submit(self, workload: str, records: Records, *, when: When = "offpeak") -> AsyncJob:
        """See `Client.submit`."""
        from lanes.jobs import AsyncJob, submit

        core = self._core
        w = core.workload(workload, "offline")
        job = await asyncio.to_thread(
            submit, w, workload, records, when, core.settings, core.base, core.prefect_api_url
        )
        return AsyncJob(job)

    def job(self, id: str) -> AsyncJob:
        """See `Client.job`."""
        from lanes.jobs import AsyncJob, Job

        core = self._core
        return AsyncJob(Job(id, core.settings, prefect_api_url=core.prefect_api_url))

    async def _send(self, request: Request, stream: bool = False) -> httpx.Response:
        core = self._core
        for attempt in range(core.max_retries + 1):
            try:
                response = await self._http.send(
                    self._http.build_request(
                        request.method, request.path, json=request.body, headers=request.headers
                    ),
                    stream=stream,
                )
                if response.status_code < 400:
                    return response
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise core.error(response.status_code, response.content, response.headers)
            except (LanesError, httpx.TransportError) as error:
                if not core.retryable(error, attempt):
                    raise core.failure(error) from None
                await asyncio.sleep(core.backoff(attempt, error))
        raise AssertionError("unreachable: the last attempt is never retried")

    async def _chunks(self, request: Request) -> AsyncIterator[str]:
        response = await self._send(request, stream=True)
        try:
            async for line in response.aiter_lines():
                event = _sse_data(line)
                if event is _DONE:
                    return
                if event is not None:
                    text = self._core.chunk_text(event)
                    if text:
                        yield text
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            await response.aclose()
        raise _cut_short(self._core.endpoint)


# ---- wire helpers ---------------------------------------------------------------------

_DONE: dict[str, Any] = {}


def _sse_data(line: str) -> dict[str, Any] | None:
    """One SSE line: an event's JSON, _DONE for `data: [DONE]`, None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        event = json.loads(data)
    except ValueError:
        raise LanesError(f"the stream sent an event that is not JSON: {data[:200]!r}") from None
    return event if isinstance(event, dict) else None


def _cut_short(endpoint: str) -> LanesError:
    return LanesError(f"the stream from {endpoint} ended before its [DONE] event; retry it")


def _json_body(response: httpx.Response, endpoint: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise LanesError(
            f"{endpoint} answered HTTP {response.status_code} with a body that is not JSON: "
            f"{response.text[:200]!r}"
        ) from None


def _message(body: bytes) -> str | None:
    """The server's message: OpenAI's {"error": {"message"}} or v2's {"error": "..."}."""
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
        return max(0.0, float(headers.get("retry-after", "1")))
    except ValueError:
        return 1.0  # an HTTP date: lanes never sends one


def _mapping(input: Any) -> Mapping[str, Any]:
    if not isinstance(input, Mapping):
        raise InvalidInput(
            f"input: an infer workload takes a mapping of input name -> array, "
            f"found {type(input).__name__}"
        )
    return input


_V2_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BYTES"}


def _tensor(name: str, value: Any) -> dict[str, Any]:
    """One v2 request tensor. Python floats (float64) go as FP32, the models' type."""
    array = np.asarray(value)
    if array.dtype.kind in "OUS":
        datatype = "BYTES"
    elif array.dtype == np.float64:
        datatype = "FP32"
    else:
        found = _V2_NAMES.get(array.dtype)
        if found is None:
            raise InvalidInput(f"input {name!r}: dtype {array.dtype} has no v2 datatype")
        datatype = found
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
    return np.asarray(output["data"], dtype=DTYPES[output["datatype"]]).reshape(output["shape"])


def _vector(embedding: Any) -> np.ndarray[Any, Any]:
    if isinstance(embedding, str):  # OpenAI's base64: little-endian float32
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").astype(np.float32)
    return np.asarray(embedding, dtype=np.float32)
