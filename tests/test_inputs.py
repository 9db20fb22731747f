"""lanes.inputs: a job reads its workload's input, its staging area or an allowed root."""

from __future__ import annotations

from pathlib import Path

import pytest

from lanes.errors import InvalidInput
from lanes.inputs import absolute, allowed_roots, check_input, folder_of
from lanes.settings import Settings


@pytest.fixture
def project(tmp_path: Path) -> Path:
    for folder in ("in/sub", "elsewhere", "shared/corpora"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "in" / "sub" / "a.jsonl").write_text("{}\n")
    (tmp_path / "in-other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "in" / "escape").symlink_to(tmp_path / "elsewhere")
    return tmp_path


def allowed(uri: str, workload_input: str, base: Path, settings: Settings | None = None) -> bool:
    try:
        check_input(uri, workload_input, base, settings or Settings())
    except InvalidInput:
        return False
    return True


def test_local_inputs_must_lie_under_the_workloads_input(project: Path) -> None:
    inside = [
        "in/",
        "in/sub/",
        "in/sub/a.jsonl",
        "in/*.jsonl",
        "in/**/*.jsonl",
        "in/_submitted/20260101-000000-abcdef12/",
        str(project / "in" / "sub"),
        f"file://{project}/in/sub/",
        "in/sub/../sub/a.jsonl",
    ]
    outside = [
        "../../elsewhere/*.jsonl",
        "elsewhere/",
        "in/../elsewhere/",
        "in/escape/",  # a symlink inside the input that points out of it
        "link/",
        "in-other/",  # shares a prefix with the input, but is another folder
        "in*/",
        "/",
        "in/*/../../elsewhere/*.jsonl",
        "http://example.com/in/",
        "in/sub/a\x00.jsonl",  # refused as input, not a ValueError of the OS
    ]
    assert [u for u in inside if not allowed(u, "in/", project)] == []
    assert [u for u in outside if allowed(u, "in/", project)] == []


def test_a_single_file_input_allows_itself_and_its_staging_area(project: Path) -> None:
    single = "in/sub/a.jsonl"
    assert allowed(single, single, project)
    assert allowed("in/sub/_submitted/k/", single, project)
    assert not allowed("in/sub/b.jsonl", single, project)
    assert not allowed("in/", single, project)


def test_s3_inputs_by_bucket_and_prefix(project: Path) -> None:
    root = "s3://corpus/in/"
    assert allowed("s3://corpus/in/", root, project)
    assert allowed("s3://corpus/in/part-1.jsonl", root, project)
    assert allowed("s3://corpus/in/sub/*.jsonl", root, project)
    assert allowed("s3://corpus/in//x/a.jsonl", root, project)
    assert allowed("s3://corpus/in/_submitted/k/", root, project)
    assert allowed("s3://corpus/in/a.jsonl", "s3://corpus/in", project)
    for uri in (
        "s3://corpus/inside/",
        "s3://corpus/in*",
        "s3://other/in/",
        "s3://corpus/",
        str(project / "in"),
    ):
        assert not allowed(uri, root, project), uri
    with pytest.raises(InvalidInput, match=r"may not hold '\.\.' parts"):
        check_input("s3://corpus/in/../secret/", root, project, Settings())
    assert not allowed("s3://corpus/in/x.jsonl", str(project / "in"), project)


def test_allowed_roots_come_from_the_setting(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANES_ALLOWED_INPUT_ROOTS", '["shared/corpora/", "s3://shared/corpora"]')
    settings = Settings()
    assert settings.allowed_input_roots == ("shared/corpora/", "s3://shared/corpora")
    assert allowed("shared/corpora/*.jsonl", "in/", project, settings)
    assert allowed("s3://shared/corpora/2026/a.jsonl", "s3://corpus/in/", project, settings)
    assert not allowed("shared/", "in/", project, settings)
    assert not allowed("s3://shared/corpora-2/", "s3://corpus/in/", project, settings)
    roots = allowed_roots("in/", project, settings)
    assert roots == [
        f"{project}/in/",
        f"{project}/in/_submitted/",
        f"{settings.batch_store()}batches/",  # where the Batch API stages its batches
        f"{project}/shared/corpora/",
        "s3://shared/corpora",
    ]
    with pytest.raises(InvalidInput) as caught:
        check_input("elsewhere/", "in/", project, settings)
    message = str(caught.value)
    assert f"input elsewhere/ ({project}/elsewhere/) is outside what this workload reads" in message
    assert "LANES_ALLOWED_INPUT_ROOTS" in message and "\n" not in message


def test_the_setting_takes_folders_not_patterns(monkeypatch: pytest.MonkeyPatch) -> None:
    from lanes.errors import SettingsError

    monkeypatch.setenv("LANES_ALLOWED_INPUT_ROOTS", '["s3://shared/*"]')
    wanted = (
        r"LANES_ALLOWED_INPUT_ROOTS: expected folders .* without wildcards, found 's3://shared/\*'"
    )
    with pytest.raises(SettingsError, match=wanted):
        Settings()


def test_absolute_and_folder_of(project: Path) -> None:
    assert absolute("in/sub/", project) == f"{project}/in/sub/"
    assert absolute("link/x.jsonl", project) == f"{project}/elsewhere/x.jsonl"
    assert absolute("s3://b/in/", project) == "s3://b/in/"
    assert folder_of("in/sub/a.jsonl", project) == f"{project}/in/sub"
    assert folder_of("in/*.jsonl", project) == f"{project}/in"
    assert folder_of("s3://b/in/a.jsonl", project) == "s3://b/in/"
    assert folder_of("s3://b/in/", project) == "s3://b/in/"
