"""The ASGI app that hosts every interactive workload of a spec.

Workers load in the background after start-up (serving/loading.py), so liveness answers
at once and readiness (serving/readiness.py) turns true when every session is loaded and
warm, or says which workload failed and why. On SIGTERM the server drains (serving/server.py):
readiness turns false and every answer closes its connection, then the listener closes
and each worker finishes what is queued before it exits.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lanes.backfill import INTERNAL_PREFIX
from lanes.batches import Batches
from lanes.errors import AuthError, LanesError, Overloaded
from lanes.protocols import TIMEOUT_HEADER
from lanes.protocols.openai import error_body, error_of
from lanes.runtime import Runtime
from lanes.serving import (
    backfill_routes,
    batches_routes,
    files_routes,
    generate_routes,
    openai_routes,
    triton_routes,
    v2_routes,
)
from lanes.serving.access import RequestIds, named, record_of
from lanes.serving.batch_sweep import swept
from lanes.serving.http import (
    JSONResponse,
    Receipt,
    closes_after,
    discard_unread,
    error_response,
    is_v2,
    v2_body,
)
from lanes.serving.loading import load_workloads
from lanes.serving.metrics import Metrics
from lanes.serving.readiness import LoadState, Readiness
from lanes.serving.state import ServingState
from lanes.serving.tracing import TracedRequests
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tracing import Tracing

log = logging.getLogger("lanes.serving")

HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


def create_app(
    spec: Spec,
    settings: Settings,
    runtime: Runtime | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    now: Callable[[], float] = time.time,
) -> Served:
    """An app serving `spec`'s interactive workloads; loading starts with its lifespan.

    Outermost, `RequestIds` (serving/access.py) gives each request its id and access line.

    Its sessions come from `runtime` (by default one built from `settings`); `clock`
    times every queue, deadline and run. `tracing` (by default as `settings.tracing`
    says: off) traces each request, its queue wait and its batch; `now` (the wall
    clock) times the Batch API's batches and the statistics' last inference.
    """
    tracing = tracing if tracing is not None else Tracing.from_settings(settings)
    state = ServingState(spec, settings, Metrics(now), clock=clock, tracing=tracing)
    state.metrics.price.set(settings.price_per_device_hour)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(load_workloads(state, runtime), name="lanes-load")
        background = [loading, *swept(app.state.batches, settings.batch.sweep_s)]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await asyncio.gather(*(w.stop() for w in state.workers.values()))
            await asyncio.gather(*(e.stop() for e in state.engines.values()))
            state.offload.close()
            if tracing is not None:
                # Now, not at exit: uvicorn ends a process stopped by a signal by raising
                # it again, which runs no exit handler (the batch processor's among them).
                await asyncio.to_thread(tracing.flush)

    handlers = {HTTPException: no_route, Exception: internal_error}
    app = Starlette(routes=_routes(), lifespan=lifespan, exception_handlers=handlers)
    # `Served` serves a path with a trailing slash as without it (`unslashed`); no
    # answer is ever Starlette's empty-bodied 307 to the other spelling.
    app.router.redirect_slashes = False
    app.state.lanes = state
    app.state.batches = Batches(spec, settings, now)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    edge = Edge(
        app,
        state.metrics,
        clock=clock,
        api_key=key,
        readiness=state.readiness,
        discard_limit=settings.discard_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    outer: ASGIApp = edge if tracing is None else TracedRequests(edge, tracing)
    return Served(RequestIds(outer, route_label), state, edge)


class Served:
    """What `create_app` returns: the ASGI app uvicorn runs, the state it serves, and
    the switches `lanes serve` turns on SIGTERM (`drain`), when its listener closes
    (`closed`) and before its grace for the requests in flight runs out (`expire`)."""

    def __init__(self, app: ASGIApp, state: ServingState, edge: Edge) -> None:
        self.app = app
        self.state = state
        self._edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # Before anything reads the path: ids, traces, metrics and routes see one.
            scope = unslashed(scope)
        await self.app(scope, receive, send)

    def drain(self) -> None:
        """Not ready from now on, each answer closing its connection; safe in a signal
        handler."""
        self._edge.drain()

    def closed(self) -> None:
        """The listener closed: nothing can join a batch waiting for company any
        more, so each worker runs what waits now, not at its `max_wait_ms` (which
        could outlast the grace for the requests in flight)."""
        for worker in self.state.workers.values():
            worker.hurry()

    def ready(self) -> bool:
        """Whether /readyz says ready: every workload loaded, and not draining."""
        readiness = self.state.readiness
        return readiness.overall() is LoadState.READY and not readiness.draining

    def expire(self) -> None:
        """The server exits within seconds: every stream still generating ends now,
        whole (serving/engine.py `expire`), before the exit would cut it off."""
        for engine in self.state.engines.values():
            engine.expire()


async def live(request: Request) -> Response:
    return JSONResponse({"status": "ok", "live": True})


async def ready(request: Request) -> Response:
    """/readyz and /v2/health/ready: 200 once every workload is loaded and warm, else
    503; the body has each workload's state, and what failed, for a caller with the
    API key when the server has one. The route is open (probes send no key): anyone
    else reads the status alone, not what the server hosts."""
    state: ServingState = request.app.state.lanes
    body = state.readiness.as_json()
    key = state.settings.api_key
    if key is not None and not holds_key(request.scope, key.get_secret_value().encode()):
        body = {"status": body["status"], "ready": body["ready"]}
    return JSONResponse(body, 200 if body["ready"] else 503)


async def metrics(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    for worker in state.workers.values():
        worker.refresh_gauges()
    for engine in state.engines.values():
        engine.refresh_gauges()  # they decay to 0 while it is idle
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def no_route(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, as JSON in the protocol of the path."""
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    headers = exc.headers if isinstance(exc, HTTPException) else None
    what = "method for URL" if status == 405 else "URL"
    message = f"Invalid {what} ({request.method} {request.url.path})"
    path = request.url.path
    # An /internal/ path passes the Edge without the API key (its routes check their
    # own): its 404 tells no one what the server serves.
    if status == 404 and not path.startswith(INTERNAL_PREFIX):
        message += f"; lanes serves {_SERVED}"
    body = {"error": message} if is_v2(path) else error_body(message, "invalid_request_error")
    return JSONResponse(body, status, headers=headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A failure no route expected (a bug, or a handler's answer that is not JSON): a
    500 in the route's protocol. The Edge logs its traceback once."""
    return _internal(request.url.path, exc)


def _internal(path: str, exc: BaseException) -> JSONResponse:
    error = LanesError(
        f"internal error ({type(exc).__name__}: {exc}); the server's log has the details"
    )
    return error_response(path, error)


_REFUSED = AuthError("missing or wrong API key: send Authorization: Bearer <key>")
_UNAUTHORIZED = orjson.dumps(error_of(_REFUSED))
# Every v2 error, 401 included, is {"error": "..."} with its code beside it, as the
# routes write theirs: tritonclient reads no other shape.
_V2_UNAUTHORIZED = orjson.dumps(v2_body(_REFUSED))
_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
# The inference routes with a fixed path, which Edge serves without Starlette.
_STRAIGHT: dict[str, Callable[[Request], Awaitable[Response]]] = {
    "/v1/embeddings": openai_routes.embeddings,
    "/v1/completions": generate_routes.completions,
    "/v1/chat/completions": generate_routes.chat_completions,
}
OTHER_ROUTE = "other"
_TIMEOUT_HEADER = TIMEOUT_HEADER.lower().encode()


def _routes() -> list[Route]:
    return [
        Route("/healthz", live, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/readyz", ready, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes.routes,
        *generate_routes.routes,
        *triton_routes.routes,
        *v2_routes.routes,  # /v2/models/stats first: "stats" is no workload's name
        *backfill_routes.routes,
        *files_routes.routes,
        *batches_routes.routes,
    ]


# The label of each route the app serves: its template, so that names and versions
# in the path never make a series of their own.
_STATIC = frozenset(r.path for r in _routes() if not r.param_convertors)
# What a 404 lists: every route but the internal one, those that only refuse
# (serving/triton_routes.py) and the versioned twins of /v2/models/{name}/...
_LISTED = [r.path for r in _routes() if r not in triton_routes.routes and "{version}" not in r.path]
_SERVED = ", ".join(p for p in dict.fromkeys(_LISTED) if not p.startswith(INTERNAL_PREFIX))
_SERVED += "; each /v2/models/{name}/... also at /v2/models/{name}/versions/1/..."
_TEMPLATES = tuple((r.path_regex, r.path) for r in _routes() if r.param_convertors)


def _closing(send: Send) -> Send:
    """`send`, with `Connection: close` on the answer."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
        await send(message)

    return closing


_CLOSE = (b"connection", b"close")


def unslashed(scope: Scope) -> Scope:
    """`scope` with its path's trailing slashes dropped (`/v1/models/` is
    `/v1/models`), the root's aside. vLLM's FastAPI redirects such a path (307) to the
    one without; a client that follows the redirect gets that route's answer, which is
    what this serves at once: no empty-bodied 307 for a client that does not follow
    it (httpx's default), no second upload of a POST's body, and no Location built from
    a Host header that a proxy in front may have rewritten."""
    path: str = scope["path"]
    if len(path) < 2 or not path.endswith("/"):
        return scope
    bare = path.rstrip("/") or "/"
    raw: bytes = scope.get("raw_path") or path.encode()
    return {**scope, "path": bare, "raw_path": raw.rstrip(b"/") or b"/"}


def route_label(path: str) -> str:
    """The template of the route `path` belongs to (`/v2/models/{name}/infer`), or
    OTHER_ROUTE for a path no route serves: the label set is fixed by the code,
    whatever paths clients send."""
    if path in _STATIC:
        return path
    for regex, template in _TEMPLATES:
        if regex.match(path):
            return template
    return OTHER_ROUTE


class Edge:
    """The ASGI app uvicorn runs: bearer-key auth (constant-time, the scheme in any
    case), responses counted by status code, every failure answered in the route's
    protocol, and a straight path to the inference routes.

    POST /v1/embeddings, /v2/models/{name}/infer, /v1/completions and
    /v1/chat/completions carry every inference call, so they skip Starlette's
    middleware, router and endpoint wrappers: a lone minilm request was 0.10-0.19 ms
    faster without them (paired A/B, 2-vCPU VM), and a streamed token passes through
    every wrapper of `send`. They call the same endpoints Starlette routes to; any
    other method or path, and the lifespan, go through Starlette.

    An exception no route caught is logged once, with its traceback, and answered
    500 (JSON) when the answer had not started, so the connection stays usable.

    Every answer reaches its client: one sent before the body was read, on a
    connection that closes after it, first reads what is left of the body (up to
    `discard_limit` bytes, see `discard_unread`) so that the close is not a reset.
    """

    def __init__(
        self,
        app: Starlette,
        metrics: Metrics,
        api_key: str | None,
        readiness: Readiness,
        discard_limit: int,
        body_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics
        self.clock = clock  # times each inference call, for its workload's statistics
        self.token = api_key.encode() if api_key else None
        self.discard_limit = discard_limit
        self.readiness = readiness

    def drain(self) -> None:
        """Stop being ready and close each connection after its answer (the server is
        about to stop); safe to call from a signal handler."""
        self.readiness.drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.readiness.draining:
            # A client told to close opens its next connection elsewhere (or here while
            # the listener is open), never reusing one the server is about to close.
            send = _closing(send)
        path: str = scope["path"]
        label = route_label(path)
        receipt = Receipt(receive, self.body_timeout_s)
        # The internal routes check their own key (serving/backfill_routes.py).
        open_path = path in HEALTH_PATHS or path.startswith(INTERNAL_PREFIX)
        if self.token is not None and not open_path and not self._authorized(scope):
            self._counted(scope, label, 401)
            body = _V2_UNAUTHORIZED if is_v2(path) else _UNAUTHORIZED
            refusal = Response(body, 401, _UNAUTHORIZED_HEADERS, "application/json")
            await self._before_answer(scope, receipt, refusal.raw_headers)
            await refusal(scope, receipt, send)
            return
        endpoint = self._inference(scope)
        if endpoint is None:
            await self._routed(scope, receipt, send, label)
            return
        scope["app"] = self.app  # what Starlette sets, for request.app.state
        started = self.clock()
        overloaded = self._shed(scope)
        if overloaded is not None:
            response: Response = error_response(path, overloaded)
        else:
            try:
                response = await endpoint(Request(scope, receipt))
            except Exception as exc:
                log.exception("%s %s failed", scope["method"], path)
                response = _internal(path, exc)
        await self._before_answer(scope, receipt, response.raw_headers)
        await response(scope, receipt, send)
        self._counted(scope, label, response.status_code)
        self._inferred(scope, response.status_code, self.clock() - started)

    def _counted(self, scope: Scope, label: str, status: int) -> None:
        """Count one answer by route, and by workload once the request named it."""
        code = str(status)
        self.metrics.responses.labels(label, code).inc()
        record = record_of(scope)
        if record is not None and record.workload is not None:
            self.metrics.workload_responses.labels(record.workload, code).inc()

    def _inferred(self, scope: Scope, status: int, seconds: float) -> None:
        """An inference call's outcome in its workload's statistics, once the request
        named a workload the server hosts (serving/model_stats.py)."""
        record = record_of(scope)
        if record is None or record.workload is None:
            return
        ok = status < 400 and record.error is None  # a stream's error event sets it
        self.metrics.statistics.of(record.workload).answered(ok, seconds)

    async def _before_answer(
        self, scope: Scope, receipt: Receipt, headers: list[tuple[bytes, bytes]]
    ) -> None:
        # While draining every answer closes its connection (`_closing`).
        closes = self.readiness.draining or closes_after(scope, headers)
        if not receipt.whole and closes:
            await discard_unread(scope, receipt, self.discard_limit)

    async def _routed(self, scope: Scope, receipt: Receipt, send: Send, label: str) -> None:
        started = finished = False

        async def counted(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
                self._counted(scope, label, message["status"])
                await self._before_answer(scope, receipt, message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receipt, counted)
        except Exception as exc:
            if started and not finished:
                raise  # cut short mid-answer: uvicorn logs it and closes the connection
            log.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                await _internal(scope["path"], exc)(scope, receipt, counted)

    def _shed(self, scope: Scope) -> Overloaded | None:
        """Overloaded when every workload an inference call may be for refuses one
        more input now (queue full, or its expected wait past the workload's
        deadline): then the 503 costs no body reading, parsing or tokenizing, which
        under overload is what would otherwise take the model's share of the CPU.

        /v1/embeddings names its workload in the body, so it is shed only while every
        embed workload refuses. A call with a deadline of its own (X-Timeout-Ms) is
        left to its route, which knows it; a v2 `timeout` parameter lies in the body,
        unread here, so the workload's own deadline (`slo.timeout_ms`) decides.
        """
        state: ServingState = self.app.state.lanes
        path = scope["path"]
        if path == "/v1/embeddings":
            workers = [w for w in state.workers.values() if w.task.kind == "embed"]
        elif "path_params" in scope:  # /v2/models/{name}/infer
            worker = state.workers.get(scope["path_params"]["name"])
            workers = [] if worker is None else [worker]
            if worker is not None:  # its 503 counts as the workload's
                named(scope, worker.name)
        else:  # a generate route: its engine admits, once the body names the model
            return None
        if not workers or any(name == _TIMEOUT_HEADER for name, _ in scope["headers"]):
            return None
        refusal = None
        for worker in workers:
            try:
                worker.admit(1)
            except Overloaded as e:
                refusal = e
            else:
                return None
        return refusal

    def _inference(self, scope: Scope) -> Callable[[Request], Awaitable[Response]] | None:
        """The endpoint of an inference call; path parameters go where Starlette puts them."""
        if scope["method"] != "POST":
            return None
        path = scope["path"]
        straight = _STRAIGHT.get(path)
        if straight is not None:
            return straight
        found = _INFER_PATH.fullmatch(path)
        if found is None:
            return None
        name, version = found.groups()  # version: None on the unversioned path
        scope["path_params"] = {"name": name, "version": version}
        return v2_routes.infer

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        return holds_key(scope, self.token)


def holds_key(scope: Scope, key: bytes) -> bool:
    """Whether the request sends `Authorization: Bearer <key>` (compared in constant time)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            # RFC 9110: the scheme is case-insensitive.
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
    return False
