"""lanes.storage: local files and S3 (a moto server over HTTP), listing and atomic publish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lanes.errors import PermanentStorageError, StorageError
from lanes.settings import Settings
from lanes.staging import this_process
from lanes.storage import MiB, Storage, Versioned
from lanes.uris import join
from tests.flows_fixtures import (
    moto_server,
    ran_where_modes_bind,
    read_only,
    s3_env,
    staging_writer,
)

SUFFIXES = (".jsonl", ".parquet")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    return s3_env(monkeypatch, endpoint)


def names(storage: Storage, location: str) -> list[str]:
    return [f.name for f in storage.list_files(location, SUFFIXES)]


# ---- local ------------------------------------------------------------------------


def test_local_folder_lists_data_files_recursively_skipping_bookkeeping(tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.parquet", "sub/c.jsonl", "notes.txt", "_errors/x.jsonl", ".h.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    storage = Storage(Settings())
    assert names(storage, str(tmp_path)) == ["a.parquet", "b.jsonl", "sub/c.jsonl"]
    assert names(storage, f"file://{tmp_path}/") == ["a.parquet", "b.jsonl", "sub/c.jsonl"]
    assert names(storage, str(tmp_path / "*.jsonl")) == ["b.jsonl"]
    assert names(storage, str(tmp_path / "**" / "*.jsonl")) == ["b.jsonl", "sub/c.jsonl"]
    assert names(storage, str(tmp_path / "b.jsonl")) == ["b.jsonl"]
    # Skipping is for what a folder or glob finds: a file named itself is the user's.
    assert names(storage, str(tmp_path / "_errors" / "x.jsonl")) == ["x.jsonl"]
    assert names(storage, str(tmp_path / ".h.jsonl")) == [".h.jsonl"]


def read_all(storage: Storage, uri: str) -> bytes:
    with storage.open(uri) as stream:
        return stream.read()


def test_local_globs_reach_the_files_glob_would(tmp_path: Path) -> None:
    for name in ("a.jsonl", "sub/b.jsonl", "sub/deep/c.jsonl", "other/d.jsonl", "_x/e.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    storage = Storage(Settings())
    assert names(storage, str(tmp_path / "*" / "*.jsonl")) == ["other/d.jsonl", "sub/b.jsonl"]
    assert names(storage, str(tmp_path / "sub" / "**" / "*.jsonl")) == ["b.jsonl", "deep/c.jsonl"]
    assert names(storage, str(tmp_path / "[as]*" / "*" / "*.jsonl")) == ["sub/deep/c.jsonl"]
    assert names(storage, str(tmp_path / "none" / "*.jsonl")) == []


def test_local_listing_follows_links_to_folders_once_round_a_cycle(tmp_path: Path) -> None:
    for name in ("in/a.jsonl", "in/sub/b.jsonl", "ext/e.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "in" / "link").symlink_to("../ext", target_is_directory=True)
    # A cycle: the walk would go in/sub/up/sub/up/... until the kernel refused the path.
    (tmp_path / "in" / "sub" / "up").symlink_to("..", target_is_directory=True)
    storage = Storage(Settings())
    folder = tmp_path / "in"
    assert names(storage, str(folder)) == ["a.jsonl", "link/e.jsonl", "sub/b.jsonl"]
    assert names(storage, str(folder / "*" / "*.jsonl")) == ["link/e.jsonl", "sub/b.jsonl"]
    assert names(storage, str(folder / "**" / "*.jsonl")) == [
        "a.jsonl",
        "link/e.jsonl",
        "sub/b.jsonl",
    ]
    assert names(storage, str(folder / "l*" / "*.jsonl")) == ["link/e.jsonl"]


def test_a_local_file_or_folder_it_may_not_read_is_a_permanent_error_naming_it(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not ran_where_modes_bind(request, tmp_path):
        return
    for name in ("a.jsonl", "locked.jsonl", "shut/b.jsonl", "_errors/c.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    locked, shut = tmp_path / "locked.jsonl", tmp_path / "shut"
    storage = Storage(Settings())
    for path in (locked, shut, tmp_path / "_errors"):
        path.chmod(0)
    try:
        for attempt in (
            lambda: read_all(storage, str(locked)),
            lambda: storage.read_bytes(str(locked)),
        ):
            with pytest.raises(PermanentStorageError) as read:
                attempt()
            assert str(read.value) == (
                f"{locked}: permission denied reading it; give the user lanes runs as read "
                f"access (e.g. chmod a+r {locked}), or move it out of the input"
            )
        # pathlib's and glob's own walks would skip `shut` and lose its shard unsaid.
        for location in (str(tmp_path), str(tmp_path / "**" / "*.jsonl")):
            with pytest.raises(PermanentStorageError) as listing:
                storage.list_files(location, SUFFIXES)
            assert str(listing.value).startswith(f"{shut}: permission denied listing it (")
            assert f"(e.g. chmod a+rx {shut}), or narrow the workload's input" in str(listing.value)
        # A glob that cannot reach it, and bookkeeping (never data), need no access.
        assert names(storage, str(tmp_path / "*.jsonl")) == ["a.jsonl", "locked.jsonl"]
    finally:
        for path in (locked, shut, tmp_path / "_errors"):
            path.chmod(0o755)


def test_a_volume_roots_lost_found_is_skipped_where_it_may_not_be_listed(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not ran_where_modes_bind(request, tmp_path):
        return
    for name in ("a.jsonl", "lost+found/#12.jsonl", "vol/b.jsonl", "vol/lost+found/#13.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    # As on an ext4 volume's root (a PVC's too): root's alone, where lanes may not look.
    shut = (tmp_path / "lost+found", tmp_path / "vol" / "lost+found")
    for path in shut:
        path.chmod(0)
    storage = Storage(Settings())
    try:
        assert names(storage, str(tmp_path)) == ["a.jsonl", "vol/b.jsonl"]
        assert names(storage, str(tmp_path / "**" / "*.jsonl")) == ["a.jsonl", "vol/b.jsonl"]
        assert names(storage, str(tmp_path / "*" / "*.jsonl")) == ["vol/b.jsonl"]
    finally:
        for path in shut:
            path.chmod(0o755)


def test_local_missing_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no such folder or file"):
        Storage(Settings()).list_files(str(tmp_path / "nope"), SUFFIXES)


def test_local_publish_is_a_rename_and_leaves_nothing_aside(tmp_path: Path) -> None:
    storage = Storage(Settings())
    target = join(str(tmp_path), "out", "part.jsonl")
    with storage.staged(target) as stage:
        stage.write_text("new\n")
        assert stage.parent == tmp_path / "out" and stage.name.startswith(".")
        assert not Path(target).exists()  # nothing visible until published
        storage.publish(stage, target)
    assert Path(target).read_text() == "new\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part.jsonl"]
    assert storage.read_bytes(target) == b"new\n"
    assert storage.read_bytes(str(tmp_path / "missing")) is None


def test_clean_stale_removes_only_old_staging_files_it_cannot_ask_the_owner_of(
    tmp_path: Path,
) -> None:
    """Files from before staging files were locked, and files of another host."""
    old = tmp_path / "_errors" / ".part.jsonl.abc.tmp"
    young = tmp_path / ".part.jsonl.def.tmp"
    elsewhere_old = tmp_path / ".a.jsonl.other-host-12-0123456789abcdef.tmp"
    elsewhere_young = tmp_path / ".b.jsonl.other-host-12-0123456789abcdef.tmp"
    for path in (old, young, elsewhere_old, elsewhere_young):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    for path in (old, elsewhere_old):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    assert Storage(Settings()).clean_stale(str(tmp_path), older_than_s=3600) == 2
    assert not old.exists() and not elsewhere_old.exists()
    assert young.exists() and elsewhere_young.exists()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_next_run_removes_a_killed_writers_staging_files_never_a_live_ones(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # S3 uploads stage in the system temp folder: one of this test's own.
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    folder = str(tmp_path / "out") if where == "local" else "s3://bucket/out"
    storage = Storage(Settings())
    with (
        staging_writer(join(folder, "killed.jsonl")) as (killed, killed_file),
        staging_writer(join(folder, "live.jsonl")) as (live, live_file),
        storage.staged(join(folder, "mine.jsonl")) as mine,
    ):
        mine.write_text("this process's, still being written")
        staged_in = killed_file.parent
        assert staged_in == (tmp_path / "out" if where == "local" else temp)
        assert this_process().host in killed_file.name and str(killed.pid) in killed_file.name
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=60) == -signal.SIGKILL
        assert killed_file.exists()  # what a killed run leaves, seconds old

        # The next run's clean-up: the killed writer's goes, at once; the others stay.
        assert storage.clean_stale(folder, older_than_s=24 * 3600) == 1
        assert not killed_file.exists()
        assert live_file.exists() and mine.exists()
        assert live.stdin is not None
        live.stdin.write("done\n")
        live.stdin.flush()
        assert live.wait(timeout=60) == 0
    assert sorted(p.name for p in staged_in.iterdir()) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_conditional_write_holds_only_while_the_version_does(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if where == "s3":
        request.getfixturevalue("s3").create_bucket(Bucket="records")
    folder = str(tmp_path / "records") if where == "local" else "s3://records/r"
    storage = Storage(Settings())
    uri = join(folder, "b.json")
    assert storage.read_versioned(uri) == Versioned(None, None)
    assert storage.write_if(uri, b"1", None)  # a create: only where there is none
    assert not storage.write_if(uri, b"other", None)
    first = storage.read_versioned(uri)
    assert first.data == b"1" and first.tag
    assert storage.write_if(uri, b"2", first.tag)
    assert not storage.write_if(uri, b"3", first.tag)  # another wrote since that read
    second = storage.read_versioned(uri)
    assert second.data == b"2" and second.tag != first.tag
    assert not storage.write_if(join(folder, "gone.json"), b"x", first.tag)
    assert storage.read_bytes(join(folder, "gone.json")) is None
    listed = [f.name for f in storage.list_files(folder, (".json", ".lock"))]
    assert listed == ["b.json"]  # a local lock file is hidden


# Each process adds 1 to a counter file `ROUNDS` times: read, then a conditional write,
# again on a conflict, as lanes.batchstore's update_batch does.
_COUNTING = """
import sys
from lanes.settings import Settings
from lanes.storage import Storage

