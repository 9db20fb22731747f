"""`lanes deploy`: compile, make sure the work pool exists, `prefect deploy --all`, then
remove the deployments of workloads the spec no longer has.

Against the Prefect API in PREFECT_API_URL (or the active Prefect profile). The
deploy itself is Prefect's own CLI on the compiled prefect.yaml, so what lanes
registers is exactly what a person running `prefect deploy --all` would.

Removed, not paused: a deployment whose workload is gone from the spec can only
fail (its flow finds no such workload), so keeping it paused would leave a trap for
`prefect deployment run` and for submitted jobs; the spec is the declaration, and
adding the workload back and deploying makes it anew. Finished flow runs stay in
Prefect; scheduled ones go with the deployment.

A deadline's deferred runs (flows.start: tagged lanes-deadline, with `planned_start`)
were planned under the schedule before the deploy and never plan again, so each is
replaced by a run due now that plans afresh (`replan_deferred`); the deferred run it
then makes is one per window, whoever else plans that window. Only deployments
compiled from the same spec are touched: flow `lanes-offline`, the same work pool, the
same working directory and spec path (`flows.compile.Source`); other projects' are
left alone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from lanes.errors import LanesError
from lanes.flows import FLOW_NAME
from lanes.flows.compile import (
    POOL_TYPE,
    WORKING_DIRECTORY_STEP,
    Source,
    deployment_names,
    source_of,
    work_pool,
    write_prefect_yaml,
)
from lanes.flows.start import DEADLINE_TAG
from lanes.settings import Settings
from lanes.spec import OfflineWorkload, Spec

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.responses import DeploymentResponse as Deployment

DEPLOY_TIMEOUT_S = 300
PAGE = 200  # deployments or flow runs read from Prefect at a time

T = TypeVar("T")


@dataclass(frozen=True)
class Deployed:
    prefect_yaml: Path
    pool: str
    pool_created: bool
    deployments: list[str]  # "flow/deployment"
    removed: list[str]  # "flow/deployment": compiled from this spec, no longer in it
    replanned: list[Replanned]  # deferred runs planned under the schedule before
    output: str  # what prefect deploy printed
    shadowed: list[Shadowed]  # the pool's env values the deployments' replace


@dataclass(frozen=True)
class Shadowed:
    """A variable that the deployments' job variables (the settings where lanes deploy
    ran) set to another value than the pool's own env (e.g. what `lanes render k8s`
    gave the Kubernetes Jobs): Prefect merges the deployment's env over the pool's, so
    `here` is what every flow run gets."""

    name: str
    here: str
    pool: str


@dataclass(frozen=True)
class Replanned:
    """A deferred run of a deadline (flows.start) that `lanes deploy` replaced."""

    deployment: str  # "flow/deployment"
    run: str  # the deferred run's id, now deleted
    due: datetime | None  # when it was to start
    replacement: str | None  # the run that plans again; None: the cron fires next


def api_url() -> str | None:
    """The Prefect API this process would talk to (None: ephemeral, no server)."""
    from prefect.settings import PREFECT_API_URL

    value = PREFECT_API_URL.value()
    return str(value) if value else None


def ensure_work_pool(name: str) -> bool:
    """Create the work pool (type process, Prefect's default job template) if it is
    missing. Returns True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pool = WorkPoolCreate(
                name=name,
                type=POOL_TYPE,
                base_job_template=ProcessWorker.get_default_base_job_template(),
            )
            client.create_work_pool(pool)
            return True


def pool_env(name: str) -> dict[str, str]:
    """The env the work pool gives each flow run (its base job template's `env`
    default); empty for a pool without one, such as a process pool's."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        template = client.read_work_pool(name).base_job_template
    env = template.get("variables", {}).get("properties", {}).get("env", {}).get("default")
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def shadowed(pool: dict[str, str], deployments: dict[str, str]) -> list[Shadowed]:
    """The variables both set, to different values, sorted by name."""
    both = sorted(set(pool) & set(deployments))
    return [Shadowed(k, deployments[k], pool[k]) for k in both if pool[k] != deployments[k]]


def deploy(
    spec: Spec,
    spec_file: Path,
    settings: Settings,
    dest: Path | None = None,
    project_dir: Path | None = None,
    force: bool = False,
) -> Deployed:
    """Compile (as `lanes compile` does with `dest`, `project_dir`, `force`), register
    every offline workload, and remove the deployments of workloads no longer in the
    spec. Raises LanesError with Prefect's own output when the deploy fails."""
    url = api_url()
    if url is None:
        raise LanesError(
            "lanes deploy registers deployments on a Prefect server, and none is set: "
            "start one (`prefect server start`) and set PREFECT_API_URL, e.g. "
            "http://127.0.0.1:4200/api"
        )
    path = write_prefect_yaml(spec, settings, spec_file, dest, project_dir, force)
    names = deployment_names(spec)  # the Batch API's too, with interactive workloads
    if not names:
        raise LanesError(f"{spec_file}: no workloads to deploy")
    try:
        created = ensure_work_pool(settings.work_pool)
        env_of_pool = pool_env(settings.work_pool)
    except Exception as err:  # httpx and Prefect raise many kinds for one cause
        raise LanesError(
            f"cannot reach the Prefect API at {url} to check work pool "
            f"{settings.work_pool!r}: {err}; is the server up?"
        ) from err
    command = [
        sys.executable,
        "-m",
        "prefect",
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        str(path),
    ]
    env = {**os.environ, "PREFECT_API_URL": url}
    try:
        done = subprocess.run(
            command,
            cwd=path.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEPLOY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise LanesError(f"prefect deploy took over {DEPLOY_TIMEOUT_S} s; is {url} up?") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise LanesError(f"prefect deploy failed (exit {done.returncode}):\n{output.strip()}")
    source = source_of(spec_file, path, project_dir)
    removed = remove_dropped(set(names), source, settings.work_pool)
    replanned = replan_deferred(spec, source, settings.work_pool)
    deployed = [f"{FLOW_NAME}/{n}" for n in names]
    carried = work_pool(settings)["job_variables"].get("env", {})
    return Deployed(
        path,
        settings.work_pool,
        created,
        deployed,
        removed,
        replanned,
        output,
        shadowed(env_of_pool, carried),
    )


def remove_dropped(names: set[str], source: Source, pool: str) -> list[str]:
    """Delete the deployments compiled from `source` into `pool` whose workload is not
    in `names`. Returns them, as "flow/deployment"."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    removed: list[str] = []
    with get_client(sync_client=True) as client:
        for deployment in _ours(client, source, pool):
            if deployment.name in names:
                continue
            try:
                client.delete_deployment(deployment.id)
            except ObjectNotFound:
                continue  # removed meanwhile
            removed.append(f"{FLOW_NAME}/{deployment.name}")
    return removed


def replan_deferred(spec: Spec, source: Source, pool: str) -> list[Replanned]:
    """Replace the deferred runs (flows.start) of the workloads deployed from `source`:
    each was planned under the schedule before this deploy, and a run with
    `planned_start` never plans again. A workload that still has a `finish_by` gets a
    run due now in its place, which plans its start under the new schedule; one with
    none has its cron's next firing. Returns what was done, run by run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Scheduled

    done: list[Replanned] = []
    with get_client(sync_client=True) as client:
        # The Batch API's deployment is no workload: its runs plan nothing.
        ours = {d.id: d for d in _ours(client, source, pool) if d.name in spec.workloads}
        if not ours:
            return done
        deferred = FlowRunFilter(
            tags=FlowRunFilterTags(all_=[DEADLINE_TAG]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
        )
        of_ours = DeploymentFilter(id=DeploymentFilterId(any_=list(ours)))
        runs = _pages(
            lambda limit, offset: client.read_flow_runs(
                flow_run_filter=deferred, deployment_filter=of_ours, limit=limit, offset=offset
            )
        )
        for run in runs:
            if run.deployment_id not in ours:
                continue
            deployment = ours[run.deployment_id]
            replacement: str | None = None
            # Deleted first: a replan that ran before it would find this run under the
            # window's key, keep it, and the delete would leave the window with none.
            # Prefect deletes whatever the state: one that started in the moment since
            # it was read goes too (a wart; its committed shards stay committed).
            with contextlib.suppress(ObjectNotFound):  # removed meanwhile
                client.delete_flow_run(run.id)
            if has_deadline(spec, deployment.name):
                parameters = {k: v for k, v in run.parameters.items() if k != "planned_start"}
                made = client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters=parameters,
                    state=Scheduled(),
                    name=f"{deployment.name}-replan",
                )
                replacement = str(made.id)
            due = run.next_scheduled_start_time or run.expected_start_time
            name = f"{FLOW_NAME}/{deployment.name}"
            done.append(Replanned(name, str(run.id), due, replacement))
    return done


def has_deadline(spec: Spec, name: str) -> bool:
    workload = spec.workloads.get(name)
    schedule = workload.schedule if isinstance(workload, OfflineWorkload) else None
    return schedule is not None and schedule.finish_by is not None


def _ours(client: SyncPrefectClient, source: Source, pool: str) -> list[Deployment]:
    """The deployments compiled from `source` into `pool` (flow lanes-offline, the same
    working directory and spec path); other projects' are not."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
    found = _pages(
        lambda limit, offset: client.read_deployments(flow_filter=flows, limit=limit, offset=offset)
    )
    ours = []
    for deployment in found:
        parameters = deployment.parameters or {}
        directories = [
            step[WORKING_DIRECTORY_STEP].get("directory")
            for step in deployment.pull_steps or []
            if WORKING_DIRECTORY_STEP in step
        ]
        if (
            deployment.work_pool_name == pool
            and parameters.get("spec") == source.spec
            and directories == [source.directory]
        ):
            ours.append(deployment)
    return ours


def _pages(read: Callable[[int, int], list[T]]) -> list[T]:
    """Every item `read(limit, offset)` pages through: it ends at the first short page."""
    found: list[T] = []
    for offset in itertools.count(0, PAGE):
        page = read(PAGE, offset)
        found += page
        if len(page) < PAGE:
            return found
    raise AssertionError("unreachable")  # itertools.count never ends
