"""flows.embedded: `lanes run`'s embedded Prefect server ends with `lanes run`, however
that ends, and a later `lanes run` on the same PREFECT_HOME runs as before."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lanes.flows import embedded
from tests.flows_fixtures import write_jsonl, write_spec
from tests.gates import GATE_FILE_ENV, SERVER_START_S, held_marker, wait_until

ROOT = Path(__file__).resolve().parent.parent
SERVER_APP = "prefect.server.api.server:create_app"  # what Prefect's server runs
GUARD = embedded.__file__  # the guard's command: python -I GUARD PARENT SERVER
# A SIGTERMed server's shutdown, then its SIGKILL after the guard's grace, on a loaded
# machine: a generous bound, never a wait.
GONE_S = 120.0
RUN_S = 600
# `lanes run` twice in one process, as typer's CliRunner or a notebook does, then the
# server stopped as prefect_test_harness stops it, while the process lives on: the test
# says when to go on, a line on stdin at each step.
TWO_RUNS = f"""
from prefect.server.api.server import SubprocessASGIServer
from lanes.flows.embedded import start_embedded_server

start_embedded_server({SERVER_START_S})
start_embedded_server({SERVER_START_S})
print("started", flush=True)
input()
SubprocessASGIServer().stop()
print("stopped", flush=True)
input()
"""


def _processes_of(home: Path, marker: str) -> list[int]:
    """This user's processes whose command line has `marker`, started for `home` (their
    environment names it as PREFECT_HOME)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or another user's
            continue
        if marker.encode() in command and f"PREFECT_HOME={home}".encode() in environ:
            found.append(int(entry.name))
    return found


@contextmanager
def _watching(pid: int) -> Iterator[int]:
    """A process descriptor of `pid`: readable once it has ended."""
    descriptor = os.pidfd_open(pid)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent`, zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # ended meanwhile
            continue
        # "pid (command) state ppid ...", where the command may hold spaces and ")"
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def _guards_of(parent: int) -> list[int]:
    found = []
    for child in _children(parent):
        try:
            command = (Path("/proc") / str(child) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if GUARD.encode() in command:
            found.append(child)
    return found


def _line(process: subprocess.Popen[str], within_s: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], within_s)
    assert ready, f"no line from the process within {within_s} s"
    return process.stdout.readline().strip()


def _ended(descriptor: int, within_s: float) -> bool:
    ready, _, _ = select.select([descriptor], [], [], within_s)
    return bool(ready)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the guard needs Linux's pidfd")
def test_a_sigkilled_lanes_run_takes_its_embedded_server_with_it(tmp_path: Path) -> None:
    workload = {
        "mode": "offline",
        "task": "infer",
        "model": "affine",
        "input": "in/",
        "output": "out/",
        "retries": 0,
        "handler": "tests.flows_fixtures:held_from_shard_3",
        "runner": {"max_concurrent_shards": 1},
    }
    spec = write_spec(tmp_path, {"slow": workload})
    for shard in range(5):
        records = [{"id": f"s{shard}-{i}", "x": [[i, shard, 0, 0]]} for i in range(3)]
        write_jsonl(tmp_path / "in" / f"part-{shard:02d}.jsonl", records)
    home = tmp_path / "prefect"
    gate = tmp_path / "gate-open"  # closed for the first run: shard 3 waits there
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(home), GATE_FILE_ENV: str(gate), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lanes.router.cli", "run", "slow", "--file", str(spec)]

    killed = subprocess.Popen(command, cwd=ROOT, env=env)
    try:
        wait_until(
            lambda: held_marker(gate).exists() or killed.poll() is not None,
            "the run held at shard 3",
            timeout=SERVER_START_S,
            interval=0.1,
        )
        assert killed.poll() is None, f"the run ended first, with {killed.returncode}"
        (server,) = _processes_of(home, SERVER_APP)
        assert len(_processes_of(home, GUARD)) == 1, "no guard beside the server"
        with _watching(server) as server_ended:
            killed.send_signal(signal.SIGKILL)
            killed.wait(timeout=60)
            try:
                assert _ended(server_ended, GONE_S), "the server outlived its SIGKILLed run"
            finally:
                if not _ended(server_ended, 0):
                    signal.pidfd_send_signal(server_ended, signal.SIGKILL)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait(timeout=60)
    wait_until(lambda: not _processes_of(home, GUARD), "the guard gone", GONE_S, 0.1)

    gate.touch()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stderr
    assert "2 run, 3 already done" in done.stdout, done.stdout
    # A normal exit stops the server as Prefect always has (at exit), and the guard
    # then ends on its own.
    assert _processes_of(home, SERVER_APP) == []
    wait_until(lambda: not _processes_of(home, GUARD), "the guard gone", GONE_S, 0.1)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the guard needs Linux's pidfd")
def test_a_guard_that_cannot_watch_its_processes_exits_quietly() -> None:
    # A kernel without pidfd, a seccomp filter or gVisor refuses every pidfd_open with an
    # OSError (ENOSYS, EPERM); this kernel refuses pid 0 so (EINVAL).
    server = subprocess.Popen(["sleep", "600"])
    try:
        for parent, watched in [(os.getpid(), 0), (0, server.pid)]:
            done = subprocess.run(
                [sys.executable, "-I", GUARD, str(parent), str(watched)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert server.poll() is None, "the guard stopped a server it could not watch"
    finally:
        server.kill()
        server.wait(timeout=60)


def test_the_guard_runs_on_the_standard_library_alone() -> None:
    # Not the lanes package and all it imports (half a second, tens of MB): the guard
    # is this file run by path, and imports only what Python itself has.
    done = subprocess.run(
        [sys.executable, "-I", "-X", "importtime", GUARD, str(os.getpid()), "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # "import time: self [us] | cumulative | imported package", then one line a module
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()[1:]}
    assert {name for name in imported if name.split(".")[0] in {"lanes", "prefect"}} == set()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the guard needs Linux's pidfd")
def test_one_guard_per_server_reaped_when_the_server_stops(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(ROOT)}
    runs = subprocess.Popen(
        [sys.executable, "-c", TWO_RUNS],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert runs.stdin is not None
    try:
        assert _line(runs, SERVER_START_S) == "started"
        guards = _guards_of(runs.pid)
        assert len(guards) == 1, f"{len(guards)} guards for one server"
        runs.stdin.write("\n")
        runs.stdin.flush()
        assert _line(runs, GONE_S) == "stopped"
        # Reaped, its pid is no child of the process any more; a zombie's still is.
        wait_until(lambda: guards[0] not in _children(runs.pid), "the guard reaped", GONE_S, 0.1)
        runs.communicate("\n", timeout=GONE_S)
        assert runs.returncode == 0
    finally:
        if runs.poll() is None:
            runs.kill()
            runs.wait(timeout=60)
