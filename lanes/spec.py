"""The workloads.yaml schema: pydantic models for every field, and the cross-field rules.

`parse_spec` validates plain data (every problem at once, as `Problem`s with field
paths); `lanes.specfile.load_spec` adds YAML reading, line numbers and env overrides.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from lanes.template import Template, is_template

Mode = Literal["interactive", "offline"]
TaskName = Literal["embed", "infer", "generate"]
_TASKS = get_args(TaskName)

# Workload names become URL paths and Prefect deployment names: DNS labels.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
HANDLER_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class StrictModel(BaseModel):
    """Unknown keys are errors; values are not coerced across types silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SessionOptions(StrictModel):
    intra_op_threads: PositiveInt | None = Field(
        None, description="Threads inside one operator; default: the LANES_THREADS setting."
    )
    inter_op_threads: PositiveInt | None = Field(None, description="Threads across operators.")
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="onnxruntime graph optimisation level."
    )
    spinning: bool = Field(
        True,
        description="Let idle onnxruntime threads spin-wait for the next run (lower latency, "
        "even on 2 cores; turn off to leave idle cores to other processes).",
    )


class ModelSpec(StrictModel):
    path: Path = Field(description="The .onnx file, relative to workloads.yaml.")
    tokenizer: Path | None = Field(None, description="A Hugging Face tokenizer.json.")
    max_length: PositiveInt = Field(
        256,
        description="Longest input in tokens (embed: longer text is refused unless the "
        "workload sets `truncate`); generate: the context, when config.json does not say.",
    )
    session: SessionOptions = Field(default_factory=SessionOptions)


class Batching(StrictModel):
    max_batch_size: PositiveInt = Field(
        32, le=65536, description="Most requests (or sequences in flight) per model run."
    )
    max_wait_ms: NonNegativeFloat = Field(
        0.0, le=60_000, description="How long an idle executor waits for company; 0 runs now."
    )
    max_queue: PositiveInt = Field(
        1024, description="Requests waiting beyond this are refused with 503 and Retry-After."
    )


class Slo(StrictModel):
    p50_ms: PositiveFloat | None = Field(None, description="Target median latency.")
    p99_ms: PositiveFloat | None = Field(None, description="Target 99th percentile latency.")
    ttft_ms: PositiveFloat | None = Field(None, description="Target time to first token.")
    timeout_ms: PositiveFloat | None = Field(
        None, description="Deadline of each request: past it, a queued request gets 504."
    )


class Generation(StrictModel):
    max_new_tokens: PositiveInt = Field(128, le=65536)
    temperature: NonNegativeFloat = Field(1.0, le=10, description="0 means greedy.")
    top_k: int = Field(0, ge=0, description="0 means no top-k cut.")
    top_p: float = Field(1.0, ge=0, le=1, description="0 keeps only the likeliest token.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")


class Guard(StrictModel):
    """A scorer a generate workload's text must pass before a client sees it."""

    handler: str = Field(
        pattern=HANDLER_PATTERN,
        description="module:fn; fn(text) -> a risk score in [0, 1] (or a bool: True fails).",
    )
    mode: Literal["buffer", "chunked"] = Field(
        "buffer",
        description="buffer: hold a stream until the whole text passed (safe, no TTFT "
        "gain); chunked: score the text so far every `every_tokens` tokens and send "
        "only what passed.",
    )
    every_tokens: PositiveInt = Field(
        16, le=4096, description="chunked: tokens between scorings (and held back)."
    )
    threshold: float = Field(0.5, ge=0, le=1, description="A score at or above this fails.")


class Schedule(StrictModel):
    cron: str = Field(description='Five-field cron, e.g. "0 2 * * *".')
    timezone: str = Field("UTC", description="IANA time zone the cron is read in.")

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(
                f'expected a five-field cron expression like "0 2 * * *", found {value!r}'
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f'expected an IANA time zone like "UTC" or "Europe/Paris", found {value!r}'
            ) from None
        return value

    def next_run(self, after: datetime | None = None) -> datetime:
        """The first time strictly after `after` (default: now) that the cron fires."""
        zone = ZoneInfo(self.timezone)
        start = (after or datetime.now(zone)).astimezone(zone)
        result: datetime = croniter(self.cron, start).get_next(datetime)
        return result


