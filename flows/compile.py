"""The compiler: offline workloads -> prefect.yaml, one deployment per workload.

    lanes compile                      # writes ./prefect.yaml beside workloads.yaml
    prefect --no-prompt deploy --all   # registers every deployment, no questions

Each deployment runs `lanes.flows.batch:offline` (a module path: it works wherever lanes is
installed) with the workload's name as a parameter, on the workload's cron schedule
or, without one, the default off-peak window (`Settings.offpeak`), in the work pool
`Settings.work_pool`. The worker first changes to the project folder, so the spec's
relative paths mean there what they mean here.

The output depends only on its inputs: compiling an unchanged spec gives the same
bytes, so prefect.yaml can be committed and diffed.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

from lanes.flows import ENTRYPOINT, FLOW_NAME
from lanes.settings import Settings
from lanes.spec import Schedule, Spec, Workload

POOL_TYPE = "process"


def schedule_of(workload: Workload, settings: Settings) -> tuple[Schedule, bool]:
    """The workload's own schedule, or the default off-peak window (and True).
    `lanes plan` shows the same (router.plan imports this)."""
    if workload.schedule is not None:
        return workload.schedule, False
    return settings.offpeak, True


def deployment(
    name: str, workload: Workload, settings: Settings, spec_param: str
) -> dict[str, Any]:
    """One entry of prefect.yaml's `deployments`."""
    schedule, is_default = schedule_of(workload, settings)
    when = "the default off-peak window" if is_default else "its schedule"
    description = workload.description or (
        f"Offline {workload.task} with model {workload.model}, on {when}."
    )
    return {
        "name": name,
        "description": description,
        "entrypoint": ENTRYPOINT,
        "parameters": {"workload": name, "spec": spec_param},
        "work_pool": {"name": settings.work_pool, "work_queue_name": None, "job_variables": {}},
        "schedules": [{"cron": schedule.cron, "timezone": schedule.timezone, "active": True}],
        "tags": ["lanes", "offline", workload.task],
    }


def render(spec: Spec, settings: Settings, spec_file: Path, project_dir: Path) -> str:
    """prefect.yaml's text for every offline workload of `spec`, in the spec's order."""
    project = project_dir.resolve()  # need not exist here: e.g. /app in a container image
    spec_path = spec_file.resolve()
    try:
        spec_param = spec_path.relative_to(project).as_posix()
    except ValueError:
        spec_param = str(spec_path)  # the spec lives outside the project folder
    document = {
        "name": project.name or "lanes",
        "prefect-version": version("prefect"),
        "build": None,
        "push": None,
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(project)}}],
        "deployments": [
            deployment(name, w, settings, spec_param)
            for name, w in spec.workloads.items()
            if w.mode == "offline"
        ],
    }
    header = (
        f"# Written by `lanes compile` from {spec_file.name}: flow {FLOW_NAME}, one deployment\n"
        "# per offline workload. Edit the workloads and recompile rather than this file.\n"
    )
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=100)
    return header + body


def write_prefect_yaml(
    spec: Spec,
    settings: Settings,
    spec_file: Path,
    dest: Path | None = None,
    project_dir: Path | None = None,
) -> Path:
    """Write prefect.yaml (default: beside the spec); rewrite only when it changes."""
    dest = dest or spec_file.resolve().parent / "prefect.yaml"
    text = render(spec, settings, spec_file, project_dir or spec_file.resolve().parent)
    if not dest.is_file() or dest.read_text(encoding="utf-8") != text:
        staged = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        staged.write_text(text, encoding="utf-8")
        staged.replace(dest)
    return dest
