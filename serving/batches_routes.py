"""The Batch API's batches: POST/GET /v1/batches, GET /v1/batches/{id}, POST .../cancel.

Each call reads Prefect and the batch store afresh (lanes.batches), in a thread: the
server keeps no batch in memory, and Prefect is imported only when a batch is touched.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lanes.batches import Batches
from lanes.errors import InvalidInput, LanesError, shown
from lanes.serving.http import JSONResponse, openai_error, read_json
from lanes.serving.state import ServingState


def _batches(request: Request) -> Batches:
    batches: Batches = request.app.state.batches
    return batches


async def create(request: Request) -> Response:
    batches = _batches(request)
    try:
        state: ServingState = request.app.state.lanes
        body = await read_json(request, batches.settings.max_body_bytes, state.offload)
        made = await asyncio.to_thread(batches.create, body)
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(made)


async def retrieve(request: Request) -> Response:
    try:
        found = await asyncio.to_thread(_batches(request).retrieve, request.path_params["batch_id"])
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(found)


async def list_batches(request: Request) -> Response:
    query = request.query_params
    try:
        raw = query.get("limit", "20")
        if not raw.isdigit():
            raise InvalidInput.field(
                "limit", f"expected an integer from 1 to 100, found {shown(raw)}"
            )
        page = await asyncio.to_thread(_batches(request).page, query.get("after"), int(raw))
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(page)


async def cancel(request: Request) -> Response:
    try:
        found = await asyncio.to_thread(_batches(request).cancel, request.path_params["batch_id"])
    except LanesError as err:
        return openai_error(err)
    return JSONResponse(found)


routes = [
    Route("/v1/batches", create, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"]),
]
