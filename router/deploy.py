"""`lanes deploy`: compile, make sure the work pool exists, `prefect deploy --all`, then
remove the deployments of workloads the spec no longer has.

Against the Prefect API in PREFECT_API_URL (or the active Prefect profile). The
deploy itself is Prefect's own CLI on the compiled prefect.yaml, so what lanes
registers is exactly what a person running `prefect deploy --all` would.

Removed, not paused: a deployment whose workload is gone from the spec can only
fail (its flow finds no such workload), so keeping it paused would leave a trap for
`prefect deployment run` and for submitted jobs; the spec is the declaration, and
adding the workload back and deploying makes it anew. Finished flow runs stay in
Prefect; scheduled ones go with the deployment. Only deployments compiled from the
same spec are touched: flow `lanes-offline`, the same work pool, the same working
directory and spec path (`flows.compile.Source`); other projects' are left alone.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lanes.batches import BATCH_DEPLOYMENT
from lanes.errors import LanesError
from lanes.flows import FLOW_NAME
from lanes.flows.compile import (
    POOL_TYPE,
    WORKING_DIRECTORY_STEP,
    Source,
    source_of,
    write_prefect_yaml,
)
from lanes.settings import Settings
from lanes.spec import Spec

DEPLOY_TIMEOUT_S = 300


@dataclass(frozen=True)
class Deployed:
    prefect_yaml: Path
    pool: str
    pool_created: bool
    deployments: list[str]  # "flow/deployment"
    removed: list[str]  # "flow/deployment": compiled from this spec, no longer in it
    output: str  # what prefect deploy printed


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
    names = [n for n, w in spec.workloads.items() if w.mode == "offline"]
    if any(w.mode == "interactive" for w in spec.workloads.values()):
        names.append(BATCH_DEPLOYMENT)  # the Batch API's runs of interactive workloads
    if not names:
        raise LanesError(f"{spec_file}: no workloads to deploy")
    try:
        created = ensure_work_pool(settings.work_pool)
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
    deployed = [f"{FLOW_NAME}/{n}" for n in names]
    return Deployed(path, settings.work_pool, created, deployed, removed, output)


def remove_dropped(names: set[str], source: Source, pool: str) -> list[str]:
    """Delete the deployments compiled from `source` into `pool` whose workload is not
    in `names`. Returns them, as "flow/deployment"."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.exceptions import ObjectNotFound

    page = 200
    flows = FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))
    removed: list[str] = []
    with get_client(sync_client=True) as client:
        found = []
        for offset in itertools.count(0, page):  # ends at the first short page
            batch = client.read_deployments(flow_filter=flows, limit=page, offset=offset)
            found += batch
            if len(batch) < page:
                break
        for deployment in found:
            parameters = deployment.parameters or {}
            directories = [
                step[WORKING_DIRECTORY_STEP].get("directory")
                for step in deployment.pull_steps or []
                if WORKING_DIRECTORY_STEP in step
            ]
            ours = (
                deployment.work_pool_name == pool
                and parameters.get("spec") == source.spec
                and directories == [source.directory]
            )
            if ours and deployment.name not in names:
                try:
                    client.delete_deployment(deployment.id)
                except ObjectNotFound:
                    continue  # removed meanwhile
                removed.append(f"{FLOW_NAME}/{deployment.name}")
    return removed
