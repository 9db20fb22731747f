"""flows.compile: offline workloads -> prefect.yaml, stable to the byte."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from lanes.errors import LanesError
from lanes.flows import ENTRYPOINT, FLOW_NAME
from lanes.flows.compile import MARKER, render, schedule_of, source_of, write_prefect_yaml
from lanes.router import plan as router_plan
from lanes.router.offline_cli import compile as compile_command
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
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
    nightly, whenever, batches = document["deployments"]
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
    # The spec has an interactive workload: the Batch API runs its batches offline here.
    assert batches["name"] == "openai_batch" and batches["schedules"] is None
    assert batches["parameters"] == {"spec": "workloads.yaml", "lane": "offline"}


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
    source = source_of(spec_file, spec_file.parent / "prefect.yaml", Path("/app"))
    text = render(load_spec(spec_file, settings), settings, spec_file, source)
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
    # The project is at /app there and in the folder of prefect.yaml here: the spec
    # is named relative to it, never by this machine's path.
    assert whenever["parameters"]["spec"] == "workloads.yaml"
    # Its runs plan their deadlines on the window it fires on, whatever the worker's env.
    env = {"LANES_OFFPEAK__CRON": "15 3 * * 6", "LANES_OFFPEAK__TIMEZONE": "America/New_York"}
    for deployment in document["deployments"]:
        assert deployment["work_pool"]["job_variables"] == {"env": env}


def test_one_key_of_the_off_peak_window_keeps_the_default_opening(
    spec_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANES_OFFPEAK__TIMEZONE (or __FINISH_BY) alone moves the default window, whose
    cron stays 0 2 * * *: it was refused as a window with no cron."""
    monkeypatch.setenv("LANES_OFFPEAK__TIMEZONE", "America/New_York")
    monkeypatch.setenv("LANES_OFFPEAK__FINISH_BY", "06:00")
    settings = Settings()
    source = source_of(spec_file, spec_file.parent / "prefect.yaml", None)
    document = yaml.safe_load(render(load_spec(spec_file, settings), settings, spec_file, source))
    whenever = document["deployments"][1]
    assert whenever["schedules"][0] == {
        "cron": "0 2 * * *",
        "timezone": "America/New_York",
        "active": True,
    }
    assert whenever["work_pool"]["job_variables"]["env"]["LANES_OFFPEAK__FINISH_BY"] == "06:00"


