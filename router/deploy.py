"""`lanes deploy`: compile, make sure the work pool exists, `prefect deploy --all`.

Against the Prefect API in PREFECT_API_URL (or the active Prefect profile). The
deploy itself is Prefect's own CLI on the compiled prefect.yaml, so what lanes
registers is exactly what a person running `prefect deploy --all` would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lanes.errors import LanesError
from lanes.flows import FLOW_NAME
from lanes.flows.compile import POOL_TYPE, write_prefect_yaml
from lanes.settings import Settings
from lanes.spec import Spec

DEPLOY_TIMEOUT_S = 300


@dataclass(frozen=True)
class Deployed:
    prefect_yaml: Path
    pool: str
    pool_created: bool
    deployments: list[str]  # "flow/deployment"
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


def deploy(spec: Spec, spec_file: Path, settings: Settings) -> Deployed:
    """Compile and register every offline workload. Raises LanesError with Prefect's
    own output when the deploy fails."""
    url = api_url()
    if url is None:
        raise LanesError(
            "lanes deploy registers deployments on a Prefect server, and none is set: "
            "start one (`prefect server start`) and set PREFECT_API_URL, e.g. "
            "http://127.0.0.1:4200/api"
        )
    path = write_prefect_yaml(spec, settings, spec_file)
    names = [n for n, w in spec.workloads.items() if w.mode == "offline"]
    if not names:
        raise LanesError(f"{spec_file}: no offline workloads to deploy")
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
    return Deployed(path, settings.work_pool, created, [f"{FLOW_NAME}/{n}" for n in names], output)
