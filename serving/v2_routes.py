"""Open Inference Protocol v2 (KServe, Triton) routes: JSON and binary tensor data.

infer workloads take their model's named tensors; embed workloads take one BYTES
tensor of texts and answer an FP32 `embedding` tensor [n, dim]. Each workload is
served as version "1", also at `/v2/models/{name}/versions/1/...`; any other
version is a 404.

Metadata describes what infer answers: the model's inputs, and its outputs, or with a
handler's `post` what post returned at warm-up (names, datatypes, ranks; every dim
-1), none when post failed there. Without a `pre`, each input's datatype must be
the model's; with one, `pre` takes the inputs as they come.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lanes.errors import InvalidInput, LanesError, ModelError, Overloaded, UnknownWorkload, shown
from lanes.protocols.openai import check_inputs
from lanes.protocols.v2 import (
    HEADER_LENGTH,
    MODEL_VERSION,
    Array,
    InferCall,
    InferRequest,
    datatype_of,
)
from lanes.protocols.v2inputs import parse_infer
from lanes.protocols.v2outputs import encode_response, output_metadata, result_arrays
from lanes.runtime import TensorInfo
from lanes.serving.access import RequestRecord, named, record_of
from lanes.serving.http import (
    JSONResponse,
    departure,
    read_body,
    timeout_s,
    v2_error,
)
from lanes.serving.readiness import LoadState
from lanes.serving.state import ServingState
from lanes.serving.worker import BatchWorker
from lanes.spec import TaskName, as_interactive
from lanes.tasks import Task
from lanes.tasks.embed import EmbedTask
from lanes.tasks.infer import InferTask

log = logging.getLogger("lanes.serving")

TASKS: tuple[TaskName, ...] = ("infer", "embed")
EMBED_INPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


async def infer(request: Request) -> Response:
    """As /v1/embeddings: admission before preparing, large bodies off the loop."""
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        worker = _served(state, request)
    except LanesError as e:  # a failed load was logged once, when it failed
        return v2_error(e)
    named(request.scope, worker.name)
    try:
        raw = await read_body(request, state.settings.max_body_bytes, state.offload)
        header_length = request.headers.get(HEADER_LENGTH)
        call = await state.offload.run(len(raw), parse_infer, raw, header_length)
        header = timeout_s(request)  # checked whether or not parameters.timeout is given
        timeout = call.request.timeout_s() or header
        record = record_of(request.scope)
        gone = departure(request)
        if worker.task.kind == "embed":
            outputs = await _embed(state, worker, call, timeout, len(raw), record, gone)
        else:
            outputs = await _infer(state, worker, call, timeout, len(raw), record, gone)
        answer = encode_response(call.request, name, outputs)
    except ModelError as e:  # the model or the handler's answer, not the request's fault
        log.exception("workload %s: v2 infer failed", name)
        return v2_error(e)
    except LanesError as e:
        return v2_error(e)
    except Exception as e:  # a handler's own bug: still an answer in v2's shape
        log.exception("workload %s: v2 infer failed", name)
        return v2_error(LanesError(f"workload {name!r} failed: {type(e).__name__}: {e}"))
    if answer.header_length is None:
        return Response(answer.body, media_type="application/json")
    headers = {HEADER_LENGTH: str(answer.header_length)}
    return Response(answer.body, media_type="application/octet-stream", headers=headers)


async def _infer(
    state: ServingState,
    worker: BatchWorker,
    call: InferCall,
    timeout: float | None,
    size: int,
    record: RequestRecord | None,
    gone: Callable[[], Awaitable[None]],
) -> dict[str, Array]:
    task = worker.task
    assert isinstance(task, InferTask)
    body = call.request
    if body.outputs:
        declared = _outputs(task)
        if declared is not None:  # else only the answer tells
            body.check_outputs([o["name"] for o in declared], task.name)
    if task.handler.pre is None:
        _check_datatypes(task, body)
    worker.admit(1, timeout)
    try:
        item = await state.offload.run(size, task.prepare, call.inputs)
    except InvalidInput as err:
        raise _about_input(err) from None
    [result] = await worker.submit([item], timeout, record, gone)
    outputs = result_arrays(result)
    body.check_outputs(outputs, task.name)
    return outputs


def _check_datatypes(task: InferTask, body: InferRequest) -> None:
    for tensor in body.inputs:
        info = task.inputs.get(tensor.name)
        if info is None:
            continue  # prepare names every unknown and missing input
        expected = _datatype(info)
        if tensor.datatype != expected:
            raise InvalidInput.field(
                f"inputs.{tensor.name}.datatype",
                f"the model takes {expected}, found {tensor.datatype}",
            )


def _about_input(error: InvalidInput) -> InvalidInput:
    """The task's error about one input (its `param`: the input's name) named as every
    v2 error names an input, `inputs.<name>`; its message stays the task's."""
    if error.param is None or error.param == "inputs" or error.param.startswith("inputs."):
        return error
    return InvalidInput(str(error), param=f"inputs.{error.param}", code=error.code)


