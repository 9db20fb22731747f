"""The Prefect flow every offline workload runs: one task per shard, bounded, retried.

    offline(workload="embed-corpus")            # now, in-process (embedded Prefect)
    prefect deploy --all                        # on a schedule: see flows/compile.py

The flow plans the job, skips shards an earlier run committed, runs the rest as
`shard` tasks on the workload's runner (threads here, or a Dask cluster through
prefect-dask) with at most `runner.max_concurrent_shards` in flight, then writes the
run's manifest. A shard that still fails after its retries fails the run, after
every other shard has finished and the manifest is written: a rerun redoes only it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from lanes.errors import JobFailed
from lanes.flows import FLOW_NAME
from lanes.flows.job import Job, plan_job, plan_shards
from lanes.flows.manifest import Manifest, ShardFailure, build_manifest, write_manifest
from lanes.flows.shard import Model, ShardPlan, ShardStats, committed, run_shard
from lanes.runtime import Runtime
from lanes.settings import Settings
from lanes.spec import Runner
from lanes.storage import Storage
from lanes.tasks import load_task

# Staging files older than this were left by a killed run; younger ones may be live.
STALE_STAGING_S = 24 * 3600

log = logging.getLogger(__name__)
# Progress events for whoever watches in this process (`lanes run` draws a bar).
progress_log = logging.getLogger("lanes.flows.progress")


@flow(
    name=FLOW_NAME,
    description="Run one offline workload of workloads.yaml over its input shards.",
    validate_parameters=True,
)
def offline(
    workload: str,
    spec: str = "workloads.yaml",
    input: str | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Run `workload` from the spec file `spec` (relative to the working directory).
    `input`/`output` override the workload's. Returns the manifest's summary."""
    settings = Settings()
    return run_job(plan_job(workload, Path(spec), settings, input, output), settings).summary()


def run_job(job: Job, settings: Settings) -> Manifest:
    """Inside a flow run: the shards of `job`, then the manifest. Raises JobFailed."""
    from prefect.runtime import flow_run

    started = datetime.now(UTC)
    storage = Storage(settings)
    storage.ensure_folder(job.output)
    storage.clean_stale(job.output, STALE_STAGING_S)
    plans = plan_shards(job, storage)
    done: list[ShardStats] = []
    pending: list[ShardPlan] = []
    for plan in plans:
        earlier = committed(storage, plan)
        if earlier is None:
            pending.append(plan)
        else:
            done.append(earlier)
    _progress("planned", shards=len(plans), pending=len(pending))
    ran, failures = _run_shards(job, pending, settings)
    manifest = build_manifest(
        workload=job.workload,
        flow_run=str(flow_run.id) if flow_run.id else None,
        input=job.input,
        output=job.output,
        started=started,
        ended=datetime.now(UTC),
        stats=done + ran,
        failures=failures,
        price_per_device_hour=settings.price_per_device_hour,
    )
    uri = write_manifest(storage, manifest)
    log.info("manifest %s", uri)
    if failures:
        listed = "; ".join(f"{f.input}: {f.error}" for f in failures)
        raise JobFailed(
            f"{len(failures)} of {len(plans)} shards failed after their retries ({listed}); "
            "the others are committed: fix the cause and run again to redo only these"
        )
    return manifest


@task(name="shard", cache_policy=NO_CACHE, task_run_name="shard {plan.name}")
def shard(job: Job, plan: ShardPlan, settings: Settings) -> ShardStats:
    """One shard: read, run, write, commit (flows.shard.run_shard)."""
    model = _model(job, settings)
    stats = run_shard(
        plan,
        model,
        Storage(settings),
        job.batch_size,
        job.max_record_bytes,
        progress=lambda n: _progress("records", records=n),
    )
    _progress("shard", shard=plan.name)
    return stats


def _run_shards(
    job: Job, plans: list[ShardPlan], settings: Settings
) -> tuple[list[ShardStats], list[ShardFailure]]:
    """Submit shard tasks, never more than `max_concurrent_shards` in flight."""
    if not plans:
        return [], []
    bound = job.runner.max_concurrent_shards
    retried = shard.with_options(retries=job.retries, retry_delay_seconds=2)
    queue = deque(plans)
    in_flight: dict[PrefectFuture[ShardStats], ShardPlan] = {}
    stats: list[ShardStats] = []
    failures: list[ShardFailure] = []
    with task_runner(job.runner, settings) as runner:
        # Each pass waits for one shard to end: at most len(plans) passes.
        for _ in range(len(plans)):
            while queue and len(in_flight) < bound:
                plan = queue.popleft()
                parameters = {"job": job, "plan": plan, "settings": settings}
                in_flight[runner.submit(retried, parameters)] = plan
            finished = next(as_completed(list(in_flight)))
            plan = in_flight.pop(finished)
            finished.wait()
            if finished.state.is_completed():
                stats.append(finished.result())
            else:
                error = finished.result(raise_on_failure=False)
                failures.append(ShardFailure(plan.input.uri, f"{type(error).__name__}: {error}"))
    return stats, failures


def task_runner(runner: Runner, settings: Settings) -> TaskRunner[Any]:
    """Threads in this process, or Dask (a cluster at `address`, else a local one)."""
    if runner.kind == "local":
        return ThreadPoolTaskRunner(max_workers=runner.max_concurrent_shards)
    from prefect_dask.task_runners import DaskTaskRunner

    if runner.address:
        return DaskTaskRunner(address=runner.address)
    cluster = {
        "n_workers": runner.workers,
        "threads_per_worker": 1,  # a worker runs one shard; onnxruntime uses the cores
        "processes": True,
        # The scheduler serves HTTP (health, metrics) even without a dashboard, by
        # default on 8787: on a free port instead, so a second cluster on the machine
        # never finds it taken (Dask then warns and moves).
        "dashboard_address": ":0",
        "scheduler_kwargs": {"dashboard": False},
        "local_directory": str(settings.home / "dask"),
    }
    return DaskTaskRunner(cluster_kwargs=cluster)


# One loaded model per process, reused by every shard task that runs here (a thread
# of this flow, or a Dask worker): loading costs more than a small shard.
_loaded: dict[str, Model] = {}
_loading = threading.Lock()


def _model(job: Job, settings: Settings) -> Model:
    key = f"{job.workload}|{job.model_key}|{settings.model_dump_json()}"
    with _loading:
        model = _loaded.get(key)
        if model is None:
            runtime = Runtime(settings)
            loaded = load_task(job.workload, job.spec, runtime)
            loaded.warm_up()
            model = Model(loaded, runtime.providers[0])
            _loaded.clear()  # a worker serves one job at a time: keep memory flat
            _loaded[key] = model
        return model


def _progress(event: str, **fields: Any) -> None:
    progress_log.debug("%s %s", event, fields, extra={"lanes_event": event, "lanes": fields})
