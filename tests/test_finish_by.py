"""`schedule.finish_by`: an offline workload's deadline. The window's arithmetic with an
injected clock (no waiting), the spec's checks, the planned start from a real input
and a real run's rate, `lanes plan`, and the calibration a workload without history
gets first."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml

from lanes.deadline import MARGIN, STARTUP_S, deadline_after, opening, plan_start, window_at
from lanes.digests import model_key
from lanes.errors import JobFailed, SpecError, StorageError
from lanes.flows.batch import offline
from lanes.flows.job import Job, settle_job
from lanes.flows.sample import SAMPLE_BATCHES, SAMPLE_SOURCE
from lanes.flows.start import deadline_key, deferred_until, plan_run, should_plan
from lanes.measurements import Measurements, Throughput
from lanes.router.plan import plan
from lanes.schedule import Schedule
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
from lanes.specfile import load_spec
from lanes.storage import Storage
from tests.flows_fixtures import text, write_jsonl, write_spec

ROOT = Path(__file__).resolve().parent.parent
BERLIN = ZoneInfo("Europe/Berlin")
TOKYO = ZoneInfo("Asia/Tokyo")


def needed(items: int, rate: float) -> timedelta:
    return timedelta(seconds=items / rate * (1 + MARGIN) + STARTUP_S)


# ---- the window --------------------------------------------------------------------------


def test_a_window_that_crosses_midnight_ends_at_the_next_mornings_finish_by() -> None:
    opens = Schedule(cron="0 22 * * *", timezone="Europe/Berlin")
    # Winter (UTC+1): 22:00 in Berlin is 21:00 UTC; 07:00 the next day is 06:00 UTC.
    now = datetime(2030, 1, 1, 20, 0, tzinfo=UTC)
    window = window_at(opens, "07:00", "Europe/Berlin", now)
    assert window.opens == datetime(2030, 1, 1, 21, 0, tzinfo=UTC)
    assert window.finish_by == datetime(2030, 1, 2, 6, 0, tzinfo=UTC)
    # Inside it (past midnight) it is the same window; past its deadline, tomorrow's.
    inside = window_at(opens, "07:00", "Europe/Berlin", datetime(2030, 1, 2, 1, 0, tzinfo=UTC))
    assert inside == window
    after = window_at(opens, "07:00", "Europe/Berlin", datetime(2030, 1, 2, 6, 0, tzinfo=UTC))
    assert after.opens == datetime(2030, 1, 2, 21, 0, tzinfo=UTC)
    # The moment it opens (when the deployment fires), it is open.
    at_opening = window_at(opens, "07:00", "Europe/Berlin", window.opens)
    assert at_opening == window


def test_summer_time_moves_the_window_in_utc() -> None:
    opens = Schedule(cron="0 22 * * *", timezone="Europe/Berlin")
    window = window_at(opens, "07:00", "Europe/Berlin", datetime(2030, 7, 1, 12, 0, tzinfo=UTC))
    assert window.opens == datetime(2030, 7, 1, 20, 0, tzinfo=UTC)  # UTC+2
    assert window.finish_by == datetime(2030, 7, 2, 5, 0, tzinfo=UTC)
    # The night the clocks go back (2030-10-27, 03:00 -> 02:00) is an hour longer, and
    # the start is that many real seconds before the deadline.
    autumn = window_at(opens, "07:00", "Europe/Berlin", datetime(2030, 10, 26, 12, 0, tzinfo=UTC))
    assert autumn.finish_by - autumn.opens == timedelta(hours=10)
    local = autumn.finish_by.astimezone(BERLIN)  # 07:00 CET; the start falls in CEST
    start = plan_start(18_000, 1.0, local, autumn.opens, autumn.opens)
    assert start.start == datetime(2030, 10, 26, 23, 44, tzinfo=UTC)
    assert start.start == datetime(2030, 10, 27, 6, 0, tzinfo=UTC) - needed(18_000, 1.0)


def test_finish_by_alone_takes_the_default_windows_opening_in_its_own_time_zone() -> None:
    workload = offline_workload({"finish_by": "07:00", "timezone": "Asia/Tokyo"})
    settings = Settings()
    opens_with, is_default = opening(workload, settings)
    assert is_default and opens_with == settings.offpeak  # 02:00 UTC
    window = window_at(opens_with, "07:00", "Asia/Tokyo", datetime(2030, 1, 1, 0, 0, tzinfo=UTC))
    # 02:00 UTC is 11:00 in Tokyo: the deadline is 07:00 Tokyo the next day, 22:00 UTC.
    assert window.opens == datetime(2030, 1, 1, 2, 0, tzinfo=UTC)
    assert window.finish_by == datetime(2030, 1, 2, 7, 0, tzinfo=TOKYO)
    assert window.finish_by == datetime(2030, 1, 1, 22, 0, tzinfo=UTC)


def test_a_finish_by_at_the_opening_gives_a_whole_day() -> None:
    opens = datetime(2030, 1, 1, 7, 0, tzinfo=BERLIN)
    assert deadline_after(opens, "07:00", "Europe/Berlin") == opens + timedelta(days=1)
    assert deadline_after(opens, "07:01", "Europe/Berlin") == opens + timedelta(minutes=1)


def offline_workload(schedule: dict[str, Any], **more: Any) -> OfflineWorkload:
    return OfflineWorkload(
        mode="offline",
        task="embed",
        model="enc",
        input="in/",
        output="out/",
        schedule=Schedule(**schedule),
        **more,
    )


# ---- the spec ------------------------------------------------------------------------------

SPEC = """\
version: 1
models:
  enc: {path: enc.onnx, tokenizer: tok.json}
