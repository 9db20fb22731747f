"""Where an offline job's files live under its output location.

The flows write these and the SDK's `Job` reads them, so both import them from here.
Names starting with '_' are bookkeeping: input listings skip them.
"""

from __future__ import annotations

ERRORS = "_errors"  # one JSONL of rejected records per input shard
MARKERS = "_committed"  # a shard's commit marker, written after its output
MANIFESTS = "_manifests"  # one manifest per run
LATEST = "_manifest.json"  # a copy of the latest run's manifest
SUBMITTED = "_submitted"  # records staged by client.submit, beside the workload's input
JOBS = "jobs"  # outputs of submitted jobs, one folder per job
RUNNING = "_running"  # locked by the run writing the folder now (lanes.runlock)
