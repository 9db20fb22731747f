"""flows.compile: offline workloads -> prefect.yaml, stable to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from lanes.flows import ENTRYPOINT, FLOW_NAME
from lanes.flows.compile import render, schedule_of, write_prefect_yaml
from lanes.router import plan as router_plan
from lanes.router.offline_cli import compile as compile_command
from lanes.settings import Settings
from lanes.specfile import load_spec
from tests.flows_fixtures import write_spec

WORKLOADS = {
    "live": {"mode": "interactive", "task": "infer", "model": "affine"},
    "nightly": {
        "mode": "offline",
        "task": "embed",
        "model": "enc",
        "input": "in/",
        "output": "out/",
        "schedule": {"cron": "30 1 * * *", "timezone": "Europe/Paris"},
        "description": "Embed the corpus overnight.",
    },
    "whenever": {
        "mode": "offline",
        "task": "infer",
        "model": "affine",
        "input": "s3://bucket/in/",
        "output": "s3://bucket/out/",
    },
}


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    return write_spec(tmp_path, WORKLOADS)


def test_one_deployment_per_offline_workload(spec_file: Path) -> None:
    settings = Settings()
    path = write_prefect_yaml(load_spec(spec_file, settings), settings, spec_file)
    assert path == spec_file.parent / "prefect.yaml"
    document = yaml.safe_load(path.read_text())
    assert document["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(spec_file.parent)}}
    ]
    nightly, whenever = document["deployments"]
    assert nightly == {
        "name": "nightly",
        "description": "Embed the corpus overnight.",
        "entrypoint": ENTRYPOINT,
        "parameters": {"workload": "nightly", "spec": "workloads.yaml"},
        "work_pool": {"name": "lanes", "work_queue_name": None, "job_variables": {}},
        "schedules": [{"cron": "30 1 * * *", "timezone": "Europe/Paris", "active": True}],
        "tags": ["lanes", "offline", "embed"],
    }
    # No schedule of its own: the default off-peak window.
    assert whenever["schedules"] == [{"cron": "0 2 * * *", "timezone": "UTC", "active": True}]
    assert "default off-peak window" in whenever["description"]


def test_recompiling_an_unchanged_spec_gives_the_same_bytes(spec_file: Path) -> None:
    settings = Settings()
    path = write_prefect_yaml(load_spec(spec_file, settings), settings, spec_file)
    first = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    write_prefect_yaml(load_spec(spec_file, Settings()), Settings(), spec_file)
    assert path.read_bytes() == first
    assert path.stat().st_mtime_ns == mtime  # not even rewritten


def test_settings_choose_the_pool_and_the_off_peak_window(
    spec_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_WORK_POOL", "gpu-pool")
    monkeypatch.setenv("LANES_OFFPEAK__CRON", "15 3 * * 6")
    monkeypatch.setenv("LANES_OFFPEAK__TIMEZONE", "America/New_York")
    settings = Settings()
    text = render(load_spec(spec_file, settings), settings, spec_file, Path("/app"))
    document = yaml.safe_load(text)
    whenever = document["deployments"][1]
    assert whenever["work_pool"]["name"] == "gpu-pool"
    assert whenever["schedules"][0] == {
        "cron": "15 3 * * 6",
        "timezone": "America/New_York",
        "active": True,
    }
    assert document["pull"][0]["prefect.deployments.steps.set_working_directory"] == {
        "directory": "/app"
    }
    # The spec lives outside /app here, so the parameter names it in full.
    assert whenever["parameters"]["spec"] == str(spec_file)


def test_the_compiler_and_lanes_plan_agree(spec_file: Path) -> None:
    settings = Settings()
    spec = load_spec(spec_file, settings)
    assert router_plan.OFFLINE_FLOW == FLOW_NAME
    for workload in spec.workloads.values():
        assert schedule_of(workload, settings) == router_plan.schedule_of(workload, settings)
    planned = {r.deployment for r in router_plan.plan(spec, settings) if r.deployment}
    assert planned == {f"{FLOW_NAME}/nightly", f"{FLOW_NAME}/whenever"}


def test_the_entrypoint_is_the_flow() -> None:
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(ENTRYPOINT, use_placeholder_flow=False)
    assert flow.name == FLOW_NAME
    assert set(flow.parameters.properties) == {"workload", "spec", "input", "output", "rerun"}
    assert flow.parameters.properties["rerun"]["enum"] == ["uncommitted", "errors", "all"]


def test_lanes_compile_command(spec_file: Path) -> None:
    app = typer.Typer()
    app.command("compile")(compile_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["compile", str(spec_file)])
    assert result.exit_code == 0, result.output
    assert "2 deployment(s) (nightly, whenever)" in result.output
    assert (spec_file.parent / "prefect.yaml").is_file()
    broken = spec_file.parent / "broken.yaml"
    broken.write_text("version: 1\nmodels: {}\nworkloads: {x: {mode: offline}}\n")
    result = CliRunner().invoke(app, ["compile", str(broken)])
    assert result.exit_code == 2 and "missing required key 'task'" in result.output
