"""When a run of a workload with a deadline (`schedule.finish_by`) starts.

The deployment fires when the off-peak window opens (flows.compile). A run of a
workload with `finish_by` then plans its start (`plan_run`): the input's records
counted (flows.records.count_records), the newest measured offline rate of the
workload's model (lanes.measurements: `lanes calibrate` or an earlier run's
manifest) or, with none, one measured now on a sample of the real input
(flows.sample) and stored beside `lanes calibrate`'s, then lanes.deadline.plan_start
with its margin. A start later than now is honoured by Prefect: the run creates a
flow run of the same deployment, scheduled then, with `planned_start` among its
parameters (so it runs, not replans), and ends Completed saying so (`defer`): one such
run per workload and window, however many runs plan it (`lanes deploy` replaces it
with one that plans again: router.deploy). A run that cannot finish in time off-peak
starts now; with `runner: {kind: endpoint}` it runs on the shared endpoint, in the
idle time its interactive traffic leaves.

Rates are per device: a run over several (a Dask cluster) is planned as if on one,
so it starts early rather than late.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from lanes.deadline import opening, plan_start, window_at
from lanes.errors import LanesError
from lanes.flows.job import Job, plan_shards
from lanes.flows.records import count_records
from lanes.flows.runners import ShardModel
from lanes.flows.sample import measure_sample
from lanes.measurements import Measurements, Throughput, newest
from lanes.prefectapi import create_run
from lanes.settings import Settings
from lanes.spec import as_offline
from lanes.storage import Storage

log = logging.getLogger(__name__)

# A planned start this close to now is now: rescheduling costs a flow run's start.
RESCHEDULE_SLACK_S = 60.0
DEADLINE_TAG = "lanes-deadline"  # the runs a deadline rescheduled
# A window's deferred runs that ended (cancelled, say) before another run planned it.
MAX_DEFERRED_PER_WINDOW = 20


@dataclass(frozen=True)
class RunStart:
    """A deadline run's plan: when it starts, from what, and why (`note`)."""

    window_opens: datetime
    finish_by: datetime
    items: int
    items_per_second: float | None
    rate_source: str | None  # "calibrate", "manifest URI", or the sample's
    calibrated: bool  # the rate was measured just now, on a sample of the input
    start: datetime
    expected_finish: datetime | None
    on_time: bool
    fits: bool  # False: it does not fit in the window, so it starts now
    note: str

    def as_json(self) -> dict[str, Any]:
        """Its fields, the times in ISO format to the whole second (as `lanes plan`
        shows them)."""
        shown = asdict(self)
        for key in ("window_opens", "finish_by", "start", "expected_finish"):
            value = getattr(self, key)
            shown[key] = value.isoformat(timespec="seconds") if value is not None else None
        return shown


def has_deadline(job: Job) -> bool:
    workload = as_offline(job.spec.workload(job.workload))
    return workload.schedule is not None and workload.schedule.finish_by is not None


def plan_run(
    job: Job,
    settings: Settings,
    storage: Storage,
    now: datetime,
    records: list[Throughput],
    calibrate: Callable[[], tuple[Throughput, str]] | None = None,
) -> RunStart:
    """When `job` starts, planned at `now` from `records` (newest first, as
    Measurements.load gives them). With no rate for its model there, `calibrate()`
    measures one and says where it is kept (None: plan without, starting when the
    window opens). Raises
    LanesError when the job has no deadline, or its input cannot be read."""
    workload = as_offline(job.spec.workload(job.workload))
    schedule = workload.schedule
    if schedule is None or schedule.finish_by is None:
        raise LanesError(f"workload {job.workload!r} has no schedule.finish_by to plan by")
    window = window_at(opening(workload, settings)[0], schedule.finish_by, schedule.timezone, now)
    plans = plan_shards(job, storage)
    items = sum(count_records(storage, plan.input, plan.roots) for plan in plans)
    record = newest(records, "offline", job.model_key, job.workload)
    calibrated, kept = False, ""
    if record is None and calibrate is not None:
        (record, kept), calibrated = calibrate(), True
    rate = record.items_per_second if record is not None else None
    plan = plan_start(items, rate, window.finish_by, window.opens, now)
    note = plan.note
    if calibrated and record is not None:
        note = (
            f"no earlier run of this model: measured {rate:g} items/s on {record.items} "
            f"records of the input ({kept}); {note}"
        )
    if plan.start == now and rate is not None and job.runner.kind == "endpoint":
        note += "; on the shared endpoint (runner: endpoint), in its interactive lane's idle time"
    return RunStart(
        window_opens=window.opens,
        finish_by=window.finish_by,
        items=items,
        items_per_second=rate,
        rate_source=record.source if record is not None else None,
        calibrated=calibrated,
        start=plan.start,
        expected_finish=plan.expected_finish,
        on_time=plan.on_time,
        fits=plan.fits,
        note=note,
    )


