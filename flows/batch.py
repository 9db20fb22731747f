"""The Prefect flow every offline workload runs: one task per shard, bounded, retried.

    offline(workload="embed-corpus")            # now, in-process (embedded Prefect)
    prefect deploy --all                        # on a schedule: see flows/compile.py

The flow plans the job, checks a sample of the records against the record shape
(flows.validate: too many mismatches fail the run before any shard runs), skips
shards an earlier run committed, runs the rest as `shard` tasks (flows.shard_task) on
the workload's runner (threads here, or a Dask cluster through prefect-dask) with at
most `runner.max_concurrent_shards` in flight (flows.scheduling), then writes the run's
manifest. A shard that still fails after its retries (or at once, where no retry
changes anything: it rejects more than `max_error_rate` of its records, or its input
is a corrupt file, denied to us or gone since the listing) fails the run, after every
other shard has finished and the manifest is written: a rerun redoes only it.

A run holds its output folder while it runs (lanes.runlock): another run of the same
output meanwhile fails at once, naming it, instead of redoing the shards not committed.

`rerun` says what an earlier run's commits are worth: "uncommitted" (the default)
runs the shards without a current commit; "errors" also reruns the rejected records
of committed shards; "all" ignores the commits and runs every shard again.

No shard starts once `finish_by` passed (a batch's completion window), nor once a
shard found the run's endpoint gone (`runner: {kind: endpoint}`, flows.endpoint): each
would only pay the same refused attempts. A rerun runs them, as any uncommitted shard.

The final state says how it went: Completed when every record was answered,
Completed named CompletedWithErrors (a message with the counts) when some were
rejected, Completed named Expired when shards did not start past `finish_by` (what it
answered is kept, as for an expired OpenAI batch), Failed when a shard failed. A
manifest that cannot be written is a warning in the message (and the log), never the
run's state: the shards decide that.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast

from prefect import State, flow
from prefect.states import Completed

from lanes.backfill import served_workload
from lanes.errors import JobFailed, LanesError, OutputBusy, StorageError
from lanes.flows import FLOW_NAME
from lanes.flows.endpoint import batch_key, check_key, check_reachable, model_weights
from lanes.flows.job import Job, Lane, check_output_owner, plan_job, plan_shards
from lanes.flows.manifest import Manifest, build_manifest, write_manifest
from lanes.flows.outcome import outcome, run_deadline
from lanes.flows.progress import progress
from lanes.flows.sample import SAMPLE_BATCHES
from lanes.flows.scheduling import PendingShard, ShardsOutcome, run_shards
from lanes.flows.shard import ShardPlan, ShardStats, committed
from lanes.flows.shard_task import endpoint_url, loaded_model
from lanes.flows.start import (
    calibration,
    defer,
    deferred_until,
    plan_run,
    should_plan,
)
from lanes.flows.validate import check_records
from lanes.jobs import BATCH_TAG
from lanes.measurements import Measurements, Throughput, newest
from lanes.outputs import OutputStorage
from lanes.settings import Settings
from lanes.storage import Storage
from lanes.tracing import Tracing, maybe_span

Rerun = Literal["uncommitted", "errors", "all"]
DEFAULT_SPEC = "workloads.yaml"  # the flow's, and `lanes run`'s without LANES_SPEC

# Staging files older than this were left by a killed run; younger ones may be live.
STALE_STAGING_S = 24 * 3600

log = logging.getLogger(__name__)


@flow(
    name=FLOW_NAME,
    description="Run one offline workload of workloads.yaml over its input shards.",
    validate_parameters=True,
)
def offline(
    workload: str,
    spec: str = DEFAULT_SPEC,
    input: str | None = None,
    output: str | None = None,
    rerun: Rerun = "uncommitted",
    trace: dict[str, str] | None = None,
    lane: Lane = "declared",
    finish_by: datetime | None = None,
    planned_start: datetime | None = None,
) -> dict[str, Any]:
    """Run `workload` from the spec file `spec` (relative to the working directory).
    `input`/`output` override the workload's; `rerun` is "uncommitted", "errors" or
    "all" (the module docstring); `trace` is the W3C context (traceparent) of whoever
    submitted the run, continued by its spans when LANES_TRACING is on; `lane="offline"`
    runs an interactive workload in the offline lane (flows.job.plan_job); past
    `finish_by` no further shard starts (a batch's completion window: the shards left
    are its expired requests, and the run ends Expired). A deployment's run of a
    workload with `schedule.finish_by` first plans its start (flows.start) and, when
    that is later, schedules a run of the same deployment then (`planned_start`: that
    run's planned time) and ends Completed saying so. Returns the manifest's summary; raises
    JobFailed when a shard failed."""
    settings = Settings()
    tracing = Tracing.from_settings(settings)
    try:
        with maybe_span(tracing, f"offline {workload}", {"lanes.workload": workload}, trace):
            job = plan_job(workload, Path(spec), settings, input, output, lane)
            now = datetime.now(UTC)
            later = _start_later(job, settings, now)
            if later is not None:
                return cast("dict[str, Any]", later)
            deadline = run_deadline(job, settings, finish_by, planned_start, now)
            ran = run_job(job, settings, rerun, tracing, finish_by, deadline)
    finally:
        if tracing is not None:
            tracing.flush()  # a worker process may exit next
    # A State returned by a flow becomes its run's final state, and a caller of the
    # flow gets the state's data: the summary.
    state = outcome(ran.manifest, _retry(job, spec, input, output), ran.manifest_missing)
    return cast("dict[str, Any]", state)


def _retry(job: Job, spec: str, input: str | None, output: str | None) -> str:
    """What reruns the rejected records of this run: `lanes run --retry-errors` on the
    same input and output (a submitted job's own, not the workload's); a Batch API
    batch's are sent again in a new batch."""
    from prefect.runtime import flow_run

    if BATCH_TAG in flow_run.tags:
        return "send them again in a new batch"
    command = ["lanes", "run", job.workload]
    if spec != DEFAULT_SPEC:
        command += ["--file", spec]
    if input is not None or output is not None:
        command += ["--input", job.input, "--output", job.output]
    return f"rerun them with `{shlex.join([*command, '--retry-errors'])}`"


def _start_later(job: Job, settings: Settings, now: datetime) -> State[dict[str, Any]] | None:
    """A Completed state when this run of a deadline workload, planned at `now`, starts
    later, as another flow run (flows.start); None to run now."""
    from prefect.runtime import deployment, flow_run

    parameters = dict(flow_run.parameters)
    if not should_plan(job, deployment.name, parameters):
        return None
    storage = Storage(settings)
    measure = calibration(job, settings, storage, lambda: loaded_model(job, settings))
    try:
        plan = plan_run(job, settings, storage, now, Measurements(settings.home).load(), measure)
    except LanesError as err:
        # An input that cannot be counted (a corrupt file) fails its own shard when it
        # runs; the others are not held back for it.
        log.warning("%s: cannot plan the start, starting now: %s", job.workload, err)
        return None
    at = deferred_until(plan, now)
    if at is None:
        if plan.fits:
            log.info("%s: starting now: %s", job.workload, plan.note)
        else:
            log.warning("%s: not in time off-peak: %s", job.workload, plan.note)
        return None
    run = defer(deployment.name, plan, parameters, name=f"{job.workload}-{at:%Y%m%d-%H%M}")
    message = f"starts at {run.start.isoformat()} as flow run {run.id}: {plan.note}"
    return Completed(message=message, data={"rescheduled_as": run.id, **plan.as_json()})


@dataclass(frozen=True)
class Ran:
    """A run whose shards all committed, and its manifest."""

    manifest: Manifest
    manifest_missing: str | None  # why the manifest could not be written; None: it was


def run_job(
    job: Job,
    settings: Settings,
    rerun: Rerun = "uncommitted",
    tracing: Tracing | None = None,
    finish_by: datetime | None = None,
    deadline: datetime | None = None,
) -> Ran:
    """Inside a flow run: the shards of `job` (none started past `finish_by`), then the
    manifest. Raises JobFailed when a shard failed, whether or not the manifest could
    be written: the shards' outcome decides. With `tracing`, each shard's span
    continues the current one. A run with a `deadline` warns when it starts or ends
    past it, and its manifest says whether it met it."""
    from prefect.runtime import flow_run

    started = datetime.now(UTC)
    if deadline is not None and started > deadline:
        late = (started - deadline).total_seconds()
        log.warning(
            "%s: started %.0f s after its deadline %s", job.workload, late, deadline.isoformat()
        )
    if job.runner.kind == "endpoint":
        # No key, no endpoint, a key it refuses, another model there: fail before any
        # shard runs, saying why.
        key = batch_key(settings)
        url = endpoint_url(job, settings)
        check_reachable(url, settings.endpoint_retries)
        weights = model_weights(job.spec, job.workload, settings)
        check_key(url, served_workload(job.spec.workloads, job.workload), key, weights)
    # Every file this run writes lands in the output folder as planned (lanes.outputs).
    storage = OutputStorage(settings, job.real_output, job.output)
    storage.ensure_folder(job.output)
    # One run at a time writes an output (lanes.runlock): another run of it now
    # would redo every shard this one has not committed yet.
    with storage.exclusive(job.output, _holder(started)) as held:
        storage.clean_stale(job.output, STALE_STAGING_S)
        plans = plan_shards(job, storage)
        check_output_owner(job, plans, storage)
        done: list[ShardStats] = []
        pending: list[PendingShard] = []
        for plan in plans:
            # Read whatever `rerun` says: a marker of another job's fails the run here,
            # before any shard writes over its results.
            earlier = committed(storage, plan)
            if rerun == "all":
                earlier = None
            if earlier is None:
                pending.append(PendingShard(plan, None))
            elif rerun == "errors" and earlier.errors > 0:
                pending.append(PendingShard(plan, earlier))
            else:
                done.append(earlier)
        # Only shards that will be read whole: a retried one was checked when it first ran.
        check_records(job, [p.plan for p in pending if p.retry is None], storage)
        progress("planned", shards=len(plans), pending=len(pending))
        trace = tracing.carrier() if tracing is not None else None
        # A lost S3 lease (lanes.s3lock) is another run's output now: no shard starts.
        shards = run_shards(job, pending, settings, trace, finish_by, lambda: held.lost)
        failures = shards.failures
        measurements = Measurements(settings.home)
        manifest = build_manifest(
            workload=job.workload,
            flow_run=str(flow_run.id) if flow_run.id else None,
            input=job.input,
            output=job.output,
            started=started,
            ended=datetime.now(UTC),
            stats=done + shards.stats,
            failures=failures,
            not_started=shards.not_started,
            price_per_device_hour=settings.price_per_device_hour,
            interactive=newest(measurements.load(), "interactive", job.model_key, job.workload),
            finish_by=deadline,
        )
        overran = manifest.late_by()
        if overran is not None:
            log.warning(
                "%s: finished %.0f s after its deadline %s",
                job.workload,
                overran,
                manifest.finish_by,
            )
        missing: str | None = None
        try:
            uri = write_manifest(storage, manifest)
            log.info("manifest %s", uri)
        except StorageError as err:
            # The storage that failed the manifest may have failed shards too: their
            # failure, not this one, is the run's.
            missing = f"the manifest could not be written under {job.output} ({err})"
            log.warning("%s", missing)
        # A failed shard's retries are in the wall time, not its items; a measurement's
        # source is its manifest, so none without one.
        if not failures and missing is None:
            _record_throughput(measurements, job, manifest, uri)
        if held.lost is not None:
            raise OutputBusy(f"{held.lost}; {_lost(shards)}")
        if failures:
            raise JobFailed(_failed(plans, shards, missing))
        return Ran(manifest, missing)


def _lost(shards: ShardsOutcome) -> str:
    """What a run that lost its output's lease mid-way left to the run that took it."""
    return (
        f"this run committed {len(shards.stats)} shards and started no other "
        f"({shards.not_started} not started); the run that holds the output now runs "
        "those not committed. If none does, run again"
    )


def _holder(started: datetime) -> str:
    """Who runs, for the refusal of a second run of the same output."""
    from prefect.runtime import flow_run

    run = f"flow run {flow_run.name} ({flow_run.id})" if flow_run.id else "a run"
    return f"{run} on host {socket.gethostname()}, pid {os.getpid()}, since {started.isoformat()}"


def _failed(plans: list[ShardPlan], shards: ShardsOutcome, missing: str | None) -> str:
    """The message of a run whose shards failed: how many of all, each one's error, the
    ones that did not start and why, and what redoes them."""
    failures = shards.failures
    listed = "; ".join(f"{f.input}: {f.error}" for f in failures)
    message = f"{len(failures)} of {len(plans)} shards failed ({listed})"
    redo = "fix the cause and run again to redo only these"
    if shards.not_started:
        message += f"; {shards.not_started} did not start, {shards.stopped}"
        redo = "fix the cause and run again to redo only these and the ones not started"
    if shards.gone is not None:
        redo = (
            f"rerun the job once the endpoint at {shards.gone} is back: it runs only the "
            "shards not committed"
        )
    if len(plans) > len(failures) + shards.not_started:
        redo = f"the others are committed: {redo}"
    also = f"; {missing}" if missing is not None else ""
    return f"{message}; {redo}{also}"


def _record_throughput(store: Measurements, job: Job, manifest: Manifest, uri: str) -> None:
    """The run's offline items/s per device (and, on the endpoint, per second of the
    model time its items used there: its price), for `lanes plan` and later manifests. A
    run that ran nothing measured nothing, and one of fewer than `SAMPLE_BATCHES` full
    batches (a small job, a --retry-errors of a few records) measured its fixed costs
    (loading the model, starting shards), not its rate: neither replaces the newest
    measurement. A home that cannot be written costs the run nothing but a warning."""
    if manifest.items < SAMPLE_BATCHES * job.batch_size:
        return
    busy = manifest.busy_seconds if manifest.cost_basis == "busy_seconds" else None
    record = Throughput(
        workload=job.workload,
        model_key=job.model_key,
        lane="offline",
        items_per_second=manifest.items / max(manifest.wall_seconds, 1e-3) / manifest.devices,
        measured_at=datetime.fromisoformat(manifest.ended_at),
        source=f"manifest {uri}",
        items=manifest.items,
        provider=manifest.provider,
        batch_size=job.batch_size,
        items_per_busy_second=manifest.items / busy if busy else None,
    )
    try:
        store.save(record)
    except OSError as err:
        log.warning("could not record the run's throughput under %s: %s", store.folder, err)