storage, uri = Storage(Settings()), sys.argv[1]
for _ in range(int(sys.argv[2])):
    while True:
        read = storage.read_versioned(uri)
        if storage.write_if(uri, str(int(read.data or b"0") + 1).encode(), read.tag):
            break
"""


def test_local_conditional_writes_from_several_processes_lose_no_update(tmp_path: Path) -> None:
    uri, rounds, processes = str(tmp_path / "counter"), 30, 4
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    counting = [
        subprocess.Popen([sys.executable, "-c", _COUNTING, uri, str(rounds)], env=env)
        for _ in range(processes)
    ]
    assert [p.wait(timeout=120) for p in counting] == [0] * processes
    assert Path(uri).read_bytes() == str(rounds * processes).encode()


def test_a_read_only_folder_is_one_storage_error_that_says_what_to_do(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "_committed").mkdir(parents=True)  # as an earlier run left it
    storage = Storage(Settings())
    with read_only(out):
        for attempt in (
            lambda: storage.ensure_folder(str(out)),
            lambda: storage.write_bytes(join(str(out), "_committed", "a.json"), b"{}"),
            lambda: storage.write_bytes(join(str(out), "part.jsonl"), b"{}"),
            lambda: storage.write_bytes(join(str(out), "new", "part.jsonl"), b"{}"),
        ):
            with pytest.raises(StorageError) as caught:
                attempt()
            message = str(caught.value)
            assert str(out) in message and "\n" not in message, message
            assert "make it writable, or choose another output (--output" in message, message
        assert storage.clean_stale(str(out), older_than_s=0) == 0  # nothing, and no error
    assert sorted(p.name for p in out.iterdir()) == ["_committed"]


def test_a_write_that_fails_for_want_of_room_is_a_storage_error(tmp_path: Path) -> None:
    """A file-size limit makes writes fail as a full disk does (EFBIG, like ENOSPC)."""
    code = f"""
