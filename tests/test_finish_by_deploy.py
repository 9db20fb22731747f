"""A deployment's run of a workload with `schedule.finish_by`, on a real Prefect server:
fired at the window's opening, with no earlier run, it measures its model on a sample
of the input, schedules a run of the same deployment at its planned start and ends
Completed saying so. Driven by command lines, as a person
would (`lanes deploy`, `prefect deployment run`, a process worker)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from lanes.deadline import MARGIN, STARTUP_S
from lanes.flows.sample import SAMPLE_SOURCE
from lanes.flows.start import DEADLINE_TAG
from lanes.measurements import Measurements
from tests.flows_fixtures import outputs_of, text, write_jsonl, write_spec
from tests.prefect_server import PREFECT, PrefectServer, call_api

pytestmark = pytest.mark.slow

LANES = [sys.executable, "-m", "lanes.router.cli"]


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{args} failed:\n{output}"
    return output


def test_a_run_fired_at_the_opening_reschedules_itself_at_its_planned_start(
    tmp_path: Path,
) -> None:
    with PrefectServer(tmp_path / "prefect-home") as server:
        # The window opens three hours from now and closes eight hours from now (UTC), so
        # the run fired now is before it whatever the time of day: no wall-clock race.
        now = datetime.now(UTC)
        opens, closes = now + timedelta(hours=3), now + timedelta(hours=8)
        workload: dict[str, Any] = {
            "mode": "offline",
            "task": "embed",
            "model": "enc",
            "input": "in/",
            "output": "out/",
            "batch_size": 4,
            "schedule": {
                "cron": f"{opens.minute} {opens.hour} * * *",
                "finish_by": f"{closes.hour:02d}:{closes.minute:02d}",
                "timezone": "UTC",
            },
        }
        project = tmp_path / "project"
        spec_file = write_spec(project, {"corpus": workload})
        write_jsonl(project / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(12)])
        home = tmp_path / "home"  # no earlier run: the run measures its model first
        env = {**server.wait(), "LANES_HOME": str(home)}
        api = env["PREFECT_API_URL"]

        _run([*LANES, "deploy", str(spec_file)], env, project)
        _run([*PREFECT, "deployment", "run", "lanes-offline/corpus"], env, tmp_path)
        _run([*PREFECT, "worker", "start", "--pool", "lanes", "--run-once"], env, tmp_path)

        deployment = call_api("GET", f"{api}/deployments/name/lanes-offline/corpus").json()
        runs: list[dict[str, Any]] = call_api(
            "POST",
            f"{api}/flow_runs/filter",
            json={"deployments": {"id": {"any_": [deployment["id"]]}}},
        ).json()
    fired = [r for r in runs if r["state_type"] == "COMPLETED"]
    assert len(fired) == 1, [(r["name"], r["state_type"]) for r in runs]
    deferred = [r for r in runs if DEADLINE_TAG in r["tags"]]
    assert len(deferred) == 1, [(r["name"], r["tags"]) for r in runs]
    (later,) = deferred
    # Measured on a sample of the input (two batches of 4), stored as lanes calibrate's.
    (measured,) = Measurements(home).load()
    assert measured.source == SAMPLE_SOURCE and measured.items == 8
    rate = measured.items_per_second
    deadline = closes.replace(second=0, microsecond=0)  # the first finish_by after opening
    start = deadline - timedelta(seconds=12 / rate * (1 + MARGIN) + STARTUP_S)
    assert later["state_type"] == "SCHEDULED"
    assert datetime.fromisoformat(later["expected_start_time"]) == start
    assert datetime.fromisoformat(later["parameters"]["planned_start"]) == start
    assert later["parameters"]["workload"] == "corpus"
    message = fired[0]["state"]["message"]
    assert message.startswith(f"starts at {start.isoformat()} as flow run {later['id']}")
    assert "no earlier run of this model: measured" in message and "latest moment" in message
    assert not (project / "out").exists() or outputs_of(project / "out") == []


def _runs(api: str, deployment: str) -> list[dict[str, Any]]:
    found = call_api("GET", f"{api}/deployments/name/lanes-offline/{deployment}").json()
    runs: list[dict[str, Any]] = call_api(
        "POST", f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [found["id"]]}}}
    ).json()
    return runs


def _deferred(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if DEADLINE_TAG in r["tags"] and r["state_type"] == "SCHEDULED"]


def test_one_deferred_run_per_window_and_a_deploy_replans_it(tmp_path: Path) -> None:
    with PrefectServer(tmp_path / "prefect-home") as server:
        # As above: the window opens in three hours, whatever the time of day. The
        # deadline moves from eight hours from now to six, before the first plan's start.
        now = datetime.now(UTC)
        opens = now + timedelta(hours=3)
        first, moved = now + timedelta(hours=8), now + timedelta(hours=6)

        def spec_with(finish_by: datetime) -> Path:
            schedule = {
                "cron": f"{opens.minute} {opens.hour} * * *",
                "finish_by": f"{finish_by.hour:02d}:{finish_by.minute:02d}",
                "timezone": "UTC",
            }
            workload = {
                "mode": "offline",
                "task": "embed",
                "model": "enc",
                "input": "in/",
                "output": "out/",
                "batch_size": 4,
                "schedule": schedule,
            }
            return write_spec(tmp_path / "project", {"corpus": workload})

        spec_file = spec_with(first)
        project = spec_file.parent
        write_jsonl(project / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(12)])
        env = {**server.wait(), "LANES_HOME": str(tmp_path / "home")}
        api = env["PREFECT_API_URL"]
        worker = [*PREFECT, "worker", "start", "--pool", "lanes", "--run-once"]

        # Two runs plan the same window (a manual run and the cron's, say): one is deferred.
        _run([*LANES, "deploy", str(spec_file)], env, project)
        for _ in range(2):
            _run([*PREFECT, "deployment", "run", "lanes-offline/corpus"], env, tmp_path)
        _run(worker, env, tmp_path)
        runs = _runs(api, "corpus")
        fired = [r for r in runs if r["state_type"] == "COMPLETED"]
        assert len(fired) == 2, [(r["name"], r["state_type"]) for r in runs]
        (old,) = _deferred(runs)
        old_start = datetime.fromisoformat(old["parameters"]["planned_start"])
        assert moved < old_start < first.replace(second=0, microsecond=0)
        for run in fired:
            assert f"as flow run {old['id']}: " in run["state"]["message"]

        # The deadline moves before that start: the deploy replaces the deferred run with
        # one that plans again, under the new schedule.
        spec_with(moved)
        deployed = _run([*LANES, "deploy", str(spec_file)], env, project)
        assert f"lanes-offline/corpus  deferred run {old['id']} (due " in deployed
        runs = _runs(api, "corpus")
        assert _deferred(runs) == [] and old["id"] not in [r["id"] for r in runs]
        # Prefect's scheduler may have made the cron's own runs meanwhile: not ours.
        (replan,) = [r for r in runs if r["state_type"] == "SCHEDULED" and not r["auto_scheduled"]]
        assert f"removed: flow run {replan['id']} plans it again now" in deployed
        assert "planned_start" not in replan["parameters"]

        _run(worker, env, tmp_path)
        (new,) = _deferred(_runs(api, "corpus"))
        new_start = datetime.fromisoformat(new["parameters"]["planned_start"])
        assert opens.replace(second=0, microsecond=0) < new_start
        assert new_start < moved.replace(second=0, microsecond=0)
        assert datetime.fromisoformat(new["expected_start_time"]) == new_start

        # A deferred run that ended (cancelled here) holds no window: the next plan of
        # it schedules another, once.
        call_api(
            "POST",
            f"{api}/flow_runs/{new['id']}/set_state",
            json={"state": {"type": "CANCELLED"}, "force": True},
        )
        _run([*PREFECT, "deployment", "run", "lanes-offline/corpus"], env, tmp_path)
        _run(worker, env, tmp_path)
        (again,) = _deferred(_runs(api, "corpus"))
        assert again["id"] != new["id"]
        assert datetime.fromisoformat(again["parameters"]["planned_start"]) < moved
