"""The workloads.yaml schema: pydantic models for every field.

A workload is interactive or offline (`Workload`, a union told apart by `mode`), and
each mode has only its own keys. `lanes.specrules.parse_spec` checks plain data
against it, with the rules that span fields; `lanes.specfile.load_spec` reads the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from lanes.errors import shown, with_article
from lanes.quantity import CpuQuantity
from lanes.schedule import Schedule
from lanes.strict import StrictModel
from lanes.template import Template, is_template

Mode = Literal["interactive", "offline"]
TaskName = Literal["embed", "infer", "generate"]
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)


def a_task(task: TaskName) -> str:
    """The task's name with its article, for messages: "an embed", "a generate"."""
    return with_article(task)


# Workload names become URL paths and Prefect deployment names: DNS labels.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
HANDLER_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"

# What a file system takes (Linux: PATH_MAX, NAME_MAX), checked on the text alone so a
# bad value is a spec problem, not an OSError from the first stat().
MAX_PATH_CHARS = 4096
MAX_NAME_BYTES = 255


def _path_text(value: str) -> str:
    if "\0" in value:
        raise ValueError("expected a path, found one holding a NUL character")
    if len(value) > MAX_PATH_CHARS:
        raise ValueError(
            f"expected a path of at most {MAX_PATH_CHARS} characters, found {len(value)}"
        )
    if "://" not in value:  # a local path: each name must fit the file system
        for part in value.split("/"):
            if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                raise ValueError(
                    f"expected a path whose every name is at most {MAX_NAME_BYTES} bytes, "
                    f"found one of {len(part.encode('utf-8', 'surrogatepass'))}"
                )
    return value


def _location(value: str) -> str:
    """A folder or glob, file:// or s3://bucket/prefix/: what lanes.storage reads, so that
    a mistyped URI fails at load, not at the first run (or as a local folder "s3:")."""
    scheme, sep, rest = value.partition("://")
    if sep and scheme == "s3" and not rest.split("/", 1)[0]:
        raise ValueError(f"expected s3://bucket/prefix/, found {shown(value)} (no bucket)")
    # s3:/bucket/ is a mistyped URI, not a local folder named "s3:".
    read = scheme in ("s3", "file") if sep else not value.lower().startswith("s3:")
    if not read:
        raise ValueError(f"expected a folder, a glob or s3://bucket/prefix/, found {shown(value)}")
    return value


