"""Whether an S3 store honours conditional writes, found out before lanes relies on them.

lanes keeps one run per S3 output (lanes.s3lock's lease on `<output>/_running`) and one
writer per Batch API record (lanes.storage `write_if`) with S3's conditional PutObject:
`If-None-Match: *` only creates, `If-Match: <etag>` only replaces that version. AWS S3
honours both (since 2024), as do recent S3-compatible stores; older ones (MinIO, Ceph
RGW, some gateways) ignore the headers and write anyway, and say 200. Then two runs
would each hold the lease and redo every shard, two servers would each win a claim, and
nothing would say so.

So before the first conditional write in a bucket, `ConditionalWrites.require` asks the
store, beside the key about to be written, to create a probe object twice, to replace
a version of it that it does not have, to replace an object that does not exist, and
to delete a version of the probe it does not have (a run's lease is released so);
a store that writes or deletes any of those times, or answers that it takes no
conditions (NotImplemented), is refused with a `PermanentStorageError` that
names it and says what to do. The probe objects are deleted again, and are bookkeeping
(`_` names) that listings skip should a delete fail.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any

from lanes.errors import PermanentStorageError
from lanes.s3errors import s3_errors

# The answers of a store that refused a conditional write: 412, the condition does not
# hold; 409, another conditional write raced it; 404, an If-Match on no object.
_REFUSED = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"})
# The answers of a store that does not take conditional requests at all.
_UNSUPPORTED = frozenset({"NotImplemented"})
_IGNORED = "ignored a conditional write ({})"
# The ETag no object has: an If-Match on it must fail.
_NO_ETAG = '"' + "0" * 32 + '"'
_WHAT_TO_DO = (
    "Use a store that honours S3's conditional writes (AWS S3, or a MinIO or Ceph RGW "
    "release whose PutObject supports If-None-Match and If-Match), or, where one process "
    "at a time writes each output and the Batch API's store, set "
    "LANES_S3_CHECK_CONDITIONAL_WRITES=false"
)


@dataclass(frozen=True)
class _Where:
    """One store's bucket: the endpoint boto3 sends to (its client's), and the bucket."""

    endpoint: str
    bucket: str


class ConditionalWrites:
    """The verdict on each bucket a `Storage` writes conditionally, found on first need
    and kept: one probe per bucket and endpoint for the life of the Storage (a flow
    run's, a server's batch store). Thread-safe."""

    def __init__(self) -> None:
        # The refusal's reason per bucket; None where the store honoured every condition.
        self._verdicts: dict[_Where, str | None] = {}
        self._lock = threading.Lock()

    def require(self, client: Any, uri: str, endpoint: str | None) -> None:
        """Return once the store behind `client` has shown it honours conditional
        writes in `uri`'s bucket; raise PermanentStorageError, naming `uri` and the
        store, where it ignored one. `endpoint` is the setting, for boto3's errors."""
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        where = _Where(str(client.meta.endpoint_url), bucket)
        # Held while probing: a second thread's first write waits for the one verdict.
        with self._lock:
            if where not in self._verdicts:
                folder = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
                with s3_errors(uri, "write", endpoint):
                    self._verdicts[where] = _ignored(client, bucket, folder)
            ignored = self._verdicts[where]
        if ignored is not None:
            raise PermanentStorageError(
                f"{uri}: the S3 store at {where.endpoint} {ignored}, which lanes needs "
                "to keep one run per output (its _running lease) and one writer per Batch "
                f"API record; nothing was written there. {_WHAT_TO_DO}"
            )


def _ignored(client: Any, bucket: str, folder: str) -> str | None:
    """What the store did wrong (ignored a condition, or took none), probing under
    `folder` in `bucket`; None when it refused every write and delete it should have."""
    from botocore.exceptions import ClientError

    probe = f"{folder}_lanes-probe-{uuid.uuid4().hex}"
    missing = f"{probe}-missing"
    try:
        client.put_object(Bucket=bucket, Key=probe, Body=b"", IfNoneMatch="*")
        if _wrote(client, bucket, probe, {"IfNoneMatch": "*"}):
            return _IGNORED.format("If-None-Match: * on an object that exists: it wrote anyway")
        if _wrote(client, bucket, probe, {"IfMatch": _NO_ETAG}):
            return _IGNORED.format("If-Match on another version of an object: it wrote anyway")
        if _wrote(client, bucket, missing, {"IfMatch": _NO_ETAG}):
            return _IGNORED.format("If-Match on an object that does not exist: it wrote anyway")
        if _deleted(client, bucket, probe):
            return _IGNORED.format(
                "If-Match on a delete of another version of an object: it deleted anyway"
            )
        return None
    except ClientError as err:
        if str(err.response.get("Error", {}).get("Code", "")) in _UNSUPPORTED:
            return "does not support conditional writes (it answered NotImplemented)"
        raise
    finally:
        # S3 answers a delete of no object as done.
        for key in (probe, missing):
            client.delete_object(Bucket=bucket, Key=key)


def _deleted(client: Any, bucket: str, key: str) -> bool:
    """Whether a delete of `key` on an ETag it does not have, which must fail, was made.
    The lease's release is such a delete: one run must not delete another's lease."""
    from botocore.exceptions import ClientError

    try:
        client.delete_object(Bucket=bucket, Key=key, IfMatch=_NO_ETAG)
    except ClientError as err:
        if str(err.response.get("Error", {}).get("Code", "")) in _REFUSED:
            return False
        raise
    return True


def _wrote(client: Any, bucket: str, key: str, condition: dict[str, str]) -> bool:
    """Whether a write under `condition`, which must fail, was made."""
    from botocore.exceptions import ClientError

    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"", **condition)
    except ClientError as err:
        if str(err.response.get("Error", {}).get("Code", "")) in _REFUSED:
            return False
        raise
    return True
