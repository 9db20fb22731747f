"""Walking a local input: the folders and files a folder or glob input lists, matched
segment by segment against the glob, and the permanent errors for what this process
may not read or list (lanes.listing builds its listing on these).

Symbolic links to folders are followed, never into a folder above them; a folder named
lost+found is skipped; any other folder that may not be listed fails the listing,
naming it.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from lanes.errors import PermanentStorageError, StorageError

# Files whose name starts with one of these are the job's own bookkeeping (markers,
# errors, staging, manifests) or hidden: never listed as data (Spark's convention).
PRIVATE = ("_", ".")
GLOB_CHARS = "*?["
# fsck's folder at the root of every ext2/3/4 volume (a PVC's root included): never
# data, and root's alone (mode 0700), so lanes in a non-root image could not list it
# and would fail every input that holds a volume's root.
_LOST_FOUND = "lost+found"
_GRANT = "give the user lanes runs as"


def glob_root(pattern: Path) -> Path:
    """The folder part of a glob before its first wildcard (names are relative to it)."""
    parts = []
    for part in pattern.parts:
        if any(c in part for c in GLOB_CHARS):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def walk(
    root: Path, location: str, pattern: tuple[str, ...] | None
) -> Iterator[tuple[Path, list[str]]]:
    """Each folder under `root` and its file names; not the private folders (never
    data), nor lost+found, nor, for a glob `pattern`, the folders it cannot reach.

    Links to folders are followed, for folder inputs and globs alike: glob.glob, which
    globs used, followed them, and a folder input should list what `folder/**/*` does.
    A link to a folder that the path already went through (same device and inode) is
    a cycle and not walked, so the walk ends and lists each file once. A folder that
    two paths reach without a cycle is listed under each, as glob.glob did: a set of
    all folders visited would drop the second path's files where only it matches a
    glob.

    A folder this process may not list is a PermanentStorageError: pathlib's and glob's
    own walks skip it without a word, and its shards would be missing from the job unsaid.
    """

    def refused(err: OSError) -> None:
        if isinstance(err, FileNotFoundError | NotADirectoryError):
            return  # gone while the walk ran, or a glob's root that is none: no files
        if isinstance(err, PermissionError):
            raise denied_listing(err.filename or location, err)
        raise StorageError(f"{err.filename or location}: cannot list it: {err.strerror or err}")

    try:
        info = root.stat()
    except OSError as err:
        refused(err)
        return
    # Each folder not yet descended into -> the folders on its path from `root`.
    above: dict[Path, frozenset[tuple[int, int]]] = {root: frozenset({_key(info)})}

    def descend(parent: Path, folder: Path) -> bool:
        try:
            key = _key(folder.stat())
        except FileNotFoundError:
            return False  # gone while the walk ran
        except PermissionError as err:  # a folder that may be read but not searched
            raise denied_listing(str(parent), err) from None
        if key in above[parent]:
            return False
        above[folder] = above[parent] | {key}
        return True

    for folder, subfolders, names in os.walk(root, onerror=refused, followlinks=True):
        here = Path(folder)
        subfolders[:] = [
            s
            for s in subfolders
            if not s.startswith(PRIVATE)
            and s != _LOST_FOUND
            and (
                pattern is None
                or glob_matches((here / s).relative_to(root).parts, pattern, partial=True)
            )
            and descend(here, here / s)
        ]
        del above[here]
        yield here, names


def _key(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def glob_matches(parts: tuple[str, ...], pattern: tuple[str, ...], partial: bool = False) -> bool:
    """Whether a path's `parts` match a glob's (`**`: any number of folders, as glob's
    recursive mode); `partial`: whether a folder's parts could begin a match."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return glob_matches(parts, pattern[1:], partial) or (
            bool(parts) and glob_matches(parts[1:], pattern, partial)
        )
    if not parts:
        return partial
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and glob_matches(
        parts[1:], pattern[1:], partial
    )


def regular_file(path: Path) -> os.stat_result | None:
    """`path`'s status when it is a regular file (through links); None when it is no
    file (a socket, a link to a folder, a broken link) or went while the listing ran."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    except PermissionError as err:  # a folder that may be read but not searched
        raise denied_listing(str(path.parent), err) from None
    return info if stat.S_ISREG(info.st_mode) else None


def denied_reading(uri: str, path: Path) -> PermanentStorageError:
    return PermanentStorageError(
        f"{uri}: permission denied reading it; {_GRANT} read access (e.g. chmod a+r {path}), "
        "or move it out of the input"
    )


def denied_listing(folder: str, err: OSError) -> PermanentStorageError:
    return PermanentStorageError(
        f"{folder}: permission denied listing it ({err.strerror or err}); {_GRANT} read and "
        f"search access (e.g. chmod a+rx {folder}), or narrow the workload's input to what "
        "it may read"
    )