import resource, signal, sys
from lanes.errors import PermanentStorageError, StorageError
from lanes.settings import Settings
from lanes.storage import Storage
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
try:
    Storage(Settings()).write_bytes({str(tmp_path / "big.json")!r}, b"x" * 4096)
except StorageError as err:
    print(err)
    sys.exit(3)
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"{tmp_path}: cannot write {tmp_path / 'big.json'} there (File too large)" in done.stdout
    assert list(tmp_path.iterdir()) == []  # nothing published, nothing left aside


def test_join_keeps_every_part_below_the_base(tmp_path: Path) -> None:
    assert join(str(tmp_path), "/tmp/x/evil.jsonl") == str(tmp_path / "tmp/x/evil.jsonl")
    assert join("s3://b/out/", "/tmp/x.jsonl") == "s3://b/out/tmp/x.jsonl"


# ---- S3 -------------------------------------------------------------------------


def test_s3_lists_past_one_page_of_keys(s3: Any) -> None:
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    s3.create_bucket(Bucket="many")
    # 1,006 puts over HTTP take ~10 s here; the keys go straight into the moto server's
    # store instead (it runs in this process). The listing below is over HTTP.
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key in [f"in/part-{i:05d}.jsonl" for i in range(1005)] + ["in/_errors/x.jsonl"]:
        backend.put_object("many", key, b"{}\n")
    s3.put_object(Bucket="many", Key="inside.jsonl", Body=b"{}\n")  # shares the prefix "in"
    found = Storage(Settings()).list_files("s3://many/in/", SUFFIXES)
    assert len(found) == 1005  # S3 answers 1,000 keys a page
    assert found[0].uri == "s3://many/in/part-00000.jsonl"
    assert found[0].name == "part-00000.jsonl" and found[0].size == 3 and found[0].version