def _matching(pattern: str, expected: str) -> Callable[[str], str]:
    """A check that text matches `pattern` whose failure says `expected` in words: a
    user fixing workloads.yaml reads "module:attribute", not the regular expression."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise ValueError(f"expected {expected}, found {shown!r}")
        return value

    return check


def _local_path(value: Path) -> Path:
    _path_text(str(value))
    return value


# Numbers as YAML writes them. Pydantic's lax mode would read `batch_size: true` as 1,
# "8" as 8 and 2.0 as 2: an integer field takes an integer alone, a number field an
# integer or a decimal, never a boolean or a string (the message says which was found).
Integer = Annotated[int, Strict()]
Number = Annotated[float, Strict()]
PositiveInt = Annotated[Integer, Field(gt=0)]
NonNegativeFloat = Annotated[Number, Field(ge=0)]
NonNegativeInt = Annotated[Integer, Field(ge=0)]
PositiveFloat = Annotated[Number, Field(gt=0)]
# A duration in milliseconds: up to a day.
Milliseconds = Annotated[Number, Field(gt=0, le=86_400_000)]
IdleSeconds = Annotated[Number, Field(gt=0, le=30 * 86_400)]  # at most 30 days
LocalPath = Annotated[Path, AfterValidator(_local_path)]
Location = Annotated[
    str, Field(min_length=1), AfterValidator(_path_text), AfterValidator(_location)
]
HandlerRef = Annotated[
    str,
    Field(max_length=200),
    AfterValidator(_matching(HANDLER_PATTERN, "module:attribute, e.g. mypkg.hooks:handler")),
]
# Each stop string is looked for at every token of its sequence, and the text that
# could start one is held back; the work per token grows with each string's length
# (at 16 strings of 256 characters, about a millisecond in the worst case, a text
# made to match their starts; at 16384, 0.2 s). Delimiters are a few characters.
MAX_STOP_CHARS = 256
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class SessionOptions(StrictModel):
    intra_op_threads: PositiveInt | None = Field(
        None,
        le=1024,
        description="Threads inside one operator; default: the LANES_THREADS setting.",
    )
    inter_op_threads: PositiveInt | None = Field(
        None, le=1024, description="Threads across operators."
    )
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="onnxruntime graph optimisation level."
    )
    spinning: bool = Field(
        True,
        description="Let idle onnxruntime threads spin-wait for the next run (lower latency, "
        "even on 2 cores; turn off to leave idle cores to other processes).",
    )


class ModelSpec(StrictModel):
    path: LocalPath = Field(description="The .onnx file, relative to workloads.yaml.")
    tokenizer: LocalPath | None = Field(None, description="A Hugging Face tokenizer.json.")
    max_length: PositiveInt = Field(
        256,
        le=1_048_576,
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
        1024,
        le=1_048_576,
        description="Requests waiting beyond this are refused with 503 and Retry-After.",
    )
    max_prefill_tokens: PositiveInt | None = Field(
        None,
        le=1_048_576,
        description="generate: prompt tokens one step may prefill; a longer prompt is "
        "prefilled in parts over several steps, so rows already decoding keep stepping "
        "(default: whole prompts; slo.ttft_ms, when set, may lower it).",
    )
    max_kv_bytes: PositiveInt | None = Field(
        None,
        description="generate: bytes of KV cache the sequences in flight may take at most. "
        "A sequence joins only while every running sequence's worst case (its prompt and "
        "max_tokens, at most the context, times the model's bytes per token: layers x 2 x "
        "KV heads x head_dim x dtype size) fits it together, so nothing is preempted for "
        "memory; a request whose own worst case is over it is refused with 400 naming "
        "max_tokens. Offline sequences on this engine count in it too (default: no "
        "budget: max_batch_size rows of the whole context may be cached).",
    )
    preempt_offline: bool = Field(
        False,
        description="embed/infer: an interactive request that arrives while an offline "
        "batch runs on this workload's model stops that run, unless the run is expected to "
        "end sooner than it has run (then the request waits at most that long); its items "
        "run again, whole, after it. Interactive latency waits less for offline runs, at "
        "the cost of the stopped runs' work (default: an offline run ends first). Applies "
        "while offline runs take turns with interactive ones (`offline_threads: 0`, and on "
        "a GPU); with `offline_threads`, the turns they take over `offline_beside_until` "
        "are always stopped so.",
    )
    offline_threads: NonNegativeInt | None = Field(
        None,
        le=1024,
        description="embed/infer on the CPU: threads that run offline batches beside the "
        "interactive ones at the operating system's idle priority, on a one-thread session "
        "of the model of their own (loaded with the first offline batch): the OS gives an "
        "interactive run the cores the moment it starts, and offline runs use what it "
        "leaves; the workload's own session then stops spin-waiting when a run ends. 0: "
        "offline runs take turns with interactive ones on the model's own thread, as they "
        "always do on a GPU (default: the cores this process may use where the model runs "
        "on the CPU, the OS has an idle priority and an offline workload of this spec runs "
        "on this one, `runner: {kind: endpoint}`; else 0).",
    )
    offline_beside_until: Number = Field(
        0.8,
        gt=0,
        le=1,
        description="embed/infer with `offline_threads`: while interactive runs keep the "
        "model busier than this share of the last second, offline batches no longer start "
        "beside them and take turns on the model's thread instead, each run stopped by an "
        "interactive arrival as with `preempt_offline`. Beside, every interactive run is a "
        "little slower (the threads share memory bandwidth and caches), and near "
        "saturation that multiplies the queueing. 1: always beside.",
    )


class Slo(StrictModel):
    p50_ms: Milliseconds | None = Field(None, description="Target median latency.")
    p99_ms: Milliseconds | None = Field(None, description="Target 99th percentile latency.")
    ttft_ms: Milliseconds | None = Field(
        None,
        description="Target time to first token; for generate it bounds one step's "
        "prefill (longer prompts are prefilled in parts over several steps).",
    )
    itl_ms: Milliseconds | None = Field(
        None,
        description="Target inter-token latency; for generate it bounds the rows of one "
        "decode step.",
    )
    timeout_ms: Milliseconds | None = Field(
        None, description="Deadline of each request: past it, a queued request gets 504."
    )


class Generation(StrictModel):
    max_new_tokens: PositiveInt = Field(128, le=65536)
    # A request's range (OpenAI's): a default no request could set would be refused by
    # every lane the moment a record repeats it.
    temperature: NonNegativeFloat = Field(1.0, le=2, description="0 means greedy.")
    top_k: Integer = Field(0, ge=0, le=1_048_576, description="0 means no top-k cut.")
    top_p: Number = Field(1.0, ge=0, le=1, description="0 keeps only the likeliest token.")
    # An empty string would end every completion before its first character. Each
    # stop string is looked for at every token of its sequence, so a list without
    # bound, or strings without one, would slow the batch it shares (OpenAI takes 4;
    # vLLM, any number of any length).
    stop: list[StopString] = Field(
        default_factory=list, max_length=16, description="Strings that end a completion."
    )
    # What changes the logits a token is picked from (lanes/generation/processors.py).
    presence_penalty: Number = Field(
        0.0, ge=-2, le=2, description="OpenAI's: taken off the logit of each token made."
    )
    frequency_penalty: Number = Field(
        0.0, ge=-2, le=2, description="OpenAI's: taken off a token's logit per time made."
    )
    repetition_penalty: Number = Field(
        1.0, gt=0, description="vLLM's: divides the prompt's and made tokens' logits; 1: none."
    )
    min_p: Number = Field(
        0.0, ge=0, le=1, description="vLLM's: drops tokens below min_p x the likeliest."
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Dumped only when set: an offline job's identity hashes this dump
        # (flows/job.py), and a workload that sets none of them stays the job it was.
        dumped: dict[str, Any] = handler(self)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            if name not in self.model_fields_set:
                dumped.pop(name, None)
        return dumped


class Guard(StrictModel):
    """A scorer a generate workload's text must pass before a client sees it."""

    handler: HandlerRef = Field(
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
    threshold: Number = Field(0.5, ge=0, le=1, description="A score at or above this fails.")


class Runner(StrictModel):
    """Where an offline workload's shard tasks run. `runner: dask` is short for `{kind: dask}`."""

    kind: Literal["local", "dask", "endpoint"] = Field(
        "local",
        description="local: threads in the flow's own process; dask: a Dask cluster "
        "through prefect-dask; endpoint: the serving endpoint's own sessions, in its "
        "offline lane (batches run only while no interactive request waits).",
    )
    address: (
        Annotated[
            str,
            AfterValidator(
                _matching(r"^[a-z][a-z0-9+.-]*://[^\s/]+$", "an address like tcp://10.0.0.5:8786")
            ),
        ]
        | None
    ) = Field(
        None,
        max_length=255,
        description="Dask scheduler address, e.g. tcp://10.0.0.5:8786 (kind: dask); "
        "none starts a local cluster.",
    )
    workers: PositiveInt = Field(
        2, le=1024, description="Processes of the local Dask cluster started when no address."
    )
    max_concurrent_shards: PositiveInt = Field(
        2, le=4096, description="Shards in flight at once: reading one overlaps running another."
    )
    url: (
        Annotated[
            str,
            AfterValidator(
                _matching(r"^https?://[^\s/]+(/[^\s]*)?$", "a URL like http://10.0.0.5:8000")
            ),
        ]
        | None
    ) = Field(
        None,
        max_length=2000,
        description="kind: endpoint: the serving endpoint, e.g. http://10.0.0.5:8000; "
        "none: the LANES_ENDPOINT setting. The flow authenticates with LANES_INTERNAL_KEY "
        "(else LANES_API_KEY), which the server must hold too.",
    )
    workload: str | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="kind: endpoint: the interactive workload whose sessions run the "
        "batches (same model and task), or the name of that model; none: the one "
        "interactive workload of the same model and task.",
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
        "(prompt, max_tokens, ...); a kept prompt or generation option is still the "
        "request's.",
    )
    keep: list[str] = Field(
        default_factory=list,
        description="Fields copied from each record into its output line, beside the id; "
        "a copied prompt or generation option still applies.",
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


class WorkloadBase(StrictModel):
    """What a workload of either mode has. A workload is an `InteractiveWorkload` or an
    `OfflineWorkload` (`Workload`), told apart by `mode`; a key of the other mode is
    an error."""

    mode: Mode = Field(description="interactive: someone is waiting; offline: nobody is.")
    task: TaskName
    model: str = Field(max_length=1000, description="A key of `models`.")
    description: str | None = None
    handler: HandlerRef | None = Field(
        None, description="module:attr of an object with optional pre(item) and post(output)."
    )
    truncate: bool = Field(
        False,
        description="embed: cut text over the model's max_length tokens instead of "
        "refusing it (HTTP 400 online, an errors-file line offline).",
    )
    generation: Generation = Field(default_factory=Generation)
    guard: Guard | None = Field(None, description="generate: score text before it is sent.")


# A Kubernetes resource quantity ("500m", "2", "4Gi").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Its Deployment is named lanes-GROUP: a DNS label of at most 63 characters.
GROUP_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,55}[a-z0-9])?$"