async def _embed(
    state: ServingState,
    worker: BatchWorker,
    call: InferCall,
    timeout: float | None,
    size: int,
    record: RequestRecord | None,
    gone: Callable[[], Awaitable[None]],
) -> dict[str, Array]:
    body = call.request
    body.check_outputs(["embedding"], worker.name)
    (text,) = EMBED_INPUTS
    if len(body.inputs) != 1 or body.inputs[0].datatype != "BYTES":
        raise InvalidInput.field(
            "inputs", f"an embed workload takes one BYTES tensor of texts, {text['name']!r}"
        )
    where = f"inputs.{body.inputs[0].name}"
    if body.inputs[0].name != text["name"]:
        # As Triton: the name its metadata gives, so a client sending another tensor
        # by mistake hears so instead of having it embedded.
        raise InvalidInput.field(
            f"{where}.name",
            f"expected {text['name']!r} (the model's metadata), found {shown(body.inputs[0].name)}",
        )
    texts = call.inputs[body.inputs[0].name].reshape(-1)
    if texts.size == 0:
        raise InvalidInput.field(where, "expected at least one text, found none")
    count = int(texts.size)
    check_inputs(count, state.settings.max_inputs_per_request, where)
    worker.admit(count, timeout, where)
    items = await state.offload.run(size, _prepare_texts, worker.task, texts, where)
    vectors = await worker.submit(items, timeout, record, gone)
    try:
        return {"embedding": np.stack(vectors)}
    except (ValueError, TypeError) as e:
        raise ModelError(f"workload {worker.name!r}: the outputs are not vectors ({e})") from None


def _prepare_texts(task: Task, texts: Array, tensor: str) -> list[Any]:
    items = []
    for i, text in enumerate(texts):
        where = f"{tensor}.data[{i}]"
        try:
            value = text.decode() if isinstance(text, bytes) else text
            items.append(task.prepare(value))
        except UnicodeDecodeError:
            raise InvalidInput.field(where, "expected UTF-8 text") from None
        except InvalidInput as e:
            raise e.at(where) from None
    return items


async def model_metadata(request: Request) -> Response:
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        _, inputs, outputs = _described(state, request)
    except LanesError as e:
        return v2_error(e)
    return JSONResponse(
        {
            "name": name,
            "versions": [MODEL_VERSION],
            "platform": "onnxruntime_onnx",
            "inputs": inputs,
            "outputs": outputs,
        }
    )


async def model_config(request: Request) -> Response:
    """Triton's model configuration (`get_model_config`), from what metadata says.

    Where every input and output has rows first and another dim after them (the
    rows of requests are stacked into one run), and for embed, whose texts are rows,
    `max_batch_size` is the workload's `batching.max_batch_size` and `dims` leave the
    rows out, as Triton writes it (rows alone, embed's texts: dims [1] reshaped to
    []); lanes counts requests in a batch, not rows, and caps no request's rows. Else
    `max_batch_size` is 0 and `dims` are the whole shapes.
    """
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        task, inputs, outputs = _described(state, request)
    except LanesError as e:
        return v2_error(e)
    tensors = [*inputs, *outputs]
    rows = not isinstance(task, InferTask) or (
        task.stacks_rows and all(len(t["shape"]) >= 2 for t in tensors)
    )
    batching = as_interactive(task.workload).batching
    config: dict[str, Any] = {
        "name": name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": batching.max_batch_size if rows else 0,
        "input": [_config_tensor(t, rows) for t in inputs],
        "output": [_config_tensor(t, rows) for t in outputs],
    }
    if rows:
        delay_us = round(batching.max_wait_ms * 1000)
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
    return JSONResponse(config)


def _config_tensor(meta: dict[str, Any], rows: bool) -> dict[str, Any]:
    """A metadata tensor as Triton's config writes it: TYPE_FP32, BYTES as TYPE_STRING."""
    datatype = meta["datatype"]
    dims = meta["shape"][1:] if rows else meta["shape"]
    tensor: dict[str, Any] = {
        "name": meta["name"],
        "data_type": "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}",
        "dims": dims,
    }
    if rows and not dims:  # rows alone: Triton writes them as [1] reshaped to []
        tensor.update(dims=[1], reshape={"shape": []})
    return tensor


def _inputs(task: Task) -> list[dict[str, Any]]:
    return [_meta(i) for i in task.inputs.values()] if isinstance(task, InferTask) else EMBED_INPUTS


