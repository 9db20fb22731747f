"""An offline job, planned: which workload, where from and to, and one plan per shard.

Relative local paths in the spec (and in --input/--output) are read against the
folder of workloads.yaml, like model paths, so a deployment finds the same files
wherever its worker starts. An input other than the workload's own must lie under
it, its staging area or an allowed root (lanes.inputs), and an output other than the
workload's own under its output folder, the Batch API's store or an allowed root
(lanes.outputs): whoever made the flow run, the job reads and writes with this
worker's credentials.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from lanes.digests import Digests, model_key
from lanes.errors import PermanentStorageError, StorageError, WrongMode
from lanes.flows.records import FORMATS, is_known, output_name
from lanes.flows.shard import ShardPlan
from lanes.inputs import (
    absolute,
    allowed_roots,
    check_files,
    check_input,
    folder_of,
    output_inside_input,
)
from lanes.layout import ERRORS, MARKERS
from lanes.listing import StoredFile
from lanes.outputs import check_output
from lanes.settings import Settings
from lanes.spec import (
    OfflineWorkload,
    Spec,
    in_offline_lane,
)
from lanes.specfile import load_spec
from lanes.specoffline import Runner
from lanes.storage import Storage
from lanes.uris import is_s3, join

# Bumped when what a shard key covers changes: keys of another format never match.
KEY_FORMAT = "shard/2"

# "declared": the workload as workloads.yaml says; "offline": an interactive one too.
Lane = Literal["declared", "offline"]


@dataclass(frozen=True)
class Job:
    """Everything a shard task needs, picklable (Dask ships it to its workers)."""

    workload: str
    spec: Spec
    input: str
    output: str
    # `output` as it really lay when the job was planned, links resolved (an s3:// URI
    # as it is): where every local write of the job must land (lanes.outputs).
    real_output: str
    batch_size: int
    retries: int
    runner: Runner
    model_key: str  # changes when the model, its tokenizer or the task's settings do
    max_record_bytes: int
    max_inputs: int  # an OpenAI batch line's, as a request's (LANES_MAX_INPUTS_PER_REQUEST)
    # Where an input given besides the workload's own must really lie, links resolved
    # (lanes.inputs.check_files); None: the workload's own input, read as it lies.
    roots: tuple[str, ...] | None = None


def plan_job(
    workload: str,
    spec_file: str | Path,
    settings: Settings,
    input: str | None = None,
    output: str | None = None,
    lane: Lane = "declared",
) -> Job:
    """Load the spec and settle the job. Raises SpecError, UnknownWorkload, WrongMode.
    `lane="offline"` runs an interactive workload in the offline lane (the Batch API's
    batches): its model and task with the offline defaults, `Settings.batch.batch_size`
    records per model run, and no error-rate limit (OpenAI's batches fail no request
    for another's error); it needs `input` and `output`."""
    spec = load_spec(spec_file, settings)
    return settle_job(
        spec, workload, Path(spec_file).resolve().parent, settings, input, output, lane
    )


def settle_job(
    spec: Spec,
    workload: str,
    base: Path,
    settings: Settings,
    input: str | None = None,
    output: str | None = None,
    lane: Lane = "declared",
) -> Job:
    """`plan_job` of a loaded spec whose relative paths are read against `base`."""
    declared = spec.workload(workload)
    if lane == "offline" and declared.mode == "interactive":
        if not input or not output:
            raise WrongMode(
                f"workload {workload!r} is interactive: a batch of it names input and output"
            )
        offline = in_offline_lane(
            declared, input, output, batch_size=settings.batch.batch_size, max_error_rate=1.0
        )
        spec = spec.model_copy(update={"workloads": {**spec.workloads, workload: offline}})
    w = spec.workload(workload)
    if w.mode != "offline":
        raise WrongMode(
            f"workload {workload!r} is interactive: call it through the endpoint, "
            "or declare it `mode: offline` with an input and output"
        )
    source = _resolve(input or w.input, base, "input")
    roots = None
    if input and w.input:
        # An interactive workload reads nothing of its own: only what the Batch API staged.
        own = w.input if declared.mode == "offline" else join(settings.batch_store(), "batches")
        check_input(source, own, base, settings)
        roots = tuple(allowed_roots(own, base, settings))
    dest = _resolve(output or w.output, base, "output")
    if output:
        # Where the worker writes, with its credentials: whoever made the flow run.
        own_output = declared.output if isinstance(declared, OfflineWorkload) else None
        check_output(dest, own_output, base, settings)
    if output_inside_input(dest, source, base):
        raise StorageError(
            f"output {dest} is inside input {source}: outputs would be read as inputs on "
            "the next run; choose an output folder outside the input"
        )
    return Job(
        workload=workload,
        spec=spec,
        input=source,
        output=dest,
        real_output=absolute(dest, base),
        batch_size=w.batch_size,
        retries=w.retries,
        runner=w.runner,
        model_key=model_key(spec, w, settings),
        max_record_bytes=settings.max_body_bytes,
        max_inputs=settings.max_inputs_per_request,
        roots=roots,
    )


def _resolve(location: str | None, base: Path, what: str) -> str:
    if not location:
        raise StorageError(f"no {what}: set it in workloads.yaml or pass --{what}")
    if is_s3(location) or "://" in location:
        return location
    path = Path(location).expanduser()
    resolved = str(path if path.is_absolute() else base / path)
    return resolved + "/" if location.endswith("/") else resolved


def folder_job(spec: Spec, name: str, folder: Path | str, settings: Settings) -> Job:
    """Offline workload `name`'s job over `folder`/in/ into `folder`/out/, without
    retries: what a calibration or a benchmark runs in a scratch folder."""
    workload = spec.workload(name)
    if not isinstance(workload, OfflineWorkload):
        raise WrongMode(f"workload {name!r} is not offline: give its offline copy")
    return Job(
        workload=name,
        spec=spec,
        input=f"{folder}/in/",
        output=f"{folder}/out/",
        real_output=absolute(f"{folder}/out/", Path.cwd()),
        batch_size=workload.batch_size,
        retries=0,
        runner=workload.runner,
        model_key=model_key(spec, workload, settings),
        max_record_bytes=settings.max_body_bytes,
        max_inputs=settings.max_inputs_per_request,
    )


def shard_source(file: StoredFile, root: Path | None) -> str:
    """How a shard's input is named wherever the project lies: a local file inside the
    spec's folder `root` by its path relative to it (e.g. data/corpus/part-0.jsonl),
    any other file by its URI."""
    if root is None or is_s3(file.uri) or "://" in file.uri:
        return file.uri
    try:
        return Path(os.path.normpath(file.uri)).relative_to(root).as_posix()
    except ValueError:
        return file.uri


def shard_key(file: StoredFile, source: str, model: str, digests: Digests) -> str:
    """Input identity + model identity. A local file counts by its content (an S3
    object by its ETag), so moving or copying the project keeps its commits."""
    content: str | None = file.version
    if not is_s3(file.uri):
        digest = digests.of(Path(os.path.normpath(file.uri)))
        content = digest.blake2b if digest else None
    return hashlib.sha256(orjson.dumps([KEY_FORMAT, source, file.size, content, model])).hexdigest()


def plan_shards(job: Job, storage: Storage) -> list[ShardPlan]:
    """One plan per input shard, sorted by name. No inputs at all is an error, and so is
    a file in a format not read (skipping it would drop its records unsaid), a file two
    shards would write, or one that must be a file for one shard and a folder for
    another: every shard's output, errors and marker are its own. A job given an input
    refuses a file that a link takes outside its roots (`Job.roots`) before any is read."""
    listed = storage.list_files(job.input, ("",))  # every name ends with ""
    if job.roots is not None:
        check_files(job.input, (f.uri for f in listed), job.roots)
    unknown = [f.uri for f in listed if not is_known(f.name)]
    if unknown:
        shown = ", ".join(unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise StorageError(
            f"{job.input}: {shown}: not an input format lanes reads ({FORMATS}); "
            "convert or remove it, or narrow the workload's input with a glob "
            "(e.g. in/*.jsonl)"
        )
    files = [f for f in listed if is_known(f.name)]
    if not files:
        raise StorageError(f"{job.input}: no input files ({FORMATS}); check the workload's input")
    plans: list[ShardPlan] = []
    digests = Digests(storage.settings.home)
    writers: dict[str, StoredFile] = {}  # each written name below the output -> its input
    for file in files:
        name = output_name(file.name)
        written = [name, f"{ERRORS}/{name}", f"{MARKERS}/{name.removesuffix('.jsonl')}.json"]
        for path in written:
            if path in writers:
                raise StorageError(
                    f"{writers[path].uri} and {file.uri} would both write {path}; "
                    "rename one of them"
                )
            writers[path] = file
        source = shard_source(file, job.spec.root)
        plans.append(
            ShardPlan(
                input=file,
                name=name,
                output=join(job.output, written[0]),
                errors=join(job.output, written[1]),
                marker=join(job.output, written[2]),
                key=shard_key(file, source, job.model_key, digests),
                workload=job.workload,
                source=source,
                roots=job.roots,
            )
        )
    for path, file in writers.items():
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in writers:
                raise StorageError(
                    f"{writers[folder].uri} would write the file {folder} and {file.uri} "
                    f"the folder {folder}/; rename one of them"
                )
    return plans


def check_output_owner(job: Job, plans: list[ShardPlan], storage: Storage) -> None:
    """Refuse an output holding commit markers of another job's shards before any shard
    writes: another workload's, or of a file outside this job's input folder (by its
    URI, or by its path inside the project: `shard_source`). `committed` reads only
    the markers of this job's own shard names, so two jobs whose files are named apart
    would mix their results in one folder, each manifest counting its own. A marker of
    a file since gone from this job's input is its own."""
    own = {plan.name.removesuffix(".jsonl") + ".json" for plan in plans}
    try:
        markers = storage.list_files(join(job.output, MARKERS), (".json",))
    except StorageError:
        return  # no marker yet (a storage outage fails the shards' own reads)
    folder = folder_of(job.input, job.spec.root or Path.cwd()).rstrip("/") + "/"
    relative: str | None = None  # the folder inside the project, where it is inside
    project = job.spec.root
    if project is not None and "://" not in folder and Path(folder).is_relative_to(project):
        inner = Path(folder).relative_to(project).as_posix()
        relative = "" if inner == "." else inner + "/"
    for marker in markers:
        if marker.name in own:
            continue
        try:
            found = orjson.loads(storage.read_bytes(marker.uri) or b"null")
        except orjson.JSONDecodeError:
            continue  # unreadable: not known to be anyone's
        if not isinstance(found, dict) or not isinstance(found.get("input"), str):
            continue
        workload, input, source = found.get("workload"), found["input"], found.get("source")
        # Inside the project, by `source`; a marker older than it, of a project since
        # moved: its input's path holds the folder's (as `_same_input` reads it).
        ours = input.startswith(folder) or (
            relative is not None
            and (
                source.startswith(relative) if isinstance(source, str) else f"/{relative}" in input
            )
        )
        if workload in (None, job.workload) and ours:
            continue
        owner = f"workload {workload}'s shard of " if workload else "a shard of "
        raise PermanentStorageError(
            f"{job.output} holds the results of {owner}{input} (commit marker "
            f"{marker.uri}), not of {job.input} for workload {job.workload}: two jobs "
            f"write this output and their results would mix; give this one a different "
            f"output, or delete {job.output} to replace the old results"
        )
