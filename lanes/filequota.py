"""The batch store's quota: the bytes it may hold (`Settings.batch.max_store_bytes`), as
OpenAI limits an organization's file storage.

What counts: every file's data, and each batch's copy of its input file (the shards a
create splits it into, lanes.batches), kept until the batch ends: without it, one file
batched again and again would fill the disk whatever the quota. One API key is one
tenant (lanes.batchstore), so the quota is the whole store's. What is used is read
from the store at each check (the sizes its listing gives), so it is right after a
restart, and counts what other servers or the offline lane wrote or deleted; nothing is
kept but the reservations in flight.

An upload, or a batch's copy, reserves its size under one lock before any of it is
stored, and holds it until it is listed: two that each fit, but not together, cannot
both pass. Servers that share a store each hold their own lock: together they can go
over by at most what the others have in flight at that moment.

A batch's output and error files count once stored but are never refused: a batch that
ran must not fail for want of room. They may take the store over its quota; then
uploads and creates are refused until files are deleted or batches end. Its run's
shards (`batches/<key>/out/`) do not count: they are deleted as those files, which
hold the same lines, are saved (lanes.batches), so counting both would count a
batch's results twice as it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lanes.errors import InvalidInput

CODE = "storage_quota_exceeded"
# How room is freed, for every refusal.
FREE = (
    "delete files you no longer need (DELETE /v1/files/{file_id}: a batch's input once it "
    "has been created, its output and error files once read), or end batches you no longer "
    "need (POST /v1/batches/{batch_id}/cancel): a batch's copy of its input file is "
    "deleted once the batch has ended (completed, failed, expired or cancelled) and the "
    "server has finalized it (within LANES_BATCH__SWEEP_S, or at its next retrieve)"
)


def over_quota(param: str, what: str, used: int, quota: int) -> InvalidInput:
    """The refusal (a 400 about `param`): `what` says what would take the store to how
    many bytes."""
    return InvalidInput.field(
        param,
        f"{what}, over the quota of {quota} bytes (LANES_BATCH__MAX_STORE_BYTES), of which "
        f"{used} are used; to free room, {FREE}",
        code=CODE,
    )


class FileQuota:
    """Room within `quota` bytes; `stored` lists the bytes stored, by what holds them
    (a file's id, a batch's input folder), read afresh at each call. Thread-safe."""

    def __init__(self, quota: int, stored: Callable[[], dict[str, int]]) -> None:
        self.quota = quota
        self._stored = stored
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # key -> bytes reserved, of writes in flight

    def used(self) -> int:
        """Bytes stored, and reserved by writes in flight."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        stored = self._stored()
        # What a write has listed already counts by its listing, not twice: a batch's
        # copy is listed a shard at a time, and its reservation covers the rest.
        pending = sum(max(0, size - stored.get(key, 0)) for key, size in self._pending.items())
        return sum(stored.values()) + pending

    @contextmanager
    def reserved(self, key: str, size: int, param: str, what: str) -> Iterator[None]:
        """Room for `size` bytes stored under `key`, held until the block ends (by then
        they are stored, or nothing is); when there is none, before the block runs, the
        refusal about `param`, whose message begins with `what` (what needs the room)."""
        with self._lock:
            used = self._used()
            if used + size > self.quota:
                detail = f"{what} would take the store to {used + size} bytes"
                raise over_quota(param, detail, used, self.quota)
            self._pending[key] = size
        try:
            yield
        finally:
            with self._lock:
                del self._pending[key]