def test_the_spec_overrides_compiled_with_reach_the_runs(
    spec_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An override given where `lanes compile` ran shapes the deployment (its cron) and
    must shape its runs too: a worker loads workloads.yaml with its own environment and
    the deployment's job variables, never this one's."""
    here = {
        "LANES_WORKLOADS__NIGHTLY__SCHEDULE__CRON": "0 4 * * *",
        "LANES_WORKLOADS__NIGHTLY__OUTPUT": "elsewhere/",
        "LANES_MODELS__ENC__MAX_LENGTH": "16",
    }
    for name, value in here.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    source = source_of(spec_file, spec_file.parent / "prefect.yaml", None)
    document = yaml.safe_load(render(load_spec(spec_file, settings), settings, spec_file, source))
    nightly = document["deployments"][0]
    assert nightly["schedules"][0]["cron"] == "0 4 * * *"
    env = nightly["work_pool"]["job_variables"]["env"]
    assert document["deployments"][1]["work_pool"]["job_variables"]["env"] == env

    for name in here:  # the worker: only the deployment's job variables
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    there = load_spec(spec_file, Settings())
    workload = there.workloads["nightly"]
    assert isinstance(workload, OfflineWorkload)
    assert workload.output == "elsewhere/"
    assert workload.schedule is not None and workload.schedule.cron == "0 4 * * *"
    assert there.models["enc"].max_length == 16


def test_the_compiler_and_lanes_plan_agree(spec_file: Path) -> None:
    settings = Settings()
    spec = load_spec(spec_file, settings)
    assert router_plan.OFFLINE_FLOW == FLOW_NAME
    for workload in spec.workloads.values():
        if not isinstance(workload, OfflineWorkload):
            continue
        assert schedule_of(workload, settings) == router_plan.schedule_of(workload, settings)
    planned = {r.deployment for r in router_plan.plan(spec, settings) if r.deployment}
    assert planned == {f"{FLOW_NAME}/nightly", f"{FLOW_NAME}/whenever"}


def test_the_entrypoint_is_the_flow() -> None:
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(ENTRYPOINT, use_placeholder_flow=False)
    assert flow.name == FLOW_NAME
    # trace: the W3C context of a submitter; lane, finish_by: the Batch API's runs;
    # planned_start: a deadline workload's run at the start it planned (flows.start)
    expected = {"workload", "spec", "input", "output", "rerun", "trace", "lane", "finish_by"}
    expected.add("planned_start")
    assert set(flow.parameters.properties) == expected
    assert flow.parameters.properties["rerun"]["enum"] == ["uncommitted", "errors", "all"]


def test_lanes_compile_command(spec_file: Path) -> None:
    app = typer.Typer()
    app.command("compile")(compile_command)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, ["compile", str(spec_file)])
    assert result.exit_code == 0, result.output
    assert "3 deployment(s) (nightly, whenever, openai_batch)" in result.output
    assert (spec_file.parent / "prefect.yaml").is_file()
    broken = spec_file.parent / "broken.yaml"
    broken.write_text("version: 1\nmodels: {}\nworkloads: {x: {mode: offline}}\n")
    result = CliRunner().invoke(app, ["compile", str(broken)])
    assert result.exit_code == 2 and "missing required key 'task'" in result.output


def compile_cli(*args: str) -> Any:
    app = typer.Typer()
    app.command("compile")(compile_command)
    app.command("noop")(lambda: None)
    return CliRunner().invoke(app, ["compile", *args])


def test_with_a_project_dir_the_spec_is_named_from_the_project_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lanes compile --project-dir /app` in the project's root, the spec in a subfolder."""
    spec_file = write_spec(tmp_path / "config", WORKLOADS)
    monkeypatch.chdir(tmp_path)
    result = compile_cli(
        "config/workloads.yaml", "--output", "prefect.yaml", "--project-dir", "/app"
    )
    assert result.exit_code == 0, result.output
    document = yaml.safe_load((tmp_path / "prefect.yaml").read_text())
    assert document["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/app"}}
    ]
    specs = {d["parameters"]["spec"] for d in document["deployments"]}
    assert specs == {"config/workloads.yaml"}
    assert str(tmp_path) not in (tmp_path / "prefect.yaml").read_text()
    # A spec under the project folder as this machine has it: relative to that.
    assert source_of(spec_file, tmp_path / "x.yaml", tmp_path).spec == "config/workloads.yaml"
    # Without --project-dir, workers run in the spec's folder.
    assert source_of(spec_file, tmp_path / "x.yaml").directory == str(tmp_path / "config")


