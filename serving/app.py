"""The ASGI app that hosts every interactive workload of a spec.

Workers load in the background after start-up, so liveness answers at once and
readiness turns true when every session is loaded and warm. On shutdown (uvicorn
stops accepting on SIGTERM) each worker finishes what is queued before it exits.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from lanes.errors import LanesError
from lanes.protocols.openai import error_body
from lanes.runtime import Runtime
from lanes.serving import generate_routes, openai_routes, v2_routes
from lanes.serving.http import JSONResponse
from lanes.serving.metrics import Metrics
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.tasks import GenerateTask, load_task

log = logging.getLogger("lanes.serving")

HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"})


def create_app(
    spec: Spec,
    settings: Settings,
    runtime: Runtime | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Edge:
    """An app serving `spec`'s interactive workloads; loading starts with its lifespan.

    Its sessions come from `runtime` (by default one built from `settings`); `clock`
    times every queue, deadline and run.
    """
    state = ServingState(spec, settings, clock=clock)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state, runtime), name="lanes-load")
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await asyncio.gather(*(w.stop() for w in state.workers.values()))
            await asyncio.gather(*(e.stop() for e in state.engines.values()))

    routes = [
        Route("/healthz", live, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/readyz", ready, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *openai_routes.routes,
        *generate_routes.routes,
        *v2_routes.routes,
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.lanes = state
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return Edge(app, state.metrics, api_key=key)


async def _load(state: ServingState, runtime: Runtime | None) -> None:
    runtime = Runtime(state.settings) if runtime is None else runtime
    try:
        for name, workload in state.spec.workloads.items():
            if workload.mode != "interactive":
                continue
            task = await asyncio.to_thread(load_task, name, state.spec, runtime)
            await asyncio.to_thread(task.warm_up)
            if isinstance(task, GenerateTask):
                generate_routes.start_engine(state, task)  # continuous batching
                log.info("workload %s ready (%s, %s)", name, workload.task, workload.model)
                continue
            worker = BatchWorker(task, state.metrics, state.clock)
            worker.start()
            state.workers[name] = worker
            log.info("workload %s ready (%s, %s)", name, workload.task, workload.model)
        freeze_heap()
        state.ready = True
    except LanesError as e:
        state.load_error = str(e)
        log.error("loading failed: %s", e)


def freeze_heap() -> None:
    """Move everything loaded so far out of the garbage collector's sight.

    A full collection walks every tracked object while holding the GIL: with the
    libraries and sessions loaded that was a 30 ms stall of the event loop and the
    engine threads (once every ~10 s under streaming load), the worst
    time-to-first-token of the run. What start-up loaded lives as long as the server.
    """
    gc.collect()
    gc.freeze()


async def live(request: Request) -> Response:
    return JSONResponse({"status": "ok", "live": True})


async def ready(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    if state.ready:
        return JSONResponse({"status": "ready", "ready": True})
    body = {"status": "failed" if state.load_error else "loading", "ready": False}
    if state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, 503)


async def metrics(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    for name, worker in state.workers.items():
        state.metrics.utilization.labels(name).set(worker.busy_fraction())
    for engine in state.engines.values():
        engine.refresh_gauges()  # they decay to 0 while it is idle
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


_UNAUTHORIZED = orjson.dumps(
    error_body(
        "missing or wrong API key: send Authorization: Bearer <key>",
        "authentication_error",
        code="invalid_api_key",
    )
)
_MODEL_PATH = re.compile(r"^/v2/models/[^/]+")
_INFER_PATH = re.compile(r"/v2/models/([^/]+)/infer")


def route_label(path: str) -> str:
    """A bounded label for a path: workload names in /v2 paths are folded away."""
    return _MODEL_PATH.sub("/v2/models/{name}", path)


class Edge:
    """The ASGI app uvicorn runs: bearer-key auth (constant-time), responses counted by
    status code, and a straight path to the two inference routes.

    POST /v1/embeddings and POST /v2/models/{name}/infer carry every inference call,
    so they skip Starlette's middleware, router and endpoint wrappers: a lone minilm
    request was 0.10-0.19 ms faster without them (paired A/B, 2-vCPU VM). They call
    the same endpoints Starlette routes to; any other method or path, and the
    lifespan, go through Starlette.
    """

    def __init__(self, app: Starlette, metrics: Metrics, api_key: str | None) -> None:
        self.app = app
        self.metrics = metrics
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        label = route_label(path)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(label, str(message["status"])).inc()
            await send(message)

        if self.key is not None and path not in HEALTH_PATHS and not self._authorized(scope):
            body = _UNAUTHORIZED
            await counted(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        endpoint = self._inference(scope)
        if endpoint is None:
            await self.app(scope, receive, counted)
            return
        scope["app"] = self.app  # what Starlette sets, for request.app.state
        try:
            response = await endpoint(Request(scope, receive))
        except Exception:
            self.metrics.responses.labels(label, "500").inc()  # uvicorn answers 500
            raise
        await response(scope, receive, send)
        self.metrics.responses.labels(label, str(response.status_code)).inc()

    def _inference(self, scope: Scope) -> Callable[[Request], Awaitable[Response]] | None:
        """The endpoint of an inference call; path parameters go where Starlette puts them."""
        if scope["method"] != "POST":
            return None
        path = scope["path"]
        if path == "/v1/embeddings":
            return openai_routes.embeddings
        found = _INFER_PATH.fullmatch(path)
        if found is None:
            return None
        scope["path_params"] = {"name": found.group(1)}
        return v2_routes.infer

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.key)
        return False
