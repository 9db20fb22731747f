"""Submitting an offline job from the SDK: its records staged beside the workload's
input (or an input URI checked against its roots, lanes.inputs), and a flow run of
the workload's deployment created at the next off-peak window or now. What a job is,
and how it is followed by id, is lanes.jobs.

    <workload input folder>/_submitted/<key>/records.jsonl   the staged records
    <workload output folder>/jobs/<key>/                     its outputs (lanes.layout)
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from lanes import layout
from lanes.deadline import opening
from lanes.errors import InvalidInput
from lanes.inputs import absolute, check_input, folder_of
from lanes.jobs import SUBMIT_TAG, Job
from lanes.prefectapi import PrefectApi
from lanes.settings import Settings
from lanes.spec import OfflineWorkload
from lanes.storage import Storage
from lanes.uris import join
from lanes.validation import describe


def submit(
    workload: OfflineWorkload,
    name: str,
    records: Iterable[Mapping[str, Any]] | str | os.PathLike[str],
    when: str,
    settings: Settings,
    base: Path,
    prefect_api_url: str | None = None,
    trace: dict[str, str] | None = None,
) -> Job:
    """Stage `records` beside the workload's input (or take an input URI under the
    workload's input or a root `settings.allowed_input_roots` allows: lanes.inputs; a
    relative local path is read against the working directory), and create a flow run
    of its deployment at the next off-peak window (the workload's schedule, else
    `settings.offpeak`) or now. `trace` (W3C headers of the caller's span) goes with
    the run, whose spans continue it."""
    from prefect.states import Scheduled

    if when not in ("offpeak", "now"):
        raise InvalidInput.field("when", f'expected "offpeak" or "now", found {when!r}')
    key = datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
    given: str | None = None  # an input URI, or records to stage
    if isinstance(records, str | os.PathLike):
        given, data = absolute(os.fspath(records), Path.cwd()), b""
        check_input(given, workload.input, base, settings, written=os.fspath(records))
    else:
        data = _jsonl(records)
    scheduled = datetime.now(UTC)
    if when == "offpeak":
        scheduled = opening(workload, settings)[0].next_run()
    prefect = PrefectApi(prefect_api_url)
    with prefect.client() as client:
        deployment = prefect.deployment(client, name)
        # Staged only once the deployment is known: a refused submit leaves no files.
        if given is None:
            source = join(folder_of(workload.input, base), layout.SUBMITTED, key) + "/"
            Storage(settings).write_bytes(join(source, "records.jsonl"), data)
        else:
            source = given
        output = join(folder_of(workload.output, base), layout.JOBS, key) + "/"
        run = client.create_flow_run_from_deployment(
            deployment,
            parameters={
                "workload": name,
                "input": source,
                "output": output,
                **({"trace": trace} if trace else {}),
            },
            state=Scheduled(scheduled_time=scheduled),
            name=f"{name}-{key}",
            tags=[SUBMIT_TAG],
        )
    return Job(str(run.id), settings, prefect_api_url=prefect_api_url)


def _jsonl(records: Iterable[Mapping[str, Any]]) -> bytes:
    if isinstance(records, Mapping) or not isinstance(records, Iterable):
        found = (
            "one record: put it in a list" if isinstance(records, Mapping) else describe(records)
        )
        raise InvalidInput.field(
            "records",
            "expected a list of records (mappings like {'id': ..., 'text': ...}), "
            f"a file or an input URI; found {found}",
        )
    lines = []
    for n, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise InvalidInput.field(
                f"records[{n}]",
                f"expected a mapping like {{'id': ..., 'text': ...}}, found {describe(record)}",
            )
        try:
            line = orjson.dumps(dict(record))
        except TypeError as err:
            raise InvalidInput.field(f"records[{n}]", f"not JSON-serialisable ({err})") from None
        if b"null" in line:  # orjson writes NaN and infinities as null: none may pass
            _check_finite(record, f"records[{n}]")
        lines.append(line + b"\n")
    if not lines:
        raise InvalidInput.field("records", "expected at least one record, found none")
    return b"".join(lines)


def _check_finite(value: Any, where: str) -> None:
    """InvalidInput naming the first NaN or infinity in a record (`where` is its path),
    as a call's body refuses them (lanes.payloads): JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput.field(
            where,
            f"cannot be sent as JSON ({value!r} is no JSON number); send finite numbers",
            "invalid_value",
        )
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")