def test_the_lanes_deploy_it_suggests_registers_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lanes compile --project-dir /app --output F` says to register them with `lanes
    deploy`: that command must compile the same file (a bare `lanes deploy` would
    register runs in this machine's folder, which no image has)."""
    write_spec(tmp_path / "config", WORKLOADS)
    monkeypatch.chdir(tmp_path)
    args = ["config/workloads.yaml", "--output", "lanes-prefect.yaml", "--project-dir", "/app"]
    result = compile_cli(*args)
    assert result.exit_code == 0, result.output
    written = (tmp_path / "lanes-prefect.yaml").read_bytes()
    hint = result.output.split("register them: ", 1)[1].split(", or ", 1)[0]
    suggested = shlex.split(hint)
    assert suggested[:2] == ["lanes", "deploy"]
    (tmp_path / "lanes-prefect.yaml").unlink()
    again = compile_cli(*suggested[2:])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "lanes-prefect.yaml").read_bytes() == written
    assert not (tmp_path / "prefect.yaml").exists()
    # With nothing to carry, the hint is the bare command.
    plain = compile_cli("config/workloads.yaml")
    assert "register them: lanes deploy config/workloads.yaml, or " in plain.output


def test_a_spec_outside_the_project_root_is_refused_with_a_project_dir(tmp_path: Path) -> None:
    spec_file = write_spec(tmp_path / "elsewhere", WORKLOADS)
    with pytest.raises(LanesError, match=r"is outside .*project\b.* at /app: write prefect\.yaml"):
        source_of(spec_file, tmp_path / "project" / "prefect.yaml", Path("/app"))
    result = compile_cli(
        str(spec_file), "-o", str(tmp_path / "p" / "prefect.yaml"), "--project-dir", "/app"
    )
    assert result.exit_code == 2 and "--output ROOT/prefect.yaml" in result.output
    assert not (tmp_path / "p" / "prefect.yaml").exists()


def test_a_prefect_yaml_lanes_did_not_write_is_never_replaced(spec_file: Path) -> None:
    mine = spec_file.parent / "prefect.yaml"
    hand_written = "# my own deployments\ndeployments:\n- name: mine\n  entrypoint: my.py:flow\n"
    mine.write_text(hand_written)
    result = compile_cli(str(spec_file))
    assert result.exit_code == 2, result.output  # a bad argument: --output or --force
    assert f"{mine} was not written by lanes compile" in result.output
    assert "--output" in result.output and "--force" in result.output
    assert mine.read_text() == hand_written

    # Written elsewhere, beside it: lanes' own file, marked as such.
    other = spec_file.parent / "lanes-prefect.yaml"
    result = compile_cli(str(spec_file), "--output", str(other))
    assert result.exit_code == 0, result.output
    assert "prefect --no-prompt deploy --all --prefect-file lanes-prefect.yaml" in result.output
    assert other.read_text().startswith(MARKER) and mine.read_text() == hand_written
    assert compile_cli(str(spec_file), "--output", str(other)).exit_code == 0  # its own: fine

    result = compile_cli(str(spec_file), "--force")
    assert result.exit_code == 0, result.output
    assert mine.read_text() == other.read_text()


def test_a_deadline_deploys_on_its_windows_opening(tmp_path: Path) -> None:
    """`finish_by` alone: the default window's opening; with a cron: the cron."""
    deadline = {**WORKLOADS["nightly"], "description": None}
    workloads = {
        "alone": {**deadline, "schedule": {"finish_by": "07:00", "timezone": "Europe/Berlin"}},
        "both": {
            **deadline,
            "output": "out-both/",
            "schedule": {"cron": "0 22 * * *", "finish_by": "07:00"},
        },
    }
    spec_file = write_spec(tmp_path, workloads)
    settings = Settings()
    document = yaml.safe_load(
        render(
            load_spec(spec_file, settings),
            settings,
            spec_file,
            source_of(spec_file, spec_file.parent / "prefect.yaml"),
        )
    )
    alone, both = document["deployments"]
    assert alone["schedules"] == [{"cron": "0 2 * * *", "timezone": "UTC", "active": True}]
    assert "default off-peak window" in alone["description"]
    assert both["schedules"] == [{"cron": "0 22 * * *", "timezone": "UTC", "active": True}]


def test_a_relative_batch_store_reaches_the_runs_as_the_folder_it_named_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANES_BATCH__STORE is read against the working directory of `lanes compile`:
    the runs start in the spec's folder, and must read the store the server writes."""
    write_spec(tmp_path / "config", WORKLOADS)
    here = tmp_path / "project"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("LANES_BATCH__STORE", "store/")
    result = compile_cli(str(tmp_path / "config" / "workloads.yaml"))
    assert result.exit_code == 0, result.output
    document = yaml.safe_load((tmp_path / "config" / "prefect.yaml").read_text())
    for deployment in document["deployments"]:
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["LANES_BATCH__STORE"] == f"{here}/store/"