# `deploy` keys each workload of a group sets for itself; the others are the group's.
PER_WORKLOAD_DEPLOY_KEYS = frozenset({"group", "target_queue_depth"})


class Deploy(StrictModel):
    """How `lanes render k8s` runs an interactive workload. The workloads of one group
    share a Deployment (each pod serves them all, as one `lanes serve` does); the
    group-wide keys must agree across its workloads where they are set."""

    group: Annotated[
        str,
        AfterValidator(
            _matching(
                GROUP_PATTERN,
                "a DNS-safe name (lower-case letters, digits and '-', at most 57, starting "
                "and ending alphanumeric)",
            )
        ),
    ] = Field("serve", description="The Deployment lanes-GROUP serves it.")
    device: Literal["cpu", "cuda", "tensorrt"] | None = Field(
        None,
        description="The group's pods' LANES_DEVICE; cuda and tensorrt ask for one "
        "nvidia.com/gpu per pod (default: the renderer's LANES_DEVICE).",
    )
    min_replicas: Integer = Field(
        1, ge=0, le=1000, description="Fewest pods (0: KEDA scales the group to zero)."
    )
    max_replicas: Integer = Field(4, ge=1, le=1000, description="Most pods.")
    cpu: CpuQuantity = Field(
        "1",
        description="CPU per pod (requests = limits): 2, 1.5 or 500m; LANES_THREADS "
        "is its whole cores.",
    )
    memory: Annotated[
        str, AfterValidator(_matching(QUANTITY_PATTERN, "a quantity like 2Gi, 512Mi or 1.5G"))
    ] = Field("2Gi", description="Memory per pod (requests = limits).")
    target_queue_depth: PositiveInt | None = Field(
        None,
        le=1_048_576,
        description="Requests waiting (generate: sequences waiting or in flight) per pod "
        "that KEDA keeps the group at (default: the workload's max_batch_size).",
    )

    @model_validator(mode="after")
    def _replicas_in_order(self) -> Deploy:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"expected min_replicas <= max_replicas, found {self.min_replicas} > "
                f"{self.max_replicas}"
            )
        return self


