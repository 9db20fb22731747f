"""Checking plain data against the workloads.yaml schema: every problem at once, each
with its field path, and the cross-field rules pydantic cannot state.

`parse_spec` validates plain data; `lanes.specfile.load_spec` adds YAML reading, line
numbers and env overrides. `lanes.specproblems` words pydantic's own errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ValidationError

from lanes.backfill import ENDPOINT_TASKS, served_workload
from lanes.errors import shown
from lanes.spec import (
    NAME_PATTERN,
    TASK_NAMES,
    WORKLOAD,
    InteractiveWorkload,
    ModelSpec,
    OfflineWorkload,
    Spec,
    TaskName,
    a_task,
)
from lanes.specinteractive import PER_WORKLOAD_DEPLOY_KEYS
from lanes.specproblems import Found, Loc, from_pydantic, workload_errors
from lanes.strict import StrictModel
from lanes.validation import describe


def _version_number(value: Any) -> Any:
    """`version: true` and `version: 1.0` are not 1 (Literal[1] takes both: True == 1)."""
    if isinstance(value, bool | float):
        raise ValueError(f"expected 1, found {describe(value)}")
    return value


class _Top(StrictModel):
    version: Annotated[Literal[1], BeforeValidator(_version_number)] = 1
    models: dict[str, Any]
    workloads: dict[str, Any]


# Which `fields:` key names the item of which task.
_ITEM_FIELDS = {"text": "embed", "prompt": "generate"}
# The fields a plain record's output line has besides its id and kept fields, where a
# task without a handler's `post` makes them: embed's vector, generate's Completion
# (less `logprobs`, which a plain record never asks for). Infer's are its graph's.
_OUTPUT_FIELDS: dict[TaskName, tuple[str, ...]] = {
    "embed": ("embedding",),
    "generate": (
        "text",
        "tokens",
        "finish_reason",
        "prompt_tokens",
        "prompt_logprobs",
        "stop_token",
    ),
}

# The fields only a generate workload has (their path in the workload: an offline
# workload has no batching), and what each bounds.
_GENERATE_BUDGETS = {
    ("batching", "max_prefill_tokens"): "prefill per step",
    ("batching", "max_kv_bytes"): "KV cache",
    ("max_kv_bytes",): "KV cache",
}

# The batching fields of an embed or infer workload's offline lane, and what each does.
_OFFLINE_LANE_FIELDS = {
    "preempt_offline": "stops an embed or infer workload's offline runs",
    "offline_threads": "runs an embed or infer workload's offline batches beside its "
    "interactive ones",
    "offline_beside_until": "bounds an embed or infer workload's offline batches beside "
    "its interactive ones",
}


# Names a route of the server's own takes at the place a workload's name goes.
RESERVED_NAMES = {
    "stats": "/v2/models/stats is Triton's statistics route, not a workload's; rename it",
}


def parse_spec(
    data: Any,
    base: Path,
    check_files: bool = True,
    check_models: bool = False,
    *,
    spec_name: str = "workloads.yaml",
) -> tuple[Spec | None, Found]:
    """Validate plain data. Returns the spec (None if anything is wrong) and every problem.

    Model paths are made absolute against `base`, the folder of the spec file
    `spec_name` (the name a missing model's message says they are relative to), and,
    with `check_files`, must exist and every handler and guard must import (with `base`
    on the import path); a client that only routes calls needs neither. With
    `check_models` too, each existing model's graph is read for inputs its workloads'
    tasks cannot feed (`_input_problems`).
    """
    found: Found = []
    if not isinstance(data, dict):
        message = (
            f"expected a mapping of `version`, `models` and `workloads`, found {describe(data)}"
        )
        return None, [((), message, False)]
    try:
        top = _Top.model_validate(data)
    except ValidationError as err:
        return None, from_pydantic(err, (), _Top)
    models: dict[str, ModelSpec] = {}
    for name, raw in top.models.items():
        try:
            models[name] = _resolve(ModelSpec.model_validate(raw), base)
        except ValidationError as err:
            found += from_pydantic(err, ("models", name), ModelSpec)
    workloads: dict[str, InteractiveWorkload | OfflineWorkload] = {}
    for name, raw in top.workloads.items():
        if not NAME_PATTERN.match(name):
            found.append(
                (
                    ("workloads", name),
                    "expected a DNS-safe name (lower-case letters, digits and '-', "
                    f"at most 63, starting and ending alphanumeric), found {shown(name)}",
                    True,
                )
            )
        if name in RESERVED_NAMES:
            found.append((("workloads", name), RESERVED_NAMES[name], True))
        try:
            workloads[name] = WORKLOAD.validate_python(raw)
        except ValidationError as err:
            found += workload_errors(err, ("workloads", name), raw)
    for name, model in models.items() if check_files else ():
        found += _model_problems(name, model, spec_name)
    for name, workload in workloads.items() if check_files else ():
        found += _code_problems(name, workload, base)
    if check_files and check_models:
        found += _input_problems(workloads, models)
        found += _tokenizer_problems(models)
    for name, raw in top.workloads.items():
        found += _workload_problems(name, raw, top.models, models)
    for name, workload in workloads.items():
        found += _runner_problems(name, workload, workloads)
        found += _output_problems(name, workload, base)
    found += _group_problems(workloads)
    found += _shared_output_problems(workloads, base)
    if found:
        return None, found
    return Spec(version=top.version, models=models, workloads=workloads, root=base), []


def _resolve(model: ModelSpec, base: Path) -> ModelSpec:
    tokenizer = base / model.tokenizer if model.tokenizer else None
    return model.model_copy(update={"path": base / model.path, "tokenizer": tokenizer})


def _model_problems(name: str, model: ModelSpec, spec_name: str) -> Found:
    found: Found = []
    for key, path in (("path", model.path), ("tokenizer", model.tokenizer)):
        if path is None:
            continue
        try:
            problem = _file_problem(key, path, spec_name)
        except (OSError, ValueError) as err:  # the joined path may still be too long
            message = f"cannot check {shown(str(path))}: {getattr(err, 'strerror', None) or err}"
            found.append((("models", name, key), message, False))
            continue
        if problem is not None:
            found.append((("models", name, key), problem, False))
    return found


def _file_problem(key: str, path: Path, spec_name: str) -> str | None:
    """What is wrong with model file `key` (path: the .onnx; tokenizer: a tokenizer.json)
    at `path`, a path of the spec file `spec_name`, or None. Only a path where the demo keeps its models (NAME/ of
    lanes.demo.place.MODEL_NAMES under a models/ folder) is told to build them."""
    from lanes.demo.place import MODEL_NAMES  # it reads specs: imported here, not above

    if path.is_file():
        return None
    what, wanted = ("model", ".onnx") if key == "path" else ("tokenizer", "tokenizer.json")
    expected = "an .onnx file" if key == "path" else "a tokenizer.json file"
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(wanted))
        if len(inside) == 1:
            return f"{path} is a folder; expected {expected}: point at {path / inside[0]}"
        if inside:
            listed = ", ".join(inside)
            return f"{path} is a folder; expected {expected}: point at one of {listed} in it"
        return f"{path} is a folder with no {wanted} file in it; expected {expected}"
    if path.parent.name in MODEL_NAMES and path.parent.parent.name == "models":
        hint = "build the demo models with `lanes models build`, or fix the path"
    else:
        hint = f"expected the path of {expected} (relative to {spec_name}): fix it"
    return f"no {what} file at {path}; {hint}"


def _input_problems(
    workloads: dict[str, InteractiveWorkload | OfflineWorkload], models: dict[str, ModelSpec]
) -> Found:
    """What loading an embed workload's model would refuse about its inputs, from the
    graph's inputs alone (lanes.onnxinputs: no weight is read). generate's own check
    needs the files beside the model as well, and infer feeds what each request brings:
    both are left to loading."""
    from lanes.errors import ModelError
    from lanes.onnxinputs import required_inputs

    try:
        from lanes.tasks.embed import check_fed
    except ImportError:  # an install without lanes[runtime] cannot serve it either
        return []

    found: Found = []
    read: dict[Path, list[str] | str] = {}  # a model's inputs, or why it cannot be read
    for name, workload in workloads.items():
        model = models.get(workload.model)
        if workload.task != "embed" or model is None or not _is_file(model.path):
            continue  # a missing file is _model_problems' to report
        if model.path not in read:
            try:
                read[model.path] = required_inputs(model.path)
            except (OSError, ValueError) as err:
                problem = f"cannot read {model.path} as an ONNX model: {err}"
                read[model.path] = problem
                found.append((("models", workload.model, "path"), problem, False))
        inputs = read[model.path]
        if isinstance(inputs, str):
            continue
        try:
            check_fed(inputs, str(model.path))
        except ModelError as err:
            found.append((("workloads", name, "task"), str(err), False))
    return found


def _tokenizer_problems(models: dict[str, ModelSpec]) -> Found:
    """A tokenizer file that will not load, as loading the model would refuse it: the
    file exists (a missing one is _model_problems'), but may be no tokenizer.json."""
    try:
        from lanes.tasks.base import load_tokenizer
    except ImportError:  # an install without lanes[runtime] cannot serve it either
        return []
    from lanes.errors import ModelError

    found: Found = []
    for name, model in models.items():
        if model.tokenizer is None or not _is_file(model.tokenizer):
            continue
        try:
            load_tokenizer(model, "embed")
        except ModelError as err:
            message = f"{err}; expected a tokenizers tokenizer.json"
            found.append((("models", name, "tokenizer"), message, False))
    return found


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _code_problems(name: str, workload: InteractiveWorkload | OfflineWorkload, root: Path) -> Found:
    """The user's own code must import now, not at the first request or in a worker."""
    from lanes.errors import HandlerError
    from lanes.tasks.handler import load_handler, load_scorer

    found: Found = []
    try:
        if workload.handler is not None:
            handler = load_handler(workload.handler, root)
            # Its answers are OpenAI completion and chat bodies, whatever post returns.
            online_generate = workload.mode == "interactive" and workload.task == "generate"
            if handler.post is not None and online_generate:
                message = (
                    f"handler {workload.handler}: defines post, but an interactive generate "
                    "workload answers in OpenAI's completion shapes, which post cannot "
                    "change (post shapes offline records only); drop post and post-process "
                    "on the client, or declare the workload `mode: offline`"
                )
                found.append((("workloads", name, "handler"), message, True))
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
    when some other field of the workload failed validation; each value's type is
    checked before it is used (a failed field has its own problem already)."""
    if not isinstance(raw, dict):
        return []
    at: Loc = ("workloads", name)
    found: Found = []
    model, task, mode = (_text(raw.get(key)) for key in ("model", "task", "mode"))
    if model is not None and model not in declared:
        known = ", ".join(sorted(declared)) or "none declared"
        message = f"expected the name of a declared model ({known}), found {shown(model)}"
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
    if raw.get("generation") is not None and task in ("embed", "infer"):
        # Silently ignored otherwise: an embed or infer model samples no tokens.
        message = (
            "`generation` applies to generate workloads only (how tokens are sampled); "
            f"task {task!r} generates none: remove it, or set `task: generate`"
        )
        found.append(((*at, "generation"), message, True))
    batching = raw.get("batching")
    for path, bounds in _GENERATE_BUDGETS.items():
        *within, key = path
        holder = batching if within else raw
        set_here = isinstance(holder, dict) and holder.get(key) is not None
        if set_here and task in ("embed", "infer"):
            message = f"`{key}` bounds a generate workload's {bounds}; task {task!r} has none"
            found.append(((*at, *path), message + ": remove it", True))
    for key, does in _OFFLINE_LANE_FIELDS.items():
        if isinstance(batching, dict) and batching.get(key) and task == "generate":
            message = (
                f"`{key}` {does}; a generate workload's offline sequences take its free "
                "rows, preempted when interactive ones need them: remove it"
            )
            found.append(((*at, "batching", key), message, True))
    if raw.get("idle_unload_s") is not None and task == "generate":
        message = (
            "`idle_unload_s` unloads an embed or infer model when idle; a generate "
            "workload's decoder stays loaded: remove it"
        )
        found.append(((*at, "idle_unload_s"), message, True))
    if mode == "offline":
        runner = raw.get("runner")
        if isinstance(runner, dict) and runner.get("address") and runner.get("kind") != "dask":
            message = "`address` names a Dask scheduler: set `kind: dask`, or remove it"
            found.append(((*at, "runner", "address"), message, True))
        fields = raw.get("fields")
        for key, wanted in _ITEM_FIELDS.items():
            if isinstance(fields, dict) and key in fields and task in TASK_NAMES and task != wanted:
                message = f"`fields.{key}` is for task {wanted}; task {task} does not read it"
                found.append(((*at, "fields", key), message, True))
        found += _kept_output_problems(at, raw, fields, task)
    return found


def _kept_output_problems(at: Loc, raw: dict[str, Any], fields: Any, task: str | None) -> Found:
    """A kept field that the output line has too would be written twice: every record
    is rejected once the model has run for it, so it is refused here. A handler may
    rename the output's fields, so with one the record decides."""
    keep = fields.get("keep") if isinstance(fields, dict) else None
    kind = next((k for k in _OUTPUT_FIELDS if k == task), None)
    if raw.get("handler") is not None or not isinstance(keep, list) or kind is None:
        return []
    clash = next((name for name in keep if name in _OUTPUT_FIELDS[kind]), None)
    if clash is None:
        return []
    message = (
        f"{shown(clash)} is a field of {a_task(kind)} output line too, so it would be "
        "written twice: drop it from `fields.keep`, or rename it in a handler's `post`"
    )
    return [((*at, "fields", "keep"), message, False)]


def _runner_problems(
    name: str,
    workload: InteractiveWorkload | OfflineWorkload,
    workloads: dict[str, InteractiveWorkload | OfflineWorkload],
) -> Found:
    """An offline workload on the endpoint needs an interactive one to run on."""
    if not isinstance(workload, OfflineWorkload):
        return []
    at: Loc = ("workloads", name, "runner")
    runner = workload.runner
    if runner.kind != "endpoint":
        keys = [k for k in ("url", "workload") if getattr(runner, k) is not None]
        return [
            ((*at, k), f"`{k}` is for `kind: endpoint`: set it, or remove this", True) for k in keys
        ]
    try:
        served_workload(workloads, name)
    except ValueError as err:
        key = "kind" if workload.task not in ENDPOINT_TASKS else "workload"
        return [((*at, key), str(err), False)]
    return []


def _group_problems(workloads: dict[str, InteractiveWorkload | OfflineWorkload]) -> Found:
    """A group's pods are one Deployment: a group-wide `deploy` key set on two of its
    workloads must agree (each disagreement at the later workload's key)."""
    found: Found = []
    first: dict[tuple[str, str], tuple[str, Any]] = {}  # (group, key) -> (workload, value)
    for name, workload in workloads.items():
        if not isinstance(workload, InteractiveWorkload):
            continue
        deploy = workload.deploy
        for key in sorted(deploy.model_fields_set - PER_WORKLOAD_DEPLOY_KEYS):
            value = getattr(deploy, key)
            setter, before = first.setdefault((deploy.group, key), (name, value))
            if before != value:
                found.append(
                    (
                        ("workloads", name, "deploy", key),
                        f"{value!r} disagrees with workload {setter}'s {before!r}, in the "
                        f"same deploy.group {deploy.group!r} (one Deployment): set it the "
                        "same on both, or give them different groups",
                        False,
                    )
                )
    return found


def _output_problems(
    name: str, workload: InteractiveWorkload | OfflineWorkload, base: Path
) -> Found:
    """The job's own rule (flows/job.py), so that what validates is what runs."""
    # lanes.inputs reads Settings, whose module reads this one's errors: imported here.
    from lanes.inputs import output_inside_input

    if not isinstance(workload, OfflineWorkload):
        return []
    if not output_inside_input(workload.output, workload.input, base):
        return []
    message = (
        f"{workload.output} is inside the input {workload.input}: outputs would be read as "
        "inputs on the next run; choose an output folder outside the input"
    )
    return [(("workloads", name, "output"), message, False)]


def _shared_output_problems(
    workloads: dict[str, InteractiveWorkload | OfflineWorkload], base: Path
) -> Found:
    """Each offline workload's commit markers must be its own: two writing one output
    folder (or one inside the other) redo and overwrite each other's shards. Reported
    at the later workload's output."""
    from lanes.inputs import inside_output  # as in _output_problems

    found: Found = []
    earlier: list[tuple[str, str]] = []  # (workload, output)
    for name, workload in workloads.items():
        if not isinstance(workload, OfflineWorkload):
            continue
        output = workload.output
        for other, theirs in earlier:
            if inside_output(output, theirs, base) and inside_output(theirs, output, base):
                where = f"is also the output of workload {other} ({theirs})"
            elif inside_output(output, theirs, base):
                where = f"is inside the output of workload {other}, {theirs}"
            elif inside_output(theirs, output, base):
                where = f"holds the output of workload {other}, {theirs}"
            else:
                continue
            message = (
                f"{output} {where}: the two would overwrite each other's results; give "
                "each offline workload an output folder of its own"
            )
            found.append((("workloads", name, "output"), message, False))
        earlier.append((name, output))
    return found


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
