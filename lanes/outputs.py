"""Where a job may write: under its workload's own output folder, the Batch API's
batch store, or a root that `Settings.allowed_output_roots` allows. Nothing else,
however the URI is spelt.

A job writes with the worker's credentials, whoever created its flow run (`prefect
deployment run -p output=...`, any Prefect API client), so the flow checks a given
output where it plans the job, before anything is written. `submit` always writes
under the workload's output folder (`<output>/jobs/<key>/`), the Batch API under its
store. The spelling rules are the input's (lanes.inputs): local paths are compared
after resolving `..` and symlinks, so an output folder that is a link out of the
roots when the job is planned (`<output>/jobs/<key>` made a link to /elsewhere) is
refused; an s3:// URI must not hold `.` or `..` parts. The workload's own output, run
as declared (no output given), is the operator's, as its input is.
"""

from __future__ import annotations

from pathlib import Path

from lanes.errors import InvalidInput
from lanes.inputs import absolute, check_spelling, folder_of, inside_output
from lanes.settings import Settings
from lanes.storage import join


def allowed_output_roots(workload_output: str | None, base: Path, settings: Settings) -> list[str]:
    """Where a job of the workload with output `workload_output` (None: it declares
    none, an interactive workload) may write, absolute."""
    own = [folder_of(workload_output, base)] if workload_output else []
    # Where the Batch API's batches write (lanes.batches: <store>/batches/<key>/out/).
    batches = join(settings.batch_store(), "batches") + "/"
    extra = [absolute(root, base) for root in settings.allowed_output_roots]
    return [*own, batches, *extra]


def check_output(uri: str, workload_output: str | None, base: Path, settings: Settings) -> None:
    """Raise InvalidInput unless `uri` lies under one of `allowed_output_roots`, by its
    real path now. Relative local paths are read against `base`."""
    check_spelling(uri, "output")
    resolved = absolute(uri, base)
    roots = allowed_output_roots(workload_output, base, settings)
    if any(inside_output(resolved, root, base) for root in roots):
        return
    shown = uri if resolved == uri else f"{uri} ({resolved})"
    raise InvalidInput(
        f"output {shown} is outside where this workload writes ({', '.join(roots)}); "
        "write under one of them, or allow its folder in LANES_ALLOWED_OUTPUT_ROOTS (a "
        "JSON list) where the job runs (the worker's environment, or `lanes run`'s)"
    )
