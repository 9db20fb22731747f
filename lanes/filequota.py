"""The batch store's quota: the bytes its files may take together
(`Settings.batch.max_store_bytes`), as OpenAI limits an organization's file storage.

One API key is one tenant (lanes.batchstore), so the quota is the whole store's. What is
used is read from the store at each upload (the sizes of the files' data, as listed),
so it is right after a restart, and counts what other servers or the offline lane
wrote or deleted; nothing is kept but the uploads in flight.

An upload reserves its size under a lock, before any of it is stored, and holds it until
its file is listed: two uploads to one server that each fit, but not together, cannot
both pass. Servers that share a store each hold their own lock: together they can go
over by at most what the others have in flight at that moment.

A batch's output and error files count once stored but are never refused: a batch that
ran must not fail for want of room. They may take the store over its quota; then
uploads are refused until files are deleted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lanes.errors import InvalidInput

CODE = "storage_quota_exceeded"


class FileQuota:
    """Room for uploads within `quota` bytes; `stored` lists the bytes of each stored
    file by id (read afresh at each call). Thread-safe."""

    def __init__(self, quota: int, stored: Callable[[], dict[str, int]]) -> None:
        self.quota = quota
        self._stored = stored
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # file id -> bytes, of uploads not yet listed

    def used(self) -> int:
        """Bytes stored, and reserved by uploads in flight."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        stored = self._stored()
        # A file whose data is listed already counts by its listing, not twice.
        pending = sum(size for file_id, size in self._pending.items() if file_id not in stored)
        return sum(stored.values()) + pending

    @contextmanager
    def reserved(self, file_id: str, size: int) -> Iterator[None]:
        """Room for file `file_id` of `size` bytes, held until the block ends (by then
        the file is stored, or nothing is); an InvalidInput (400) naming the quota and
        what is used when there is none, before the block runs."""
        with self._lock:
            used = self._used()
            if used + size > self.quota:
                raise InvalidInput.field(
                    "file",
                    f"{size} bytes would take the stored files to {used + size} bytes, over "
                    f"the quota of {self.quota} bytes (LANES_BATCH__MAX_STORE_BYTES), of which "
                    f"{used} are used; delete files you no longer need "
                    "(DELETE /v1/files/{file_id}: a batch's input once it has run, its "
                    "output and error files once read) to free room",
                    code=CODE,
                )
            self._pending[file_id] = size
        try:
            yield
        finally:
            with self._lock:
                del self._pending[file_id]