def test_s3_prefix_glob_and_single_key(s3: Any) -> None:
    s3.create_bucket(Bucket="data")
    for key in ("in/a.jsonl", "in/b.parquet", "in/sub/c.jsonl", "inside.jsonl", "in/d.txt"):
        s3.put_object(Bucket="data", Key=key, Body=b"{}\n")
    s3.put_object(Bucket="data", Key="in/_x.jsonl", Body=b"{}\n")
    storage = Storage(Settings())
    assert names(storage, "s3://data/in/") == ["a.jsonl", "b.parquet", "sub/c.jsonl"]
    assert names(storage, "s3://data/in") == ["a.jsonl", "b.parquet", "sub/c.jsonl"]
    assert names(storage, "s3://data/in/*.jsonl") == ["a.jsonl"]  # a local glob's `*`
    assert names(storage, "s3://data/in/a.jsonl") == ["a.jsonl"]
    assert names(storage, "s3://data/in/_x.jsonl") == ["_x.jsonl"]  # named: the user's
    assert names(storage, "s3://data") == [
        "in/a.jsonl",
        "in/b.parquet",
        "in/sub/c.jsonl",
        "inside.jsonl",
    ]


def test_exists_says_whether_a_file_is_there_without_reading_it(s3: Any, tmp_path: Path) -> None:
    # What a rerun asks of a committed shard's output before it skips the shard.
    s3.create_bucket(Bucket="data")
    s3.put_object(Bucket="data", Key="out/a.jsonl", Body=b"{}\n")
    (tmp_path / "a.jsonl").write_text("{}\n")
    storage = Storage(Settings())
    assert storage.exists("s3://data/out/a.jsonl") and storage.exists(str(tmp_path / "a.jsonl"))
    assert not storage.exists("s3://data/out/b.jsonl") and not storage.exists("s3://data/out")
    assert not storage.exists(str(tmp_path / "b.jsonl")) and not storage.exists(str(tmp_path))


def test_an_s3_glob_s_double_star_matches_no_folder_too_as_a_local_one_does(s3: Any) -> None:
    s3.create_bucket(Bucket="data")
    for key in ("in/a.jsonl", "in/sub/c.jsonl", "in/sub/deep/d.jsonl", "in/sub/e.parquet"):
        s3.put_object(Bucket="data", Key=key, Body=b"{}\n")
    storage = Storage(Settings())
    everything = ["a.jsonl", "sub/c.jsonl", "sub/deep/d.jsonl"]
    assert names(storage, "s3://data/in/**/*.jsonl") == everything
    assert names(storage, "s3://data/in/**/sub/**/*.jsonl") == everything[1:]
    assert names(storage, "s3://data/in/sub/**/d.jsonl") == ["deep/d.jsonl"]  # below in/sub/


def test_a_glob_reads_the_same_files_locally_and_on_s3(s3: Any, tmp_path: Path) -> None:
    """One spec, moved from a folder to a bucket, reads the same records: a glob's `*`
    stays within a folder on S3 too, as S3's console shows folders."""
    keys = (
        "a.jsonl",
        "sub/b.jsonl",
        "sub/deep/c.jsonl",
        "other/d.parquet",
        "x/sub/e.jsonl",
        "#1.jsonl",
    )
    s3.create_bucket(Bucket="same")
    for key in keys:
        s3.put_object(Bucket="same", Key=f"in/{key}", Body=b"{}\n")
        (tmp_path / "in" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / key).write_text("{}\n")
    storage = Storage(Settings())
    globs = ("*.jsonl", "*/*.jsonl", "*/*", "**/*.jsonl", "**/sub/*.jsonl", "s?b/**/*", "*/*/*")
    for glob in globs:
        local = names(storage, f"{tmp_path}/in/{glob}")
        assert names(storage, f"s3://same/in/{glob}") == local, glob
    assert names(storage, "s3://same/in/*/*.jsonl") == ["sub/b.jsonl"]
    # A key's `?` and `#` are its own, no URL's query or fragment.
    assert names(storage, "s3://same/in/#1.jsonl") == ["#1.jsonl"]


