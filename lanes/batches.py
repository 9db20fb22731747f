"""OpenAI's Batch API over the offline lane: a batch is a Prefect flow run of `lanes-offline`.

    create    every line of the input file checked (OpenAI's `validating`,
              lanes.batchlines); a bad file
              is a `failed` batch whose `errors` name the lines. A good one is split
              into shards of `Settings.batch.shard_lines` lines under the store and run
              as a flow run: an offline workload's own deployment, or, for an
              interactive workload, the `openai-batch` deployment, which runs it in
              the offline lane with `Settings.batch.batch_size` (flows.batch `lane`).
    retrieve  the status from the flow run's state and the shards' commits:
              in_progress (request_counts of committed shards), cancelling, and once the
              run ended, finalizing -> completed | failed | expired | cancelled, with
              the output and error files assembled from the committed shards.
    cancel    the flow run is cancelled; committed shards stay, in the output file.

Once a batch has ended, and its files and last status are saved, its folder in the
store (its input's copy, its run's shards) is deleted: the files hold its lines. A
batch nobody retrieves ends all the same: the server sweeps them (serving/batch_sweep.py).

A window that passes expires the batch: the run is stopped (the flow also starts no
shard past it), the committed shards' lines are in the output file, the rest in the
error file with OpenAI's `batch_expired` error.

Everything lives in Prefect and the store (lanes.batchstore); any server reaching both
answers for any batch, after a restart too. Servers change a record only by the store's
conditional write (`BatchStore.update_batch`), so a cancel and a finalize that race
each keep their change. Finalizing is claimed that way first (lanes.batch_claim): only
the claim's winner assembles the files (their ids are the batch's, lanes.batchfiles);
the others answer `finalizing` meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field

from lanes.batch_claim import FINAL, Claim, Claiming, claim, counts_of, finish, read_markers
from lanes.batchfiles import BatchError, assemble
from lanes.batchlines import LineErrors, check_line, check_model
from lanes.batchstore import BatchStore, new_id
from lanes.deadline import offpeak_opening, plan_start
from lanes.digests import model_key
from lanes.errors import InvalidInput, NotConfigured, NotFound, StorageError, shown
from lanes.jobs import BATCH_PREFIX, BATCH_TAG, Job
from lanes.jobstates import FAILED_STATES, FINISHED
from lanes.measurements import Measurements, newest
from lanes.prefectapi import PrefectApi, create_run
from lanes.protocols.openai import Shape, parse
from lanes.settings import Settings
from lanes.spec import Spec
from lanes.uris import join

log = logging.getLogger(__name__)

# The deployment that runs batches of interactive workloads (compiled when the spec has
# any): not a DNS label, so it never clashes with a workload's own.
BATCH_DEPLOYMENT = "openai_batch"
EXPIRED = BatchError(
    "batch_expired", "This request could not be executed before the completion window expired."
)
_WINDOW = re.compile(r"^(\d{1,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# OpenAI's bounds on a batch's metadata: 16 pairs, keys of 64 characters, values of 512.
METADATA_KEY_CHARS = 64


class BatchCreate(Shape):
    input_file_id: str = Field(min_length=1, max_length=100)
    endpoint: Literal["/v1/embeddings", "/v1/completions", "/v1/chat/completions"]
    completion_window: str = Field(min_length=2, max_length=10)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)

    def check(self) -> None:
        # A key's bound is checked here: pydantic's error for a key reads as its value's.
        for key in self.metadata or {}:
            if len(key) > METADATA_KEY_CHARS:
                raise InvalidInput.field(
                    "metadata",
                    f"key {key[:METADATA_KEY_CHARS]!r}... is {len(key)} characters; expected "
                    f"at most {METADATA_KEY_CHARS}",
                )


def window_seconds(window: str) -> int:
    """ "24h" -> 86400. OpenAI takes only 24h; lanes takes any count of s, m, h or d."""
    found = _WINDOW.match(window)
    if found is None or int(found.group(1)) == 0:
        raise InvalidInput.field(
            "completion_window",
            f'expected a duration like "24h" (s, m, h or d), found {shown(window)}',
        )
    return int(found.group(1)) * _UNIT_S[found.group(2)]


@dataclass(frozen=True)
class _Checked:
    """An input file, checked and split: its lines, shards, model, and what was wrong."""

    lines: int
    shards: int
    model: str | None
    errors: list[dict[str, Any]]
    starts: list[int]  # each shard's first line's number in the input file


# What a server's install needs for this API (pyproject.toml's extras).
BATCH_INSTALL = "lanes[serve,batch]"


class Batches:
    """The Batch API's operations. `now` is the wall clock (seconds since the epoch)."""

    def __init__(
        self,
        spec: Spec,
        settings: Settings,
        now: Callable[[], float] = time.time,
        prefect_api_url: str | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.store = BatchStore(settings)
        self.now = now
        self.prefect_api_url = prefect_api_url or settings.prefect_api_url
        # Orders this process's finalizes: a second one waits and finds the first's
        # result, rather than its claim (`finalizing`). Marks need no lock (the store's
        # write is conditional), so a cancel never waits for another batch's files.
        self._finalizing = threading.Lock()
        self._markers = functools.partial(read_markers, self.store)

    # ---- create -------------------------------------------------------------------

    def create(self, body: Any) -> dict[str, Any]:
        request = parse(BatchCreate, body)
        self._check_prefect()
        window = window_seconds(request.completion_window)
        given = self.store.file(request.input_file_id)
        if given.purpose != "batch":  # a batch's own output or error file, say
            raise InvalidInput.field(
                "input_file_id",
                f"file {given.id} has purpose {given.purpose!r}; a batch's input is a "
                'file uploaded with purpose "batch"',
            )
        folder_key = uuid.uuid4().hex
        folder = self.store.batch_folder(folder_key)
        # The split input is a copy of the file, kept until the batch ends: it takes
        # room as an upload does (one byte more for a last line without its newline).
        size = given.bytes + 1
        what = f"the batch's copy of file {given.id} (up to {size} bytes, kept until it ends)"
        with self.store.quota.reserved(self.store.batch_input(folder), size, "input_file_id", what):
            try:
                return self._create(request, window, folder_key, folder)
            except Exception:
                # No record points at the split input: a create that failed (the Prefect
                # API down) leaves nothing behind, or each retry of it would leave a copy.
                try:
                    self.store.storage.delete_folder(folder)
                except StorageError as err:
                    log.warning("a failed batch create left %s: %s", folder, err)
                raise

    def _create(
        self, request: BatchCreate, window: int, folder_key: str, folder: str
    ) -> dict[str, Any]:
        """The input checked and split under `folder`, and the batch's run created."""
        checked = self._check_and_split(request.input_file_id, request.endpoint, folder)
        created = int(self.now())
        record: dict[str, Any] = {
            "id": "",
            "object": "batch",
            "endpoint": request.endpoint,
            "errors": None,
            "input_file_id": request.input_file_id,
            "completion_window": request.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + window,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": checked.lines, "completed": 0, "failed": 0},
            "metadata": request.metadata,
            "_lanes": {
                "folder": folder,
                "shards": checked.shards,
                "starts": checked.starts,
                "flow_run": None,
                # The order of batches created in one second (`created_at` is whole
                # seconds, and may be the injected clock's): lists are newest first.
                "created_ns": time.time_ns(),
            },
        }
        if checked.errors:
            record.update(
                id=new_id(BATCH_PREFIX),
                status="failed",
                failed_at=created,
                errors={"object": "list", "data": checked.errors},
            )
            self.store.create_batch(record)
            self._drop_folder(record)  # it ended as it was made
            return public(record)
        assert checked.model is not None
        workload = self.spec.workloads[checked.model]
        parameters: dict[str, Any] = {
            "workload": checked.model,
            "input": join(folder, "in") + "/",
            "output": join(folder, "out") + "/",
            "finish_by": datetime.fromtimestamp(created + window, UTC).isoformat(),
        }
        deployment = checked.model
        if workload.mode == "interactive":
            parameters["lane"] = "offline"
            deployment = BATCH_DEPLOYMENT
        start = self._start(checked.model, checked.lines, created + window)
        run = create_run(
            deployment,
            parameters,
            start,
            name=f"batch-{checked.model}-{folder_key[:8]}",
            tags=[BATCH_TAG],
            prefect_api_url=self.prefect_api_url,
        )
        record.update(id=BATCH_PREFIX + run.id.hex, status="in_progress", in_progress_at=created)
        record["_lanes"]["flow_run"] = str(run.id)
        self.store.create_batch(record)
        return public(record)

    def _check_prefect(self) -> None:
        """Before any work: a batch runs as a Prefect flow, so a server without a
        Prefect API cannot take one (its operator's to set, not the caller's)."""
        try:
            from prefect.settings import PREFECT_API_URL
        except ImportError:
            raise NotConfigured(
                "this server's Batch API runs each batch on a Prefect server, and this "
                "install has no Prefect: its operator must install lanes with the batch "
                f"extra (pip install '{BATCH_INSTALL}'; infra/images/serve.Dockerfile "
                "installs it, so rebuild an image made from lanes[serve] alone)"
            ) from None
        if not (self.prefect_api_url or PREFECT_API_URL.value()):
            raise NotConfigured(
                "this server's Batch API runs each batch on a Prefect server, and it has "
                "none: its operator must start `lanes serve` with PREFECT_API_URL (or "
                "LANES_PREFECT_API_URL) set to the Prefect API `lanes deploy` registered "
                f"the {BATCH_DEPLOYMENT!r} deployment on"
            )

    def _start(self, workload: str, items: int, deadline: float) -> datetime:
        """When the batch's run starts (`Settings.batch.start`; lanes.deadline)."""
        if self.settings.batch.start == "now":
            return datetime.now(UTC)  # due at once on Prefect's clock, whatever `now` says
        now = datetime.fromtimestamp(self.now(), UTC)
        # The newest offline rate of this model as it is now (a rate measured before the
        # model changed would plan on another model's speed), as the flow plans its runs.
        key = model_key(self.spec, self.spec.workloads[workload], self.settings)
        rate = newest(Measurements(self.settings.home).load(), "offline", key, workload)
        plan = plan_start(
            items,
            rate.items_per_second if rate else None,
            datetime.fromtimestamp(deadline, UTC),
            offpeak_opening(self.settings.offpeak, now),
            now,
        )
        log.info("batch of %s: %s", workload, plan.note)
        return plan.start

    def _check_and_split(self, file_id: str, endpoint: str, folder: str) -> _Checked:
        """Every line checked (OpenAI's validating step), the good ones written in shards."""
        errors = LineErrors()
        seen: set[str] = set()
        model: str | None = None
        lines = shards = 0
        per_shard = self.settings.batch.shard_lines
        storage = self.store.storage
        # A shard holds `per_shard` requests and the blank lines among them, so a line's
        # number in its shard (the flow's, blank lines counted) maps back to the file's.
        starts: list[int] = []
        with self.store.content(file_id) as stream:
            numbered = enumerate(iter(stream), 1)
            exhausted = False
            while not exhausted:
                uri = join(folder, "in", f"part-{shards:05d}.jsonl")
                written = first = 0
                with storage.staged(uri) as stage, stage.open("wb") as out:
                    for number, raw in numbered:
                        first = first or number
                        out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                        if not raw.strip():
                            continue
                        lines += 1
                        found = check_line(number, raw, endpoint, seen, model, errors.add)
                        model = model or found
                        written += 1
                        if written == per_shard:
                            break
                    else:
                        exhausted = True
                    out.flush()
                    if written:
                        storage.publish(stage, uri)
                if written:
                    shards += 1
                    starts.append(first)
        if lines == 0:
            errors.add(1, "the input file holds no lines; expected one JSON request per line")
        if model is not None and not errors:
            check_model(self.spec, model, endpoint, errors.add)
        return _Checked(lines, shards, model, errors.listed(), starts)

    # ---- retrieve, list, cancel ---------------------------------------------------

    def retrieve(self, batch_id: str) -> dict[str, Any]:
        record, state = self.settled(batch_id)
        if record["status"] in FINAL or state in _ENDED:
            return public(record)  # final, or `_finalize`'s answer
        if state is None:
            return self._run_gone(record)
        record["request_counts"] = counts_of(self.store, record)
        if state == "CANCELLING":
            expiring = record["_lanes"].get("expiring")
            record["status"] = "finalizing" if expiring else "cancelling"
        else:
            record["status"] = "in_progress"
        return public(record)

    def settled(self, batch_id: str) -> tuple[dict[str, Any], str | None]:
        """What a retrieve does before it answers: the batch's record, its run stopped
        if its window passed, finalized if its run ended, and that run's state (None:
        the record is final, or the Prefect API does not know its run). Its shards'
        counts are not read: the server's sweep (serving/batch_sweep.py) calls it too."""
        record = self.store.batch(batch_id)
        if record["status"] in FINAL:
            return record, None
        job = self._job(record)
        try:
            state = job.status()
        except NotFound:
            return record, None
        now = int(self.now())
        expiring = record["_lanes"].get("expiring")
        if now >= record["expires_at"] and not expiring and state not in _ENDED:
            record = self._mark(batch_id, lambda r: r["_lanes"].update(expiring=True))
            if record["status"] in FINAL:
                return record, None  # another server finished it meanwhile
            state = job.expire()
        if state in _ENDED:
            return self._finalize(record, state, job), state
        return record, state

    def _run_gone(self, record: dict[str, Any]) -> dict[str, Any]:
        """A batch whose flow run the Prefect API does not know: deleted there, or this
        server points at another Prefect. `failed` in this answer only, never stored:
        pointed at the right Prefect again, the batch reads as its run says."""
        url = PrefectApi(self.prefect_api_url).shown()
        gone = BatchError(
            "batch_run_missing",
            f"the batch's flow run is not on the Prefect API at {url}: deleted there, or "
            "this server's LANES_PREFECT_API_URL (else PREFECT_API_URL) is not the API "
            "the batch was created on",
        )
        record["request_counts"] = counts_of(self.store, record)
        errors = {"object": "list", "data": [gone.as_json()]}
        record.update(status="failed", failed_at=int(self.now()), errors=errors)
        return public(record)

    def page(self, after: str | None, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise InvalidInput.field("limit", f"expected 1 to 100, found {limit}")
        records = [self.store.batch(i) for i in self.store.batch_ids()]
        records.sort(key=_creation, reverse=True)
        ids = [r["id"] for r in records]
        start = 0
        if after is not None:
            if after not in ids:  # a 400 as /v1/files answers: the list itself is there
                raise InvalidInput.field("after", f"no batch with id {shown(after)}")
            start = ids.index(after) + 1
        page = records[start : start + limit]
        data = [self.retrieve(r["id"]) if r["status"] not in FINAL else public(r) for r in page]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(records),
        }

    def cancel(self, batch_id: str) -> dict[str, Any]:
        record = self.store.batch(batch_id)
        if record["status"] not in FINAL:
            now = int(self.now())
            record = self._mark(batch_id, lambda r: r.update(cancelling_at=now))
        if record["status"] in FINAL:
            raise InvalidInput.field(
                "batch_id", f"batch {batch_id} is already {record['status']}", "batch_final"
            )
        with contextlib.suppress(NotFound):  # its run is gone: nothing left to cancel
            self._job(record).cancel()
        return self.retrieve(batch_id)

    def _mark(self, batch_id: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """The batch's record read afresh and, unless it is final, changed and saved.

        A record read before a slow call (Prefect's) must not be saved over one that
        another request finished meanwhile. The save is conditional (lanes.batchstore
        `update_batch`): had another server written the record since this read, it is
        read again and `change` applied to that, or, now final, left as it is. So
        neither server's change is lost; `change` may run more than once."""

        def unless_final(record: dict[str, Any]) -> bool:
            if record["status"] in FINAL:
                return False
            change(record)
            return True

        return self.store.update_batch(batch_id, unless_final)

    def _job(self, record: dict[str, Any]) -> Job:
        return Job(record["id"], self.settings, prefect_api_url=self.prefect_api_url)

    # ---- progress and the end -----------------------------------------------------

    def _finalize(self, record: dict[str, Any], state: str, job: Job) -> dict[str, Any]:
        """The ended run's output and error files, and the batch's last status.

        Claimed first (lanes.batch_claim): only the claim's winner assembles the files;
        another server answers with the claimed record meanwhile (this one's threads
        wait for the winner, and answer with its result)."""
        with self._finalizing:
            claiming = Claiming(uuid.uuid4().hex)
            claimed = claim(self.store, record["id"], claiming, self.now, self._markers, state, job)
            if claimed["status"] in FINAL:
                return claimed
            ending = Claim(**claimed["_lanes"]["finalizing"])
            if ending.by != claiming.token:
                claimed["request_counts"] = counts_of(self.store, claimed)  # as in_progress
                return claimed
            unanswered = EXPIRED if ending.status == "expired" else None
            if ending.status == "failed":
                # Nothing lost: each request its run never answered is an error line.
                unanswered = BatchError(
                    "batch_failed",
                    f"This request was not executed: the batch's run failed ({ending.message}).",
                )
            markers = claiming.markers_of(claimed, self._markers)
            counts = assemble(
                self.store, claimed, markers, unanswered, self.settings.batch.shard_lines
            )
            files = {k: claimed[k] for k in ("output_file_id", "error_file_id")}
            finished = finish(self.store, record["id"], ending, claiming.now, files, counts)
            self._drop_folder(finished)
            return finished

    def _drop_folder(self, record: dict[str, Any]) -> None:
        """Delete an ended batch's folder (`BatchStore.drop_folder`), read only by its run
        and its assembly, both over (`_ENDED`: a cancelled run once CANCELLED), and only
        once its last status is saved: a server taking over a stale claim reassembles."""
        folder = record["_lanes"]["folder"]
        try:
            self.store.drop_folder(folder)
        except StorageError as err:  # the batch has ended all the same
            log.warning("batch %s ended, and its folder %s stays: %s", record["id"], folder, err)


_ENDED = frozenset({*FINISHED, *FAILED_STATES} - {"CANCELLING"})


def _creation(record: dict[str, Any]) -> tuple[int, int, str]:
    """A batch's place in the creation order (0 for a record stored before lanes kept
    `created_ns`: ordered by its id within its second)."""
    return record["created_at"], record["_lanes"].get("created_ns", 0), record["id"]


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The batch object as OpenAI shapes it (lanes' own bookkeeping left out)."""
    return {k: v for k, v in record.items() if not k.startswith("_")}