workloads:
  nightly:
    mode: offline
    task: embed
    model: enc
    input: in/
    output: out/
    schedule: SCHEDULE
"""


def load(folder: Path, schedule: str) -> Any:
    for name in ("enc.onnx", "tok.json"):
        (folder / name).write_bytes(b"")
    path = folder / "workloads.yaml"
    path.write_text(textwrap.dedent(SPEC).replace("SCHEDULE", schedule))
    return load_spec(path, Settings())


@pytest.mark.parametrize(
    "schedule",
    [
        '{finish_by: "07:00", timezone: Europe/Berlin}',
        '{cron: "0 22 * * *", finish_by: "06:30"}',
        '{finish_by: "00:00"}',
        '{finish_by: "23:59"}',
        '{cron: "0 2 * * *"}',
    ],
)
def test_finish_by_takes_a_time_of_day_with_or_without_a_cron(
    tmp_path: Path, schedule: str
) -> None:
    spec = load(tmp_path, schedule)
    assert spec.workloads["nightly"].schedule is not None


@pytest.mark.parametrize(
    "value", ['"7:00"', '"24:00"', '"07:60"', '"7am"', '"07:00:00"', "700", '""', "22:30"]
)
def test_a_bad_finish_by_names_the_field_and_the_format(tmp_path: Path, value: str) -> None:
    with pytest.raises(SpecError) as caught:
        load(tmp_path, "{finish_by: " + value + "}")
    (problem,) = [str(p) for p in caught.value.problems]
    assert "workloads.nightly.schedule.finish_by:" in problem
    assert 'expected a time of day as "HH:MM"' in problem, problem
    if value == "22:30":  # unquoted: YAML 1.1 makes it a number in base 60
        assert "found the number 1350" in problem and "in quotes" in problem


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # YAML 1.1 reads a leading 0 as octal: 0700 is the number 448.
        (
            "0700",
            'expected a time of day as "HH:MM" in quotes, e.g. finish_by: "07:00", found the '
            "number 448, which is how YAML reads an unquoted 0700 (octal) or 7:28 (base 60): "
            "quote the time",
        ),
        # 0800 is no octal number: YAML keeps it as text, which has no colon.
        (
            "0800",
            'expected a time of day as "HH:MM" (00:00 to 23:59), e.g. "07:00", found '
            "'0800'; write it with a colon, \"08:00\"",
        ),
    ],
)
def test_a_finish_by_written_as_four_digits_says_how_to_write_it(
    tmp_path: Path, value: str, expected: str
) -> None:
    with pytest.raises(SpecError) as caught:
        load(tmp_path, "{finish_by: " + value + "}")
    (problem,) = [str(p) for p in caught.value.problems]
    assert problem.split("workloads.nightly.schedule.finish_by: ", 1)[1] == expected


def test_a_schedule_needs_a_cron_or_a_finish_by(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load(tmp_path, "{timezone: Europe/Berlin}")
    (problem,) = [str(p) for p in caught.value.problems]
    assert "workloads.nightly.schedule:" in problem and "finish_by" in problem


# ---- the planned start, from a real input ---------------------------------------------------

WORKLOAD: dict[str, Any] = {
    "mode": "offline",
    "task": "embed",
    "model": "enc",
    "input": "in/",
    "output": "out/",
    "batch_size": 4,
    "retries": 0,
    "schedule": {"cron": "0 22 * * *", "finish_by": "07:00", "timezone": "Europe/Berlin"},
}
# 22:00 Berlin on 2030-01-01 (winter), when the deployment fires; 07:00 is 06:00 UTC.
OPENS = datetime(2030, 1, 1, 21, 0, tzinfo=UTC)
DEADLINE = datetime(2030, 1, 2, 6, 0, tzinfo=UTC)


def project(
    folder: Path, records: int, others: dict[str, Any] | None = None, **workload: Any
) -> tuple[Path, Job]:
    spec_file = write_spec(folder, {"corpus": {**WORKLOAD, **workload}, **(others or {})})
    half = records // 2
    write_jsonl(folder / "in" / "a.jsonl", [{"id": i, "text": text(i)} for i in range(half)])
    lines = [json.dumps({"id": i, "text": text(i)}) for i in range(half, records)]
    (folder / "in" / "b.jsonl").write_text("\n\n".join(lines))  # blank lines, no last newline
    settings = Settings()
    return spec_file, settle_job(load_spec(spec_file, settings), "corpus", folder, settings)


def rate(job: Job, items_per_second: float) -> Throughput:
    return Throughput(
        workload=job.workload,
        model_key=job.model_key,
        lane="offline",
        items_per_second=items_per_second,
        measured_at=datetime(2029, 12, 31, tzinfo=UTC),
        source="manifest somewhere",
    )


def test_the_start_is_the_latest_that_finishes_by_the_deadline(tmp_path: Path) -> None:
    _, job = project(tmp_path, 36)
    started = plan_run(job, Settings(), Storage(Settings()), OPENS, [rate(job, 0.01)])
    assert started.items == 36  # both files, blank lines and a missing last newline too
    assert started.window_opens == OPENS and started.finish_by == DEADLINE
    # 36 items at 0.01/s: an hour of work, 75 min with the margin and the start-up.
    assert started.start == DEADLINE - needed(36, 0.01) == datetime(2030, 1, 2, 4, 44, tzinfo=UTC)
    assert started.expected_finish == started.start + timedelta(seconds=3600 + STARTUP_S)
    assert started.on_time and started.fits and "latest moment" in started.note
    assert not started.calibrated and started.rate_source == "manifest somewhere"
    # The run the deployment fired at the opening waits for it; one at the start runs.
    assert deferred_until(started, OPENS) == started.start
    assert deferred_until(started, started.start) is None


def test_a_window_has_one_deferred_run_key_whoever_plans_it() -> None:
    berlin = datetime(2030, 1, 2, 7, 0, tzinfo=BERLIN)  # 06:00 UTC, the same moment
    assert deadline_key("corpus", DEADLINE) == deadline_key("corpus", berlin)
    assert deadline_key("corpus", DEADLINE) != deadline_key("other", DEADLINE)
    assert deadline_key("corpus", DEADLINE) != deadline_key("corpus", DEADLINE - timedelta(hours=4))


def test_an_impossible_deadline_starts_now_and_says_so(tmp_path: Path) -> None:
    _, job = project(tmp_path, 36)
    slow = rate(job, 36 / (12 * 3600))  # twelve hours of work in a nine-hour window
    started = plan_run(job, Settings(), Storage(Settings()), OPENS, [slow])
    assert started.start == OPENS and not started.on_time and not started.fits
    assert "does not fit" in started.note and "even if started now" in started.note
    assert deferred_until(started, OPENS) is None


def test_on_the_shared_endpoint_a_late_run_starts_now_there(tmp_path: Path) -> None:
    search = {"mode": "interactive", "task": "embed", "model": "enc"}
    _, job = project(tmp_path, 36, {"search": search}, runner={"kind": "endpoint"})
    started = plan_run(job, Settings(), Storage(Settings()), OPENS, [rate(job, 0.0001)])
    assert started.start == OPENS and "on the shared endpoint (runner: endpoint)" in started.note


def test_which_runs_plan_their_start(tmp_path: Path) -> None:
    _, job = project(tmp_path, 4)
    scheduled = {"workload": "corpus", "spec": "workloads.yaml"}
    assert should_plan(job, "corpus", scheduled)
    assert not should_plan(job, None, scheduled)  # `lanes run`: now
    assert not should_plan(job, "corpus", {**scheduled, "planned_start": OPENS})
    assert not should_plan(job, "corpus", {**scheduled, "input": "in/_submitted/x/"})
    _, plain = project(tmp_path / "plain", 4, schedule={"cron": "0 2 * * *"})
    assert not should_plan(plain, "corpus", scheduled)


# ---- lanes plan, after a real run -----------------------------------------------------------


def lanes(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lanes.router.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "LANES_HOME": str(home)},
        timeout=300,
    )


def test_lanes_plan_shows_the_start_from_the_last_runs_rate(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("LANES_HOME", str(home))
    spec_file, _ = project(tmp_path, 24)
    offline(workload="corpus", spec=str(spec_file))  # no deployment: runs now, as `lanes run`
    (measured,) = Measurements(home).load()
    assert measured.source.startswith("manifest ") and measured.items == 24

    at = "2030-01-01T21:00:00+00:00"
    done = lanes("plan", str(spec_file), "--json", "--at", at, home=home)
    assert done.returncode == 0, done.stderr
    (route,) = json.loads(done.stdout)
    deadline = route["deadline"]
    assert deadline["items"] == 24 and deadline["rate_source"] == measured.source
    assert deadline["items_per_second"] == pytest.approx(measured.items_per_second)
    assert datetime.fromisoformat(deadline["finish_by"]) == DEADLINE
    start = DEADLINE - needed(24, measured.items_per_second)
    assert datetime.fromisoformat(deadline["start"]) == start.replace(microsecond=0)
    assert deadline["on_time"] and not deadline["calibrated"]

    table = lanes("plan", str(spec_file), "--at", at, home=home)
    assert table.returncode == 0, table.stderr
    assert "finish by 2030-01-02T06:00:00+00:00" in table.stdout
    assert f"start {deadline['start']}" in table.stdout  # whole seconds, as the README's
    assert not re.search(r"\d\d:\d\d:\d\d\.\d", table.stdout)
    assert f"expected finish {deadline['expected_finish']}" in table.stdout
    assert "corpus: 24 items at" in table.stdout and "latest moment" in table.stdout

    bad = lanes("plan", str(spec_file), "--at", "tonight", home=home)
    assert bad.returncode == 2 and "--at: expected an ISO time" in bad.stderr


def test_a_run_with_a_failed_shard_records_no_rate_and_a_corrupt_file_plans_no_start(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed shard's retries are in the run's wall time but not its items: its
    rate would price the model many times over."""
    home = tmp_path / "home"
    monkeypatch.setenv("LANES_HOME", str(home))
    spec_file, job = project(tmp_path, 8)
    (tmp_path / "in" / "c.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(JobFailed, match=r"c\.parquet"):
        offline(workload="corpus", spec=str(spec_file))
    assert Measurements(home).load() == []
    # A file whose records cannot be counted: the plan says which, as for bad JSONL.
    with pytest.raises(StorageError, match=r"c\.parquet: not a readable Parquet file"):
        plan_run(job, Settings(), Storage(Settings()), OPENS, [rate(job, 1.0)])


def test_a_deferred_run_that_starts_past_its_deadline_says_so(
    prefect_api: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Planned in a window that ended long ago (its worker was down, say): it runs, and
    its log, final state and manifest say it missed the deadline."""
    monkeypatch.setenv("LANES_HOME", str(tmp_path / "home"))
    spec_file, _ = project(tmp_path, 6)
    planned = datetime(2020, 1, 1, 23, 0, tzinfo=UTC)  # in the window 22:00-07:00 Berlin
    deadline = "2020-01-02T06:00:00+00:00"
    with caplog.at_level(logging.WARNING, logger="lanes.flows.batch"):
        state = offline(
            workload="corpus", spec=str(spec_file), planned_start=planned, return_state=True
        )
    assert state.is_completed()
    message = state.message or ""
    assert message.startswith("6 records answered; finished late, "), message
    assert message.endswith(f" s after its deadline {deadline}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"s after its deadline {deadline}" in w and "started" in w for w in warnings)
    assert any(f"s after its deadline {deadline}" in w and "finished" in w for w in warnings)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert (manifest["finish_by"], manifest["deadline_met"]) == (deadline, False)


def test_a_run_without_a_deadline_records_none(prefect_api: str, tmp_path: Path) -> None:
    spec_file, _ = project(tmp_path, 2)
    state = offline(workload="corpus", spec=str(spec_file), return_state=True)
    assert state.message == "2 records answered"
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert (manifest["finish_by"], manifest["deadline_met"]) == (None, None)


def test_without_history_plan_calibrates_on_a_sample_of_the_input_first(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec_file, _ = project(tmp_path, 40)
    settings = Settings(home=home)
    spec = load_spec(spec_file, settings)

    unplanned = plan(spec, settings, OPENS)  # not asked to calibrate: no rate, says so
    assert unplanned[0].deadline is not None
    assert unplanned[0].deadline["start"] == OPENS.isoformat()
    assert "no measured rate" in unplanned[0].deadline["note"]
    assert Measurements(home).load() == []

    (route,) = plan(spec, settings, OPENS, calibrate=True)
    deadline = route.deadline
    assert deadline is not None and deadline["calibrated"]
    (stored,) = Measurements(home).load()  # where `lanes calibrate` stores its rates
    assert stored.source == SAMPLE_SOURCE and stored.lane == "offline"
    assert stored.items == SAMPLE_BATCHES * 4  # two batches of the real input
    assert stored.model_key == model_key(spec, spec.workload("corpus"), settings)
    assert deadline["items_per_second"] == stored.items_per_second
    start = DEADLINE - needed(40, stored.items_per_second)
    assert datetime.fromisoformat(deadline["start"]) == start.replace(microsecond=0)
    assert deadline["note"].startswith(
        f"no earlier run of this model: measured {stored.items_per_second:g} items/s on "
        f"{SAMPLE_BATCHES * 4} records of the input"
    )
    # The same plan prices the offline lane by the rate it just measured.
    assert route.cost.items_per_second == pytest.approx(stored.items_per_second, rel=1e-3)

    # The next plan uses the stored rate: nothing is measured again.
    (again,) = plan(spec, settings, OPENS, Measurements(home).load(), calibrate=True)
    assert again.deadline is not None and not again.deadline["calibrated"]
    assert len(Measurements(home).load()) == 1


def test_the_readmes_example_is_a_window_from_22_to_7_in_berlin(tmp_path: Path) -> None:
    section = (ROOT / "README.md").read_text().split("### Finish by a deadline", 1)[1]
    found = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert found, "the README's deadline section has no yaml example"
    (example,) = yaml.safe_load(found.group(1)).values()
    spec_file = write_spec(tmp_path, {"embed-corpus": {**example, "model": "enc"}})
    workload = load_spec(spec_file, Settings()).workloads["embed-corpus"]
    assert isinstance(workload, OfflineWorkload) and workload.schedule is not None
    schedule = workload.schedule
    assert schedule.finish_by is not None
    window = window_at(schedule, schedule.finish_by, schedule.timezone, OPENS)
    assert (window.opens, window.finish_by) == (OPENS, DEADLINE)
