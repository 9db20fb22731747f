"""Content digests of local files: what a file holds, not where it lies or when it was
copied, so that a model or an input moved, copied or mounted elsewhere (a laptop's
project, a Kubernetes Job's /app) is recognised as the same.

A digest is blake2b (32 bytes) over the file, read in 1 MiB blocks. It is cached in
LANES_HOME/digests/, one small JSON per resolved path, with the size and mtime_ns it was
computed for: asked again about the same version of a file, `Digests` reads it back
instead of the file; a file rewritten (another size or mtime) is read again. A cache
that cannot be written (a read-only home) only costs reading the file again.

A fresh pod (a Kubernetes Job, a serving replica) starts with an empty home, so the
cache alone would read every model again on each start. A *seal* carries the digest
with the file instead: `NAME.lanes-digest` beside it, written by `lanes models seal`
(the baked image runs it at build time), holding the size and mtime it was computed
for. It is trusted only while the file still has that size and mtime, so a model
rewritten after sealing is read again, never served under the sealed digest. The
mtime may have lost its fraction of a second on the way (image layers and tar keep
whole seconds); anything else differing counts as another version.

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
from lanes.settings import Settings
from lanes.spec import ModelSpec, OfflineWorkload, Spec, Workload
from lanes.specoffline import Fields
from lanes.staging import staging_file

log = logging.getLogger(__name__)

BLOCK = 1024 * 1024
SEAL_SUFFIX = ".lanes-digest"
_SECOND = 1_000_000_000
# A StringStringEntryProto {key: "location", value: ...}: field 1 (tag 0x0a, 8 bytes),
# then field 2's tag (0x12), its length and the file's name.
_LOCATION = b"\x0a\x08location\x12"
# Read beside the model (config.json, ...) and the tokenizer (lanes.tasks.decoder_config).
MODEL_CONFIGS = ("config.json", "generation_config.json", "genai_config.json")
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class Digest:
    """One file's content digest; for an ONNX model, its external-data files too
    (their names as the graph gives them, relative to the model's folder)."""

    blake2b: str
    external: tuple[str, ...] = ()


def seal_of(path: Path) -> Path:
    """Where `path`'s seal lies: beside it, so it travels with the file."""
    return path.with_name(path.name + SEAL_SUFFIX)


class Digests:
    """Digests of local files, cached under `home`/digests and read from seals beside
    them. Thread- and process-safe: each entry or seal is replaced whole (written aside,
    then renamed). With `seal=True`, every digest asked for is also sealed beside its
    file (what `lanes models seal` does)."""

    def __init__(self, home: Path, seal: bool = False) -> None:
        self.folder = Path(home) / "digests"
        self.seal = seal

    def of(self, path: Path) -> Digest | None:
        """`path`'s digest; None when it is not a readable file here (a remote worker
        may hold a model where this machine does not). Sealing, a seal that cannot be
        written raises OSError."""
        try:
            resolved = path.resolve()
            info = resolved.stat()
        except OSError:
            return None
        entry = self.folder / (hashlib.sha256(str(resolved).encode()).hexdigest() + ".json")
        version = {"path": str(resolved), "size": info.st_size, "mtime_ns": info.st_mtime_ns}
        digest = _read(entry, version, exact=True)
        if digest is None:
            digest = _read(seal_of(resolved), version, exact=False)
            if digest is None:
                try:
                    digest = _compute(resolved)
                except OSError:
                    return None
            self._save(entry, {**version, "blake2b": digest.blake2b, "external": digest.external})
        if self.seal:
            data = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
            _write(
                seal_of(resolved), {**data, "blake2b": digest.blake2b, "external": digest.external}
            )
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
            _write(entry, data)
        except OSError as err:  # a read-only home: the next ask reads the file again
            log.debug("cannot cache the digest of %s in %s: %s", data["path"], entry, err)


def model_digests(model: ModelSpec, digests: Digests) -> dict[str, Digest | None]:
    """The digest of every file a model reads, by its role (model/NAME, tokenizer,
    ...): what model_key counts and `lanes models seal` seals."""
    files = {f"model/{name}": d for name, d in digests.model_files(model.path)}
    if model.tokenizer:
        files["tokenizer"] = digests.of(model.tokenizer)
    tokenizer_folder = (model.tokenizer or model.path).parent
    sides = [(f"model/{n}", model.path.parent / n) for n in MODEL_CONFIGS]
    sides.append((f"tokenizer/{TOKENIZER_CONFIG}", tokenizer_folder / TOKENIZER_CONFIG))
    for name, side in sides:
        found = digests.of(side)
        if found is not None:  # mostly absent, and then left out as before they counted
            files[name] = found
    return files


def _write(target: Path, data: dict[str, object]) -> None:
    with staging_file(target.parent, target.name) as aside:
        aside.write_bytes(orjson.dumps(data))
        os.replace(aside, target)


def _read(entry: Path, version: dict[str, object], exact: bool) -> Digest | None:
    """The digest `entry` holds for this version of the file, or None. A cache entry
    (`exact`) matches path, size and mtime; a seal matches size and mtime, which may
    have been cut to whole seconds since it was written (never the other way)."""
    try:
        data = orjson.loads(entry.read_bytes())
        if exact:
            if any(data.get(k) != v for k, v in version.items()):
                return None  # another version of the file (or, unlikely, a hash collision)
        else:
            sealed, found = data["mtime_ns"], version["mtime_ns"]
            if not isinstance(sealed, int) or data["size"] != version["size"]:
                return None
            if found not in (sealed, sealed - sealed % _SECOND):
                return None
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


def model_key(spec: Spec, workload: Workload, settings: Settings) -> str:
    """A digest of what decides a record's output besides the record itself (the same
    for a workload in either lane, so that the lanes' measurements can be compared).
    The model's files count by their content (`model_digests`), never by where they lie
    or when they were copied: a laptop's project and a Job's /app share their commits.
    Besides the .onnx, its external data and tokenizer, the configs a decoder reads
    beside them count when present."""
    model = spec.models[workload.model]
    files = model_digests(model, Digests(settings.home))
    identity = {
        "files": {name: d.blake2b if d else None for name, d in files.items()},
        "model": model.model_dump(mode="json", exclude={"path", "tokenizer"}),
        "task": workload.task,
        "handler": workload.handler,
        "generation": workload.generation.model_dump(mode="json"),
    }
    if isinstance(workload, OfflineWorkload) and workload.fields != Fields():
        # Only when set, as before `fields:` existed.
        identity["fields"] = workload.fields.model_dump(mode="json")
    return hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()
