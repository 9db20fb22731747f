"""A run's pending shards as `shard` tasks on the workload's task runner, bounded.

`run_shards` submits the shard task (flows.shard_task) of each pending shard on the
runner (threads here, or a Dask cluster through prefect-dask) with at most
`runner.max_concurrent_shards` in flight, and starts none once `finish_by` passed or a
shard found the run's endpoint gone (flows.endpoint): each would only pay the same
refused attempts. Nor once the caller's `stop` says why not (the run lost its output's
lease to another run, lanes.s3lock). What became of them is a `ShardsOutcome`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from lanes.flows.endpoint import EndpointGone
from lanes.flows.job import Job
from lanes.flows.manifest import ShardFailure
from lanes.flows.progress import progress
from lanes.flows.shard import ShardPlan, ShardStats
from lanes.flows.shard_task import endpoint_url, shard, worth_retrying
from lanes.settings import Settings
from lanes.specoffline import Runner

# The flow's logger: a run's warnings (shards not started, a deadline missed) have one name.
log = logging.getLogger("lanes.flows.batch")


@dataclass(frozen=True)
class ShardsOutcome:
    """What became of a run's pending shards."""

    stats: list[ShardStats]  # of those committed
    failures: list[ShardFailure]
    not_started: int = 0  # shards never started, for the reason `stopped` says
    stopped: str = ""  # "past its deadline ...", "as the endpoint at ... is gone"
    gone: str | None = None  # the endpoint a shard found gone (EndpointGone)


@dataclass(frozen=True)
class PendingShard:
    """A shard to run: whole, or (`retry`: what an earlier run committed) its errors."""

    plan: ShardPlan
    retry: ShardStats | None


def run_shards(
    job: Job,
    pending: list[PendingShard],
    settings: Settings,
    trace: dict[str, str] | None = None,
    finish_by: datetime | None = None,
    stop: Callable[[], str | None] = lambda: None,
) -> ShardsOutcome:
    """Submit shard tasks, never more than `max_concurrent_shards` in flight, and none
    once `finish_by` passed, a shard found the endpoint gone, or `stop` says why not
    (the shards in flight then end as they do)."""
    if not pending:
        return ShardsOutcome([], [])
    bound = job.runner.max_concurrent_shards
    retried = shard.with_options(
        retries=job.retries, retry_delay_seconds=2, retry_condition_fn=worth_retrying
    )
    queue = deque(pending)
    stats: list[ShardStats] = []
    failures: list[ShardFailure] = []
    in_flight: dict[PrefectFuture[ShardStats], PendingShard] = {}
    not_started, stopped, gone = 0, "", None
    with _api_for_workers(), task_runner(job.runner, settings) as runner:
        # Each pass waits for one shard to end: at most len(pending) passes.
        for _ in range(len(pending)):
            if not stopped and finish_by is not None and datetime.now(UTC) >= finish_by:
                stopped = f"past its deadline {finish_by.isoformat()}"
            stopped = stopped or stop() or ""
            if stopped and queue:
                log.warning("%s: %d shards not started: %s", job.workload, len(queue), stopped)
                not_started += len(queue)
                queue.clear()
            if not in_flight and not queue:
                break
            while queue and len(in_flight) < bound:
                item = queue.popleft()
                parameters = {
                    "job": job,
                    "plan": item.plan,
                    "settings": settings,
                    "retry": item.retry,
                    "trace": trace,
                }
                in_flight[runner.submit(retried, parameters)] = item
            finished = next(as_completed(list(in_flight)))
            item = in_flight.pop(finished)
            finished.wait()
            if finished.state.is_completed():
                done: ShardStats = finished.result()
                stats.append(done)
                ran = done.retried if item.retry is not None and done.retried else done.records
                progress("shard", shard=item.plan.name, records=ran)
            else:
                error = finished.result(raise_on_failure=False)
                failures.append(
                    ShardFailure(item.plan.input.uri, f"{type(error).__name__}: {error}")
                )
                progress("shard", shard=item.plan.name, records=0)
                if isinstance(error, EndpointGone) and gone is None:
                    # Each shard left would only meet the same refusal: they all run
                    # again in a rerun once the endpoint is back.
                    gone = endpoint_url(job, settings)
                    stopped = stopped or f"as the endpoint at {gone} is gone"
    return ShardsOutcome(stats, failures, not_started, stopped, gone)


@contextmanager
def _api_for_workers() -> Iterator[None]:
    """Shard tasks report to this flow run's Prefect API, wherever they run.

    Prefect hands a task's settings to a Dask worker with the task, but an embedded
    API (`lanes run` without PREFECT_API_URL) is not among them: each worker process
    would start an embedded server of its own. Naming this run's API in the settings
    the tasks carry keeps them on the flow's.
    """
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    context = FlowRunContext.get()
    if PREFECT_API_URL.value() or context is None or context.client is None:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: str(context.client.api_url)}):
        yield


def task_runner(runner: Runner, settings: Settings) -> TaskRunner[Any]:
    """Threads in this process (for the endpoint runner too: its shards wait on the
    endpoint), or Dask (a cluster at `address`, else a local one)."""
    if runner.kind in ("local", "endpoint"):
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
