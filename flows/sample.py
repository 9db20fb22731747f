"""Measure a workload's offline rate on a few records, through the shard code path.

    stats = run_records(job, records, folder, model, storage)      # one shard, timed
    rate = measure_sample(job, settings, storage, model)           # the job's own input

`run_records` is what `lanes calibrate` times (router.calibrate, on synthetic items);
`measure_sample` times up to `SAMPLE_BATCHES` batches of the job's real input, for a
workload with a deadline and no earlier run (flows.start). Neither writes below the
job's own output: the records go to `folder`, a scratch folder of the caller's.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from lanes.errors import InvalidInput, StorageError
from lanes.flows.job import Job, plan_shards
from lanes.flows.records import read_shard
from lanes.flows.runners import ShardModel
from lanes.flows.shape import RecordShape
from lanes.flows.shard import ShardStats, run_shard
from lanes.measurements import Throughput
from lanes.settings import Settings
from lanes.spec import as_offline
from lanes.storage import Storage

SAMPLE_BATCHES = 2  # batches of the real input a calibration before a deadline runs
SAMPLE_SOURCE = "calibrate (sample of the input)"


def run_records(
    job: Job,
    records: Iterable[dict[str, Any]],
    folder: Path,
    model: ShardModel,
    storage: Storage,
    progress: Callable[[int], None] = lambda n: None,
) -> ShardStats:
    """`records` as one input file under `folder`, run as one shard of `job` (its
    workload, batch size and model) that writes under `folder` too."""
    (folder / "in").mkdir(parents=True)
    with (folder / "in" / "items.jsonl").open("wb") as out:
        for record in records:
            out.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    # The scratch input is written here, not given: no roots to hold it to.
    scratch = dataclasses.replace(job, input=f"{folder}/in/", output=f"{folder}/out/", roots=None)
    (plan,) = plan_shards(scratch, storage)
    return run_shard(
        plan, model, storage, job.batch_size, job.max_record_bytes, job.max_inputs, progress
    )


def first_records(job: Job, storage: Storage, count: int) -> list[dict[str, Any]]:
    """Up to `count` readable records from the start of the job's input shards, as a
    JSON record holds them (they are run from a JSONL file): a CSV record's numbers
    read as the shard reads them (RecordShape.typed)."""
    shape = RecordShape.of(job.workload, as_offline(job.spec.workload(job.workload)), None)

    def readable() -> Iterator[dict[str, Any]]:
        for plan in plan_shards(job, storage):
            for line in read_shard(storage, plan.input, job.max_record_bytes, plan.roots):
                if line.value is None:
                    continue
                try:
                    yield dict(shape.typed(line.value, line.text, line.parquet))
                except InvalidInput:
                    yield line.value  # rejected in the run, as in the shard

    return list(itertools.islice(readable(), count))


def measure_sample(job: Job, settings: Settings, storage: Storage, model: ShardModel) -> Throughput:
    """The offline rate of `job` over up to SAMPLE_BATCHES batches of its own input
    (`model` already loaded and warmed up). StorageError when the input holds no
    readable record; InvalidInput when it answers none of them."""
    records = first_records(job, storage, SAMPLE_BATCHES * job.batch_size)
    if not records:
        raise StorageError(
            f"{job.input}: no readable record to measure {job.workload!r} on; check its input"
        )
    with tempfile.TemporaryDirectory(prefix="lanes-sample-", dir=_scratch(settings)) as folder:
        stats = run_records(job, records, Path(folder), model, storage)
    if not stats.items:
        raise InvalidInput(
            f"{job.input}: no record of its input was answered ({stats.errors} of "
            f"{stats.records} rejected, as max_error_rate allows), so {job.workload!r} has "
            "no rate to plan by; check its records against the workload"
        )
    return Throughput(
        workload=job.workload,
        model_key=job.model_key,
        lane="offline",
        items_per_second=stats.items / max(stats.seconds, 1e-9),
        measured_at=datetime.now(UTC),
        source=SAMPLE_SOURCE,
        items=stats.items,
        provider=model.provider,
        batch_size=job.batch_size,
    )


def _scratch(settings: Settings) -> Path:
    folder = settings.home / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
