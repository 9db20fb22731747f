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

Where the folder's filesystem has no locks, runs are not kept apart (as before). An
S3 output has no lock: there, two runs at once each do the work, and the results are
still each record once.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lanes.errors import OutputBusy, StorageError

log = logging.getLogger(__name__)


@contextmanager
def output_lock(path: Path, holder: str) -> Iterator[None]:
    """Hold the lock file `path` while the block runs, writing `holder` (who runs,
    where, since when) into it. Raises OutputBusy, naming the holder, when another
    process holds it; StorageError when the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
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
            raise OutputBusy(
                f"{path.parent} is being written by another run ({other or 'one starting now'}); "
                "this run wrote nothing. Wait for that one to end (then run again: the "
                "shards it committed are skipped), or cancel it and run again"
            ) from None
        except OSError as err:  # a filesystem without locks (ENOLCK, EOPNOTSUPP)
            log.warning("%s: cannot lock (%s): runs at once are not kept apart", path, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: nobody holds it now
    finally:
        os.close(fd)  # the lock goes with the last descriptor
