"""Locations by URI: a local path (or file://...) or s3://bucket/key; which one a URI
names, and joining one with relative parts.

Apart from lanes.storage because most modules only name places (an output's folder, a
marker's key) and never open a file; they need no S3 client to do that.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from lanes.errors import StorageError


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def join(base: str, *parts: str) -> str:
    """`base` (a folder or prefix, with or without a trailing '/') joined with `parts`,
    each taken as relative: a leading '/' never makes a local part absolute."""
    tail = "/".join(p.strip("/") for p in parts)
    if is_s3(base) or "://" in base:
        return base.rstrip("/") + "/" + tail
    return str(Path(base, *(p.strip("/") for p in parts)))


def local_path(uri: str) -> Path:
    """The file a local URI (a path, or file://) names."""
    if uri.startswith("file://"):
        return Path(unquote(urlparse(uri).path))
    if "://" in uri:
        raise StorageError(f"{uri}: unsupported scheme; use a local path, file:// or s3://")
    return Path(uri)


def split_s3(uri: str) -> tuple[str, str]:
    # Not urlparse: a key's `?` (a glob's, or the key's own) and `#` are no URL query
    # or fragment, and would be cut off.
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise StorageError(f"{uri}: expected s3://bucket/key")
    return bucket, key.lstrip("/")
