"""One run at a time per S3 output: `<output>/_running` as a lease (lanes.runlock's
contract, where S3 has no `flock`).

A run takes the lease with a conditional write that only creates (`If-None-Match: *`),
so of two runs starting at once S3 lets exactly one in; the object names the holder,
as the lock file does. Nothing drops it when its process dies, so the holder renews it
every third of the lease from a background thread, each time only if it is still the
object it wrote (`If-Match` on its ETag: a renewal never overwrites a lease another run
took over). A lease not renewed for longer than its holder's lease (`lease_s` in its
body) is a killed run's, and the next run takes it over, again only if it is still the
object it judged stale (`If-Match`), so of two takers one wins. Its age is S3's own
clock on both ends (the object's LastModified against the Date of the response that
read it), never this host's. Both are in whole seconds: a lease counts as stale only
once it is a second older than its holder's lease. Release deletes the lease if it is
still ours (`If-Match` on a delete).

A holder whose renewal finds the lease gone or another run's has lost the output: the
renewal logs an error and sets `Held.lost`, and the flow starts no further shard (the
shards in flight, which may be on other hosts, end as they do: each record is still in
the output once) and then fails saying so.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from lanes.errors import OutputBusy, StorageError
from lanes.runlock import Held, busy_message
from lanes.s3errors import s3_errors
from lanes.settings import Settings

# S3 dates (LastModified, Date) are in whole seconds.
_RESOLUTION_S = 1.0
# Conditional writes that lost: 412, the condition no longer holds; 409, another
# conditional write on the key raced this one; 404, an If-Match on a key now gone.
_LOST = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"})
# Acquiring: a try that loses a race (another run created, renewed or took over the
# lease first) reads it again and decides afresh, at most this many times.
_TRIES = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Found:
    """The lease object as read: who holds it, for how long, and how old S3 says it is."""

    holder: str
    lease_s: float | None  # None: its body does not say (not a lease of ours)
    etag: str
    age_s: float
    token: str | None  # None: not a lease of ours


class S3Lease:
    """The lease of the run writing an S3 output, on the object `uri` (its `_running`).

    `acquire` takes it or raises OutputBusy naming its holder; `renew` keeps it (False,
    and `held.lost` says why, once it is no longer ours); `release` gives it back.
    `s3_output_lock` does all three, renewing from a thread every `lease_s / 3`.
    """

    def __init__(
        self, client: Any, uri: str, holder: str, endpoint: str | None, lease_s: float
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s: expected a positive number of seconds, got {lease_s}")
        self.uri, self.holder, self.lease_s = uri, holder, lease_s
        self.held = Held()
        self._client, self._endpoint = client, endpoint
        self._bucket, _, key = uri.removeprefix("s3://").partition("/")
        self._key = key.lstrip("/")
        # The token makes our writes ours alone, even beside a holder string like ours: a
        # create S3 made but whose answer was lost, retried by boto3, is read back as
        # ours. Each write also counts itself, so that each renewal changes the ETag: a
        # run that judged the lease stale before a late renewal then cannot take it over
        # (its If-Match names the ETag before the renewal).
        self._token = uuid.uuid4().hex
        self._writes = 0
        self._etag: str | None = None

    def acquire(self) -> None:
        """Create the lease, or take over a stale one. Raises OutputBusy naming the
        holder of a live one (or StorageError when S3 cannot be reached)."""
        found: _Found | None = None
        for _ in range(_TRIES):
            condition = {"IfNoneMatch": "*"} if found is None else {"IfMatch": found.etag}
            if self._put(condition):
                if found is not None:
                    log.warning(
                        "%s: took over the lease of a run gone for %.0f s (%s)",
                        self.uri,
                        found.age_s,
                        found.holder,
                    )
                return
            found = self._read()
            if found is not None and found.token == self._token:
                self._etag = found.etag  # our create, whose answer was lost and retried
                return
            if found is not None and not self._stale(found):
                break
        folder = self.uri.rsplit("/", 1)[0]
        raise OutputBusy(busy_message(folder, found.holder if found else ""))

    def renew(self) -> bool:
        """Write the lease again, only if it is still ours. False once it is not (then,
        and from then on, `held.lost` says why, and an error was logged). A renewal S3
        did not answer is a warning: the next one tries again, and fails this way if
        another run took the lease over meanwhile."""
        if self.held.lost is not None:
            return False
        try:
            if self._put({"IfMatch": str(self._etag)}):
                return True
        except StorageError as err:
            log.warning("%s: could not renew the lease (%s); trying again", self.uri, err)
            return True
        try:
            found = self._read()
        except StorageError:
            found = None
        now = f"another run holds it ({found.holder})" if found else "it is gone"
        self.held.lost = f"lost the lease of {self.uri}: {now}"
        log.error("%s; no further shard starts, and this run fails", self.held.lost)
        return False

    def keep(self, stop: threading.Event) -> None:
        """Renew every third of the lease until `stop` is set or the lease is lost."""
        while not stop.wait(self.lease_s / 3):
            if not self.renew():
                return

    def release(self) -> None:
        """Delete the lease if it is still ours; another run's is left alone."""
        if self._etag is None or self.held.lost is not None:
            return
        from botocore.exceptions import ClientError

        try:
            with s3_errors(self.uri, "delete", self._endpoint):
                try:
                    self._client.delete_object(
                        Bucket=self._bucket, Key=self._key, IfMatch=self._etag
                    )
                except ClientError as err:
                    if _code(err) not in _LOST:
                        raise
                    log.error("%s: the lease was another run's by the end of this one", self.uri)
        except StorageError as err:
            # Left behind, it only makes the next run wait out one lease.
            log.warning("%s: could not release the lease (%s)", self.uri, err)

    def _body(self) -> bytes:
        self._writes += 1
        body = {
            "holder": self.holder,
            "lease_s": self.lease_s,
            "token": self._token,
            "write": self._writes,
        }
        return json.dumps(body).encode()

    def _put(self, condition: dict[str, str]) -> bool:
        """Write our body under `condition`; False when S3 refused the condition."""
        from botocore.exceptions import ClientError

        with s3_errors(self.uri, "write", self._endpoint):
            try:
                put = self._client.put_object(
                    Bucket=self._bucket, Key=self._key, Body=self._body(), **condition
                )
            except ClientError as err:
                if _code(err) in _LOST:
                    return False
                raise
        self._etag = str(put["ETag"])
        return True

    def _read(self) -> _Found | None:
        """The lease as it is now; None when there is none."""
        from botocore.exceptions import ClientError

        with s3_errors(self.uri, "read", self._endpoint):
            try:
                got = self._client.get_object(Bucket=self._bucket, Key=self._key)
            except ClientError as err:
                if _code(err) in ("NoSuchKey", "404"):
                    return None
                raise
            data = got["Body"].read()
        now = parsedate_to_datetime(got["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (now - got["LastModified"]).total_seconds()
        holder, lease_s, token = _parse(data)
        return _Found(holder, lease_s, str(got["ETag"]), age, token)

    def _stale(self, found: _Found) -> bool:
        """Not renewed within its holder's lease (ours, when its body does not say)."""
        lease_s = found.lease_s if found.lease_s is not None else self.lease_s
        return found.age_s > lease_s + _RESOLUTION_S


@contextmanager
def s3_output_lock(client: Any, uri: str, holder: str, settings: Settings) -> Iterator[Held]:
    """Hold the lease `uri` (an output's `_running`) while the block runs, renewed
    every third of `settings.s3_lease_s`. Raises OutputBusy naming the holder of a
    live one."""
    lease = S3Lease(client, uri, holder, settings.s3_endpoint, settings.s3_lease_s)
    lease.acquire()
    stop = threading.Event()
    renewing = threading.Thread(target=lease.keep, args=(stop,), name=f"lease {uri}", daemon=True)
    renewing.start()
    try:
        yield lease.held
    finally:
        stop.set()
        renewing.join()
        lease.release()


def _parse(data: bytes) -> tuple[str, float | None, str | None]:
    """A lease body's holder, lease and token; what it says, raw, when it is not one of
    ours."""
    text = data.decode(errors="replace").strip()
    try:
        body = json.loads(text)
        return str(body["holder"]), float(body["lease_s"]), str(body["token"])
    except (ValueError, KeyError, TypeError):
        return text, None, None


def _code(err: Any) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))