def test_s3_settings_endpoint_wins_over_the_environment(
    s3: Any, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.create_bucket(Bucket="data")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    storage = Storage(Settings(s3_endpoint=endpoint))
    assert storage.list_files("s3://data/", SUFFIXES) == []


def test_an_s3_endpoint_without_a_scheme_in_the_environment_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # boto3's own variable (LANES_S3_ENDPOINT is checked with the other settings).
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    storage = Storage(Settings())
    with pytest.raises(PermanentStorageError) as caught:
        storage.list_files("s3://data/", SUFFIXES)
    message = str(caught.value)
    assert message.startswith("S3 endpoint: Invalid endpoint: 127.0.0.1:9000")
    assert "AWS_ENDPOINT_URL" in message and "an http:// or https:// URL" in message


def test_s3_large_shard_goes_up_in_parts_and_appears_whole(s3: Any, tmp_path: Path) -> None:
    s3.create_bucket(Bucket="out")
    storage = Storage(Settings(), multipart_threshold=5 * MiB)
    data = os.urandom(12 * MiB)
    with storage.staged("s3://out/big.jsonl") as stage:
        stage.write_bytes(data)
        storage.publish(stage, "s3://out/big.jsonl")
    head = s3.head_object(Bucket="out", Key="big.jsonl")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of 3 parts
    assert storage.read_bytes("s3://out/big.jsonl") == data
    with storage.open("s3://out/big.jsonl") as stream:
        assert stream.read(MiB) == data[:MiB]
    assert s3.list_multipart_uploads(Bucket="out").get("Uploads", []) == []


def test_s3_missing_bucket_is_a_clear_error(s3: Any) -> None:
    storage = Storage(Settings())
    with pytest.raises(StorageError, match="bucket 'nope' does not exist; create it"):
        storage.list_files("s3://nope/in/", SUFFIXES)
    with pytest.raises(StorageError, match="bucket 'nope' does not exist"):
        storage.ensure_folder("s3://nope/out/")
    with pytest.raises(StorageError, match="bucket 'nope' does not exist"):
        storage.write_bytes("s3://nope/out/x.json", b"{}")
    with pytest.raises(StorageError, match="bucket 'nope' does not exist"):
        storage.read_bytes("s3://nope/x.json")
    s3.create_bucket(Bucket="here")
    assert storage.read_bytes("s3://here/missing.json") is None


def test_an_upload_failure_without_its_client_error_still_names_the_bucket() -> None:
    # boto3 raises S3UploadFailedError from inside its `except ClientError`; the code
    # is read from the chain when it is there and from the message when it is not.
    from boto3.exceptions import S3UploadFailedError

    storage = Storage(Settings())
    bare = S3UploadFailedError(
        "Failed to upload /tmp/x to nope/out/x.json: An error occurred (NoSuchBucket) "
        "when calling the PutObject operation: The specified bucket does not exist"
    )
    failed = pytest.raises(StorageError, match="bucket 'nope' does not exist; create it")
    with failed, storage._errors("s3://nope/out/x.json", "write"):
        raise bare
    other = pytest.raises(StorageError, match=r"cannot write on S3: Failed to upload")
    with other, storage._errors("s3://nope/out/x.json", "write"):
        raise S3UploadFailedError("Failed to upload /tmp/x to nope/out/x.json: timed out")


def test_s3_denied_access_is_a_clear_error(s3: Any, endpoint: str) -> None:
    s3.create_bucket(Bucket="locked")
    # Turn on moto's authentication: the test's made-up keys are then unknown.
    httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0", timeout=10).raise_for_status()
    try:
        with pytest.raises(PermanentStorageError, match=r"access denied .* check the credentials"):
            Storage(Settings()).list_files("s3://locked/in/", SUFFIXES)
    finally:
        httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"inf", timeout=10)


def client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "GetObject")


def test_s3_errors_that_would_repeat_are_permanent_and_passing_ones_are_not() -> None:
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    storage = Storage(Settings())

    def raised(error: Exception) -> StorageError:
        with pytest.raises(StorageError) as caught, storage._errors("s3://b/in/a.jsonl", "read"):
            raise error
        return caught.value

    for code, status in [("AccessDenied", 403), ("InvalidAccessKeyId", 403), ("Unauthorized", 401)]:
        denied = raised(client_error(code, status))
        assert isinstance(denied, PermanentStorageError) and "access denied" in str(denied)
    # What boto3's own retries gave up on may pass: the shard's retries try again.
    for error in [
        client_error("InternalError", 500),
        client_error("SlowDown", 503),
        client_error("ThrottlingException", 400),
        client_error("RequestTimeTooSkewed", 403),  # a clock that may be set right
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
    ]:
        assert type(raised(error)) is StorageError, error