def _outputs(task: Task) -> list[dict[str, Any]] | None:
    """What infer answers (see the module docstring); None when it cannot be known."""
    if isinstance(task, EmbedTask):
        return [{"name": "embedding", "datatype": "FP32", "shape": [-1, task.dimensions]}]
    if not isinstance(task, InferTask):
        return None
    if task.handler.post is None:
        return [_meta(o) for o in task.outputs.values()]
    if task.post_example is None:
        return None
    return [output_metadata(n, a) for n, a in result_arrays(task.post_example).items()]


def _meta(info: TensorInfo) -> dict[str, Any]:
    shape = [d if isinstance(d, int) else -1 for d in info.shape]
    return {"name": info.name, "datatype": _datatype(info), "shape": shape}


def _datatype(info: TensorInfo) -> str:
    return (datatype_of(info.dtype) if info.dtype is not None else None) or "BYTES"


async def model_ready(request: Request) -> Response:
    """200 once the workload (any task) is loaded and warm; 503 while it loads, after
    it failed (with what failed), and while the server drains (as /readyz)."""
    state: ServingState = request.app.state.lanes
    name = request.path_params["name"]
    try:
        _check_version(request)
        hosted = state.hosted(name)
    except LanesError as e:
        return v2_error(e)
    if hosted.state is LoadState.READY and state.readiness.draining:
        # A balancer that checks the model's readiness takes the replica out too.
        stopping = f"workload {name!r} is on a server that is stopping; send to another replica"
        return v2_error(Overloaded(stopping, code="draining"))
    if hosted.state is LoadState.READY:
        return JSONResponse({"name": name, "ready": True})
    if hosted.state is LoadState.FAILED:
        return JSONResponse({"error": f"workload {name!r} failed to load: {hosted.error}"}, 503)
    return v2_error(Overloaded(f"workload {name!r} is still loading"))


def _described(
    state: ServingState, request: Request
) -> tuple[Task, list[dict[str, Any]], list[dict[str, Any]]]:
    """The path's workload's task, and its inputs' and outputs' metadata."""
    task = _served(state, request).task
    return task, _inputs(task), _outputs(task) or []


def _served(state: ServingState, request: Request) -> BatchWorker:
    """The worker of the path's workload, at the path's version if it names one."""
    worker = state.worker(request.path_params["name"], TASKS)
    _check_version(request)
    return worker


def _check_version(request: Request) -> None:
    name = request.path_params["name"]
    version = request.path_params.get("version")
    if version is not None and version != MODEL_VERSION:
        raise UnknownWorkload(
            f"workload {name!r} has version {MODEL_VERSION} only, found version {shown(version)}; "
            f"use /v2/models/{name}/versions/{MODEL_VERSION} or /v2/models/{name}"
        )


async def statistics(request: Request) -> Response:
    """Triton's statistics extension (`get_inference_statistics`): every interactive
    workload's, or the path's (serving/model_stats.py says what each figure is); an
    unknown name or version is a 404, as for metadata."""
    state: ServingState = request.app.state.lanes
    name = request.path_params.get("name")
    if name is None:
        names = [n for n in state.spec.workloads if n in state.readiness]
    else:
        try:
            _check_version(request)
            state.hosted(name)
        except LanesError as e:
            return v2_error(e)
        names = [name]
    stats = [state.metrics.statistics.of(n).as_triton() for n in names]
    return JSONResponse({"model_stats": stats})


async def server_metadata(request: Request) -> JSONResponse:
    extensions = ["binary_tensor_data", "model_configuration", "statistics"]
    return JSONResponse({"name": "lanes", "version": "1", "extensions": extensions})


routes = [
    Route("/v2", server_metadata, methods=["GET"]),
    # Before /v2/models/{name}, as in Triton: "stats" here is no workload's name.
    Route("/v2/models/stats", statistics, methods=["GET"]),
    Route("/v2/models/{name}/stats", statistics, methods=["GET"]),
    Route("/v2/models/{name}/versions/{version}/stats", statistics, methods=["GET"]),
    Route("/v2/models/{name}", model_metadata, methods=["GET"]),
    Route("/v2/models/{name}/ready", model_ready, methods=["GET"]),
    Route("/v2/models/{name}/infer", infer, methods=["POST"]),
    Route("/v2/models/{name}/config", model_config, methods=["GET"]),
    Route("/v2/models/{name}/versions/{version}", model_metadata, methods=["GET"]),
    Route("/v2/models/{name}/versions/{version}/ready", model_ready, methods=["GET"]),
    Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
    Route("/v2/models/{name}/versions/{version}/config", model_config, methods=["GET"]),
]
