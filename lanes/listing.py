"""Listing the files under a folder, glob or prefix, locally or on S3: which names a
listing holds (bookkeeping `_*` and hidden files skipped), and S3 keys matched against
a glob folder by folder, as a local glob matches a path.

Apart from lanes.storage because listing is the one part of it that decides names
rather than moves bytes; `Storage.list_files` sorts and filters what these return.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes.errors import StorageError
from lanes.localfiles import (
    GLOB_CHARS,
    PRIVATE,
    denied_listing,
    glob_matches,
    glob_root,
    regular_file,
    walk,
)
from lanes.s3errors import s3_errors
from lanes.uris import local_path, split_s3


@dataclass(frozen=True)
class StoredFile:
    """One listed file. `name` is its path below the listed root (for output names);
    `version` changes when the content may have (mtime or ETag), for resume keys."""

    uri: str
    name: str
    size: int
    version: str


def list_local(location: str) -> list[StoredFile]:
    """The files a local folder or glob holds, or the file `location` names; unsorted."""
    path = local_path(location)
    pattern: tuple[str, ...] | None = None
    if any(c in str(path) for c in GLOB_CHARS):
        root = glob_root(path)
        pattern = path.relative_to(root).parts
    else:
        root = path
        try:
            if path.is_file():
                return [f for f in [_stat(path, path.name)] if f is not None]
            if not path.is_dir():
                raise StorageError(
                    f"{location}: no such folder or file; check the workload's input"
                )
        except PermissionError as err:
            raise denied_listing(location, err) from None
    files = []
    for folder, names in walk(root, location, pattern):
        for name in names:
            relative = (folder / name).relative_to(root)
            if _is_private(relative.as_posix()):
                continue
            if pattern is None or glob_matches(relative.parts, pattern):
                stored = _stat(folder / name, relative.as_posix())
                if stored is not None:
                    files.append(stored)
    return files


def list_s3(client: Callable[[], Any], location: str, endpoint: str | None) -> list[StoredFile]:
    """The objects an S3 prefix or glob holds, through the boto3 client `client()`
    returns; unsorted. `endpoint` is only for what errors say."""
    bucket, key = split_s3(location)
    pattern: str | None = None
    if any(c in key for c in GLOB_CHARS):
        # s3://b/dir/*.jsonl: list dir/, keep the keys the pattern matches.
        pattern = key
        cut = min(key.index(c) for c in GLOB_CHARS if c in key)
        key = key[: key.rfind("/", 0, cut) + 1]
    files = []
    paginator = client().get_paginator("list_objects_v2")
    with s3_errors(location, "list", endpoint):
        # The paginator follows continuation tokens: 1,000 keys a page, any number.
        for page in paginator.paginate(Bucket=bucket, Prefix=key):
            for obj in page.get("Contents", []):
                name = _s3_relative(str(obj["Key"]), key, pattern)
                # A key equal to the prefix is the file named itself: the user's.
                if name is not None and (obj["Key"] == key or not _is_private(name)):
                    etag = str(obj.get("ETag", "")).strip('"')
                    uri = f"s3://{bucket}/{obj['Key']}"
                    files.append(StoredFile(uri, name, int(obj["Size"]), etag))
    return files


def _is_private(relative: str) -> bool:
    return any(part.startswith(PRIVATE) for part in relative.split("/"))


def _s3_relative(key: str, prefix: str, pattern: str | None) -> str | None:
    """`key`'s name below the listed prefix, or None when the listing excludes it.

    A prefix ending in '/' (or empty) is a folder; a glob keeps what it matches; a
    bare prefix is a file of that name or a folder of that name, never a sibling
    that merely starts the same ("in/a" lists "in/a" and "in/a/x", not "in/ab").
    """
    if key.endswith("/"):
        return None  # a folder placeholder object
    if pattern is not None:
        return key[len(prefix) :] if _s3_glob_matches(key, pattern) else None
    if not prefix or prefix.endswith("/"):
        return key[len(prefix) :]
    if key == prefix:
        return key.rsplit("/", 1)[-1]
    if key.startswith(prefix + "/"):
        return key[len(prefix) + 1 :]
    return None


def _s3_glob_matches(key: str, pattern: str) -> bool:
    """Whether `key` matches the glob `pattern` as a local glob matches a path: folder
    by folder ('/' parts a key's folders, as S3's console and `aws s3 ls` show them), a
    `*` within one, and a `**` part any number of folders, none included."""
    return _parts_match(key.split("/"), pattern.split("/"))


def _parts_match(names: list[str], parts: list[str]) -> bool:
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_parts_match(names[i:], parts[1:]) for i in range(len(names) + 1))
    return (
        bool(names)
        and fnmatch.fnmatchcase(names[0], parts[0])
        and _parts_match(names[1:], parts[1:])
    )


def _stat(path: Path, name: str) -> StoredFile | None:
    """`path` listed as `name`; None when it is no regular file (localfiles.regular_file)."""
    info = regular_file(path)
    if info is None:
        return None
    return StoredFile(str(path), name, info.st_size, str(info.st_mtime_ns))