def window_deadline(job: Job, settings: Settings, planned: datetime) -> datetime:
    """The deadline of a run of `job` (a workload with `schedule.finish_by`) planned to
    start at `planned`: the end of the window open then (for a deferred run, its
    `planned_start`: the window it was planned in, however late it starts)."""
    workload = as_offline(job.spec.workload(job.workload))
    schedule = workload.schedule
    if schedule is None or schedule.finish_by is None:
        raise LanesError(f"workload {job.workload!r} has no schedule.finish_by")
    opens_with = opening(workload, settings)[0]
    return window_at(opens_with, schedule.finish_by, schedule.timezone, planned).finish_by


def calibration(
    job: Job, settings: Settings, storage: Storage, model: Callable[[], ShardModel]
) -> Callable[[], tuple[Throughput, str]]:
    """`plan_run`'s `calibrate`: measure on a sample of the job's input with `model()`
    and store the rate where `lanes calibrate` stores its own (a home that cannot be
    written costs only a warning: the rate still plans this run)."""

    def measure() -> tuple[Throughput, str]:
        record = measure_sample(job, settings, storage, model())
        store = Measurements(settings.home)
        try:
            store.save(record)
        except OSError as err:
            log.warning("could not store the measured rate under %s: %s", store.folder, err)
            return record, f"not stored: cannot write under {store.folder} ({err.strerror or err})"
        return record, "stored with lanes calibrate's"

    return measure


def deferred_until(plan: RunStart, now: datetime) -> datetime | None:
    """The time a run planned as `plan` must wait for, None when it starts now."""
    if plan.start - now > timedelta(seconds=RESCHEDULE_SLACK_S):
        return plan.start
    return None


def should_plan(
    job: Job,
    deployment: str | None,
    parameters: dict[str, Any],
) -> bool:
    """Whether a flow run plans its start: a run of a deployment, of a workload with a
    deadline, that no one has planned yet (`planned_start`), reading the workload's own
    input (a submitted job or a batch says when it runs itself)."""
    if deployment is None or not has_deadline(job):
        return False
    others = ("planned_start", "input", "output", "finish_by")
    return not any(parameters.get(name) is not None for name in others)


def deadline_key(deployment: str, finish_by: datetime) -> str:
    """The idempotency key of the deferred run of `deployment` for the window that
    ends at `finish_by`: one per workload and window, however many runs plan it."""
    return f"{DEADLINE_TAG}/{deployment}/{finish_by.astimezone(UTC).isoformat()}"


@dataclass(frozen=True)
class Deferred:
    """The flow run a deadline run starts later as."""

    id: str
    start: datetime  # when it is due: as planned now, or by the run that made it


def defer(
    deployment: str,
    plan: RunStart,
    parameters: dict[str, Any],
    name: str,
) -> Deferred:
    """The flow run of `deployment` that starts at `plan.start`, with `parameters` and
    `planned_start`: made once per window (`deadline_key`), so a second run that plans
    the same window (a manual run, the cron firing after one) finds the first's. A
    run of the window that has ended (it ran, or was cancelled) does not count: the
    next key, after its id, is tried."""
    window = key = deadline_key(deployment, plan.finish_by)
    wanted = {**parameters, "planned_start": plan.start.isoformat()}
    for _ in range(MAX_DEFERRED_PER_WINDOW):
        run = create_run(
            deployment, wanted, plan.start, name=name, tags=[DEADLINE_TAG], idempotency_key=key
        )
        if not run.ended:
            break
        key = f"{window}/after/{run.id}"
    else:
        raise LanesError(
            f"{deployment}: {MAX_DEFERRED_PER_WINDOW} deferred runs for the window ending "
            f"{plan.finish_by.isoformat()} have ended already; run it with `lanes run`"
        )
    deferred = Deferred(str(run.id), run.scheduled or plan.start)
    log.info("rescheduled to %s as flow run %s: %s", deferred.start.isoformat(), run.id, plan.note)
    return deferred
