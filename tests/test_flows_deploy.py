"""End to end on a real Prefect server: compile, deploy, trigger, a process worker runs it.

Starts `prefect server start` (SQLite in a temporary PREFECT_HOME) on 127.0.0.1 at a
free port, one for the module, and drives it only through command lines, as a person
would. Each test keeps to its own work pool and deployment names, so none sees
another's deployments, runs or pool.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.flows_fixtures import outputs_of, write_jsonl, write_spec
from tests.prefect_server import PREFECT, PrefectServer, call_api

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LANES = [sys.executable, "-m", "lanes.router.cli"]  # the `lanes` command, from this venv


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real Prefect server; yields the environment that points at it."""
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server.wait()


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args} failed:\n{output}"
    return output


def test_compile_deploy_and_a_process_worker_run_the_workload(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    # A pool of its own (the README's test below makes `lanes`, the default).
    env = {**prefect_server, "LANES_WORK_POOL": "compiled"}
    api = prefect_server["PREFECT_API_URL"]
    project = tmp_path / "project"
    workload = {
        "mode": "offline",
        "task": "infer",
        "model": "affine",
        "input": "in/",
        "output": "out/",
        "schedule": {"cron": "45 3 * * *", "timezone": "Europe/Berlin"},
    }
    spec = write_spec(project, {"nightly": workload})
    for shard in range(2):
        records = [{"id": f"{shard}-{i}", "x": [[i, 1, 2, 3]]} for i in range(5)]
        write_jsonl(project / "in" / f"part-{shard}.jsonl", records)
    lanes = [sys.executable, "-m", "lanes.router.cli"]  # the `lanes` command, from this venv

    _run([*lanes, "compile", str(spec)], env, project)
    compiled = yaml.safe_load((project / "prefect.yaml").read_text())
    assert [d["name"] for d in compiled["deployments"]] == ["nightly"]

    # lanes deploy: makes the missing work pool, then `prefect deploy --all`.
    deployed = _run([*lanes, "deploy", str(spec)], env, project)
    assert "work pool 'compiled' (created)" in deployed
    assert "lanes-offline/nightly  45 3 * * * (Europe/Berlin)" in deployed
    found = call_api("GET", f"{api}/deployments/name/lanes-offline/nightly").json()
    (schedule,) = found["schedules"]
    assert schedule["schedule"]["cron"] == "45 3 * * *"
    assert schedule["schedule"]["timezone"] == "Europe/Berlin"
    assert found["parameters"] == {"workload": "nightly", "spec": "workloads.yaml"}

    prefect = PREFECT
    _run([*prefect, "deployment", "run", "lanes-offline/nightly"], env, tmp_path)
    _run([*prefect, "worker", "start", "--pool", "compiled", "--run-once"], env, tmp_path, 240)

    runs: list[dict[str, Any]] = call_api(
        "POST",
        f"{api}/flow_runs/filter",
        json={"deployments": {"id": {"any_": [found["id"]]}}, "sort": "START_TIME_DESC"},
    ).json()
    finished = [r for r in runs if r["state_type"] == "COMPLETED"]
    assert len(finished) == 1, [(r["name"], r["state_type"]) for r in runs]
    lines = outputs_of(project / "out")
    assert sorted(line["id"] for line in lines) == sorted(
        f"{s}-{i}" for s in range(2) for i in range(5)
    )
    assert {tuple(line["y"][0]) for line in lines if line["id"] == "1-3"} == {(7.0, 3.0, 5.0, 7.0)}


def _workload(**fields: Any) -> dict[str, Any]:
    base = {"mode": "offline", "task": "infer", "model": "affine", "input": "in/"}
    return {
        **base,
        "output": "out/",
        "schedule": {"cron": "0 4 * * *", "timezone": "UTC"},
        **fields,
    }


def _deployment(api: str, name: str) -> int:
    return httpx.get(f"{api}/deployments/name/lanes-offline/{name}", timeout=10).status_code


def test_lanes_deploy_removes_the_deployments_the_spec_no_longer_has(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    env = {**prefect_server, "LANES_WORK_POOL": "removals"}
    api = prefect_server["PREFECT_API_URL"]
    first = write_spec(
        tmp_path / "first", {"daily": _workload(), "weekly": _workload(output="out-weekly/")}
    )
    other = write_spec(tmp_path / "other", {"theirs": _workload()})  # another project
    _run([*LANES, "deploy", str(first)], env, first.parent)
    _run([*LANES, "deploy", str(other)], env, other.parent)
    assert [_deployment(api, n) for n in ("daily", "weekly", "theirs")] == [200, 200, 200]

    write_spec(tmp_path / "first", {"daily": _workload()})  # weekly is gone from the spec
    deployed = _run([*LANES, "deploy", str(first)], env, first.parent)

    assert f"lanes-offline/weekly  removed: no longer in {first}" in deployed
    assert [_deployment(api, n) for n in ("daily", "weekly", "theirs")] == [200, 404, 200]
    again = _run([*LANES, "deploy", str(first)], env, first.parent)
    assert "removed" not in again

    # A prefect.yaml that lanes did not write stops lanes deploy before it touches Prefect.
    (first.parent / "prefect.yaml").write_text("deployments: []\n")
    write_spec(tmp_path / "first", {"other-name": _workload()})
    refused = subprocess.run(
        [*LANES, "deploy", str(first)], env=env, cwd=first.parent, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "was not written by lanes compile" in refused.stderr
    assert (first.parent / "prefect.yaml").read_text() == "deployments: []\n"
    assert _deployment(api, "daily") == 200


def test_the_settings_a_deployment_was_compiled_with_reach_its_runs(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    """A process worker knows only its own environment: the settings chosen where
    `lanes deploy` ran, which the deployment depends on (its cron is the off-peak
    window's), travel in its job variables and reach its runs on a worker without them."""
    env = {**prefect_server, "LANES_WORK_POOL": "chosen"}
    api = prefect_server["PREFECT_API_URL"]
    chosen = {
        "LANES_ALLOWED_INPUT_ROOTS": json.dumps([str(tmp_path / "shared")]),
        "LANES_OFFPEAK__CRON": "20 1 * * *",
        "LANES_OFFPEAK__TIMEZONE": "Asia/Tokyo",
        "LANES_PRICE_PER_DEVICE_HOUR": "3.5",
    }
    assert not set(chosen) & set(env)  # the worker below has none of them
    project = tmp_path / "project"
    workload = {k: v for k, v in _workload().items() if k != "schedule"}
    spec = write_spec(project, {"offpeak": workload})
    write_jsonl(project / "in" / "part-0.jsonl", [{"id": i, "x": [[i, 1, 2, 3]]} for i in range(3)])

    _run([*LANES, "deploy", str(spec)], {**env, **chosen}, project)
    found = call_api("GET", f"{api}/deployments/name/lanes-offline/offpeak").json()
    (schedule,) = found["schedules"]
    assert (schedule["schedule"]["cron"], schedule["schedule"]["timezone"]) == (
        "20 1 * * *",
        "Asia/Tokyo",
    )
    assert found["job_variables"] == {"env": chosen}

    _run([*PREFECT, "deployment", "run", "lanes-offline/offpeak"], env, tmp_path)
    _run([*PREFECT, "worker", "start", "--pool", "chosen", "--run-once"], env, tmp_path, 240)
    manifest = json.loads((project / "out" / "_manifest.json").read_text())
    assert manifest["outputs"] == 3
    assert manifest["price_per_device_hour"] == 3.5  # the deployer's, not the default


def test_deploying_with_a_value_that_replaces_the_kubernetes_pools_says_so(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    """The pool `lanes render k8s` wrote gives the Jobs the in-cluster S3 endpoint; a
    deploy through a port-forward with LANES_S3_ENDPOINT set would put its own in every
    deployment's job variables, which Prefect merges over the pool's env: every Job
    would get 127.0.0.1. `lanes deploy` names the variable and both values; with the
    pool's own value, or unset, it says nothing."""
    env = {**prefect_server, "LANES_WORK_POOL": "rendered"}
    api = prefect_server["PREFECT_API_URL"]
    project = tmp_path / "project"
    spec = write_spec(project, {"nightly": _workload()})
    in_cluster = "http://minio.lanes.svc:9000"
    rendered = tmp_path / "k8s"
    render = [*LANES, "render", "k8s", str(spec), "--image", "i", "--worker-image", "w"]
    _run([*render, "--out", str(rendered)], {**env, "LANES_S3_ENDPOINT": in_cluster}, project)
    template = json.loads((rendered / "work-pool-rendered.json").read_text())
    pool = {"name": "rendered", "type": "kubernetes", "base_job_template": template}
    call_api("POST", f"{api}/work_pools/", json=pool)

    forwarded = {**env, "LANES_S3_ENDPOINT": "http://127.0.0.1:9000"}
    said = _run([*LANES, "deploy", str(spec)], forwarded, project)
    assert (
        "warning: LANES_S3_ENDPOINT=http://127.0.0.1:9000 here replaces the work pool's "
        f"LANES_S3_ENDPOINT={in_cluster} in every flow run" in said
    )
    for quiet in ({**env, "LANES_S3_ENDPOINT": in_cluster}, env):
        assert "warning" not in _run([*LANES, "deploy", str(spec)], quiet, project)


def test_prefect_deploy_redeploys_the_batch_api_deployment_without_a_warning(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    """The Batch API's deployment has no schedule. A redeploy by Prefect's own CLI, as
    a person runs it, prints no FutureWarning about it (Prefect will clear schedules on
    an empty list), and the deployment still has none."""
    env = {**prefect_server, "LANES_WORK_POOL": "batches"}
    api = prefect_server["PREFECT_API_URL"]
    project = tmp_path / "project"
    spec = write_spec(
        project, {"live": {"mode": "interactive", "task": "infer", "model": "affine"}}
    )
    _run([*LANES, "deploy", str(spec)], env, project)  # compiled, its pool made, deployed
    again = _run([*PREFECT, "deploy", "--all"], env, project)
    assert "Warning" not in again, again
    found = call_api("GET", f"{api}/deployments/name/lanes-offline/openai_batch").json()
    assert found["schedules"] == []


def _readme_block(heading: str) -> list[str]:
    """The command lines of the first bash block under `heading` in infra/README.md."""
    text = (ROOT / "infra" / "README.md").read_text()
    section = text.split(heading, 1)[1]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found, f"no bash block under {heading!r}"
    return [line for line in found.group(1).splitlines() if line.strip()]


def test_prefect_deploy_as_the_readme_says_in_a_project_that_runs_elsewhere(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    """infra/README.md's "With Prefect's own CLI", as written, with /app standing for an
    image's folder: the project is copied there and gone from where it was compiled."""
    env = prefect_server
    source, app = tmp_path / "source", tmp_path / "app"
    spec = write_spec(source, {"relocated": _workload()})
    relocatable(spec)
    write_jsonl(source / "in" / "part-0.jsonl", [{"id": i, "x": [[i, 1, 2, 3]]} for i in range(4)])

    commands = _readme_block("### With Prefect's own CLI")
    assert [line.split()[0] for line in commands] == ["lanes", "prefect", "prefect"]
    for line in commands:
        args = shlex.split(line.replace("/app", str(app)), comments=True)
        program = {"lanes": LANES, "prefect": PREFECT}[args[0]]
        _run([*program, *args[1:]], env, source)

    shutil.copytree(source, app)  # the image's build
    shutil.rmtree(source)  # the machine that compiled it is not where it runs
    _run([*PREFECT, "deployment", "run", "lanes-offline/relocated"], env, tmp_path)
    _run([*PREFECT, "worker", "start", "--pool", "lanes", "--run-once"], env, tmp_path, 240)

    assert sorted(line["id"] for line in outputs_of(app / "out")) == [0, 1, 2, 3]
    assert not source.exists()


def relocatable(spec: Path) -> None:
    """Model paths relative to the spec's folder, so the project can move as a whole."""
    document = yaml.safe_load(spec.read_text())
    for model in document["models"].values():
        for key in ("path", "tokenizer"):
            if key in model:
                model[key] = os.path.relpath(model[key], spec.parent)
    spec.write_text(yaml.safe_dump(document, sort_keys=False))
