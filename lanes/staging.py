"""Staging files: where an output is written before it is published, and how a later
run tells a killed writer's leftovers from a live writer's.

A staging file is named `<prefix><label>.<host>-<pid>-<token>.tmp` and its writer
holds an exclusive `flock` on it from the moment it exists until it is published
(renamed to its final name) or removed. The kernel drops a lock when its process
dies, however it dies (SIGKILL included), so on the writer's host a cleaner that can
take the lock knows the file is abandoned, and one that cannot knows it is live. No
clock is involved, and a reused pid cannot fool it. Where the lock cannot decide,
the file's age does (`older_than_s`):

- a file named for another host: that host's locks may not reach this one (a shared
  volume without lock support), so only an old file is removed;
- a file named for this very process: live by definition (a finished one is gone),
  and on filesystems that emulate flock with POSIX locks (NFS) a process would be
  granted its own lock;
- a filesystem without locks, and files from before this naming: by age.

Hosts that share an output folder need distinct host names (Kubernetes pods and
containers have them by default).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".tmp"
_LABEL_BYTES = 120  # of the final name kept in the staging name: names stay < 255 bytes
_NAME = re.compile(r"\.(?P<host>[A-Za-z0-9-]{1,63})-(?P<pid>[0-9]+)-[0-9a-f]{16}\.tmp$")
_ATTEMPTS = 3  # a cleaner can take a new file only between its creation and its lock


@dataclass(frozen=True)
class Owner:
    """The process that made a staging file."""

    host: str
    pid: int


def this_process() -> Owner:
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"
    return Owner(host, os.getpid())


def owner_of(name: str) -> Owner | None:
    """Who made the staging file called `name`; None for a name without an owner."""
    found = _NAME.search(name)
    return Owner(found["host"], int(found["pid"])) if found else None


@contextmanager
def staging_file(folder: Path, label: str, prefix: str = ".") -> Iterator[Path]:
    """A new, empty staging file in `folder`, locked for as long as the block runs;
    removed after it unless it was renamed away (published). Raises OSError when the
    folder refuses the file."""
    me = this_process()
    short = label.encode()[:_LABEL_BYTES].decode(errors="ignore")
    for _ in range(_ATTEMPTS):
        path = folder / f"{prefix}{short}.{me.host}-{me.pid}-{uuid.uuid4().hex[:16]}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _lock(fd, blocking=True)
            if os.fstat(fd).st_nlink > 0:
                break
            # A cleaner took it before the lock did, and unlinked it: make another.
        except BaseException:
            os.close(fd)
            with suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
    else:
        raise OSError(f"{folder}: staging files keep vanishing; is another cleaner running?")
    try:
        yield path
    finally:
        with suppress(OSError):
            path.unlink()  # already gone once published
        os.close(fd)  # the lock goes with it, after the name


def remove_if_abandoned(path: Path, older_than_s: float) -> bool:
    """Remove the staging file `path` if its writer is gone. Returns True if removed."""
    owner, me = owner_of(path.name), this_process()
    if owner is not None and owner.host == me.host:
        if owner.pid == me.pid:
            return False
        unlocked = _remove_unlocked(path)
        if unlocked is not None:
            return unlocked
    try:
        if path.stat().st_mtime >= time.time() - older_than_s:
            return False
        path.unlink()
        return True
    except OSError:
        return False  # gone meanwhile (published or cleaned), or not ours to remove


def _remove_unlocked(path: Path) -> bool | None:
    """True: removed (nobody held its lock); False: live, or already gone; None: this
    filesystem cannot say (no locks)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            _lock(fd, blocking=False)
        except BlockingIOError:
            return False  # its writer holds it
        except OSError:
            return None
        try:
            path.unlink()
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def _lock(fd: int, blocking: bool) -> None:
    if not blocking:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    # A filesystem without locks refuses this; its cleaners then go by age alone.
    with suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX)
