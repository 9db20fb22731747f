"""The compiler: offline workloads -> prefect.yaml, one deployment per workload.

    lanes compile                      # writes ./prefect.yaml beside workloads.yaml
    prefect --no-prompt deploy --all   # registers every deployment, no questions

Each deployment runs `lanes.flows.batch:offline` (a module path: it works wherever lanes is
installed) with the workload's name as a parameter, on the workload's cron schedule
or, without one, the default off-peak window (`Settings.offpeak`), in the work pool
`Settings.work_pool`. The worker first changes to the project folder, so the spec's
relative paths mean there what they mean here, and the settings chosen here that the
runs must agree on travel in the deployment's `job_variables.env` (`work_pool`).

Where workers find the spec (`Source`): by default they run in the spec's folder. With
`project_dir` (e.g. /app in an image) the project is elsewhere: the folder prefect.yaml
is written to is taken as the project's root here (as Prefect takes the folder that
holds prefect.yaml), and the spec is named relative to it, never by this machine's
absolute path.

lanes marks the prefect.yaml it writes (`MARKER`, its first line) and never replaces one
without it: that one is the user's.

The output depends only on its inputs: compiling an unchanged spec gives the same
bytes, so prefect.yaml can be committed and diffed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

from lanes.batches import BATCH_DEPLOYMENT
from lanes.deadline import opening
from lanes.errors import InvalidInput, StorageError
from lanes.flows import ENTRYPOINT, FLOW_NAME
from lanes.schedule import Schedule
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec

POOL_TYPE = "process"
MARKER = "# Written by `lanes compile`"  # the first line of every prefect.yaml lanes writes
WORKING_DIRECTORY_STEP = "prefect.deployments.steps.set_working_directory"


@dataclass(frozen=True)
class Source:
    """Where a deployment's runs find the spec: the folder its worker changes to first,
    and the spec's path as given to the flow (relative to that folder when inside it)."""

    directory: str
    spec: str


def source_of(spec_file: Path, dest: Path, project_dir: Path | None = None) -> Source:
    """The `Source` of deployments compiled from `spec_file` into `dest`. Raises
    InvalidInput when `project_dir` is elsewhere and the spec is not inside the folder
    of `dest` (its workers could not find it)."""
    spec_path = spec_file.resolve()
    if project_dir is None:
        return Source(str(spec_path.parent), spec_path.name)
    project = project_dir.resolve()  # need not exist here: e.g. /app in a container image
    if spec_path.is_relative_to(project):
        return Source(str(project), spec_path.relative_to(project).as_posix())
    # The project lives elsewhere (an image): here, it is the folder of prefect.yaml.
    root = dest.resolve().parent
    if not spec_path.is_relative_to(root):
        raise InvalidInput(
            f"{spec_file} is outside {root}, the folder prefect.yaml goes to, which is "
            f"taken as the project that workers find at {project}: write prefect.yaml at "
            "the project's root (--output ROOT/prefect.yaml) or move the spec into it"
        )
    return Source(str(project), spec_path.relative_to(root).as_posix())


def schedule_of(workload: OfflineWorkload, settings: Settings) -> tuple[Schedule, bool]:
    """The schedule the deployment fires on, the opening of the workload's window: its
    own cron, or the default off-peak window (and True; lanes.deadline.opening).
    `lanes plan` shows the same (router.plan imports this)."""
    return opening(workload, settings)


def deployment(
    name: str, workload: OfflineWorkload, settings: Settings, spec_param: str
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
        "work_pool": work_pool(settings),
        "schedules": [{"cron": schedule.cron, "timezone": schedule.timezone, "active": True}],
        "tags": ["lanes", "offline", workload.task],
    }


def work_pool(settings: Settings) -> dict[str, Any]:
    """A deployment's `work_pool`: the pool, and as job variables the settings chosen
    here that its runs must agree on (`Settings.shared_env`: the off-peak window its
    cron was compiled from, the price, the allowed roots, the S3 endpoint and batch
    store). A worker knows only its own environment: without them its runs would plan
    deadlines on the default window while the deployment fires on this one. Prefect
    merges them over the pool's `env` and a process worker's own; nothing secret goes
    here (job variables are shown in Prefect's UI). The spec's overrides
    (LANES_WORKLOADS__..., LANES_MODELS__...) travel too: the deployment's schedule was
    compiled with them, and without them its runs would read another input, write
    another output or load another model than the one planned here."""
    env = {**settings.shared_env(), **settings.overrides_env()}
    variables = {"env": env} if env else {}
    return {"name": settings.work_pool, "work_queue_name": None, "job_variables": variables}


