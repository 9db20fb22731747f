"""The claim to finalize a batch, so that one server of several assembles its files.

A batch whose run ended is finalized once (lanes.batches `Batches._finalize`). First a
claim, one conditional write of the batch record (lanes.batchstore `update_batch`):
status `finalizing`, and in the record the status the batch will end in, decided from
the record claimed (a cancel or an expiry that reached it counts). Only the claim's
winner assembles the files; another server answers with the claimed record meanwhile.
The winner then saves the last status (`finish`), again conditionally, so a change that
came meanwhile (a late cancel) stays. A claim older than CLAIM_S is a dead server's:
claimed afresh, with the status it decided, it makes the same files (the run has ended,
its shards are committed) under the same ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import orjson

from lanes import layout
from lanes.batchfiles import BatchError
from lanes.batchstore import BatchStore
from lanes.jobs import Job
from lanes.jobstates import EXPIRED as EXPIRED_STATUS
from lanes.jobstates import FAILED_STATES, FINISHED
from lanes.uris import join

# The statuses a batch ends in; a record in one of them changes no more.
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# A claim to finalize a batch older than this is taken to be a server's that died while
# assembling; another server claims it afresh and assembles the same files again.
CLAIM_S = 900

Markers = list[dict[str, Any] | None]


def read_markers(store: BatchStore, record: dict[str, Any]) -> Markers:
    """Each shard's commit marker (flows.shard), None for one not committed."""
    out = join(record["_lanes"]["folder"], "out")
    found: Markers = []
    for shard in range(record["_lanes"]["shards"]):
        raw = store.storage.read_bytes(join(out, layout.MARKERS, f"part-{shard:05d}.json"))
        found.append(orjson.loads(raw) if raw is not None else None)
    return found


def counts_of(store: BatchStore, record: dict[str, Any]) -> dict[str, int]:
    """The batch's request_counts as its committed shards' markers say."""
    done = [m for m in read_markers(store, record) if m is not None]
    return {
        "total": record["request_counts"]["total"],
        "completed": sum(int(m["outputs"]) for m in done),
        "failed": sum(int(m["errors"]) for m in done),
    }


@dataclass(frozen=True)
class Claim:
    """A server's claim to finalize a batch, kept in its record while it assembles."""

    status: str  # the final status it decided
    message: str | None  # for "failed", why the run failed
    by: str  # the claiming call's token

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Claiming:
    """What one finalize reads once, however often its claim is made again."""

    token: str
    now: int | None = None
    markers: Markers | None = None

    def markers_of(
        self, record: dict[str, Any], read: Callable[[dict[str, Any]], Markers]
    ) -> Markers:
        if self.markers is None:
            self.markers = read(record)  # the run has ended: they change no more
        return self.markers


def claim(
    store: BatchStore,
    batch_id: str,
    claiming: Claiming,
    clock: Callable[[], float],
    read_markers: Callable[[dict[str, Any]], Markers],
    state: str,
    job: Job,
) -> dict[str, Any]:
    """The batch's record after `claiming`'s claim was made, or refused: final already,
    or claimed by another server still assembling (its claim's `by` is not ours)."""

    def claimed(current: dict[str, Any]) -> bool:
        if current["status"] in FINAL:
            return False  # another request finished it
        if claiming.now is None:  # the claim's time, once the record is read
            claiming.now = int(clock())
        held = current["_lanes"].get("finalizing")
        if held is not None and claiming.now - current["finalizing_at"] < CLAIM_S:
            return False  # another server's, still assembling
        markers = claiming.markers_of(current, read_markers)
        if held is not None:  # a dead server's: its decision stands
            ending = replace(Claim(**held), by=claiming.token)
        else:
            ending = decide(current, state, markers, job, claiming.token)
        current["_lanes"]["finalizing"] = ending.as_json()
        current.update(status="finalizing", finalizing_at=claiming.now)
        if ending.status == "failed":
            error = BatchError("batch_failed", ending.message or "")
            current["errors"] = {"object": "list", "data": [error.as_json()]}
        return True

    return store.update_batch(batch_id, claimed)


def finish(
    store: BatchStore,
    batch_id: str,
    ending: Claim,
    at: int | None,
    files: dict[str, Any],
    counts: dict[str, int],
) -> dict[str, Any]:
    """The claim's winner saves the batch's last status, its files and counts, unless
    the record is final by now."""

    def finished(current: dict[str, Any]) -> bool:
        if current["status"] in FINAL:
            return False  # one that took a stale claim over: the same files
        current.update(files, request_counts=counts, status=ending.status)
        current[f"{ending.status}_at"] = at
        return True

    return store.update_batch(batch_id, finished)


def decide(
    record: dict[str, Any],
    state: str,
    markers: Markers,
    job: Job,
    token: str,
) -> Claim:
    """The status an ended run leaves the batch in, and for a failed one, why."""
    expired = state == EXPIRED_STATUS or (state in FINISHED and any(m is None for m in markers))
    if record["_lanes"].get("expiring") or expired:
        return Claim("expired", None, token)  # the flow starts no shard past the window
    if state == "CANCELLED" and record["cancelling_at"] is not None:
        return Claim("cancelled", None, token)
    if state in FAILED_STATES:
        return Claim("failed", job.message() or f"the offline run ended {state}", token)
    return Claim("completed", None, token)
