"""`lanes run`'s embedded Prefect API server, ended with `lanes run` however that ends.

Without PREFECT_API_URL, Prefect starts an API server in a subprocess at its first
client (`SubprocessASGIServer`) and stops it from an atexit handler. A SIGKILL runs no
handler, and nothing else ties the server to its parent: it would live on, holding its
port and its SQLite database. So `start_embedded_server` starts Prefect's own server up
front (the one its clients then use) and a guard beside it:

    python -I .../lanes/flows/embedded.py PARENT SERVER

(this file by path, isolated: the guard needs the standard library only, not the lanes
package and all it imports, so this module imports nothing else at its top). The guard
waits on process descriptors (Linux's pidfd, never reused as a pid may be) of `lanes
run` and of the server; when `lanes run` ends first, it stops the server. A normal exit
is Prefect's as before: its atexit handler stops the server, after the run's logs are
flushed to it, and the guard, finding it gone, just exits.

Prefect's server is one object per process, so a second `lanes run` in one process
(typer's CliRunner, a notebook) finds its guard started already; and a guard that ends
while this process lives on (the server stopped by prefect_test_harness) is reaped by a
daemon thread, never left a zombie.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading

# The server's time to shut down after SIGTERM before it is killed (Prefect's stop: 5 s;
# a loaded machine may need longer, and nobody waits for the guard).
STOP_GRACE_S = 30.0

# The servers (by pid) with a guard that this process started and has not reaped yet:
# as per process as Prefect's server object is.
_GUARDED: set[int] = set()
_GUARDED_LOCK = threading.Lock()


def start_embedded_server(startup_s: float) -> None:
    """Start Prefect's embedded API server now, waiting up to `startup_s` for it, tied
    to this process by one guard however often this is called; nothing to do with
    PREFECT_API_URL set. Where the platform has no working pidfd (not Linux, kernels
    before 5.3, a seccomp filter, gVisor), Prefect starts it at the first client,
    untied, as it always has."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or not _has_pidfd():
        return
    server = SubprocessASGIServer()  # Prefect's clients in this process find this one
    server.start(timeout=int(startup_s))
    if server.server_process is None:
        return  # stopped already: nothing to guard
    server_pid = server.server_process.pid
    with _GUARDED_LOCK:
        if server_pid in _GUARDED:
            return
        # posix_spawn, not Popen: the guard outlives this process by design, and a
        # Popen still running would warn at exit that it does.
        guard_pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-I", __file__, str(os.getpid()), str(server_pid)],
            os.environ,
        )
        _GUARDED.add(server_pid)
    threading.Thread(
        target=_reap, args=(guard_pid, server_pid), name="lanes-guard-reaper", daemon=True
    ).start()


def _reap(guard_pid: int, server_pid: int) -> None:
    """Wait for the guard to end (with its server, or this process's end abandons the
    wait), so that it leaves no zombie behind."""
    os.waitpid(guard_pid, 0)
    with _GUARDED_LOCK:
        _GUARDED.discard(server_pid)


def _has_pidfd() -> bool:
    """Whether this process can open process descriptors: Python has os.pidfd_open on
    any Linux, but the kernel may still refuse it."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def guard(parent: int, server: int) -> None:
    """Wait until `server` ends; when `parent` ends first, stop `server` (SIGTERM, then
    SIGKILL after STOP_GRACE_S). Returns quietly when `server` has ended already, and
    where it cannot watch them (a kernel that refuses pidfd, a pid that is no pid), the
    server then left unguarded."""
    try:
        server_fd = os.pidfd_open(server)
    except OSError:  # ended already, or no pidfd here after all: nothing to do
        return
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        parent_fd = None  # ended before we looked
    except OSError:
        return
    if parent_fd is not None and os.getppid() == parent:
        ended, _, _ = select.select([parent_fd, server_fd], [], [])
        if server_fd in ended:
            return
    _stop(server_fd)


def _stop(server_fd: int) -> None:
    try:
        signal.pidfd_send_signal(server_fd, signal.SIGTERM)
        ended, _, _ = select.select([server_fd], [], [], STOP_GRACE_S)
        if not ended:
            signal.pidfd_send_signal(server_fd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended meanwhile


def main(argv: list[str]) -> int:
    # A Ctrl-C in the terminal reaches every process of `lanes run`'s group: `lanes run`
    # handles it, and this guard ends when it does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if len(argv) != 2 or not all(arg.isdigit() for arg in argv):
        print(f"usage: python -I {__file__} PARENT_PID SERVER_PID", file=sys.stderr)
        return 2
    guard(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
