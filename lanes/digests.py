"""Content digests of local files: what a file holds, not where it lies or when it was
copied, so that a model or an input moved, copied or mounted elsewhere (a laptop's
project, a Kubernetes Job's /app) is recognised as the same.

A digest is blake2b (32 bytes) over the file, read in 1 MiB blocks. It is cached in
LANES_HOME/digests/, one small JSON per resolved path, with the size and mtime_ns it was
computed for: asked again about the same version of a file, `Digests` reads it back
instead of the file; a file rewritten (another size or mtime) is read again. A cache
that cannot be written (a read-only home) only costs reading the file again.

An ONNX model may keep its weights in external-data files beside it, named in the
graph (each tensor's `location`): `Digests.of` lists them for an .onnx file, found by
their protobuf bytes without parsing the graph, so the core needs no `onnx`.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import orjson

from lanes.onnxinputs import varint
from lanes.staging import staging_file

log = logging.getLogger(__name__)

BLOCK = 1024 * 1024
# A StringStringEntryProto {key: "location", value: ...}: field 1 (tag 0x0a, 8 bytes),
# then field 2's tag (0x12), its length and the file's name.
_LOCATION = b"\x0a\x08location\x12"


@dataclass(frozen=True)
class Digest:
    """One file's content digest; for an ONNX model, its external-data files too
    (their names as the graph gives them, relative to the model's folder)."""

    blake2b: str
    external: tuple[str, ...] = ()


class Digests:
    """Digests of local files, cached under `home`/digests. Thread- and process-safe:
    each entry is replaced whole (written aside, then renamed)."""

    def __init__(self, home: Path) -> None:
        self.folder = Path(home) / "digests"

    def of(self, path: Path) -> Digest | None:
        """`path`'s digest; None when it is not a readable file here (a remote worker
        may hold a model where this machine does not)."""
        try:
            resolved = path.resolve()
            info = resolved.stat()
        except OSError:
            return None
        entry = self.folder / (hashlib.sha256(str(resolved).encode()).hexdigest() + ".json")
        version = {"path": str(resolved), "size": info.st_size, "mtime_ns": info.st_mtime_ns}
        cached = _read(entry, version)
        if cached is not None:
            return cached
        try:
            digest = _compute(resolved)
        except OSError:
            return None
        self._save(entry, {**version, "blake2b": digest.blake2b, "external": digest.external})
        return digest

    def model_files(self, path: Path) -> list[tuple[str, Digest | None]]:
        """An ONNX model's files and their digests: the .onnx (named "") first, then each
        external-data file by its name in the graph."""
        main = self.of(path)
        files: list[tuple[str, Digest | None]] = [("", main)]
        for name in main.external if main else ():
            files.append((name, self.of(path.parent / name)))
        return files

    def _save(self, entry: Path, data: dict[str, object]) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with staging_file(self.folder, entry.name) as aside:
                aside.write_bytes(orjson.dumps(data))
                os.replace(aside, entry)
        except OSError as err:  # a read-only home: the next ask reads the file again
            log.debug("cannot cache the digest of %s in %s: %s", data["path"], entry, err)


def _read(entry: Path, version: dict[str, object]) -> Digest | None:
    try:
        data = orjson.loads(entry.read_bytes())
        if any(data.get(k) != v for k, v in version.items()):
            return None  # another version of the file (or, unlikely, a hash collision)
        return Digest(str(data["blake2b"]), tuple(str(x) for x in data["external"]))
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None


def _compute(path: Path) -> Digest:
    """The file read once: hashed through one mapping, which an .onnx's external-data
    names are then found in (from memory, not a second read of the disk)."""
    h = hashlib.blake2b(digest_size=32)
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return Digest(h.hexdigest())
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for at in range(0, len(m), BLOCK):
                    h.update(view[at : at + BLOCK])
            finally:
                view.release()
            external = _external_data(m, path.parent) if path.suffix == ".onnx" else ()
    return Digest(h.hexdigest(), external)


def _external_data(m: mmap.mmap, folder: Path) -> tuple[str, ...]:
    """The external-data files an ONNX model (mapped in `m`) names that lie in
    `folder`, sorted. A false match inside raw weights names no file there, so it is
    dropped."""
    found: set[str] = set()
    at = m.find(_LOCATION)
    while at >= 0:
        start = at + len(_LOCATION)
        try:
            length, start = varint(m, start)
        except ValueError:  # a false match at the file's end
            break
        name = _name(m[start : start + length]) if 0 < length < 4096 else None
        if name is not None and (folder / name).is_file():
            found.add(name)
        at = m.find(_LOCATION, start)
    return tuple(sorted(found))


def _name(raw: bytes) -> str | None:
    """A relative name below the model's folder, or None."""
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return None
    pure = PurePosixPath(name)
    if "\x00" in name or pure.is_absolute() or ".." in pure.parts:
        return None
    return name
