"""The ASGI app that hosts every interactive workload of a spec.

Workers load in the background after start-up, so liveness answers at once and
readiness (serving/readiness.py) turns true when every session is loaded and warm, or
says which workload failed and why. On shutdown (uvicorn
stops accepting on SIGTERM) each worker finishes what is queued before it exits.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import re
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


def create_app(spec: Spec, settings: Settings) -> Edge:
    """An app serving `spec`'s interactive workloads; loading starts with its lifespan."""
    state = ServingState(spec, settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load(state), name="lanes-load")
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
    # Starlette's own 404 and 405 (no route, wrong method): v2 paths answer in v2's shape.
    not_routed = {404: v2_routes.not_routed, 405: v2_routes.not_routed}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=not_routed)
    app.state.lanes = state
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return Edge(app, state.metrics, api_key=key)


async def _load(state: ServingState) -> None:
    """Load every interactive workload, one after another, into `state.readiness`.

    A workload that fails to load (any exception: a broken model, a user's handler, a
    bug) is logged once with its name and marked failed with the message; the others
    still load, and /readyz answers failed.
    """
    try:
        runtime = Runtime(state.settings)
    except Exception as err:
        for name in state.spec.workloads:
            if name in state.readiness:
                _failed(state, name, err)
        return
    for name, workload in state.spec.workloads.items():
        if name not in state.readiness:
            continue
        try:
            task = await asyncio.to_thread(load_task, name, state.spec, runtime)
            await asyncio.to_thread(task.warm_up)
            if isinstance(task, GenerateTask):
                generate_routes.start_engine(state, task)  # continuous batching
            else:
                worker = BatchWorker(task, state.metrics)
                worker.start()
                state.workers[name] = worker
            freeze_heap()
        except Exception as err:
            _failed(state, name, err)
            continue
        state.readiness.ready(name)
        log.info("workload %s ready (%s, %s)", name, workload.task, workload.model)


def _failed(state: ServingState, name: str, err: Exception) -> None:
    # A LanesError's message is the whole story; anything else is a bug somewhere,
    # and its traceback says where.
    ours = isinstance(err, LanesError)
    message = str(err) if ours else f"{type(err).__name__}: {err}"
    log.error("workload %s failed to load: %s", name, message, exc_info=None if ours else err)
    state.readiness.failed(name, message)


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
    """/readyz and /v2/health/ready: 200 once every workload is loaded and warm, else
    503; the body has each workload's state, and what failed."""
    state: ServingState = request.app.state.lanes
    body = state.readiness.as_json()
    return JSONResponse(body, 200 if body["ready"] else 503)


async def metrics(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    for name, worker in state.workers.items():
        state.metrics.utilization.labels(name).set(worker.utilization.fraction())
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
# Every v2 error, 401 included, is {"error": "..."}: tritonclient reads no other shape.
_V2_UNAUTHORIZED = orjson.dumps(
    {"error": "missing or wrong API key: send Authorization: Bearer <key>"}
)
_MODEL_PATH = re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?")
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


def route_label(path: str) -> str:
    """A bounded label for a path: workload names and versions in /v2 paths are folded away."""
    return _MODEL_PATH.sub(_model_label, path)


def _model_label(found: re.Match[str]) -> str:
    return "/v2/models/{name}/versions/{version}" if found.group(1) else "/v2/models/{name}"


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
            body = _V2_UNAUTHORIZED if path.startswith("/v2") else _UNAUTHORIZED
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
        name, version = found.groups()  # version: None on the unversioned path
        scope["path_params"] = {"name": name, "version": version}
        return v2_routes.infer

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.key)
        return False
