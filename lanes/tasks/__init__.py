"""Tasks: what a workload does with its model. `load_task` builds the right one.

task = load_task("search-query", spec, runtime)
outputs = task.run([task.prepare(item) for item in items])
"""

from __future__ import annotations

from lanes.backfill import backfilled
from lanes.runtime import Runtime
from lanes.spec import Spec
from lanes.tasks.base import Task
from lanes.tasks.decoder import Completion, Decoder
from lanes.tasks.embed import EmbedTask
from lanes.tasks.generate import GenerateTask
from lanes.tasks.handler import NO_HANDLER, Handler, load_handler
from lanes.tasks.infer import InferTask
from lanes.tasks.sampling import SamplingParams, sample

__all__ = [
    "Completion",
    "Decoder",
    "EmbedTask",
    "GenerateTask",
    "Handler",
    "InferTask",
    "SamplingParams",
    "Task",
    "load_handler",
    "load_task",
    "sample",
]


def load_task(name: str, spec: Spec, runtime: Runtime) -> Task:
    """The task of workload `name`, its model loaded and checked, its handler imported.

    Raises `UnknownWorkload`, `ModelError` (model missing or unfit for the task) or
    `HandlerError`. Does not warm up: call `task.warm_up()` when ready to.
    """
    workload = spec.workload(name)
    model = spec.models[workload.model]
    handler = load_handler(workload.handler, spec.root) if workload.handler else NO_HANDLER
    backfill = name in backfilled(spec.workloads)
    match workload.task:
        case "embed":
            return EmbedTask(name, workload, model, runtime, handler, backfill)
        case "infer":
            return InferTask(name, workload, model, runtime, handler, backfill)
        case "generate":
            return GenerateTask(name, workload, model, runtime, handler)
