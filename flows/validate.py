"""Checking a job's records before any shard runs, as OpenAI's batch `validating` step does.

The first records of a sample of the shards are read and matched against the record
shape (flows.requests.to_request: readable, an id, the text or prompt field, an
OpenAI line for this task). When more of them fail than the workload's
`max_error_rate` allows, the run fails at once, naming the lines and what was
expected, before any model is loaded: records in the wrong shape (a missing `id`,
another name for the text) fail in seconds, not after a night of rejections. A few
bad records pass here; the shards' own error rate decides about them.
"""

from __future__ import annotations

import logging
from itertools import islice
from typing import Any

from lanes.errors import JobFailed, StorageError
from lanes.flows.job import Job
from lanes.flows.records import read_shard, unit
from lanes.flows.requests import Rejection, to_request
from lanes.flows.shape import RecordShape
from lanes.flows.shard import ShardPlan
from lanes.spec import as_offline
from lanes.storage import Storage

SAMPLE_SHARDS = 16  # spread over the job's shards, first and last included
SAMPLE_RECORDS = 100  # from the start of each
EXAMPLES = 3  # mismatches named in the message

log = logging.getLogger(__name__)


def check_records(job: Job, plans: list[ShardPlan], storage: Storage) -> int:
    """Raise `JobFailed` when the sample's rejected share is over `max_error_rate`;
    returns how many records were checked. The handler is not imported here: with one,
    its `pre` may make the item, so only the id and kept fields are checked."""
    workload = as_offline(job.spec.workload(job.workload))
    shape = RecordShape.of(job.workload, workload, None)
    checked = 0
    rejected: list[tuple[ShardPlan, dict[str, Any]]] = []
    for plan in _spread(plans, SAMPLE_SHARDS):
        first_seen: set[Any] = set()
        records = read_shard(storage, plan.input, job.max_record_bytes, plan.roots)
        try:
            for line in islice(records, SAMPLE_RECORDS):
                checked += 1
                request = to_request(line, shape, plan.input.uri, job.max_inputs)
                if isinstance(request, Rejection):
                    rejected.append((plan, request.line))
                elif request.id in first_seen:
                    rejected.append((plan, request.reject(f"duplicate id {request.id!r}")))
                else:
                    first_seen.add(request.id)
        except StorageError as err:
            # Unreadable (a corrupt .gz, storage failing): the shard's own retries and
            # failure deal with that, without holding back the other shards.
            log.warning("validating the records: skipping %s: %s", plan.input.uri, err)
    if len(rejected) > workload.max_error_rate * checked:
        examples = "; ".join(
            f"{plan.input.uri} {unit(plan.input.name)} {line['line']}: {line['error']}"
            for plan, line in rejected[:EXAMPLES]
        )
        raise JobFailed(
            f"validating the records: {len(rejected)} of the {checked} checked (the first "
            f"records of {min(len(plans), SAMPLE_SHARDS)} shards) do not fit, more than "
            f"max_error_rate {workload.max_error_rate:g} allows, so no shard ran: {examples}"
        )
    return checked


def _spread(plans: list[ShardPlan], most: int) -> list[ShardPlan]:
    """At most `most` plans, evenly spaced, the first and the last among them."""
    if len(plans) <= most:
        return plans
    step = (len(plans) - 1) / (most - 1)
    return [plans[round(i * step)] for i in range(most)]