class InteractiveWorkload(WorkloadBase):
    """Someone is waiting: served on the endpoint, batched within a latency budget."""

    mode: Literal["interactive"] = Field(description="Someone is waiting.")
    batching: Batching = Field(default_factory=Batching)
    slo: Slo = Field(default_factory=Slo)
    stream: bool = Field(
        False,
        description="generate: the SDK's and CLI's default (`lanes call`); over HTTP only "
        "a request's own `stream: true` streams, as in OpenAI's API.",
    )
    deploy: Deploy = Field(
        default_factory=Deploy, description="Its Kubernetes group (lanes render k8s)."
    )
    idle_unload_s: IdleSeconds | None = Field(
        None,
        description="embed and infer: seconds without requests after which the model's "
        "session is unloaded (its memory freed); the next request loads it again and is "
        "answered, within its deadline. None: always loaded.",
    )


class OfflineWorkload(WorkloadBase):
    """Nobody is waiting: a Prefect flow over input files, on a schedule."""

    mode: Literal["offline"] = Field(description="Nobody is waiting.")
    input: Location = Field(description="Folder, glob or s3://bucket/prefix/ of inputs.")
    output: Location = Field(description="Folder or s3://bucket/prefix/ for outputs.")
    batch_size: PositiveInt = Field(256, le=65536, description="Records per model run.")
    max_kv_bytes: PositiveInt | None = Field(
        None,
        description="generate: bytes of KV cache a shard's sequences in flight may take at "
        "most, as an interactive workload's batching.max_kv_bytes bounds its own: a "
        "sequence joins only while every running sequence's worst case (its prompt and "
        "max_tokens, at most the context, times the model's bytes per token) fits it "
        "together; a record whose own worst case is over it is an error line naming "
        "max_tokens (default: no budget: batch_size rows of the whole context may be "
        "cached).",
    )
    schedule: Schedule | None = None
    retries: Integer = Field(2, ge=0, le=100, description="Retries of a failed shard.")
    runner: Runner = Field(default_factory=Runner)
    fields: Fields = Field(
        default_factory=Fields, description="Which record fields are the id, text and output."
    )
    max_error_rate: Number = Field(
        0.1,
        ge=0,
        le=1,
        description="Most rejected records a shard may have, as a fraction of its records: "
        "beyond it the shard fails and is not committed (0: none may fail; 1: no limit).",
    )


