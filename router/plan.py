"""Where the router sends each workload: endpoint paths, or a Prefect deployment; and
what 1000 of its items cost in its own lane and in the other one."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lanes.digests import model_key
from lanes.errors import LanesError
from lanes.flows import FLOW_NAME as OFFLINE_FLOW
from lanes.flows.compile import schedule_of
from lanes.flows.job import Job, settle_job
from lanes.flows.runners import Model, ShardModel
from lanes.flows.start import calibration, plan_run
from lanes.measurements import CostBasis, Measurements, Throughput, newest
from lanes.settings import Settings
from lanes.spec import Mode, Spec, Workload, as_offline
from lanes.storage import Storage


@dataclass(frozen=True)
class LaneCost:
    """A workload's items in one lane, from the newest measurement of its model there
    (lanes.measurements); every figure None when there is none (`note` says what to do)."""

    lane: Mode
    usd_per_1k_items: float | None
    items_per_second: float | None  # per device
    source: str | None  # "calibrate", "manifest URI", "metrics URL"
    measured_at: str | None
    measured_for: str | None  # the workload measured: this one, or another of its model
    note: str | None  # e.g. the SLO the interactive rate missed
    # What an offline price is on: an endpoint run's offline-lane busy seconds (then its
    # rate per busy second), or wall time (`items_per_second`); None when not measured,
    # and for the interactive lane (priced on its measured rate, as before).
    cost_basis: CostBasis | None = None
    items_per_busy_second: float | None = None
    provider: str | None = None  # onnxruntime's execution provider that measured it
    # The price the dollars are at, and whether LANES_PRICE_PER_DEVICE_HOUR chose it
    # (False: the default, $1, which is no one's price).
    price_per_device_hour: float = 1.0
    price_is_set: bool = False

    @classmethod
    def of(
        cls, lane: Mode, record: Throughput | None, settings: Settings, workload: str
    ) -> LaneCost:
        price = settings.price_per_device_hour
        is_set = "price_per_device_hour" in settings.model_fields_set
        if record is None:
            unmeasured = f"not measured: run lanes calibrate {workload}"
            return cls(
                lane,
                None,
                None,
                None,
                None,
                None,
                unmeasured,
                price_per_device_hour=price,
                price_is_set=is_set,
            )
        note = None
        if record.meets_slo is False:
            note = f"even one client missed the p99 target of {record.slo_p99_ms:g} ms"
        return cls(
            lane=lane,
            usd_per_1k_items=round_figure(record.usd_per_1k_items(price), 8),
            items_per_second=round_figure(record.items_per_second, 2),
            source=record.source,
            measured_at=record.measured_at.isoformat(),
            measured_for=record.workload,
            note=note,
            cost_basis=record.cost_basis if lane == "offline" else None,
            items_per_busy_second=_rounded(record.items_per_busy_second),
            provider=record.provider,
            price_per_device_hour=price,
            price_is_set=is_set,
        )


def _rounded(rate: float | None) -> float | None:
    return round_figure(rate, 2) if rate is not None else None


def decimals(value: float, at_least: int, digits: int = 3) -> int:
    """The decimal places to show `value` with: `at_least`, or more when it is smaller,
    to keep `digits` significant figures (a rate or price that is not 0 never reads 0)."""
    if value == 0 or not math.isfinite(value):
        return at_least
    return max(at_least, digits - 1 - math.floor(math.log10(abs(value))))


def round_figure(value: float, at_least: int) -> float:
    return round(value, decimals(value, at_least))


@dataclass(frozen=True)
class Route:
    workload: str
    mode: str
    task: str
    model: str
    batching: dict[str, Any]
    endpoints: list[str]  # interactive: HTTP routes of the serving endpoint
    deployment: str | None  # offline: "flow/deployment"
    schedule: str | None  # offline: "cron (timezone)"
    schedule_is_default: bool
    next_run: str | None  # offline: ISO time of the next scheduled run
    cost: LaneCost  # in its own lane
    other_lane_cost: LaneCost  # had it the other label
    deadline: dict[str, Any] | None = None  # offline with finish_by: flows.start.RunStart

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def endpoints(name: str, workload: Workload) -> list[str]:
    """The HTTP routes an interactive workload answers on (`model` is the workload name)."""
    v2 = [f"POST /v2/models/{name}/infer", f"GET /v2/models/{name}"]
    if workload.task == "embed":
        return ["POST /v1/embeddings", *v2]
    if workload.task == "generate":
        return ["POST /v1/completions", "POST /v1/chat/completions"]
    return v2


def plan(
    spec: Spec,
    settings: Settings,
    now: datetime | None = None,
    measurements: list[Throughput] | None = None,
    calibrate: bool = False,
) -> list[Route]:
    """One route per workload, in the spec's order; costs from `measurements` (newest
    first, as lanes.measurements.Measurements.load returns them; none: nothing measured).
    An offline workload with `schedule.finish_by` gets its run's start (`deadline`,
    flows.start.plan_run) for the window open at `now` or the next; with `calibrate`, a
    workload whose model has no offline rate is first measured on a sample of its input
    (and the rate stored under LANES_HOME)."""
    records = measurements or []
    routes = []
    for name, w in spec.workloads.items():
        key = model_key(spec, w, settings)
        other: Mode = "offline" if w.mode == "interactive" else "interactive"
        deadline = None
        if w.mode == "offline":
            deadline = _deadline(spec, name, settings, now, records, calibrate)
            if deadline is not None and deadline.get("calibrated"):
                # The rate it just measured and stored prices the lanes too.
                records = Measurements(settings.home).load()
        own_cost = LaneCost.of(w.mode, newest(records, w.mode, key, name), settings, name)
        other_cost = LaneCost.of(other, newest(records, other, key, name), settings, name)
        if w.mode == "interactive":
            routes.append(
                Route(
                    workload=name,
                    mode=w.mode,
                    task=w.task,
                    model=w.model,
                    batching=w.batching.model_dump(),
                    endpoints=endpoints(name, w),
                    deployment=None,
                    schedule=None,
                    schedule_is_default=False,
                    next_run=None,
                    cost=own_cost,
                    other_lane_cost=other_cost,
                )
            )
            continue
        schedule, is_default = schedule_of(w, settings)
        routes.append(
            Route(
                workload=name,
                mode=w.mode,
                task=w.task,
                model=w.model,
                batching={"batch_size": w.batch_size},
                endpoints=[],
                deployment=f"{OFFLINE_FLOW}/{name}",
                schedule=f"{schedule.cron} ({schedule.timezone})",
                schedule_is_default=is_default,
                next_run=schedule.next_run(now).isoformat(),
                cost=own_cost,
                other_lane_cost=other_cost,
                deadline=deadline,
            )
        )
    return routes


def _deadline(
    spec: Spec,
    name: str,
    settings: Settings,
    now: datetime | None,
    records: list[Throughput],
    calibrate: bool,
) -> dict[str, Any] | None:
    """The planned start of `name`'s next run when it has a deadline (the note says why
    there is none when its input cannot be read)."""
    schedule = as_offline(spec.workload(name)).schedule
    if schedule is None or schedule.finish_by is None:
        return None
    try:
        job = settle_job(spec, name, spec.root or Path.cwd(), settings)
        storage = Storage(settings)
        measure = None
        if calibrate:
            measure = calibration(job, settings, storage, lambda: _local_model(job, settings))
        return plan_run(
            job, settings, storage, now or datetime.now(UTC), records, measure
        ).as_json()
    except LanesError as err:
        return {"note": f"cannot plan the start: {err}"}


def _local_model(job: Job, settings: Settings) -> ShardModel:
    from lanes.runtime import Runtime  # onnxruntime: only when a model is measured
    from lanes.tasks import load_task

    runtime = Runtime(settings)
    task = load_task(job.workload, job.spec, runtime)
    task.warm_up()
    return Model(task, runtime.providers[0])
