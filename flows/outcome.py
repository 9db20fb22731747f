"""How an offline run that ended well reports: the deadline it answers to
(`run_deadline`) and its final state (`outcome`), from its manifest."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from prefect import State
from prefect.states import Completed

from lanes.flows.job import Job
from lanes.flows.manifest import Manifest
from lanes.flows.start import has_deadline, should_plan, window_deadline
from lanes.jobstates import EXPIRED_STATE, WITH_ERRORS_STATE
from lanes.layout import ERRORS
from lanes.settings import Settings
from lanes.uris import join


def run_deadline(
    job: Job,
    settings: Settings,
    finish_by: datetime | None,
    planned_start: datetime | None,
    now: datetime,
) -> datetime | None:
    """The deadline this run answers to, None without: a batch's `finish_by`; for a
    workload with `schedule.finish_by`, the end of the window a deferred run was planned
    in (`planned_start`), or of the one open at `now` for a run that planned to start
    now (flows.start.should_plan)."""
    from prefect.runtime import deployment, flow_run

    if finish_by is not None:
        return finish_by
    if planned_start is not None and has_deadline(job):
        return window_deadline(job, settings, planned_start)
    if should_plan(job, deployment.name, dict(flow_run.parameters)):
        return window_deadline(job, settings, now)
    return None


def outcome(
    manifest: Manifest, retry: str, manifest_missing: str | None = None
) -> State[dict[str, Any]]:
    """The final state of a run whose shards did not fail: Completed, or
    CompletedWithErrors when any committed shard holds rejected records (its message
    ends with `retry`: what reruns them), or Expired when shards did not start past its
    `finish_by` (lanes.jobstates reads it EXPIRED). A run that ended past its deadline says
    by how much. With `manifest_missing` (why the manifest could not be written), the
    message says the outputs are complete without it."""
    summary = manifest.summary()
    if manifest.shards_not_started:
        return _expired(manifest, retry, manifest_missing)
    late = manifest.late_by()
    notes = ""
    if late is not None:
        notes = f"; finished late, {late:.0f} s after its deadline {manifest.finish_by}"
    # Completed, not Failed: every shard is committed, so every record is answered and
    # a caller may read the results; failing would have Job.wait() raise and a Batch API
    # batch fail over a file that only counts them. A rerun writes it, skipping them all.
    if manifest_missing is not None:
        notes += (
            f"; the outputs are complete, but {manifest_missing}: run again to write it "
            "(every shard is skipped)"
        )
    if manifest.total_errors == 0:
        message = f"{_records(manifest.total_outputs)} answered{notes}"
        return Completed(message=message, data=summary)
    errors = join(manifest.output, ERRORS)
    message = (
        f"{_records(manifest.total_errors)} rejected, {manifest.total_outputs} answered "
        f"(each shard under its max_error_rate); the rejected ones are in {errors}: fix "
        f"them (or the workload) and {retry}{notes}"
    )
    return Completed(name=WITH_ERRORS_STATE, message=message, data=summary)


def _expired(manifest: Manifest, retry: str, manifest_missing: str | None) -> State[dict[str, Any]]:
    """Expired, not Completed: some records never ran. Not Failed either: what the
    committed shards answered stays for a caller to read (OpenAI's expired batch keeps
    its output file), and the records not run are no shard's fault."""
    left, shards = manifest.shards_not_started, manifest.shards
    message = (
        f"expired: {left} of {shards} shards not started, past its deadline "
        f"{manifest.finish_by}; {_records(manifest.total_outputs)} answered, "
        f"{manifest.total_errors} rejected; the records of the shards not started never "
        f"ran: {retry}"
    )
    if manifest_missing is not None:
        message += f"; {manifest_missing}"
    return Completed(name=EXPIRED_STATE, message=message, data=manifest.summary())


def _records(n: int) -> str:
    return f"{n} record{'' if n == 1 else 's'}"
