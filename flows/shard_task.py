"""The Prefect task that runs one shard, and the model each process loads for it.

`shard` runs flows.shard.run_shard wherever the task runner puts it (a thread of the
flow, or a Dask worker), with the model that process loaded once (`loaded_model`: the
workload's task on this machine's device, or for `runner: {kind: endpoint}` the serving
endpoint's sessions, flows.endpoint). `worth_retrying` is its retry condition.
"""

from __future__ import annotations

import threading
from typing import Any

from prefect import State, Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun

from lanes.backfill import served_workload
from lanes.errors import LanesError
from lanes.flows.endpoint import EndpointModel, batch_key, model_weights
from lanes.flows.job import Job
from lanes.flows.progress import progress
from lanes.flows.runners import Model, ShardModel
from lanes.flows.shard import ShardPlan, ShardStats, run_shard
from lanes.outputs import OutputStorage
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.tasks import load_task
from lanes.tracing import Tracing, maybe_span


@task(name="shard", cache_policy=NO_CACHE, task_run_name="shard {plan.name}")
def shard(
    job: Job,
    plan: ShardPlan,
    settings: Settings,
    retry: ShardStats | None = None,
    trace: dict[str, str] | None = None,
) -> ShardStats:
    """One shard: read, run, write, commit (flows.shard.run_shard); with `trace` (the
    flow run's span, as W3C headers: the shard may run in another process), a span."""
    model = loaded_model(job, settings)
    tracing = Tracing.from_settings(settings) if trace is not None else None
    with maybe_span(tracing, f"shard {plan.name}", {"lanes.shard": plan.name}, trace):
        return _shard(job, plan, settings, model, retry, tracing)


def _shard(
    job: Job,
    plan: ShardPlan,
    settings: Settings,
    model: ShardModel,
    retry: ShardStats | None,
    tracing: Tracing | None,
) -> ShardStats:
    stats = run_shard(
        plan,
        model,
        # It reads and writes the output where the job was planned.
        OutputStorage(settings, job.real_output, job.output),
        job.batch_size,
        job.max_record_bytes,
        job.max_inputs,
        # Seen where the task runs: in this process with threads, nowhere with Dask
        # (the flow reports each finished shard itself, for every runner).
        progress=lambda n: progress("records", shard=plan.name, records=n),
        retry=retry,
        tracing=tracing,
    )
    if tracing is not None:
        tracing.flush()  # on a Dask worker, nobody else will
    return stats


def worth_retrying(task: Task[Any, Any], run: TaskRun, state: State[Any]) -> bool:
    """Prefect's retry condition: not for an error that says it repeats (a shard over
    its error rate, an input that is corrupt, denied to us or gone: the same again)."""
    error = state.data
    return not (isinstance(error, LanesError) and error.repeats)


def endpoint_url(job: Job, settings: Settings) -> str:
    """The endpoint a `runner: {kind: endpoint}` job runs its batches on."""
    return job.runner.url or settings.endpoint


# One loaded model per process, reused by every shard task that runs here (a thread
# of this flow, or a Dask worker): loading costs more than a small shard.
_loaded: dict[str, ShardModel] = {}
_loading = threading.Lock()


def loaded_model(job: Job, settings: Settings) -> ShardModel:
    # The task holds its workload's whole declaration (max_error_rate, fields, ...) and
    # loads the model from its path: the content digest (model_key) alone would hand
    # one job's task to another job of the same name and model bytes.
    workload = job.spec.workloads[job.workload]
    key = f"{job.workload}|{workload.model_dump_json()}|"
    key += f"{job.spec.models[workload.model].model_dump_json()}|{job.model_key}|"
    key += f"{job.runner.model_dump_json()}|{settings.model_dump_json()}"
    with _loading:
        model = _loaded.get(key)
        if model is None:
            model = _endpoint_model(job, settings) if job.runner.kind == "endpoint" else None
            if model is None:
                runtime = Runtime(settings)
                loaded = load_task(job.workload, job.spec, runtime)
                loaded.warm_up()
                model = Model(loaded, runtime.providers[0])
            for old in _loaded.values():
                if isinstance(old, EndpointModel):
                    old.close()
            _loaded.clear()  # a worker serves one job at a time: keep memory flat
            _loaded[key] = model
        return model


def _endpoint_model(job: Job, settings: Settings) -> EndpointModel:
    """The endpoint runs the batches; this process only prepares and answers records,
    with the task on the CPU, whatever the device setting (the device is the
    endpoint's)."""
    key = batch_key(settings)
    task = load_task(job.workload, job.spec, Runtime(settings.model_copy(update={"device": "cpu"})))
    url = endpoint_url(job, settings)
    workload = served_workload(job.spec.workloads, job.workload)
    weights = model_weights(job.spec, job.workload, settings)
    return EndpointModel(
        task, url, workload, key, retries=settings.endpoint_retries, weights=weights
    )
