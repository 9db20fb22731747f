"""Where the router sends each workload: endpoint paths, or a Prefect deployment."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from lanes.flows import FLOW_NAME as OFFLINE_FLOW
from lanes.flows.compile import schedule_of
from lanes.settings import Settings
from lanes.spec import Spec, Workload


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


def plan(spec: Spec, settings: Settings, now: datetime | None = None) -> list[Route]:
    """One route per workload, in the spec's order."""
    routes = []
    for name, w in spec.workloads.items():
        if w.mode == "interactive":
            batching = w.batching.model_dump()
            routes.append(
                Route(
                    name,
                    w.mode,
                    w.task,
                    w.model,
                    batching,
                    endpoints(name, w),
                    None,
                    None,
                    False,
                    None,
                )
            )
            continue
        schedule, is_default = schedule_of(w, settings)
        batching = {"batch_size": w.batch_size}
        routes.append(
            Route(
                workload=name,
                mode=w.mode,
                task=w.task,
                model=w.model,
                batching=batching,
                endpoints=[],
                deployment=f"{OFFLINE_FLOW}/{name}",
                schedule=f"{schedule.cron} ({schedule.timezone})",
                schedule_is_default=is_default,
                next_run=schedule.next_run(now).isoformat(),
            )
        )
    return routes
