"""The Batch API's store: uploaded files and batch records, in a folder or on S3.

    <store>/files/<file id>.json      the file object (OpenAI's shape)
    <store>/files/<file id>.data      its bytes, as uploaded (or as a batch wrote them)
    <store>/batches/<batch id>.json   the batch record (lanes.batches)
    <store>/batches/<key>/in/         the batch's copy of its input, in shards of
                                      `shard_lines` lines, until the batch ends
    <store>/batches/<key>/out/        the offline run's outputs (lanes.layout), until
                                      the batch ends (its files hold them then)

The store is `Settings.batch_store()`: the server writes it, the offline lane's workers
read the inputs and write the outputs there, so both must see the same one. Nothing
about a file or a batch lives in the server's memory.

Several servers may share one store. A batch record is changed only by a conditional
write (`update_batch`: read it with its version tag, change it, write it only if the
tag still holds, else read again), so no server's change is lost to another's, and a
new record never replaces one of its id (`create_batch`). Locally that holds among the
processes of one host (lanes.storage `write_if`); servers on several hosts share an
S3 store.

One API key is one tenant: whoever holds the server's key sees every file and batch,
and the quota (lanes.filequota) is the whole store's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from lanes import layout
from lanes.errors import InvalidInput, NotFound, StorageError
from lanes.filequota import FileQuota
from lanes.listing import StoredFile
from lanes.settings import Settings
from lanes.storage import Storage
from lanes.uris import join

FILE_PURPOSES = ("batch", "batch_output")  # what an upload may say, what a batch writes
CHUNK = 1024 * 1024
# Conditional writes of one record that `update_batch` tries before it gives up: each
# lost one means another server wrote the record in between, which takes far longer
# than a read and a write.
UPDATE_TRIES = 10


@dataclass(frozen=True)
class FileObject:
    """OpenAI's file object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None
    # When it was made, finer than `created_at` (whole seconds, as OpenAI writes it),
    # so that a list keeps the creation order within a second; stored, never answered.
    # 0 for a file stored before lanes kept it.
    created_ns: int = field(default=0, repr=False)

    def as_json(self) -> dict[str, Any]:
        wire = asdict(self)
        del wire["created_ns"]
        return wire


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchStore:
    """Files and batch records by id. Thread-safe (Storage is); every call reads afresh."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.batch_store()
        self.storage = Storage(settings)
        # Uploads and batches' input copies reserve room in it (lanes.filequota); a
        # batch's output and error files never do.
        self.quota = FileQuota(settings.batch.max_store_bytes, self.stored_sizes)

    # ---- files --------------------------------------------------------------------

    def _file_meta(self, file_id: str) -> str:
        return join(self.root, "files", f"{_safe(file_id, 'file_id')}.json")

    def file_data(self, file_id: str) -> str:
        return join(self.root, "files", f"{_safe(file_id, 'file_id')}.data")

    @contextmanager
    def writing(self, file_id: str) -> Iterator[IO[bytes]]:
        """A stream to write a new file's bytes into; published when the block ends well."""
        uri = self.file_data(file_id)
        with self.storage.staged(uri) as stage:
            with stage.open("wb") as out:
                yield out
            self.storage.publish(stage, uri)

    def add_file(self, file_id: str, filename: str, purpose: str, size: int) -> FileObject:
        """Record a file whose bytes `writing` published."""
        made_ns = time.time_ns()
        made = FileObject(file_id, size, made_ns // 10**9, filename, purpose, created_ns=made_ns)
        self.storage.write_bytes(self._file_meta(file_id), orjson.dumps(asdict(made)))
        return made

    def put_file(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        lines: Iterator[bytes],
        keep_empty: bool = True,
    ) -> FileObject | None:
        """File `file_id` of `lines` (each with its newline), written as it comes and
        published whole, replacing one of that id; None, and nothing stored, when there
        are no lines and not `keep_empty`."""
        uri = self.file_data(file_id)
        size = 0
        with self.storage.staged(uri) as stage:
            with stage.open("wb") as out:
                for line in lines:
                    out.write(line)
                    size += len(line)
            if not size and not keep_empty:
                return None
            self.storage.publish(stage, uri)
        return self.add_file(file_id, filename, purpose, size)

    def stored_sizes(self) -> dict[str, int]:
        """What the quota counts, as the store lists it now (no record is read): the
        bytes of every file's data, by file id, and of every batch's input shards, by
        their folder (`batch_input`)."""
        listed = self._listed_files(join(self.root, "files") + "/", ".data")
        sizes = {Path(f.uri).name.removesuffix(".data"): f.size for f in listed}
        try:
            shards = self.storage.list_files(join(self.root, "batches", "*", "in", "*"), ("",))
        except StorageError:
            shards = []  # no batch yet
        for shard in shards:
            key = self.batch_input(join(self.root, "batches", shard.name.split("/")[0]))
            sizes[key] = sizes.get(key, 0) + shard.size
        return sizes

    def file(self, file_id: str) -> FileObject:
        raw = self.storage.read_bytes(self._file_meta(file_id))
        if raw is None:
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        return FileObject(**orjson.loads(raw))

    def files(self) -> list[FileObject]:
        """Every file, newest first."""
        listed = self._listed(join(self.root, "files") + "/", ".json")
        found = []
        for uri in listed:
            raw = self.storage.read_bytes(uri)
            if raw is not None:
                found.append(FileObject(**orjson.loads(raw)))
        return sorted(found, key=lambda f: (f.created_at, f.created_ns, f.id), reverse=True)

    @contextmanager
    def content(self, file_id: str) -> Iterator[IO[bytes]]:
        self.file(file_id)
        with self.storage.open(self.file_data(file_id)) as stream:
            yield stream

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """A file's bytes, CHUNK at a time (for a streamed download)."""
        with self.content(file_id) as stream:
            while chunk := stream.read(CHUNK):
                yield chunk

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        self.storage.delete(self.file_data(file_id))
        self.storage.delete(self._file_meta(file_id))

    # ---- batch records ------------------------------------------------------------

    def batch_folder(self, batch_id: str) -> str:
        return join(self.root, "batches", _safe(batch_id, "batch_id"))

    def batch_input(self, folder: str) -> str:
        """Where a batch in `folder` (`batch_folder`) keeps its copy of its input."""
        return join(folder, "in")

    def drop_folder(self, folder: str) -> None:
        """Delete a batch's folder (`batch_folder`) once it has ended: its copy of its
        input (which the quota counts, lanes.filequota) and its run's shards, whose
        lines are now its output and error files. Its run's manifests (a few KiB:
        counts, items/s, what it cost) are written back, for `Job.manifest()`. The
        input file itself stays."""
        manifests = join(folder, "out", layout.MANIFESTS)
        try:
            found = self.storage.list_files(manifests, (".json",))
        except StorageError:
            found = []  # no run wrote one
        kept = {f.uri: self.storage.read_bytes(f.uri) for f in found}
        self.storage.delete_folder(folder)
        for uri, data in kept.items():
            if data is not None:
                self.storage.write_bytes(uri, data)

    def _batch_uri(self, batch_id: str) -> str:
        return join(self.root, "batches", f"{_safe(batch_id, 'batch_id')}.json")

    def create_batch(self, record: dict[str, Any]) -> None:
        """Store a new batch's record; never over a record of its id (a StorageError)."""
        uri = self._batch_uri(record["id"])
        data = orjson.dumps(record)
        if not self.storage.write_if(uri, data, None):
            if self.storage.read_bytes(uri) == data:
                return  # this very write, retried after its answer was lost
            raise StorageError(
                f"{uri}: a batch {record['id']} exists already, and was kept; a new batch "
                "needs a new id"
            )

    def update_batch(
        self, batch_id: str, change: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        """The batch's record, read afresh and handed to `change`, which changes it in
        place and returns True to save it, or False to leave it as it is (a record that
        is final, say). Returns the record as saved, or as read when `change` declined.

        The save is conditional: if another server wrote the record after this read,
        nothing is written, and the record is read again and handed to `change` afresh,
        up to UPDATE_TRIES times (then a StorageError). So `change` may run more than
        once, and must decide from the record it is given; it may also meet a record
        that already holds its own change (a write whose answer was lost, then retried).
        """
        uri = self._batch_uri(batch_id)
        for _ in range(UPDATE_TRIES):
            read = self.storage.read_versioned(uri)
            if read.data is None:
                raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
            record: dict[str, Any] = orjson.loads(read.data)
            if not change(record):
                return record
            if self.storage.write_if(uri, orjson.dumps(record), read.tag):
                return record
        raise StorageError(
            f"{uri}: another server changed batch {batch_id}'s record each of the "
            f"{UPDATE_TRIES} times this one tried to update it; retry the request"
        )

    def batch(self, batch_id: str) -> dict[str, Any]:
        raw = self.storage.read_bytes(self._batch_uri(batch_id))
        if raw is None:
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
        record: dict[str, Any] = orjson.loads(raw)
        return record

    def batch_ids(self) -> list[str]:
        """Every batch's id."""
        listed = self._listed(join(self.root, "batches") + "/", ".json")
        return [Path(uri).name.removesuffix(".json") for uri in listed if "/in/" not in uri]

    def _listed(self, folder: str, suffix: str) -> list[str]:
        return [f.uri for f in self._listed_files(folder, suffix)]

    def _listed_files(self, folder: str, suffix: str) -> list[StoredFile]:
        try:
            files = self.storage.list_files(folder, (suffix,))
        except StorageError:
            return []  # nothing stored yet
        return [f for f in files if "/" not in f.name]


def _safe(value: str, param: str) -> str:
    """An id as a path part: no separators, no dots, bounded (ids are user input)."""
    if not value or len(value) > 100 or not all(c.isalnum() or c in "-_" for c in value):
        raise NotFound(f"no such id {value!r}", param=param)
    return value


def check_purpose(purpose: str) -> None:
    if purpose != "batch":
        raise InvalidInput.field(
            "purpose", f'expected "batch" (lanes takes files for the Batch API), found {purpose!r}'
        )
