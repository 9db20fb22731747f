"""Files by URI: a local path (or file://...) or s3://bucket/key, behind one small class.

What the offline flows need and no more: list the input shards under a folder, glob
or prefix (which names a listing holds is lanes.listing's; what a URI names,
lanes.uris'); read one; publish an output atomically; keep small JSON markers.

Publishing is atomic in both places. Locally a file is written aside, as a hidden
file in the same folder, flushed to disk, then renamed over its final name. On S3 it
is written aside on local disk, then uploaded to its final key, in parts when large:
S3 shows an object only once its whole upload completes, so a reader never sees half
of one. Files written aside are staging files (lanes.staging): a killed run's are
recognised, and removed, by the next run.

Small records that several processes change (the Batch API's batch records) are
read with a version tag and written back only if the tag still holds (`read_versioned`,
`write_if`): S3's conditional PutObject, on a store shown to honour it
(lanes.s3conditional), or locally a lock beside the file.

The S3 client, made on first S3 use, is lanes.s3client's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from lanes.errors import StorageError
from lanes.layout import RUNNING
from lanes.listing import StoredFile, list_local, list_s3
from lanes.localfiles import denied_reading
from lanes.runlock import Held, output_lock
from lanes.s3client import S3Body, s3_client
from lanes.s3conditional import ConditionalWrites
from lanes.s3errors import Missing, s3_errors
from lanes.s3lock import s3_output_lock
from lanes.settings import Settings
from lanes.staging import SUFFIX as STAGING_SUFFIX
from lanes.staging import remove_if_abandoned, staging_file
from lanes.uris import is_s3, join, local_path, split_s3

MiB = 1024 * 1024
# Staging files of S3 uploads, in the system temp folder.
_TEMP_PREFIX = "lanes-stage-"
# Errors only writing raises: whichever file they came from, the output could not be written.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
_WHAT_TO_DO = "make it writable, or choose another output (--output, or the workload's output)"


@dataclass(frozen=True)
class Versioned:
    """A small file's content and its version tag, for `Storage.write_if`; both None
    when there is no such file. The tag is the content's (S3's ETag, a local file's
    hash): a write that restores the same content keeps it."""

    data: bytes | None
    tag: str | None


class Storage:
    """Read, list and atomically publish files by URI. Thread-safe.

    Every failure is a `StorageError` that names the URI and what to do.
    `multipart_threshold` is the size from which S3 uploads go in parts.
    """

    def __init__(self, settings: Settings, multipart_threshold: int = 8 * MiB) -> None:
        self.settings = settings
        self.multipart_threshold = multipart_threshold
        self._client: Any = None
        self._lock = threading.Lock()
        self._conditional_writes = ConditionalWrites()

    # ---- listing and reading ----------------------------------------------------

    def list_files(self, location: str, suffixes: tuple[str, ...]) -> list[StoredFile]:
        """Files under a folder or prefix (recursively), or matching a glob, whose names
        end with one of `suffixes`; sorted by name. Bookkeeping (`_*`) and hidden files
        found there are skipped (as Spark skips `_SUCCESS`); a file that `location`
        names itself is listed whatever its name. A missing folder or bucket is a
        `StorageError`."""
        if is_s3(location):
            found = list_s3(self._s3, location, self.settings.s3_endpoint)
        else:
            found = list_local(location)
        return sorted((f for f in found if f.name.endswith(suffixes)), key=lambda f: f.name)

    @contextmanager
    def open(self, uri: str) -> Iterator[IO[bytes]]:
        """A binary stream of the file's content (S3: streamed, not loaded at once). A
        file that is not there is `Missing`; one this process may not read, a
        `PermanentStorageError`."""
        if not is_s3(uri):
            try:
                stream = local_path(uri).open("rb")
            except FileNotFoundError:
                raise Missing(f"{uri}: no such file") from None
            except PermissionError:
                raise denied_reading(uri, local_path(uri)) from None
            with stream:
                yield stream
            return
        bucket, key = split_s3(uri)
        with self._errors(uri, "read"):
            body = self._s3().get_object(Bucket=bucket, Key=key)["Body"]
        # botocore's body has no efficient readline: buffer it like a local file.
        stream = io.BufferedReader(S3Body(body, uri, self.settings.s3_endpoint), buffer_size=MiB)
        try:
            yield stream
        finally:
            body.close()

    def read_bytes(self, uri: str) -> bytes | None:
        """The whole file, or None when it does not exist (`open` says what else fails)."""
        if not is_s3(uri):
            try:
                return local_path(uri).read_bytes()
            except FileNotFoundError:
                return None
            except PermissionError:
                raise denied_reading(uri, local_path(uri)) from None
        bucket, key = split_s3(uri)
        client = self._s3()
        try:
            with self._errors(uri, "read"):
                data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                return data
        except Missing:
            return None

    def exists(self, uri: str) -> bool:
        """Whether there is a file at `uri` (S3: an object at the key), without reading it."""
        if not is_s3(uri):
            return local_path(uri).is_file()
        bucket, key = split_s3(uri)
        client = self._s3()
        try:
            with self._errors(uri, "read"):
                client.head_object(Bucket=bucket, Key=key)
        except Missing:
            return False
        return True

    # ---- writing ------------------------------------------------------------------

    @contextmanager
    def staged(self, uri: str) -> Iterator[Path]:
        """A local file to write `uri`'s content into before `publish`; removed after.

        A local destination stages in a hidden file beside it (same folder, so
        publishing is a rename; hidden, so never listed as data); an S3 destination
        stages in the system temp folder. Either is a locked staging file
        (lanes.staging) until the block ends. A folder that refuses the file, or a
        write in the block that fails for want of space or permission, is a
        StorageError naming the folder and what to do.
        """
        if is_s3(uri):
            folder = Path(tempfile.gettempdir())
            label = _TEMP_PREFIX + uri.rstrip("/").rsplit("/", 1)[-1]
            advice = "free space there, or point TMPDIR at a folder with room"
            with self._staging(uri, folder, label, "", advice) as stage:
                yield stage
            return
        final = local_path(uri)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageError(
                f"{uri}: cannot create {final.parent}: {err.strerror}; {_WHAT_TO_DO}"
            ) from None
        with self._staging(uri, final.parent, final.name, ".", _WHAT_TO_DO) as stage:
            yield stage

    @contextmanager
    def _staging(
        self, uri: str, folder: Path, label: str, prefix: str, advice: str
    ) -> Iterator[Path]:
        with ExitStack() as stack:
            try:
                stage = stack.enter_context(staging_file(folder, label, prefix))
            except OSError as err:
                raise _unwritable(folder, uri, err, advice) from None
            try:
                yield stage
            except OSError as err:
                if err.filename != str(stage) and err.errno not in _WRITE_ERRNOS:
                    raise
                raise _unwritable(folder, uri, err, advice) from None

    def publish(self, staged: Path, uri: str) -> None:
        """Make `staged`'s content appear at `uri` all at once, replacing what was there."""
        if not is_s3(uri):
            final = local_path(uri)
            try:
                with staged.open("rb") as f:
                    os.fsync(f.fileno())  # the content is on disk before the name is
                os.replace(staged, final)
                _fsync_dir(final.parent)
            except OSError as err:
                raise StorageError(
                    f"{uri}: cannot publish into {final.parent}: {err.strerror}; {_WHAT_TO_DO}"
                ) from None
            return
        from boto3.s3.transfer import TransferConfig

        bucket, key = split_s3(uri)
        config = TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=max(self.multipart_threshold, 5 * MiB),
        )
        with self._errors(uri, "write"):
            self._s3().upload_file(str(staged), bucket, key, Config=config)

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a small file atomically (stage, then publish)."""
        with self.staged(uri) as stage:
            stage.write_bytes(data)
            self.publish(stage, uri)

    def read_versioned(self, uri: str) -> Versioned:
        """A small file's content with its version tag, for `write_if`."""
        if not is_s3(uri):
            data = self.read_bytes(uri)
            return Versioned(data, _content_tag(data))
        bucket, key = split_s3(uri)
        client = self._s3()
        try:
            with self._errors(uri, "read"):
                got = client.get_object(Bucket=bucket, Key=key)
                return Versioned(got["Body"].read(), str(got["ETag"]))
        except Missing:
            return Versioned(None, None)

    def write_if(self, uri: str, data: bytes, tag: str | None) -> bool:
        """Write a small file only if it still has version `tag` (`read_versioned`'s),
        or, for a `tag` of None, only if there is none yet; False, and nothing written,
        when another writer came first (read it again and decide afresh).

        On S3 this is a conditional PutObject (If-Match, If-None-Match), which S3
        decides alone; a store that ignores them is refused before the first write
        (`_conditional`). Locally the check and the replace happen under an exclusive
        `flock` on a hidden lock file beside the file, so they are atomic among
        the processes of one host that write through this method. Hosts that share a
        folder over NFS or another network filesystem get no such promise: their
        locks may be emulated, or not reach across hosts; share an S3 store instead.
        A filesystem that refuses locks leaves the check and the replace unguarded.
        """
        if is_s3(uri):
            return self._write_if_s3(uri, data, tag)
        final = local_path(uri)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            lock = os.open(final.with_name(f".{final.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise StorageError(
                f"{uri}: cannot lock it in {final.parent}: {err.strerror}; {_WHAT_TO_DO}"
            ) from None
        try:
            with suppress(OSError):  # a filesystem without locks (see above)
                fcntl.flock(lock, fcntl.LOCK_EX)
            if _content_tag(self.read_bytes(uri)) != tag:
                return False
            self.write_bytes(uri, data)
            return True
        finally:
            os.close(lock)  # and with it the lock

    def _write_if_s3(self, uri: str, data: bytes, tag: str | None) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        client = self._conditional(uri)
        with self._errors(uri, "write"):
            try:
                client.put_object(Bucket=bucket, Key=key, Body=data, **condition)
            except ClientError as err:
                # 412: the tag no longer holds (or the object now exists); 409: a
                # conditional write raced this one; 404: the object went meanwhile.
                code = err.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"):
                    return False
                raise
        return True

    def delete(self, uri: str) -> bool:
        """Remove one file; False when there was none."""
        if not is_s3(uri):
            try:
                local_path(uri).unlink()
            except FileNotFoundError:
                return False
            except OSError as err:
                raise StorageError(f"{uri}: cannot delete: {err.strerror}") from None
            return True
        if not self.exists(uri):  # S3 answers a delete of no object as done
            return False
        bucket, key = split_s3(uri)
        with self._errors(uri, "delete"):
            self._s3().delete_object(Bucket=bucket, Key=key)
        return True

    def delete_folder(self, folder: str) -> None:
        """Remove a folder (an S3 prefix) and everything under it; nothing when there is
        none. For what a step that failed wrote, and nothing points at."""
        if not is_s3(folder):
            path = local_path(folder)
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                raise StorageError(f"{folder}: cannot delete: {err.strerror}") from None
            return
        bucket, prefix = split_s3(folder.rstrip("/") + "/")
        client = self._s3()
        paginator = client.get_paginator("list_objects_v2")
        with self._errors(folder, "delete"):
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    client.delete_object(Bucket=bucket, Key=obj["Key"])

    def clean_stale(self, folder: str, older_than_s: float) -> int:
        """Remove the staging files that killed runs left: under a local `folder`, or,
        for an S3 one, in the system temp folder. Returns how many went.

        A staging file whose writer ran on this host goes as soon as that writer is
        gone (its lock is free); a live writer's never goes. One from another host,
        or from before staging files were locked, goes once older than
        `older_than_s` (lanes.staging says why). An S3 upload cut short leaves no
        object (a bucket lifecycle rule should abort incomplete multipart uploads).
        """
        if is_s3(folder):
            temp = Path(tempfile.gettempdir())
            removed = 0
            for path in temp.glob(f"{_TEMP_PREFIX}*"):
                if path.name.endswith(STAGING_SUFFIX):
                    removed += remove_if_abandoned(path, older_than_s)
                elif path.is_dir() and _older(path, older_than_s):
                    shutil.rmtree(path, ignore_errors=True)  # an older lanes' staging folder
                    removed += 1
            return removed
        root = local_path(folder)
        if not root.is_dir():
            return 0
        return sum(remove_if_abandoned(p, older_than_s) for p in root.rglob(f".*{STAGING_SUFFIX}"))

    def exclusive(self, folder: str, holder: str) -> AbstractContextManager[Held]:
        """Held by the one run writing the output `folder` (lanes.runlock: another one
        raises OutputBusy naming `holder`); on S3, a lease (lanes.s3lock), on a store
        that honours conditional writes (`_conditional`)."""
        if is_s3(folder):
            lease = join(folder, RUNNING)
            return s3_output_lock(self._conditional(lease), lease, holder, self.settings)
        return output_lock(local_path(folder) / RUNNING, holder)

    def ensure_folder(self, location: str) -> None:
        """Create a local output folder and check this process can write in it; check
        an S3 output bucket exists. A StorageError says which and what to do."""
        if is_s3(location):
            bucket, _ = split_s3(location)
            with self._errors(location, "write"):
                self._s3().head_bucket(Bucket=bucket)
            return
        path = local_path(location)
        try:
            path.mkdir(parents=True, exist_ok=True)
            with staging_file(path, "write-check"):
                pass
        except OSError as err:
            raise StorageError(
                f"{location}: cannot write in the output folder ({err.strerror or err}); "
                f"{_WHAT_TO_DO}"
            ) from None

    # ---- S3 -------------------------------------------------------------------------

    def _s3(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = s3_client(self.settings.s3_endpoint)
            return self._client

    def _conditional(self, uri: str) -> Any:
        """The S3 client, for conditional writes in `uri`'s bucket: first refused
        (PermanentStorageError) where the store ignores them (lanes.s3conditional),
        unless `settings.s3_check_conditional_writes` is off."""
        client = self._s3()
        if self.settings.s3_check_conditional_writes:
            self._conditional_writes.require(client, uri, self.settings.s3_endpoint)
        return client

    def _errors(self, uri: str, action: str) -> AbstractContextManager[None]:
        return s3_errors(uri, action, self.settings.s3_endpoint)


def _content_tag(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _unwritable(folder: Path, uri: str, err: OSError, advice: str) -> StorageError:
    why = err.strerror or str(err)
    return StorageError(f"{folder}: cannot write {uri} there ({why}); {advice}")


def _older(path: Path, seconds: float) -> bool:
    try:
        return path.stat().st_mtime < time.time() - seconds
    except OSError:
        return False


def _fsync_dir(folder: Path) -> None:
    # The rename itself is durable only once its folder is flushed (POSIX).
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