class Runner(StrictModel):
    """Where an offline workload's shard tasks run. `runner: dask` is short for `{kind: dask}`."""

    kind: Literal["local", "dask"] = Field(
        "local",
        description="local: threads in the flow's own process; dask: a Dask cluster "
        "through prefect-dask.",
    )
    address: str | None = Field(
        None,
        description="Dask scheduler address, e.g. tcp://10.0.0.5:8786 (kind: dask); "
        "none starts a local cluster.",
    )
    workers: PositiveInt = Field(
        2, le=1024, description="Processes of the local Dask cluster started when no address."
    )
    max_concurrent_shards: PositiveInt = Field(
        2, le=4096, description="Shards in flight at once: reading one overlaps running another."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value


# A kept field may not take the name of the output line's own id.
RESERVED_OUTPUT_FIELDS = ("id", "custom_id")


class Fields(StrictModel):
    """Where the parts of a plain offline record are (OpenAI batch lines have their own)."""

    id: str = Field(
        "id", min_length=1, description="The field holding each record's id (a string or integer)."
    )
    text: str | None = Field(
        None,
        min_length=1,
        description="embed: the field holding the text, or a template of fields such as "
        '"{subject}\\n\\n{body}"; default: the field `text`.',
    )
    prompt: str | None = Field(
        None,
        min_length=1,
        description="generate: the field holding the prompt, or a template of fields; "
        "default: the record's fields but the id and `keep` are the request "
        "(prompt, max_tokens, ...).",
    )
    keep: list[str] = Field(
        default_factory=list,
        description="Fields copied from each record into its output line, beside the id.",
    )

    @field_validator("text", "prompt")
    @classmethod
    def _valid_template(cls, value: str | None) -> str | None:
        if value is not None and is_template(value):
            Template.parse(value)  # its ValueError says what is wrong and where
        return value

    @field_validator("keep")
    @classmethod
    def _valid_keep(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name:
                raise ValueError("expected field names, found an empty one")
            if name in RESERVED_OUTPUT_FIELDS:
                raise ValueError(
                    f"{name!r} names the output line's id (the record's `fields.id`); "
                    "it cannot be kept under that name"
                )
        twice = sorted({n for n in value if value.count(n) > 1})
        if twice:
            raise ValueError(f"expected each field once, found {', '.join(twice)} twice")
        return value


class Workload(StrictModel):
    mode: Mode = Field(description="interactive: someone is waiting; offline: nobody is.")
    task: TaskName
    model: str = Field(description="A key of `models`.")
    description: str | None = None
    handler: str | None = Field(
        None,
        pattern=HANDLER_PATTERN,
        description="module:attr of an object with optional pre(item) and post(output).",
    )
    batching: Batching = Field(default_factory=Batching)
    slo: Slo = Field(default_factory=Slo)
    stream: bool = Field(
        False,
        description="generate: the SDK's and CLI's default (`lanes call`); over HTTP only "
        "a request's own `stream: true` streams, as in OpenAI's API.",
    )
    truncate: bool = Field(
        False,
        description="embed: cut text over the model's max_length tokens instead of "
        "refusing it (HTTP 400 online, an errors-file line offline).",
    )
    generation: Generation = Field(default_factory=Generation)
    guard: Guard | None = Field(None, description="generate: score text before it is sent.")
    # offline only
    input: str | None = Field(None, description="Folder, glob or s3://bucket/prefix/ of inputs.")
    output: str | None = Field(None, description="Folder or s3://bucket/prefix/ for outputs.")
    batch_size: PositiveInt = Field(256, le=65536, description="Records per model run.")
    schedule: Schedule | None = None
    retries: int = Field(2, ge=0, le=100, description="Retries of a failed shard.")
    runner: Runner = Field(default_factory=Runner)
    fields: Fields = Field(
        default_factory=Fields, description="Which record fields are the id, text and output."
    )
    max_error_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Most rejected records a shard may have, as a fraction of its records: "
        "beyond it the shard fails and is not committed (0: none may fail; 1: no limit).",
    )


class Spec(StrictModel):
    version: Literal[1] = 1
    models: dict[str, ModelSpec]
    workloads: dict[str, Workload]
    root: Path | None = Field(
        None,
        description="The folder of workloads.yaml: relative paths and the user's handler "
        "modules are found there. Set by the loader, not a key of the file; None (a spec "
        "built in code) imports handlers from sys.path as it is.",
    )

    def workload(self, name: str) -> Workload:
        from lanes.errors import UnknownWorkload

        try:
            return self.workloads[name]
        except KeyError:
            known = ", ".join(sorted(self.workloads)) or "none"
            raise UnknownWorkload(f"no workload named {name!r}; known: {known}") from None


class _Top(StrictModel):
    version: Literal[1] = 1
    models: dict[str, Any]
    workloads: dict[str, Any]


# (path, message) pairs; a path is a tuple of keys from the document's root.
Loc = tuple[str | int, ...]
Found = list[tuple[Loc, str, bool]]  # (path, message, points at the key itself)

_OFFLINE_ONLY = ("input", "output", "schedule", "runner", "fields", "max_error_rate")
# Which `fields:` key names the item of which task.
_ITEM_FIELDS = {"text": "embed", "prompt": "generate"}


def parse_spec(data: Any, base: Path, check_files: bool = True) -> tuple[Spec | None, Found]:
    """Validate plain data. Returns the spec (None if anything is wrong) and every problem.

    Model paths are made absolute against `base`, the folder of workloads.yaml, and,
    with `check_files`, must exist and every handler and guard must import (with `base`
    on the import path); a client that only routes calls needs neither.
    """
    found: Found = []
    try:
        top = _Top.model_validate(data)
    except ValidationError as err:
        return None, _from_pydantic(err, ())
    models: dict[str, ModelSpec] = {}
    for name, raw in top.models.items():
        try:
            models[name] = _resolve(ModelSpec.model_validate(raw), base)
        except ValidationError as err:
            found += _from_pydantic(err, ("models", name))
    workloads: dict[str, Workload] = {}
    for name, raw in top.workloads.items():
        if not NAME_PATTERN.match(name):
            found.append(
                (
                    ("workloads", name),
                    "expected a DNS-safe name (lower-case letters, digits and '-', "
                    f"at most 63, starting and ending alphanumeric), found {name!r}",
                    True,
                )
            )
        try:
            workloads[name] = Workload.model_validate(raw)
        except ValidationError as err:
            found += _from_pydantic(err, ("workloads", name))
    for name, model in models.items() if check_files else ():
        found += _model_problems(name, model)
    for name, workload in workloads.items() if check_files else ():
        found += _code_problems(name, workload, base)
    for name, raw in top.workloads.items():
        found += _workload_problems(name, raw, top.models, models)
    if found:
        return None, found
    return Spec(version=top.version, models=models, workloads=workloads, root=base), []


def _resolve(model: ModelSpec, base: Path) -> ModelSpec:
    tokenizer = base / model.tokenizer if model.tokenizer else None
    return model.model_copy(update={"path": base / model.path, "tokenizer": tokenizer})


def _model_problems(name: str, model: ModelSpec) -> Found:
    hint = "build the demo models with `lanes models build`, or fix the path"
    found: Found = []
    if not model.path.is_file():
        found.append((("models", name, "path"), f"no model file at {model.path}; {hint}", False))
    if model.tokenizer is not None and not model.tokenizer.is_file():
        found.append(
            (
                ("models", name, "tokenizer"),
                f"no tokenizer file at {model.tokenizer}; {hint}",
                False,
            )
        )
    return found


def _code_problems(name: str, workload: Workload, root: Path) -> Found:
    """The user's own code must import now, not at the first request or in a worker."""
    from lanes.errors import HandlerError
    from lanes.tasks.handler import load_handler, load_scorer

    found: Found = []
    try:
        if workload.handler is not None:
            load_handler(workload.handler, root)
    except HandlerError as err:
        found.append((("workloads", name, "handler"), str(err), True))
    try:
        if workload.guard is not None:
            load_scorer(workload.guard.handler, root)
    except HandlerError as err:
        found.append((("workloads", name, "guard", "handler"), str(err), True))
    return found


def _workload_problems(
    name: str, raw: Any, declared: dict[str, Any], models: dict[str, ModelSpec]
) -> Found:
    """Cross-field rules. They read the raw mapping, so they apply (and report) even
    when some other field of the workload failed validation."""
    if not isinstance(raw, dict):
        return []
    at: Loc = ("workloads", name)
    found: Found = []
    model, task, mode = raw.get("model"), raw.get("task"), raw.get("mode")
    if isinstance(model, str) and model not in declared:
        known = ", ".join(sorted(declared)) or "none declared"
        message = f"expected the name of a declared model ({known}), found {model!r}"
        found.append(((*at, "model"), message, False))
    elif model in models and task in ("embed", "generate") and not models[model].tokenizer:
        message = (
            f"task {task!r} needs a tokenizer, but model {model!r} declares none; "
            f"add `tokenizer:` to models.{model}"
        )
        found.append(((*at, "model"), message, False))
    if raw.get("guard") is not None and task in ("embed", "infer"):
        message = f"`guard` scores generated text: it applies to task generate, not {task!r}"
        found.append(((*at, "guard"), message, True))
    if mode == "offline":
        for key in ("input", "output"):
            if raw.get(key) is None:
                message = f"an offline workload needs `{key}` (a folder, glob or s3:// URI)"
                found.append((at, message, True))
        runner = raw.get("runner")
        if isinstance(runner, dict) and runner.get("address") and runner.get("kind") != "dask":
            message = "`address` names a Dask scheduler: set `kind: dask`, or remove it"
            found.append(((*at, "runner", "address"), message, True))
        fields = raw.get("fields")
        for key, wanted in _ITEM_FIELDS.items():
            if isinstance(fields, dict) and key in fields and task in _TASKS and task != wanted:
                message = f"`fields.{key}` is for task {wanted}; task {task} does not read it"
                found.append(((*at, "fields", key), message, True))
    elif mode == "interactive":
        for key in _OFFLINE_ONLY:
            if key in raw:
                message = (
                    f"`{key}` applies to offline workloads only; remove it or set `mode: offline`"
                )
                found.append(((*at, key), message, True))
    return found


def _from_pydantic(err: ValidationError, prefix: Loc) -> Found:
    found: Found = []
    for e in err.errors(include_url=False):
        loc: Loc = prefix + tuple(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            found.append((loc, f"unknown key {loc[-1]!r}", True))
        elif kind == "missing":
            found.append((loc[:-1], f"missing required key {loc[-1]!r}", True))
        else:
            message = e["msg"].removeprefix("Value error, ")
            if "found" not in message:
                message = f"{_lower_first(message)}; found {e['input']!r}"
            found.append((loc, message, False))
    return found


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]
