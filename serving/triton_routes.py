"""Triton's HTTP extensions that lanes does not serve, refused in v2's shape.

tritonclient has a call for each (`register_system_shared_memory`, `load_model`,
`get_trace_settings`, ...). Each is answered 400 `{"error": "..."}`, saying that
lanes does not support the extension and what to do instead, rather than a 404 that
reads like a wrong URL. `get_model_config` and `get_inference_statistics` are served
(serving/v2_routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lanes.errors import InvalidInput
from lanes.serving.http import v2_error

CODE = "unsupported_extension"


@dataclass(frozen=True)
class Extension:
    """A Triton extension lanes refuses: its name, and what to do instead."""

    name: str
    instead: str

    async def refuse(self, request: Request) -> Response:
        message = f"lanes does not support Triton's {self.name} extension; {self.instead}"
        return v2_error(InvalidInput(message, code=CODE))


_TENSORS_IN_BODY = (
    "send tensors in the request body (binary tensor data, tritonclient's default, "
    "costs no more than JSON's text)"
)
SYSTEM_MEMORY = Extension("system shared memory", _TENSORS_IN_BODY)
CUDA_MEMORY = Extension("CUDA shared memory", _TENSORS_IN_BODY)
REPOSITORY = Extension(
    "model repository",
    "the models served are the interactive workloads of workloads.yaml, all loaded at "
    "start-up: change the file and restart `lanes serve`",
)
TRACE = Extension(
    "trace",
    "lanes traces with OpenTelemetry: start `lanes serve` with LANES_TRACING=true and "
    "the OTEL_* variables",
)
LOGGING = Extension(
    "logging", "start `lanes serve` with LANES_LOG_LEVEL (and LANES_LOG_FORMAT) set"
)

_BOTH = ["GET", "POST"]  # tritonclient GETs some and POSTs others: each is refused
routes = [
    Route("/v2/systemsharedmemory/{rest:path}", SYSTEM_MEMORY.refuse, methods=_BOTH),
    Route("/v2/cudasharedmemory/{rest:path}", CUDA_MEMORY.refuse, methods=_BOTH),
    Route("/v2/repository/{rest:path}", REPOSITORY.refuse, methods=_BOTH),
    Route("/v2/trace/setting", TRACE.refuse, methods=_BOTH),
    Route("/v2/models/{name}/trace/setting", TRACE.refuse, methods=_BOTH),
    Route("/v2/logging", LOGGING.refuse, methods=_BOTH),
]
