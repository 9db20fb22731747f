"""Settings read from the environment: where their relative paths point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from lanes.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_relative_env_paths_are_read_against_the_working_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read where the settings load; a later chdir (a flow run starting in the project
    folder, a subprocess) moves neither. Spec paths are the spec folder's, not these."""
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(start)
    monkeypatch.setenv("LANES_HOME", "state")
    monkeypatch.setenv("LANES_BATCH__STORE", "batch-store")
    settings = Settings()
    monkeypatch.chdir(elsewhere)
    assert settings.home == start / "state"
    assert settings.batch_store() == f"{start / 'batch-store'}/"
    assert settings.shared_env()["LANES_BATCH__STORE"] == str(start / "batch-store")


def test_an_s3_or_absolute_store_is_kept_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_BATCH__STORE", "s3://bucket/batches/")
    assert Settings().batch_store() == "s3://bucket/batches/"
    monkeypatch.setenv("LANES_BATCH__STORE", str(tmp_path / "store"))
    assert Settings().batch_store() == f"{tmp_path / 'store'}/"
    monkeypatch.delenv("LANES_BATCH__STORE")
    monkeypatch.setenv("LANES_HOME", str(tmp_path / "home"))
    assert Settings().batch_store() == f"{tmp_path / 'home' / 'batches'}/"


def test_turning_the_conditional_write_check_off_reaches_the_flow_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flow run takes its lease on the store the server checks: where the check is
    turned off here, the deployments and pods get the same choice."""
    assert "LANES_S3_CHECK_CONDITIONAL_WRITES" not in Settings().shared_env()
    monkeypatch.setenv("LANES_S3_CHECK_CONDITIONAL_WRITES", "false")
    shared = Settings().shared_env()
    monkeypatch.delenv("LANES_S3_CHECK_CONDITIONAL_WRITES")
    assert shared["LANES_S3_CHECK_CONDITIONAL_WRITES"] == "False"
    for name, value in shared.items():
        monkeypatch.setenv(name, value)
    assert Settings().s3_check_conditional_writes is False


def test_the_endpoint_runners_retries_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The back-off a flow on the endpoint waits between a batch's attempts grows per
    lost connection up to its cap; each part is a variable, a bad one named."""
    from lanes.errors import SettingsError

    assert [Settings().endpoint_retries.wait_after(n) for n in (1, 2, 9, 10, 11)] == [
        0.5,
        1.0,
        4.5,
        5.0,
        5.0,
    ]
    monkeypatch.setenv("LANES_ENDPOINT_RETRIES__BACKOFF_S", "0.01")
    monkeypatch.setenv("LANES_ENDPOINT_RETRIES__ATTEMPTS", "3")
    retries = Settings().endpoint_retries
    assert (retries.attempts, retries.backoff_s, retries.max_wait_s) == (3, 0.01, 5.0)
    monkeypatch.setenv("LANES_ENDPOINT_RETRIES__ATTEMPTS", "0")
    with pytest.raises(SettingsError, match="LANES_ENDPOINT_RETRIES__ATTEMPTS"):
        Settings()


def test_the_http_implementation_is_one_of_uvicorns(monkeypatch: pytest.MonkeyPatch) -> None:
    from lanes.errors import SettingsError

    assert Settings().http == "auto"
    monkeypatch.setenv("LANES_HTTP", "h2")
    with pytest.raises(SettingsError, match=r"LANES_HTTP: .*'auto', 'httptools' or 'h11'"):
        Settings()


def test_json_nested_past_pythons_stack_is_a_problem_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """json.loads recurses per level: such a value is one line naming its variable."""
    from lanes.errors import SettingsError

    deep = "[" * 100_000
    monkeypatch.setenv("LANES_WORKLOADS__A__BATCHING", deep)
    # An override stays text, which the spec refuses naming the variable.
    assert Settings().workloads == {"a": {"batching": deep}}
    monkeypatch.setenv("LANES_ALLOWED_INPUT_ROOTS", deep)
    with pytest.raises(SettingsError) as caught:
        Settings()
    assert [str(p) for p in caught.value.problems] == [
        "env LANES_ALLOWED_INPUT_ROOTS: expected JSON (a list or an object), found a value "
        "that does not parse"
    ]


# Settings() where no time zone loads: the tzdata wheel refused, and (PYTHONTZPATH) an
# empty folder for the system's database.
_WITHOUT_ZONES = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tzdata":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from lanes.errors import SettingsError
from lanes.settings import Settings
try:
    Settings()
except SettingsError as e:
    print(*e.problems, sep="\\n")
"""


@pytest.mark.parametrize(
    ("variables", "source", "zone"),
    [
        ({}, "default (LANES_OFFPEAK__TIMEZONE not set)", "UTC"),
        (
            {"LANES_OFFPEAK__TIMEZONE": "Europe/Paris"},
            "env LANES_OFFPEAK__TIMEZONE",
            "Europe/Paris",
        ),
    ],
    ids=["default", "variable"],
)
def test_a_time_zone_that_cannot_load_names_where_it_was_set(
    tmp_path: Path, variables: dict[str, str], source: str, zone: str
) -> None:
    """On a system without a time zone database even the default off-peak zone fails to
    load: the problem says it is the default (no variable was set) and what is missing,
    not that a valid zone is no IANA time zone."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LANES_")}
    env |= {"PYTHONTZPATH": str(tmp_path), "LANES_HOME": str(tmp_path / "home"), **variables}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ZONES],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        f"{source}: expected a time zone this system can load, found {zone!r}: it has no "
        "IANA time zone database; install the tzdata package (or the OS's tzdata)"
    )


def test_the_readmes_settings_section_names_every_setting() -> None:
    """A user looks for a variable in the README's Settings section (the rest of the
    README may tell more); a nested setting is named by its prefix (LANES_BATCH__)."""
    section = README.read_text().split("### Settings", 1)[1].split("\n## ", 1)[0]
    missing = []
    for name, field in Settings.model_fields.items():
        nested = isinstance(field.default_factory, type) and issubclass(
            field.default_factory, BaseModel
        )
        nested = nested or name in ("offpeak", "workloads", "models")
        variable = f"LANES_{name.upper()}" + ("__" if nested else r"\b")
        if not re.search(variable, section):
            missing.append(variable.removesuffix(r"\b"))
    assert not missing, f"the README's Settings section does not name {missing}"
