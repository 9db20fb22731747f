"""POST /internal/v1/batch/{workload}: offline batches on an interactive workload's sessions.

A flow whose workload declares `runner: {kind: endpoint}` sends its prepared items
here (lanes.batchframe); they wait in the workload's offline lane and run only while
no interactive request waits (serving/worker.py), or, for a generate workload, take
the rows no interactive request needs and give them up when one does
(serving/engine_offline.py). The route takes its own bearer key,
the server's internal key (LANES_INTERNAL_KEY, else LANES_API_KEY): without either
the server refuses every batch, so an open endpoint never opens its model to bulk
work unasked. A batch whose flow goes away (cancelled, killed, its connection lost)
leaves at once: its items leave the queue, its sequences their rows, its run on the
model ends early. Each answer says, in its BUSY_HEADER, the model time its items used:
an endpoint run is priced on that, not on its wall time, which holds every wait for
interactive traffic.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive

from lanes.backfill import (
    BATCH_ROUTE,
    BUSY_HEADER,
    CONTENT_TYPE,
    ENDPOINT_TASKS,
    MODEL_MISMATCH,
    PROVIDER_HEADER,
    WEIGHTS_HEADER,
    weights_digest,
)
from lanes.batchframe import decode_items, encode_outputs
from lanes.digests import Digests
from lanes.errors import AuthError, InvalidInput, LanesError
from lanes.serving.batching import DeviceShare
from lanes.serving.engine import Engine
from lanes.serving.http import openai_error, read_body
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.tasks import EmbedTask, GenerateTask, InferTask, Task

T = TypeVar("T")
log = logging.getLogger("lanes.serving")
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed it first


async def batch(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    try:
        _authorize(request, state.settings.batch_key())
        name = request.path_params["workload"]
        executor: Engine | BatchWorker
        state.hosted(name, ENDPOINT_TASKS)
        await _same_weights(request, state, name)
        if state.spec.workloads[name].task == "generate":
            executor = state.engine(name)
        else:
            executor = state.worker(name, ENDPOINT_TASKS)
        body = await read_body(request, state.settings.max_body_bytes, state.offload)
        items = decode_items(executor.task, body)
        share = DeviceShare()
        outcomes = await _unless_gone(request.receive, executor.submit_offline(items, share))
    except LanesError as e:
        return openai_error(e)
    if outcomes is None:
        log.info(
            "workload %s: an offline batch of %d items dropped: its sender went", name, len(items)
        )
        return Response(status_code=CLIENT_CLOSED)  # read by nobody; the access log's status
    headers = {PROVIDER_HEADER: _provider(executor.task), BUSY_HEADER: repr(share.seconds)}
    return Response(encode_outputs(outcomes), media_type=CONTENT_TYPE, headers=headers)


async def _unless_gone(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result; None, `work` cancelled, if the client disconnects first (nobody
    would read its answer; uvicorn does not cancel a request's task when its client goes)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()  # the executor drops what it queued and runs for this batch
    try:
        return await task  # it may have finished before it saw the cancel
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # this request's own task is cancelled (the server stops)
        return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _same_weights(request: Request, state: ServingState, name: str) -> None:
    """InvalidInput (code model_mismatch) when the flow's model or tokenizer (its
    WEIGHTS_HEADER) is not the one `name` runs here: its token ids would run on other
    weights, or be read by another tokenizer, and be answered wrongly. Read once per workload, off the event loop."""
    theirs = request.headers.get(WEIGHTS_HEADER)
    if theirs is None:
        return  # a flow older than the header
    workload = state.spec.workloads[name]
    model_name = workload.model
    model = state.spec.models[model_name]
    ours = state.weights.get(name)
    if ours is None:
        digests = Digests(state.settings.home)
        ours = await asyncio.to_thread(weights_digest, model, workload.task, digests)
        if ours is None:
            return  # not readable here: the workload's own loading says so
        state.weights[name] = ours
    if ours != theirs:
        raise InvalidInput(
            f"this endpoint serves workload {name!r} with another model than the batch's: "
            f"model {model_name!r} ({model.path}, files digest {ours[:16]}), the batch's "
            f"{theirs[:16]}; run the job on an endpoint serving the same model files",
            param="model",
            code=MODEL_MISMATCH,
        )


def _authorize(request: Request, key: str | None) -> None:
    if key is None:
        raise AuthError(
            "this server takes no offline batches: set LANES_INTERNAL_KEY (or LANES_API_KEY) "
            "on the server and on the flow that sends them"
        )
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # As bytes, as the Edge compares the API key: hmac takes no str that is not ASCII,
    # and Starlette reads a header's bytes as Latin-1.
    sent = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, key.encode()):
        raise AuthError(
            "missing or wrong internal key: send Authorization: Bearer <LANES_INTERNAL_KEY "
            "(else LANES_API_KEY) of the server>"
        )


def _provider(task: Task) -> str:
    if isinstance(task, GenerateTask):
        providers = task.decoder.session.get_providers()
    elif isinstance(task, EmbedTask | InferTask) and task.loaded:  # idle_unload_s may unload it
        providers = task.session.get_providers()
    else:
        return "unknown"
    return str(providers[0]) if providers else "unknown"


routes = [Route(BATCH_ROUTE, batch, methods=["POST"])]
