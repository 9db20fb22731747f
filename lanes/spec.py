"""The workloads.yaml schema: pydantic models for every field.

A workload is interactive or offline (`Workload`, a union told apart by `mode`), and
each mode has only its own keys. `lanes.specrules.parse_spec` checks plain data
against it, with the rules that span fields; `lanes.specfile.load_spec` reads the file.
Here: the spec, its models, the workload of each mode and what both modes share; each
mode's own sections are in lanes.specinteractive and lanes.specoffline, the value
types of their fields in lanes.spectypes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)

from lanes.errors import with_article
from lanes.schedule import Schedule
from lanes.specinteractive import Batching, Deploy, Slo
from lanes.specoffline import Fields, Runner
from lanes.spectypes import (
    HandlerRef,
    IdleSeconds,
    Integer,
    LocalPath,
    Location,
    NonNegativeFloat,
    Number,
    PositiveInt,
    StopString,
)
from lanes.strict import StrictModel

Mode = Literal["interactive", "offline"]
TaskName = Literal["embed", "infer", "generate"]
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)


def a_task(task: TaskName) -> str:
    """The task's name with its article, for messages: "an embed", "a generate"."""
    return with_article(task)


# Workload names become URL paths and Prefect deployment names: DNS labels.
NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


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
    # The key of workloads.yaml that set max_kv_bytes, which refusals name: an
    # interactive workload's offline copy (in_offline_lane) has its user's
    # batching.max_kv_bytes. Not a key of the file: copies and pickles keep it, dumps don't.
    _max_kv_bytes_key: str = PrivateAttr("max_kv_bytes")
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

    @property
    def max_kv_bytes_key(self) -> str:
        """Where `max_kv_bytes` was set: `max_kv_bytes`, or `batching.max_kv_bytes` for
        an interactive workload's offline copy."""
        return self._max_kv_bytes_key


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
    its max_kv_bytes (and the key its refusals name), with `offline`'s keys (e.g.
    batch_size) and the offline defaults for the rest."""
    if isinstance(workload, OfflineWorkload):
        return workload
    shared = workload.model_dump(include=set(WorkloadBase.model_fields) - {"mode"})
    keys = {"max_kv_bytes": workload.batching.max_kv_bytes, **offline}
    copy = OfflineWorkload(mode="offline", input=input, output=output, **shared, **keys)
    if "max_kv_bytes" not in offline:
        copy._max_kv_bytes_key = "batching.max_kv_bytes"
    return copy
