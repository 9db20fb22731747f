"""Where a job may write: under its workload's own output folder, the Batch API's
batch store, or a root that `Settings.allowed_output_roots` allows. Nothing else,
however the URI is spelt.

A job writes with the worker's credentials, whoever created its flow run (`prefect
deployment run -p output=...`, any Prefect API client), so the flow checks a given
output where it plans the job, before anything is written. `submit` always writes
under the workload's output folder (`<output>/jobs/<key>/`), the Batch API under its
store. The spelling rules are the input's (lanes.inputs): local paths are compared
after resolving `..` and symlinks, so an output folder that is a link out of the
roots when the job is planned (`<output>/jobs/<key>` made a link to /elsewhere) is
refused; an s3:// URI must not hold `.` or `..` parts. The workload's own output, run
as declared (no output given), is the operator's, as its input is.

What a job writes is judged again as it writes it (`OutputStorage`): a folder inside
the output made a link out of it (`<output>/_errors` to /elsewhere, by anyone who may
write in a shared output folder), before the run or during it, would take the
worker's writes out with it. Each local file the job writes (outputs, errors files,
commit markers, manifests, their staging files, the run's `_running` lock) must land,
by the real path of its folder when it is staged and again when it is published, in
the job's output folder as it really lay when the job was planned; one that would
not fails its shard, naming the link, and nothing is written where the link leads.
The output folder itself may be a link (an operator's data disk): its target is what
was planned. A file's own name is not judged: publishing renames over it, so a link
there is replaced, not followed; `_running` is opened in place, so it is judged
whole. S3 has no links.

What a job reads back from its output is judged the same way (`OutputStorage.open`,
`read_bytes`): a `--retry-errors` run copies a shard's old output into its new one,
and every run reads commit markers, so `<output>/a.jsonl` made a link to a secret
file would have the worker copy the secret into an output its planter may read.
A local file under the job's output (as spelt) is opened without following a link
at its own name, and by where its descriptor leads it must lie in the job's real
output folder; one that would not fails the read, naming the link, unread. Inputs
have their own check (lanes.inputs), and `exists` reads no content: it is not judged.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO

from lanes.errors import InvalidInput, PermanentStorageError
from lanes.inputs import absolute, check_spelling, folder_of, inside_output, opened_at
from lanes.layout import RUNNING
from lanes.localfiles import denied_reading
from lanes.runlock import Held
from lanes.s3errors import Missing
from lanes.settings import Settings
from lanes.storage import Storage
from lanes.uris import is_s3, join, local_path


def allowed_output_roots(workload_output: str | None, base: Path, settings: Settings) -> list[str]:
    """Where a job of the workload with output `workload_output` (None: it declares
    none, an interactive workload) may write, absolute."""
    own = [folder_of(workload_output, base)] if workload_output else []
    # Where the Batch API's batches write (lanes.batches: <store>/batches/<key>/out/).
    batches = join(settings.batch_store(), "batches") + "/"
    extra = [absolute(root, base) for root in settings.allowed_output_roots]
    return [*own, batches, *extra]


def check_output(uri: str, workload_output: str | None, base: Path, settings: Settings) -> None:
    """Raise InvalidInput unless `uri` lies under one of `allowed_output_roots`, by its
    real path now. Relative local paths are read against `base`."""
    check_spelling(uri, "output")
    resolved = absolute(uri, base)
    roots = allowed_output_roots(workload_output, base, settings)
    if any(inside_output(resolved, root, base) for root in roots):
        return
    shown = uri if resolved == uri else f"{uri} ({resolved})"
    raise InvalidInput(
        f"output {shown} is outside where this workload writes ({', '.join(roots)}); "
        "write under one of them, or allow its folder in LANES_ALLOWED_OUTPUT_ROOTS (a "
        "JSON list) where the job runs (the worker's environment, or `lanes run`'s)"
    )


class OutputStorage(Storage):
    """`Storage` for one job, whose local writes must land in `real_output`: the job's
    output folder, links resolved when it was planned (`Job.real_output`). Writing
    elsewhere is a PermanentStorageError (`check_landing`), and so is reading a file
    below `output` (the folder as spelt, `Job.output`) that lies elsewhere
    (`open_inside`). Other reads (the job's input) are the storage's own."""

    def __init__(self, settings: Settings, real_output: str, output: str) -> None:
        super().__init__(settings)
        self.real_output = real_output
        self.output = output

    @contextmanager
    def open(self, uri: str) -> Iterator[IO[bytes]]:
        if not self._holds(uri):
            with super().open(uri) as stream:
                yield stream
            return
        with open_inside(uri, self.real_output) as stream:
            yield stream

    def read_bytes(self, uri: str) -> bytes | None:
        if not self._holds(uri):
            return super().read_bytes(uri)
        try:
            with open_inside(uri, self.real_output) as stream:
                return stream.read()
        except Missing:
            return None

    def _holds(self, uri: str) -> bool:
        """Whether local `uri` is a file of the job's output, by its spelling: a link in
        its path is judged when it is opened, not here."""
        if is_s3(uri) or is_s3(self.output):
            return False
        path, folder = local_path(uri), local_path(self.output)
        return folder in path.parents

    @contextmanager
    def staged(self, uri: str) -> Iterator[Path]:
        # Before the folders are made: a link would take them out too.
        check_landing(uri, _folder(uri), self.real_output)
        with super().staged(uri) as stage:
            yield stage

    def publish(self, staged: Path, uri: str) -> None:
        # Again: a shard runs for minutes between staging and publishing.
        check_landing(uri, _folder(uri), self.real_output)
        super().publish(staged, uri)

    def ensure_folder(self, location: str) -> None:
        check_landing(location, location, self.real_output)
        super().ensure_folder(location)

    def exclusive(self, folder: str, holder: str) -> AbstractContextManager[Held]:
        # The lock file is opened where it is, not renamed over: its own name counts.
        check_landing(folder, join(folder, RUNNING), self.real_output)
        return super().exclusive(folder, holder)


def check_landing(uri: str, folder: str, real_output: str) -> None:
    """Raise PermanentStorageError, naming the link, unless local `folder` (where `uri`
    is written), resolved now, is `real_output` or lies inside it."""
    if is_s3(folder):
        return
    path = local_path(folder)
    real = os.path.realpath(path)
    if _inside(real, real_output):
        return
    raise _outside(uri, path, real_output, "nothing was written there")


@contextmanager
def open_inside(uri: str, real_output: str) -> Iterator[IO[bytes]]:
    """Local file `uri` opened for reading, unless it really lies outside `real_output`
    (a PermanentStorageError naming the link, the file left unread). A link at its own
    name is not followed by the open, but resolved and judged first, and so are its
    folders, so that nothing outside is opened (a FIFO there would block); where the
    opened descriptor leads is judged too, so a link swapped in meanwhile is caught. A missing
    file is `Missing`, one that may not be read a PermanentStorageError, as
    `Storage.open` says."""
    path = local_path(uri)
    if not _inside(os.path.realpath(path.parent), real_output):
        if not os.path.lexists(path):
            # Nothing to read: a shard writing there is refused as it stages.
            raise Missing(f"{uri}: no such file")
        raise _outside(uri, path, real_output, "nothing was read from it")
    fd = _open_unlinked(uri, path)
    if fd is None:
        # A link at the name: one within the output is read where it leads, once.
        real = Path(os.path.realpath(path))
        if not _inside(str(real), real_output):
            raise _outside(uri, path, real_output, "nothing was read from it")
        fd = _open_unlinked(uri, real)
        if fd is None:  # swapped for a link again meanwhile
            raise _outside(uri, real, real_output, "nothing was read from it")
    with os.fdopen(fd, "rb") as stream:
        if not _inside(opened_at(fd, path), real_output):
            raise _outside(uri, path, real_output, "nothing was read from it")
        yield stream


def _open_unlinked(uri: str, path: Path) -> int | None:
    """A descriptor of `path` opened to read, or None where its own name is a link."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Missing(f"{uri}: no such file") from None
    except PermissionError:
        raise denied_reading(uri, path) from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None
        raise


def _outside(uri: str, path: Path, real_output: str, done: str) -> PermanentStorageError:
    link, target = _leaving(path, real_output)
    return PermanentStorageError(
        f"{uri}: {link} is a symbolic link to {target}, outside this job's output "
        f"{real_output}, so {done}; remove the link (whoever may write in the output "
        "folder can make one) and run again"
    )


def _leaving(path: Path, real_output: str) -> tuple[Path, str]:
    """The part of `path` that leads out of `real_output`, and where it leads: the first
    below a part inside it; else (the output itself was moved) its last link."""
    parts = [*reversed(path.parents), path]
    inside = False
    for part in parts:
        real = os.path.realpath(part)
        if inside and not _inside(real, real_output):
            return part, real
        inside = _inside(real, real_output)
    link = next((part for part in reversed(parts) if part.is_symlink()), path)
    return link, os.path.realpath(link)


def _inside(real: str, real_output: str) -> bool:
    path, folder = Path(real), Path(real_output)
    return path == folder or folder in path.parents


def _folder(uri: str) -> str:
    """The folder a file `uri` is written in."""
    return str(local_path(uri).parent) if not is_s3(uri) else uri
