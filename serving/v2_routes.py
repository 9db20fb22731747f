"""Open Inference Protocol v2 (KServe, Triton) routes, JSON encoding.

infer workloads take their model's named tensors; embed workloads take one BYTES
tensor of texts and answer an FP32 `embedding` tensor [n, dim].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lanes.errors import InvalidInput, LanesError
from lanes.protocols.v2 import DTYPES, InferRequest, output_tensor, to_array
from lanes.serving.http import JSONResponse, read_json, timeout_s, v2_error
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.spec import TaskName
from lanes.tasks.infer import InferTask

TASKS: tuple[TaskName, ...] = ("infer", "embed")


async def infer(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        worker = state.worker(name, TASKS)
        body = InferRequest.parse(await read_json(request, state.settings.max_body_bytes))
        timeout = body.timeout_s() or timeout_s(request)
        if worker.task.kind == "embed":
            outputs = await _embed(worker, body, timeout)
        else:
            outputs = await _infer(worker, body, timeout)
    except LanesError as e:
        return v2_error(e)
    if body.outputs:
        outputs = [o for o in outputs if o["name"] in body.output_names]
    answer: dict[str, Any] = {"model_name": name, "outputs": outputs}
    if body.id is not None:
        answer["id"] = body.id
    return JSONResponse(answer)


async def _infer(
    worker: BatchWorker, body: InferRequest, timeout: float | None
) -> list[dict[str, Any]]:
    tensors = {t.name: to_array(t) for t in body.inputs}
    item = worker.task.prepare(tensors)
    [result] = await worker.submit([item], timeout)
    if isinstance(result, Mapping):
        return [output_tensor(k, np.asarray(v)) for k, v in result.items()]
    # A handler's `post` may return any JSON value: one BYTES element per row.
    rows = result if isinstance(result, list) else [result]
    texts = np.array([orjson.dumps(r).decode() for r in rows], dtype=object)
    return [output_tensor("result", texts)]


async def _embed(
    worker: BatchWorker, body: InferRequest, timeout: float | None
) -> list[dict[str, Any]]:
    if len(body.inputs) != 1 or body.inputs[0].datatype != "BYTES":
        raise InvalidInput("inputs: an embed workload takes one BYTES tensor of texts")
    texts = to_array(body.inputs[0]).reshape(-1)
    if texts.size == 0:
        raise InvalidInput.field("inputs[0]", "expected at least one text, found none")
    items = []
    for i, text in enumerate(texts):
        value = text.decode() if isinstance(text, bytes) else text
        try:
            items.append(worker.task.prepare(value))
        except InvalidInput as e:
            raise e.at(f"inputs[0].data[{i}]") from None
    vectors = await worker.submit(items, timeout)
    return [output_tensor("embedding", np.stack(vectors))]


async def model_metadata(request: Request) -> JSONResponse:
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        worker = state.worker(name, TASKS)
    except LanesError as e:
        return v2_error(e)
    task = worker.task
    if not isinstance(task, InferTask):
        inputs = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        outputs = [{"name": "embedding", "datatype": "FP32", "shape": [-1, -1]}]
    else:
        inputs = [_meta(i) for i in task.inputs.values()]
        outputs = [_meta(o) for o in task.outputs.values()]
    return JSONResponse(
        {
            "name": name,
            "versions": ["1"],
            "platform": "onnxruntime_onnx",
            "inputs": inputs,
            "outputs": outputs,
        }
    )


def _meta(info: Any) -> dict[str, Any]:
    names = {np.dtype(v): k for k, v in DTYPES.items() if k != "BYTES"}
    datatype = names.get(info.dtype, "BYTES") if info.dtype is not None else "BYTES"
    shape = [d if isinstance(d, int) else -1 for d in info.shape]
    return {"name": info.name, "datatype": datatype, "shape": shape}


async def model_ready(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    ready = name in state.workers
    status = 200 if ready else 404 if name not in state.spec.workloads else 503
    return JSONResponse({"name": name, "ready": ready}, status)


async def server_metadata(request: Request) -> JSONResponse:
    return JSONResponse({"name": "lanes", "version": "1", "extensions": []})


routes = [
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/models/{name}", model_metadata, methods=["GET"]),
    Route("/v2/models/{name}/ready", model_ready, methods=["GET"]),
    Route("/v2/models/{name}/infer", infer, methods=["POST"]),
]
