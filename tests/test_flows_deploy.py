"""End to end on a real Prefect server: compile, deploy, trigger, a process worker runs it.

Starts `prefect server start` (SQLite in a temporary PREFECT_HOME) on 127.0.0.1 at a
free port, and drives it only through command lines, as a person would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.flows_fixtures import outputs_of, write_jsonl, write_spec
from tests.prefect_server import PREFECT, PrefectServer

pytestmark = pytest.mark.slow


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real Prefect server; yields the environment that points at it."""
    with PrefectServer(tmp_path / "prefect-home") as server:
        yield server.wait()


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args} failed:\n{output}"
    return output


def test_compile_deploy_and_a_process_worker_run_the_workload(
    prefect_server: dict[str, str], tmp_path: Path
) -> None:
    env, api = prefect_server, prefect_server["PREFECT_API_URL"]
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
    assert "work pool 'lanes' (created)" in deployed
    assert "lanes-offline/nightly  45 3 * * * (Europe/Berlin)" in deployed
    found = httpx.get(f"{api}/deployments/name/lanes-offline/nightly", timeout=10).json()
    (schedule,) = found["schedules"]
    assert schedule["schedule"]["cron"] == "45 3 * * *"
    assert schedule["schedule"]["timezone"] == "Europe/Berlin"
    assert found["parameters"] == {"workload": "nightly", "spec": "workloads.yaml"}

    prefect = PREFECT
    _run([*prefect, "deployment", "run", "lanes-offline/nightly"], env, tmp_path)
    _run([*prefect, "worker", "start", "--pool", "lanes", "--run-once"], env, tmp_path, 240)

    runs: list[dict[str, Any]] = httpx.post(
        f"{api}/flow_runs/filter",
        json={"deployments": {"id": {"any_": [found["id"]]}}, "sort": "START_TIME_DESC"},
        timeout=10,
    ).json()
    finished = [r for r in runs if r["state_type"] == "COMPLETED"]
    assert len(finished) == 1, [(r["name"], r["state_type"]) for r in runs]
    lines = outputs_of(project / "out")
    assert sorted(line["id"] for line in lines) == sorted(
        f"{s}-{i}" for s in range(2) for i in range(5)
    )
    assert {tuple(line["y"][0]) for line in lines if line["id"] == "1-3"} == {(7.0, 3.0, 5.0, 7.0)}
