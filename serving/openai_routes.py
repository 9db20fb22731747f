"""OpenAI-compatible routes: POST /v1/embeddings, GET /v1/models and /v1/models/{name}."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from lanes.errors import LanesError, UnknownWorkload, shown
from lanes.protocols.openai import (
    EmbeddingsRequest,
    check_dimensions,
    embeddings_response,
    input_count,
    parse,
    prepare_texts,
)
from lanes.serving.access import named, record_of
from lanes.serving.http import (
    JSONResponse,
    decode_json,
    departure,
    openai_error,
    read_body,
    timeout_s,
)
from lanes.serving.state import ServingState
from lanes.spec import Workload
from lanes.tasks.embed import EmbedTask


async def embeddings(request: Request) -> JSONResponse:
    """Admission comes before tokenizing: a request the queue cannot take now, or
    ever, is refused having cost its parsing only. A large body is parsed and
    tokenized off the event loop (serving/offload.py)."""
    state: ServingState = request.app.state.lanes
    settings = state.settings
    try:
        raw = await read_body(request, settings.max_body_bytes, state.offload)
        body = await state.offload.run(len(raw), _decode, raw)
        worker = state.worker(body.model, ("embed",))
        named(request.scope, worker.name)
        if isinstance(worker.task, EmbedTask):
            check_dimensions(body, worker.task.dimensions)
        body.check_limits(settings.max_inputs_per_request)  # as an offline batch line's
        count = input_count(body.input)
        timeout = timeout_s(request)
        worker.admit(count, timeout, "input")
        items = await state.offload.run(len(raw), prepare_texts, body, worker.task.prepare)
        vectors = await worker.submit(items, timeout, record_of(request.scope), departure(request))
    except LanesError as e:
        return openai_error(e)
    tokens = sum(item.n_tokens for item in items)
    return JSONResponse(embeddings_response(body.model, vectors, tokens, body.encoding_format))


def _decode(raw: bytes) -> EmbeddingsRequest:
    return parse(EmbeddingsRequest, decode_json(raw))


def _card(state: ServingState, name: str, workload: Workload) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "lanes",
        "task": workload.task,
        "max_model_len": _context(state, name, workload),
    }


def _context(state: ServingState, name: str, workload: Workload) -> int | None:
    """vLLM's `max_model_len`: the most tokens a prompt (and its answer) may hold. A
    generate workload's is its decoder's context, known once loaded; an embed
    workload's its model's max_length; None where a model reads no tokens, or
    while it loads."""
    engine = state.engines.get(name)
    if engine is not None:
        return engine.decoder.config.max_position
    if workload.task == "embed":
        return state.spec.models[workload.model].max_length
    return None


async def models(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.lanes
    workloads = state.spec.workloads.items()
    data = [_card(state, n, w) for n, w in workloads if w.mode == "interactive"]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request) -> JSONResponse:
    """One interactive workload's card (OpenAI's retrieve model)."""
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    workload = state.spec.workloads.get(name)
    if workload is None or workload.mode != "interactive":
        known = ", ".join(n for n, w in state.spec.workloads.items() if w.mode == "interactive")
        error = UnknownWorkload(
            f"no interactive workload named {shown(name)}; interactive ones: {known or 'none'}",
            param="model",
        )
        return openai_error(error)
    return JSONResponse(_card(state, name, workload))


routes = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name}", model, methods=["GET"]),
]
