"""Where a job may read: the workload's own input, its staging area, or a root that
`Settings.allowed_input_roots` allows. Nothing else, however the URI is spelt.

A job runs with the worker's credentials, not the submitter's, so the check runs
twice: in `submit` (a clear error before anything is staged) and where the flow plans
the job (whoever created the flow run). Local paths are compared after resolving
`..` and symlinks; an s3:// URI must not hold `.` or `..` parts at all (S3 keeps them
as literal keys, but HTTP layers may collapse them). A glob is judged by its fixed
part, the folder before its first wildcard.

The files a submitted folder or glob expands to are judged too, by their real paths,
when the flow plans the job (`check_files`): a symbolic link inside an allowed folder
(a shared upload folder) to a file or folder outside every allowed root is refused,
with the whole job, before any of it is read, as a link named as the input itself is.
Skipping it instead would drop its records unsaid. The workload's own input, run
as declared (no input given), is the operator's: links there are followed wherever
they point, as an operator may link data folders in. A job given an input, even the
workload's own folder, reads a linked folder outside its roots only once
`LANES_ALLOWED_INPUT_ROOTS` allows it. Each file is judged again as its shard opens
it (`check_opened`), so that a link swapped in after planning is refused too. `submit`
checks the URI only: the files are listed where the job runs, which may not be where
it is submitted. S3 has no links.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlparse

from lanes import layout
from lanes.errors import InvalidInput, PermanentStorageError
from lanes.settings import Settings
from lanes.uris import is_s3, join, split_s3

_GLOB_CHARS = "*?["
# Names that make an s3:// location a single file, not a prefix (flows.records reads these).
DATA_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".json", ".gz", ".parquet", ".pq")


def absolute(location: str, base: Path) -> str:
    """A location as a worker will read it: a local path (or file:// URI) made absolute
    against `base`, `..` and symlinks resolved, a trailing '/' kept; other URIs as
    they are."""
    if location.startswith("file://"):
        location = unquote(urlparse(location).path)
    elif "://" in location:
        return location
    path = Path(location).expanduser()
    resolved = os.path.realpath(path if path.is_absolute() else base / path)
    return resolved + ("/" if location.endswith("/") and resolved != "/" else "")


def folder_of(location: str, base: Path) -> str:
    """The folder of a workload's input or output, absolute: a glob's fixed part, a
    single file's folder."""
    cut = min((location.index(c) for c in _GLOB_CHARS if c in location), default=None)
    if cut is not None:
        location = location[: location.rfind("/", 0, cut) + 1]
    if "://" in location and not location.startswith("file://"):
        last = location.rstrip("/").rsplit("/", 1)[-1]
        if not location.endswith("/") and last.lower().endswith(DATA_SUFFIXES):
            return location[: location.rfind("/") + 1]
        return location
    path = Path(absolute(location, base))
    return str(path.parent if path.is_file() else path)


def allowed_roots(workload_input: str, base: Path, settings: Settings) -> list[str]:
    """Where a job of the workload with input `workload_input` may read, absolute."""
    staging = join(folder_of(workload_input, base), layout.SUBMITTED) + "/"
    extra = [absolute(root, base) for root in settings.allowed_input_roots]
    # Where the Batch API stages each batch's input (lanes.batchstore).
    batches = join(settings.batch_store(), "batches") + "/"
    return [absolute(workload_input, base), staging, batches, *extra]


def check_input(
    uri: str, workload_input: str, base: Path, settings: Settings, written: str | None = None
) -> None:
    """Raise InvalidInput unless `uri` lies under one of `allowed_roots`. Relative
    local paths are read against `base`; `written` is how the user wrote `uri`, for
    the message."""
    check_spelling(uri, "input")
    resolved = absolute(uri, base)
    roots = allowed_roots(workload_input, base, settings)
    if any(_under(_fixed(resolved), _fixed(root)) for root in roots):
        return
    written = written or uri
    shown = written if resolved == written else f"{written} ({resolved})"
    listed = ", ".join(roots)
    raise InvalidInput(
        f"input {shown} is outside what this workload reads ({listed}); put it there, or "
        "allow its folder in LANES_ALLOWED_INPUT_ROOTS (a JSON list) where the job is "
        "submitted and where it runs"
    )


def check_spelling(uri: str, what: str) -> None:
    """Raise InvalidInput, naming `what` ("input", "output"), for a location no check
    of its place could judge: a NUL character, an s3:// URI with `.` or `..` parts, a
    scheme other than a local path's, file:// and s3://."""
    if "\x00" in uri:  # no path holds one: the OS would refuse it as a ValueError
        raise InvalidInput(f"{what} {uri!r}: a path may not hold a NUL character")
    if is_s3(uri):
        dots = [p for p in split_s3(uri)[1].split("/") if p in (".", "..")]
        if dots:
            raise InvalidInput(f"{what} {uri}: an s3:// URI may not hold {dots[0]!r} parts")
    elif "://" in uri and not uri.startswith("file://"):
        raise InvalidInput(f"{what} {uri}: unsupported scheme; use a local path or s3://")


def check_files(input: str, files: Iterable[str], roots: Sequence[str]) -> None:
    """Raise InvalidInput when a local file of `files` (what `input`, already checked,
    lists) really lies outside `roots` (`allowed_roots`), through a symbolic link to it
    or to a folder above it: whoever may write in an allowed folder could otherwise
    have the worker read any file the worker may read."""
    outside = []
    for uri in files:
        if is_s3(uri):
            continue  # no links on S3: its prefix, checked, is what it reads
        real = absolute(uri, Path("/"))
        if not _inside(real, roots):
            outside.append(f"{uri} ({real})")
    if outside:
        more = len(outside) - 5
        shown = ", ".join(outside[:5]) + (f" and {more} more" if more > 0 else "")
        raise InvalidInput(
            f"input {input}: {shown}: a symbolic link to a file outside what this job may "
            f"read ({', '.join(roots)}); remove the link, or allow its target's folder in "
            "LANES_ALLOWED_INPUT_ROOTS (a JSON list) where the job runs"
        )


def check_opened(uri: str, stream: IO[bytes], roots: Sequence[str]) -> None:
    """`check_files` for local file `uri` as `stream` opened it, by where its descriptor
    leads (Linux's /proc/self/fd; elsewhere its path resolved again): a link swapped in
    after the job was planned is refused too, as a PermanentStorageError of its shard."""
    real = opened_at(stream.fileno(), uri)
    if not _inside(real, roots):
        raise PermanentStorageError(
            f"{uri}: now a symbolic link to {real}, outside what this job may read "
            f"({', '.join(roots)}); it was not when the job listed its input"
        )


def opened_at(fd: int, path: str | Path) -> str:
    """Where open descriptor `fd` really leads (Linux's /proc/self/fd; elsewhere `path`,
    which it was opened by, resolved again)."""
    opened = Path(f"/proc/self/fd/{fd}")
    return os.readlink(opened) if opened.is_symlink() else os.path.realpath(path)


def _inside(real: str, roots: Sequence[str]) -> bool:
    return any(_under(real, _fixed(root)) for root in roots)


def output_inside_input(output: str, input: str, base: Path) -> bool:
    """Whether `output` lies in what `input` reads (a glob: in its fixed part), so that
    a run's outputs would be read as inputs on the next one."""
    return _under(absolute(output, base), _fixed(absolute(input, base)))


def inside_output(output: str, other: str, base: Path) -> bool:
    """Whether output folder `output` is `other` or inside it, however each is spelt
    (relative or absolute, `..`, a trailing '/')."""
    return _under(absolute(output, base), absolute(other, base))


def _fixed(location: str) -> str:
    """The part of a location before its first wildcard, cut at a '/'."""
    cut = min((location.index(c) for c in _GLOB_CHARS if c in location), default=None)
    return location if cut is None else location[: location.rfind("/", 0, cut) + 1]


def _under(location: str, root: str) -> bool:
    """Whether `location` is `root` or inside it (both absolute, from `absolute`)."""
    if is_s3(location) != is_s3(root):
        return False
    if is_s3(location):
        (bucket, key), (top, prefix) = split_s3(location), split_s3(root)
        if bucket != top:
            return False
        prefix = prefix.rstrip("/")
        return not prefix or key.rstrip("/") == prefix or key.startswith(prefix + "/")
    path, folder = Path(location), Path(root)
    return path == folder or folder in path.parents
