"""OpenAI-compatible routes: POST /v1/embeddings and GET /v1/models."""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from lanes.errors import InvalidInput, LanesError
from lanes.protocols.openai import EmbeddingsRequest, embeddings_response, parse
from lanes.serving.http import JSONResponse, openai_error, read_json, timeout_s
from lanes.serving.state import ServingState


async def embeddings(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.lanes
    try:
        body = parse(EmbeddingsRequest, await read_json(request, state.settings.max_body_bytes))
        worker = state.worker(body.model, ("embed",))
        texts = body.texts
        if not texts:
            raise InvalidInput("input: expected at least one text, found an empty list")
        items = []
        for i, text in enumerate(texts):
            try:
                items.append(worker.task.prepare(text))
            except InvalidInput as e:
                where = "input" if isinstance(body.input, str) else f"input[{i}]"
                raise InvalidInput(f"{where}: {str(e).removeprefix('input: ')}") from None
        vectors = await worker.submit(items, timeout_s(request))
    except LanesError as e:
        return openai_error(e)
    tokens = sum(item.n_tokens for item in items)
    return JSONResponse(embeddings_response(body.model, vectors, tokens, body.encoding_format))


async def models(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.lanes
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "lanes", "task": w.task}
        for name, w in state.spec.workloads.items()
        if w.mode == "interactive"
    ]
    return JSONResponse({"object": "list", "data": data})


routes = [
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
]
