"""One run at a time per output folder: the lock a run holds on its output while it runs.

Two runs writing one output (a `prefect deployment run` while the scheduled run is
still going, two workers of one pool picking up two runs, `lanes run` beside a
deployment's run) would each run every shard not yet committed when they started: the
output still holds each record once (a shard is published whole, and the last one
published wins), but the work, and the device time billed in both manifests, is done
twice. So a run takes an exclusive `flock` on `<output>/_running` before it cleans,
plans or writes anything there, and holds it until its manifest is written; the file
says who holds it. A second run that cannot take the lock refuses at once, naming the
first. The kernel drops the lock when its process dies, however it dies, so a killed
run never blocks the next, and the file is never removed (removing a locked file would
let two runs lock two different files of the same name).

An S3 output has no `flock`: there `_running` is a lease (lanes.s3lock), taken with
a conditional write, renewed by its holder and taken over once a killed run stops
renewing it. Where a local folder's filesystem has no locks, runs are not kept apart
(the run warns): two runs at once each do the work, and the results are still each
record once.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lanes.errors import OutputBusy, StorageError

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A run's hold on its output. `lost` says why the run no longer holds it (an S3
    lease another run took over, or found gone: lanes.s3lock), None while it does; a
    `flock` is never lost."""

    lost: str | None = None


def busy_message(folder: object, holder: str) -> str:
    """OutputBusy's message: the run that holds `folder`, named by its lock's `holder`."""
    return (
        f"{folder} is being written by another run ({holder or 'one starting now'}); "
        "this run wrote nothing. Wait for that one to end (then run again: the "
        "shards it committed are skipped), or cancel it and run again"
    )


@contextmanager
def output_lock(path: Path, holder: str) -> Iterator[Held]:
    """Hold the lock file `path` while the block runs, writing `holder` (who runs,
    where, since when) into it. Raises OutputBusy, naming the holder, when another
    process holds it; StorageError when the file cannot be opened."""
    try:
        # Never through a link: the run would truncate and write whatever it leads to.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        raise StorageError(
            f"cannot open {path}, the lock of the run writing {path.parent}: "
            f"{err.strerror or err}; make it writable for this user (no run holds it "
            "while you change it)"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise OutputBusy(busy_message(path.parent, other)) from None
        except OSError as err:  # a filesystem without locks (ENOLCK, EOPNOTSUPP)
            log.warning("%s: cannot lock (%s): runs at once are not kept apart", path, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            yield Held()
        finally:
            os.ftruncate(fd, 0)  # released: nobody holds it now
    finally:
        os.close(fd)  # the lock goes with the last descriptor
