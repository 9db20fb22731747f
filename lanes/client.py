"""The SDK client: one door for every workload, routed by its label in workloads.yaml.

    with lanes.Client() as client:
        vector = client.call("search-query", "how do I reverse a list")
        for chunk in client.stream("code-complete", "def fib(n):"):
            print(chunk, end="")
        job = client.submit("embed-corpus", [{"id": "a", "text": "hello"}], when="now")
        job.wait(600)

`Client` and `AsyncClient` share one core (`lanes.wire.Core`): request building,
response parsing, typed errors and the retry policy; each holds one pooled httpx client.
Interactive calls speak the server's own protocols (OpenAI for embed and generate,
Open Inference v2 for infer). Failed requests are retried, a bounded number of
times with exponential backoff and full jitter, on connection errors, on 503 and on a
proxy's 429 or 502 (never sooner than its `Retry-After`), never on another 4xx or a
read timeout, never past
a call's `timeout_ms` (a retry sends what is left of it).
`submit` creates a Prefect flow run of the workload's deployment (lanes.jobs;
prefect is imported only then).

Configuration: arguments, else settings (`LANES_ENDPOINT`, `LANES_API_KEY`,
`LANES_SPEC`), and for jobs `prefect_api_url`, else `LANES_PREFECT_API_URL` (the API
the endpoint's Batch API uses), else Prefect's `PREFECT_API_URL`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from lanes.errors import (
    LanesError,
)
from lanes.payloads import Request
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.streamed import Completion, Usage
from lanes.tracing import Tracing
from lanes.wire import Core, Prompt
from lanes.wireerrors import cut_short, json_body

__all__ = ["AsyncClient", "Client", "Completion", "Records", "Usage", "When"]

if TYPE_CHECKING:
    from lanes.jobs import AsyncJob, Job, JobSummary

When = Literal["offpeak", "now"]
# What `submit` takes: records (mappings, staged as JSONL) or an input URI as it is.
Records = Iterable[Mapping[str, Any]] | str | Path
# An endpoint that never answers a connection (a dropped route) fails in seconds, as
# the openai client's does, not in a minute per attempt.
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=5.0)


class Client:
    """The synchronous client. See the module docstring.

    `timeout` bounds each HTTP exchange (seconds, or an httpx.Timeout; by default 60 s,
    and 5 s to connect, so an endpoint that never answers fails fast); a call's
    `timeout_ms` is its deadline on the server (X-Timeout-Ms). `max_retries` bounds
    the retries of one request. `transport` is httpx's (e.g. httpx.MockTransport).
    `tracing` (default: as LANES_TRACING says, off) spans each call and sends its
    W3C traceparent.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        api_key: str | None = None,
        spec: Spec | str | Path | None = None,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        prefect_api_url: str | None = None,
        transport: httpx.BaseTransport | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._core = Core(endpoint, api_key, spec, settings, max_retries, prefect_api_url, tracing)
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
        embed: a float32 vector for a text, [n, dim] for a list (or 1-D numpy array) of texts;
        infer: a dict of output name -> array (a handler's workload: its JSON values), for
        a mapping of input name -> array, or for a model of one input, its value alone;
        generate: a Completion (a str prompt, a list of the model's token ids, or a list
        of chat messages); it travels streamed when the workload says `stream: true`.
        `options` go into the request body (e.g. max_tokens, temperature; logprobs,
        OpenAI's, and the Completion carries them); one the request does not define is
        an InvalidInput naming it, raised before anything is sent."""
        types = self._core.types_request(workload, input, options)
        if types is not None:
            self._core.learn_types(workload, self._json(types))
        request = self._core.call_request(workload, input, timeout_ms, options)
        if request.streamed:
            return self._gather(request)
        return self._core.call_result(workload, input, self._json(request))

    def _json(self, request: Request) -> Any:
        response = self._send(request)
        try:
            return json_body(response, self._core.endpoint)
        finally:
            response.close()

    def stream(
        self, workload: str, prompt: Prompt, *, timeout_ms: float | None = None, **options: Any
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
        from lanes.submit import submit

        core = self._core
        w = core.offline(workload)
        with core.submitting(workload) as trace:
            return submit(
                w, workload, records, when, core.settings, core.base, core.prefect_api_url, trace
            )

    def job(self, id: str) -> Job:
        """A job submitted earlier, or a batch made through the endpoint's /v1/batches
        (its `batch_...` id), from any process that reaches the same Prefect API."""
        from lanes.jobs import Job

        return Job(id, self._core.settings, prefect_api_url=self._core.prefect_api_url)

    def jobs(self, limit: int = 50) -> list[JobSummary]:
        """The newest submitted jobs and the endpoint's Batch API batches (the same kind
        of run: `job(id)` takes either's id), newest first."""
        from lanes.jobs import list_jobs

        return list_jobs(limit, self._core.prefect_api_url)

    def _send(self, request: Request, stream: bool = False) -> httpx.Response:
        """The response of the first attempt that is not retried; raises typed errors."""
        core = self._core
        with core.traced(request):  # a no-op unless tracing is on
            started = time.monotonic()
            for attempt in range(core.max_retries + 1):
                try:
                    response = self._http.send(
                        self._http.build_request(
                            request.method,
                            request.path,
                            content=request.content,
                            headers=core.attempt_headers(request, attempt, started),
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
                    delay = core.retry_delay(error, attempt, request, started)
                    if delay is None:
                        raise core.failure(error, attempt + 1) from None
                    time.sleep(delay)
            raise AssertionError("unreachable: the last attempt is never retried")

    def _gather(self, request: Request) -> Completion:
        gathered = self._core.gathering()
        response = self._send(request, stream=True)
        try:
            for line in response.iter_lines():
                if gathered.feed(line):
                    return gathered.result()
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            response.close()
        raise cut_short(self._core.endpoint)

    def _chunks(self, request: Request) -> Iterator[str]:
        response = self._send(request, stream=True)
        try:
            for line in response.iter_lines():
                text = self._core.line_text(line)
                if text is None:
                    return
                if text:
                    yield text
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            response.close()
        raise cut_short(self._core.endpoint)


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
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
        prefect_api_url: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._core = Core(endpoint, api_key, spec, settings, max_retries, prefect_api_url, tracing)
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
        types = self._core.types_request(workload, input, options)
        if types is not None:
            self._core.learn_types(workload, await self._json(types))
        request = self._core.call_request(workload, input, timeout_ms, options)
        if request.streamed:
            return await self._gather(request)
        return self._core.call_result(workload, input, await self._json(request))

    async def _json(self, request: Request) -> Any:
        response = await self._send(request)
        try:
            return json_body(response, self._core.endpoint)
        finally:
            await response.aclose()

    def stream(
        self, workload: str, prompt: Prompt, *, timeout_ms: float | None = None, **options: Any
    ) -> AsyncIterator[str]:
        """See `Client.stream`: `async for chunk in client.stream(...)`; `aclose()` on
        the iterator (or leaving the loop) closes the connection and frees the slot."""
        return self._chunks(self._core.stream_request(workload, prompt, timeout_ms, options))

    async def submit(self, workload: str, records: Records, *, when: When = "offpeak") -> AsyncJob:
        """See `Client.submit`."""
        from lanes.jobs import AsyncJob
        from lanes.submit import submit

        core = self._core
        w = core.offline(workload)
        with core.submitting(workload) as trace:
            job = await asyncio.to_thread(
                submit,
                w,
                workload,
                records,
                when,
                core.settings,
                core.base,
                core.prefect_api_url,
                trace,
            )
        return AsyncJob(job)

    def job(self, id: str) -> AsyncJob:
        """See `Client.job`."""
        from lanes.jobs import AsyncJob, Job

        core = self._core
        return AsyncJob(Job(id, core.settings, prefect_api_url=core.prefect_api_url))

    async def jobs(self, limit: int = 50) -> list[JobSummary]:
        """See `Client.jobs`."""
        from lanes.jobs import list_jobs

        return await asyncio.to_thread(list_jobs, limit, self._core.prefect_api_url)

    async def _send(self, request: Request, stream: bool = False) -> httpx.Response:
        core = self._core
        with core.traced(request):  # a no-op unless tracing is on
            started = time.monotonic()
            for attempt in range(core.max_retries + 1):
                try:
                    response = await self._http.send(
                        self._http.build_request(
                            request.method,
                            request.path,
                            content=request.content,
                            headers=core.attempt_headers(request, attempt, started),
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
                    delay = core.retry_delay(error, attempt, request, started)
                    if delay is None:
                        raise core.failure(error, attempt + 1) from None
                    await asyncio.sleep(delay)
            raise AssertionError("unreachable: the last attempt is never retried")

    async def _gather(self, request: Request) -> Completion:
        gathered = self._core.gathering()
        response = await self._send(request, stream=True)
        try:
            async for line in response.aiter_lines():
                if gathered.feed(line):
                    return gathered.result()
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            await response.aclose()
        raise cut_short(self._core.endpoint)

    async def _chunks(self, request: Request) -> AsyncIterator[str]:
        response = await self._send(request, stream=True)
        try:
            async for line in response.aiter_lines():
                text = self._core.line_text(line)
                if text is None:
                    return
                if text:
                    yield text
        except httpx.TransportError as error:
            raise self._core.failure(error) from None
        finally:
            await response.aclose()
        raise cut_short(self._core.endpoint)