def batch_deployment(settings: Settings, spec_param: str) -> dict[str, Any]:
    """The deployment that runs the Batch API's batches of interactive workloads in the
    offline lane (lanes.batches): no schedule; each run names its workload."""
    return {
        "name": BATCH_DEPLOYMENT,
        "description": "Batches of interactive workloads from the endpoint's /v1/batches, "
        "run in the offline lane.",
        "entrypoint": ENTRYPOINT,
        "parameters": {"spec": spec_param, "lane": "offline"},
        "work_pool": work_pool(settings),
        # None (`schedules: null`), not []: a redeploy keeps what the deployment has
        # (none) either way, but Prefect warns of [] that it will clear schedules soon.
        "schedules": None,
        "tags": ["lanes", "offline", "batch"],
    }


def deployment_names(spec: Spec) -> list[str]:
    """The deployments `render` writes, in its order: one per offline workload, and the
    Batch API's when the spec has an interactive workload."""
    names = [name for name, w in spec.workloads.items() if w.mode == "offline"]
    if any(w.mode == "interactive" for w in spec.workloads.values()):
        names.append(BATCH_DEPLOYMENT)
    return names


def render(spec: Spec, settings: Settings, spec_file: Path, source: Source) -> str:
    """prefect.yaml's text for every offline workload of `spec`, in the spec's order."""
    deployments = [
        deployment(name, w, settings, source.spec)
        for name, w in spec.workloads.items()
        if w.mode == "offline"
    ]
    if any(w.mode == "interactive" for w in spec.workloads.values()):
        deployments.append(batch_deployment(settings, source.spec))
    document = {
        "name": Path(source.directory).name or "lanes",
        "prefect-version": version("prefect"),
        "build": None,
        "push": None,
        "pull": [{WORKING_DIRECTORY_STEP: {"directory": source.directory}}],
        "deployments": deployments,
    }
    header = (
        f"{MARKER} from {spec_file.name}: flow {FLOW_NAME}, one deployment\n"
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
    force: bool = False,
) -> Path:
    """Write prefect.yaml (default: beside the spec); rewrite only when it changes.
    A prefect.yaml that lanes did not write is refused (InvalidInput) unless `force`; a
    `dest` in no folder, or that is a folder, is InvalidInput; one that cannot be
    written, StorageError."""
    dest = dest or spec_file.resolve().parent / "prefect.yaml"
    text = render(spec, settings, spec_file, source_of(spec_file, dest, project_dir))
    if dest.is_dir():
        raise InvalidInput(f"{dest} is a folder: name the file, e.g. {dest / 'prefect.yaml'}")
    if not dest.parent.is_dir():
        raise InvalidInput(
            f"{dest}: there is no folder {dest.parent}; create it, or write elsewhere"
        )
    try:
        _write_if_changed(dest, text, force)
    except OSError as err:
        raise StorageError(f"cannot write {dest}: {err.strerror or err}") from None
    return dest


def _write_if_changed(dest: Path, text: str, force: bool) -> None:
    if not force and not written_by_lanes(dest):
        raise InvalidInput(
            f"{dest} was not written by lanes compile (its first line is not {MARKER!r}): "
            "lanes will not replace it; write lanes' file elsewhere with --output (e.g. "
            "--output lanes-prefect.yaml; `prefect deploy` then needs --prefect-file "
            "lanes-prefect.yaml), or pass --force to replace it"
        )
    if not dest.is_file() or dest.read_text(encoding="utf-8") != text:
        staged = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        staged.write_text(text, encoding="utf-8")
        staged.replace(dest)


def written_by_lanes(path: Path) -> bool:
    """True when `path` does not exist or starts with lanes' marker line."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(MARKER)
    except FileNotFoundError:
        return True