Workload = Annotated[InteractiveWorkload | OfflineWorkload, Field(discriminator="mode")]
WORKLOAD = TypeAdapter[InteractiveWorkload | OfflineWorkload](Workload)
# Which keys only one mode has, for "applies to offline workloads only".
MODE_KEYS: dict[str, frozenset[str]] = {
    "interactive": frozenset(InteractiveWorkload.model_fields) - set(WorkloadBase.model_fields),
    "offline": frozenset(OfflineWorkload.model_fields) - set(WorkloadBase.model_fields),
}


def as_interactive(workload: Workload) -> InteractiveWorkload:
    """`workload`, where only an interactive one fits (the endpoint's batching, SLO and
    streaming); WrongMode for an offline one."""
    if isinstance(workload, InteractiveWorkload):
        return workload
    from lanes.errors import WrongMode

    raise WrongMode("an offline workload is not served: it runs as batch jobs (lanes run)")


def as_offline(workload: Workload) -> OfflineWorkload:
    """`workload`, where only an offline one fits (input, output, shards); WrongMode for
    an interactive one."""
    if isinstance(workload, OfflineWorkload):
        return workload
    from lanes.errors import WrongMode

    raise WrongMode("an interactive workload takes no batch jobs: call it on the endpoint")


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

    def workload(self, name: str) -> InteractiveWorkload | OfflineWorkload:
        from lanes.errors import UnknownWorkload

        try:
            return self.workloads[name]
        except KeyError:
            known = ", ".join(sorted(self.workloads)) or "none"
            raise UnknownWorkload(f"no workload named {name!r}; known: {known}") from None


def in_offline_lane(
    workload: InteractiveWorkload | OfflineWorkload, input: str, output: str, **offline: Any
) -> OfflineWorkload:
    """`workload` in the offline lane: an offline one as declared; an interactive one
    as an offline workload of the keys both modes have (same task, model, handler,
    generation), reading `input` and writing `output`, its batching.max_kv_bytes as
    its max_kv_bytes, with `offline`'s keys (e.g. batch_size) and the offline defaults
    for the rest."""
    if isinstance(workload, OfflineWorkload):
        return workload
    shared = workload.model_dump(include=set(WorkloadBase.model_fields) - {"mode"})
    offline = {"max_kv_bytes": workload.batching.max_kv_bytes, **offline}
    return OfflineWorkload(mode="offline", input=input, output=output, **shared, **offline)
